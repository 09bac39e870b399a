"""The distributed discrete Gaussian against the continuous Gaussian on the same SecAgg+ sum: the table of
``configs/benchmarks/ddg_bits.toml`` from its sweeps' ``index.json`` files.

Per secure-sum mechanism and cohort: the final test accuracy over the seeds (mean, 95 % t interval), the paired
difference to the continuous Gaussian of the same seed, the noise multiplier the clients add and the one each
round is charged at, the ε against the server, and two uplink figures per client and round: what Flower 1.41's
SecAgg+ sent (measured in the run: masked int64 coordinates plus the protocol's keys and shares) and what a
transport packing each coordinate into the field's b bits would send (computed for the current mechanism: one
coordinate per payload value since the DCT rotation; sweeps run before it sent the padded power of two).

    python -m benchmarks.ddg_bits results/sweeps/ddg-bits-clients20/index.json \
        results/sweeps/ddg-bits-clients100/index.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from fedapp.apps.privacy_plan import secure_payload_dim
from fedapp.config import resolve_config
from fedapp.experiments.report import interval, pair_by_seed, paired_test
from fedapp.privacy.profiles import client_level_mechanism, secure_sum_mechanism
from fedapp.privacy.secure_aggregation import QUANTIZATION_RANGE, modulus_for


def _variant(assignments: dict[str, Any]) -> str:
    if assignments.get("secagg-mechanism") == "gaussian":
        return "continuous Gaussian"
    return f"discrete Gaussian, {assignments.get('secagg-bits')} bits"


def _mechanism_facts(cfg: dict[str, Any], clients: int, dims: dict[str, int]) -> dict[str, float]:
    """σ added, multiplier charged per full round, and the field's bits × coordinates of one payload."""
    run = resolve_config(None, cfg)
    dp = client_level_mechanism(run.general, run.training, run.client_dp, clients)
    key = f"{run['strategy']}/{run['model']}/{run['dataset']}"
    if key not in dims:
        dims[key] = secure_payload_dim(run)
    dim = dims[key]
    ddg = secure_sum_mechanism(run.client_dp, dp, dim)
    if ddg is None:
        field_bits = int(math.log2(modulus_for(clients, QUANTIZATION_RANGE)))
        return {"sigma": dp.noise_multiplier, "charged": dp.noise_multiplier, "bits": field_bits, "coords": dim}
    return {"sigma": ddg.noise_multiplier, "charged": ddg.gaussian_equivalent(clients, clients), "bits": ddg.bits,
            "coords": ddg.rotated_dim}


def table(index_paths: list[Path]) -> str:
    rows = ["| clients a round | secure sum | final accuracy (95 % CI, n) | − continuous, paired (95 % CI) | "
            "σ added | σ charged | max ε vs server | uplink per client-round, Flower 1.41 | packed b-bit payload |",
            "|---|---|---|---|---|---|---|---|---|"]
    dims: dict[str, int] = {}
    for path in index_paths:
        doc = json.loads(path.read_text(encoding="utf-8"))
        clients = int(doc["num_supernodes"])
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for cell in doc["cells"].values():
            if cell.get("status") == "finished":
                groups[_variant(cell["assignments"])].append(cell)
        base = groups.get("continuous Gaussian", [])
        for name in sorted(groups, key=lambda v: (v != "continuous Gaussian", -int(v.split()[-2]) if "bits" in v else 0)):
            cells = groups[name]
            mean, half, n = interval([c["summary"]["final_accuracy"] for c in cells])
            facts = _mechanism_facts(cells[0]["config"], clients, dims)
            rounds = [c["summary"]["rounds_trained"] for c in cells]
            per_client = [c["summary"]["total_uplink_bytes"] / (r * clients) for c, r in zip(cells, rounds) if r]
            eps = max(c["summary"]["max_epsilon_vs_server"] for c in cells)
            if name == "continuous Gaussian":
                paired = "–"
            else:
                p = paired_test([d for _, d in pair_by_seed(cells, base, "final_accuracy")])
                paired = f"{100 * p.mean:+.1f} ± {100 * p.half:.1f} pts (n = {p.n})"
            rows.append(f"| {clients} | {name} | {100 * mean:.1f} ± {100 * half:.1f} % (n = {n}) | {paired} | "
                        f"{facts['sigma']:.4f} | {facts['charged']:.4f} | {eps:.3f} | "
                        f"{sum(per_client) / len(per_client) / 1024:.1f} KiB | "
                        f"{facts['bits'] * facts['coords'] / 8 / 1024:.1f} KiB ({facts['bits']} bits × "
                        f"{facts['coords']:,}) |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("index", type=Path, nargs="+", help="index.json of a ddg_bits sweep (one per cohort)")
    args = parser.parse_args(argv)
    print(table(args.index))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
