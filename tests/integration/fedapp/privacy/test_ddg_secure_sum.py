"""The distributed discrete Gaussian under Flower SecAgg+: exact transport of residues through Flower's quantizer,
the client's check of the server's field, a real SecAgg+ run, its ledger recomputed, and the config's refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from flwr.common import ConfigRecord, Context, RecordDict, parameters_to_ndarrays
from flwr.common.secure_aggregation.ndarrays_arithmetic import factor_combine, factor_extract, parameters_multiply
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE

from fedapp.config import ConfigError, resolve_config
from fedapp.privacy.secure_aggregation import (
    MAX_WEIGHT,
    NoContribution,
    _residue_payload,
    ddg_transport,
    residues_from_mean,
)
from strategies.privacy.discrete_gaussian import ORDERS, DistributedDiscreteGaussian, rdp_to_epsilon


def _context(bits: int, **changes: float) -> Context:
    """A client Context holding the SecAgg+ state Flower's setup stage stores, with the server's field for ``bits``."""
    t = ddg_transport(bits)
    state = {"clipping_range": t["clipping_range"], "target_range": t["quantization_range"],
             "mod_range": t["modulus_range"], "max_weight": t["max_weight"], **changes}
    return Context(run_id=0, node_id=1, node_config={}, state=RecordDict({RECORD_KEY_STATE: ConfigRecord(state)}),
                   run_config={})


def _flower_secure_mean(values: list[np.ndarray], bits: int) -> np.ndarray:
    """Flower 1.41's SecAgg+ arithmetic on each client's values (weight 1) and on the server's side, masks left out
    (they cancel modulo the field): client ``_collect_masked_vectors`` then server ``unmask_stage``."""
    t = ddg_transport(bits)
    clip, levels, modulus = t["clipping_range"], t["quantization_range"], t["modulus_range"]
    total: list[np.ndarray] | None = None
    for v in values:
        q_ratio = round(1 / MAX_WEIGHT * levels)
        quantized = factor_combine(q_ratio, quantize(parameters_multiply([v], q_ratio / levels), clip, levels))
        quantized = [a.astype(np.int64) for a in quantized]  # Flower's int64 masks promote them
        total = quantized if total is None else [a + b for a, b in zip(total, quantized)]
    assert total is not None
    recon = [np.mod(a, modulus) for a in total]
    q_total, recon = factor_extract(recon)
    (vec,) = dequantize(recon, clip, levels)
    vec += -(len(values) - 1) * clip
    vec *= levels / q_total
    return vec


@pytest.mark.parametrize("bits,clients", [(12, 1), (12, 7), (20, 100), (31, 30)])
def test_flowers_quantizer_carries_the_residues_exactly(bits: int, clients: int) -> None:
    rng = np.random.default_rng(bits + clients)
    shares = [rng.integers(0, 1 << bits, size=257).astype(np.float64) for _ in range(clients)]
    shares[0][:3] = [0, (1 << bits) - 1, 1 << (bits - 1)]  # the field's edges
    ctxt = _context(bits)
    values = [parameters_to_ndarrays(_residue_payload([u], bits, ctxt))[0] for u in shares]
    mean = _flower_secure_mean(values, bits)
    expected = np.mod(np.sum(np.stack(shares).astype(np.int64), axis=0), 1 << bits)
    assert np.array_equal(residues_from_mean(mean, bits, clients), expected)


@pytest.mark.parametrize("change", [{"mod_range": 2**21}, {"target_range": 2**20}, {"clipping_range": 8.0},
                                    {"max_weight": 1000.0}])
def test_a_client_refuses_a_field_other_than_its_mechanisms(change: dict) -> None:
    """A wider field would reveal how often the shares wrapped; any other setting breaks the exact transport."""
    u = np.arange(16, dtype=np.float64)
    with pytest.raises(NoContribution, match="not the 20-bit field"):
        _residue_payload([u], 20, _context(20, **change))
    with pytest.raises(NoContribution, match="residues modulo 2"):
        _residue_payload([u - 1.0], 20, _context(20))  # -1 is not a residue


def _overrides(**extra: object) -> dict:
    return {"num-server-rounds": 3, "privacy-dist": "fixed", "batch-size": 16, "local-steps": 2, "clip-norm": 1.0,
            "fraction-evaluate": 0.0, "seeded-noise": True, "max-samples": 400, "num-clients": 4, **extra}


def test_the_config_refuses_what_the_discrete_gaussian_cannot_claim() -> None:
    base = {"strategy": "dp-fedavg", "secagg-mechanism": "ddg"}  # set explicitly (the default would follow the run)
    with pytest.raises(ConfigError, match="'accountant' = 'prv' with secagg-mechanism = 'ddg'"):
        resolve_config(None, {**base, "accountant": "prv"})
    with pytest.raises(ConfigError, match="'client-dp-adversary' = 'release' with secagg-mechanism = 'ddg'"):
        resolve_config(None, {**base, "client-dp-adversary": "release"})
    with pytest.raises(ConfigError, match="'secagg-bits' = 16 would have no effect"):
        resolve_config(None, {**base, "secure-aggregation": False, "secagg-bits": 16})
    with pytest.raises(ConfigError, match="'secagg-bits' = 16 would have no effect"):
        resolve_config(None, {**base, "secagg-mechanism": "gaussian", "secagg-bits": 16})
    resolve_config(None, {**base, "client-dp-adversary": "release", "secagg-mechanism": "gaussian"})


def test_the_plan_refuses_too_few_bits_naming_the_key() -> None:
    from fedapp.apps.privacy_plan import privacy_plan

    cfg = resolve_config(None, {"strategy": "dp-fedavg", "target-epsilon": 0.5, "num-server-rounds": 50,
                                "secagg-bits": 8, "num-clients": 20})
    with pytest.raises(ConfigError, match="run-config 'secagg-bits' = 8: 8 bits cannot carry"):
        privacy_plan(cfg, 20)
    plan = privacy_plan(resolve_config(None, {"strategy": "fed-smp-randk", "num-clients": 20}), 20)
    mech = plan["mechanism"]
    assert mech["field_bits"] == 20 and mech["gaussian_equivalent"] >= mech["planned_gaussian_multiplier"]
    assert mech["payload_dim"] < 0.05 * 6058  # Fed-SMP privatizes the k masked values only
    assert plan["every_client"]["epsilon_vs_server"] <= plan["epsilon_budget"] * (1 + 1e-9)


def test_fed_smp_at_one_percent_sends_one_percent_of_dense_dp_fedavgs_share() -> None:
    """The Fed-SMP paper's CNN (cnn-fmnist, 1,663,370 parameters) under the default mechanism: rand-k at compression
    0.01 sends a share of k = 16,634 residues, dense DP-FedAvg one of 1,663,370 (the DCT pads nothing: the padded
    Hadamard sent 32,768 against 2,097,152, 1.56 %), so ≤ 1.1 % of the bytes, packed into the field's bits or as
    Flower's int64 coordinates plus the protocol's keys and shares (< 4,000 bytes a client: test_secure_aggregation)."""
    from fedapp.apps.privacy_plan import privacy_plan

    base = {"model": "cnn-fmnist", "dataset": "node-local", "input-shape": "[1, 28, 28]", "num-classes": 10,
            "num-clients": 20, "secure-aggregation": True}
    mech = {s: privacy_plan(resolve_config(None, {**base, "strategy": s, "compression-ratio": 0.01}), 20)["mechanism"]
            for s in ("fed-smp-randk", "dp-fedavg")}
    sparse, dense = mech["fed-smp-randk"], mech["dp-fedavg"]
    assert dense["payload_dim"] == dense["rotated_dim"] == 1_663_370
    assert sparse["payload_dim"] == sparse["rotated_dim"] == 16_634
    assert sparse["field_bits"] == dense["field_bits"] == 20
    assert sparse["payload_bytes"] <= 0.011 * dense["payload_bytes"]
    assert 8 * sparse["rotated_dim"] + 4000 <= 0.011 * 8 * dense["rotated_dim"]


@pytest.mark.slow
def test_a_discrete_gaussian_secure_sum_trains_like_the_plain_sum_and_its_ledger_is_recomputed(tmp_path: Path) -> None:
    """Real SecAgg+ (Ray simulation, 4 SuperNodes), 20 bits: with a tiny σ the secure model equals the model of the
    same run without secure aggregation up to the noise and rounding (so rotation, scaling, modular sum and decoding
    are right), and every client's epsilon_vs_server is the RDP composition of the rounds' Gaussian equivalents,
    which bounds the discrete mechanism's own RDP ε."""
    from test_secure_aggregation import rounds_of, simulate

    from fedapp.state.checkpoint import load_checkpoint

    tiny = {"strategy": "dp-fedavg", "noise-multiplier": 1e-4}
    secure = simulate(tmp_path / "ddg", _overrides(**tiny))
    plain = simulate(tmp_path / "plain", _overrides(**tiny, **{"secure-aggregation": False}))
    a, b = load_checkpoint(secure)["state"]["weights"], load_checkpoint(plain)["state"]["weights"]
    diff = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
    assert diff < 2e-3, diff
    recs = rounds_of(secure)
    assert len(recs) == 3 and all(r["metrics"]["secure_sum"] == "distributed discrete Gaussian" for r in recs)
    assert all(sum(c["status"] == "ok" for c in r["clients"]) == 4 for r in recs)

    # a realistic σ: recompute the ledger from rounds.jsonl
    run = simulate(tmp_path / "ledger", _overrides(**{"strategy": "dp-fedavg", "noise-multiplier": 1.2,
                                                      "secagg-bits": 14}))
    recs = rounds_of(run)
    meta = json.loads((run / "config.json").read_text())
    mech = meta["privacy_plan"]["mechanism"]
    ddg = DistributedDiscreteGaussian(clip=1.0, noise_multiplier=mech["noise_multiplier"], max_cohort=4,
                                      dim=mech["payload_dim"], bits=14)
    delta = recs[0]["metrics"]["delta"]
    equivalents, rdp = [], np.zeros(len(ORDERS))
    for r in recs:
        sampled = r["metrics"]["clients_sampled"]
        survivors = sum(c["status"] == "ok" for c in r["clients"])
        equivalents.append(ddg.gaussian_equivalent(survivors, sampled))
        rdp += ddg.rdp(survivors, sampled)
        assert r["metrics"]["noise_multiplier_effective"] == pytest.approx(equivalents[-1], rel=1e-9)
    acc = dp_accounting.rdp.RdpAccountant()
    for z in equivalents:
        acc.compose(dp_accounting.GaussianDpEvent(z))
    # on one set of orders and one conversion, the Gaussian equivalents' ε bounds the discrete mechanism's own
    alphas = np.asarray(ORDERS, dtype=np.float64)
    gaussian_rdp = sum(alphas / (2 * z**2) for z in equivalents)
    assert np.all(rdp <= gaussian_rdp * (1 + 1e-12))
    assert rdp_to_epsilon(rdp, delta) <= rdp_to_epsilon(gaussian_rdp, delta)
    # every sampled client summed in every round: the clients' continuous plan σ bounds the charged equivalents, so
    # their reports agree with the ledger (from above, within the calibration's tolerance) and nothing is flagged
    assert all(sum(c["status"] == "ok" for c in r["clients"]) == r["metrics"]["clients_sampled"] for r in recs)
    assert all(c["client_epsilon_spent"] >= c["epsilon_spent"] for r in recs for c in r["clients"])
    assert not [c["epsilon_mismatch"] for r in recs for c in r["clients"] if c.get("epsilon_mismatch")]
    last = recs[-1]
    for c in last["clients"]:
        assert c["epsilon_vs_server"] == pytest.approx(acc.get_epsilon(delta), rel=0.01)
    assert last["metrics"]["max_epsilon_vs_server"] <= last["metrics"]["epsilon_budget"] * (1 + 1e-9)
    assert math.isfinite(last["metrics"]["accuracy"])


@pytest.mark.parametrize("strategy", ["dp-fedavg", "fed-smp-randk", "dp2-fedsam"])
def test_clients_send_one_residue_share_of_the_payload(strategy: str) -> None:
    """Each client-level client clips, then sends its discrete Gaussian share: one array of residues modulo 2^b of
    the rotated payload, exactly as long as the payload (the model, the k masked values, or φ; no padding); without
    the round's rotation seed it refuses."""
    from flwr.common import FitIns, GetParametersIns, ndarrays_to_parameters

    from fedapp.apps.privacy_plan import secure_payload_dim
    from fedapp.registry import get_spec
    from strategies.client_level import CFG_ROTATION_SEED, rotation_seed
    from strategies.fed_smp import CFG_K, CFG_SEED, CFG_SPARSIFIER, mask_seed

    ov = {"strategy": strategy, "secagg-bits": 16, "clients-per-round": 2, "num-clients": 4, "noise-multiplier": 1.0,
          "batch-size": 16, "local-steps": 1, "max-samples": 400, "compression-ratio": 0.1}
    cfg = resolve_config(None, ov)
    ctx = Context(run_id=0, node_id=1, node_config={"partition-id": 0, "num-partitions": 4}, state=RecordDict(),
                  run_config={})
    client = get_spec(strategy).client(ctx, ov)
    params = parameters_to_ndarrays(client.get_parameters(GetParametersIns(config={})).parameters)
    dim = secure_payload_dim(cfg)
    config: dict = {"server-round": 1, CFG_ROTATION_SEED: rotation_seed(1, 1), "dp-round-clients": 2}
    if strategy == "fed-smp-randk":
        config.update({CFG_SPARSIFIER: "randk", CFG_K: dim, CFG_SEED: mask_seed(1, 1)})
    res = client.fit(FitIns(ndarrays_to_parameters(params), config))
    (share,) = parameters_to_ndarrays(res.parameters)
    assert res.metrics["status"] == "ok" and res.metrics["secagg_bits"] == 16
    assert share.shape == (dim,) and np.all((share >= 0) & (share < 2**16) & (share == np.floor(share)))
    del config[CFG_ROTATION_SEED]
    res = client.fit(FitIns(ndarrays_to_parameters(params), {**config, "server-round": 2}))
    assert res.metrics["status"] == "refused" and CFG_ROTATION_SEED in str(res.metrics["reason"])
