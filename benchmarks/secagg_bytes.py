"""Uplink bytes per client and round of the client-level families under each secure-sum mechanism.

Each cell is one round of a real Flower simulation (Ray, ``--supernodes`` SuperNodes, every client sampled) of the
project's ServerApp and ClientApp, as ``tests/integration/fedapp/privacy/test_secure_aggregation.py`` runs them; the
figure is the mean of the round's ``uplink_bytes`` over the clients (``rounds.jsonl``). Under SecAgg+ that is what
``secagg_mod`` counted: the masked vector as Flower's int64 coordinates plus the protocol's public keys and encrypted
shares (the unmask stage's shares, after the fit, are not counted); without SecAgg+ the serialized float32 arrays.
Mechanisms: ``ddg`` (the default under SecAgg+: the distributed discrete Gaussian's residues, one per rotated
coordinate), ``gaussian`` (continuous Gaussian shares through Flower's quantizer) and ``plain`` (no SecAgg+).

    .venv/bin/python -m benchmarks.secagg_bytes --model cnn-fmnist --dataset mnist --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

#: (strategy, compression ratio or None) rows; DP-FTRL's stream needs continuous shares (no ``ddg``)
ROWS: tuple[tuple[str, float | None], ...] = (("dp-fedavg", None), ("fed-smp-randk", 0.01), ("fed-smp-topk", 0.01),
                                               ("dp2-fedsam", None), ("dp-ftrl", None))
MECHANISMS = ("ddg", "gaussian", "plain")


def _overrides(strategy: str, ratio: float | None, mechanism: str, args: argparse.Namespace) -> dict[str, Any]:
    ov: dict[str, Any] = {"strategy": strategy, "model": args.model, "dataset": args.dataset, "num-server-rounds": 1,
                          "num-clients": args.supernodes, "clients-per-round": 0, "privacy-dist": "fixed",
                          "batch-size": 16, "local-steps": 1, "clip-norm": 1.0, "noise-multiplier": 1.0,
                          "fraction-evaluate": 0.0, "max-samples": args.max_samples, "seed": 1}
    if args.data_dir:
        ov["data-dir"] = args.data_dir
    if ratio is not None:
        ov["compression-ratio"] = ratio
    if strategy == "fed-smp-topk":
        ov["public-samples"] = 100
    if mechanism == "plain":
        ov["secure-aggregation"] = False
        if strategy == "dp-ftrl":  # without SecAgg+ the server adds its noise: ε only against the release
            ov["client-dp-adversary"] = "release"
    else:
        ov.update({"secure-aggregation": True, "secagg-mechanism": mechanism})
    return ov


def measure(overrides: dict[str, Any], supernodes: int) -> dict[str, Any]:
    """One simulated round: the clients' mean uplink bytes and the secure sum's coordinates."""
    from flwr.simulation import run_simulation

    from fedapp.apps.client_app import build_client_app
    from fedapp.apps.server_app import build_server_app

    with tempfile.TemporaryDirectory() as tmp:
        ov = {**overrides, "output-dir": tmp}
        run_simulation(build_server_app(ov), build_client_app(ov), num_supernodes=supernodes,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                       "init_args": {"num_cpus": 2, "logging_level": "ERROR"}})
        (run,) = [p for p in Path(tmp).iterdir() if not p.name.startswith(".")]
        (rec,) = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
        mech = json.loads((run / "config.json").read_text())["privacy_plan"]["mechanism"]
    sent = [c["uplink_bytes"] for c in rec["clients"] if c["status"] == "ok"]
    if len(sent) != supernodes:
        raise RuntimeError(f"{overrides['strategy']}: {len(sent)} of {supernodes} clients sent an update")
    return {"bytes": sum(sent) / len(sent), "coords": mech.get("rotated_dim", mech.get("payload_dim"))}


def table(results: dict[tuple[str, str], dict[str, Any]]) -> str:
    rows = ["| strategy | " + " | ".join(MECHANISMS) + " |", "|---|" + "---|" * len(MECHANISMS)]
    dense = results.get(("dp-fedavg", "ddg"))
    for strategy, ratio in ROWS:
        cells = []
        for mechanism in MECHANISMS:
            r = results.get((strategy, mechanism))
            if r is None:
                cells.append("–")
                continue
            share = f", {100 * r['bytes'] / dense['bytes']:.2f} % of dense" if dense and mechanism == "ddg" else ""
            coords = f" ({r['coords']:,} coords{share})" if mechanism == "ddg" else ""
            cells.append(f"{r['bytes']:,.0f}{coords}")
        name = strategy + (f" p = {ratio:g}" if ratio is not None else "")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn-fmnist")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--supernodes", type=int, default=6)
    parser.add_argument("--max-samples", type=int, default=400)
    parser.add_argument("--only", nargs="*", default=None, help="strategy names to run (default: all)")
    parser.add_argument("--mechanisms", nargs="*", default=list(MECHANISMS))
    parser.add_argument("--json", type=Path, default=None, help="also write the measurements here")
    args = parser.parse_args(argv)
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for strategy, ratio in ROWS:
        if args.only and strategy not in args.only:
            continue
        for mechanism in args.mechanisms:
            if strategy == "dp-ftrl" and mechanism == "ddg":
                continue  # its correlated noise stream needs continuous shares (the config refuses ddg)
            results[(strategy, mechanism)] = measure(_overrides(strategy, ratio, mechanism, args), args.supernodes)
            print(strategy, mechanism, results[(strategy, mechanism)], flush=True)
    if args.json:
        args.json.write_text(json.dumps([{"strategy": s, "mechanism": m, **r} for (s, m), r in results.items()],
                                        indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
