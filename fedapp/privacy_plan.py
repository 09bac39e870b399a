"""The privacy plan of a run, before anything runs: mechanism, its parameters and the planned ε per adversary.

``python -m fedapp.launch --plan ...`` validates the run-config and builds everything (the dry run), then prints
this plan and starts nothing; every run keeps it in ``config.json`` (``privacy_plan``). Planned values assume the
run goes as planned: a client-level client takes part in every round (the worst case against the server) and
every sampled client survives; the ledger then charges what actually happened.
"""

from __future__ import annotations

import math
from typing import Any

from fedapp.config import ConfigError, RunConfig
from fedapp.registry import get_spec
from fedapp.secure_aggregation import modulus_for

#: Flower SecAgg+'s quantization levels per coordinate (``SecAggPlusWorkflow.quantization_range``)
QUANTIZATION_RANGE = 2**22


def privacy_plan(cfg: RunConfig, num_clients: int) -> dict[str, Any]:
    """The plan of ``cfg`` for a federation of ``num_clients`` (see the module docstring)."""
    spec = get_spec(cfg["strategy"])
    plan: dict[str, Any] = {"strategy": spec.name, "threat_model": spec.privacy, "rounds": int(cfg.rounds),
                            "dp_rounds": int(cfg.dp_rounds), "clients": int(num_clients),
                            "seeded_noise": bool(cfg["seeded-noise"])}
    if spec.privacy.startswith("client-level"):
        plan.update(_client_level(cfg, num_clients))
    elif spec.privacy.startswith("record-level"):
        plan.update(_record_level(cfg, num_clients, dpsgd=spec.family != "soteriafl"))
    else:
        plan["mechanism"] = {"name": "none (non-private baseline)"}
    if plan["seeded_noise"]:
        plan["note"] = "seeded-noise = true: the server knows the noise seed, so no ε holds against it"
    return plan


def _client_level(cfg: RunConfig, n: int) -> dict[str, Any]:
    from fedapp.privacy_profiles import client_level_mechanism
    from strategies.privacy.accountants import epsilon_of

    dp = client_level_mechanism(cfg, n)
    secagg = bool(cfg["secure-aggregation"])
    mechanism: dict[str, Any] = {
        "name": "Gaussian on the sum of clipped client updates (each sampled client adds its share)",
        "secure_aggregation": "Flower SecAgg+" if secagg else "off: the server sees every update",
        "noise_multiplier": dp.noise_multiplier, "clip": dp.clip, "clients_per_round": dp.clients_per_round,
        "sample_rate": dp.sample_rate, "delta": dp.delta, "accountant": dp.accountant,
        "budget_holds_against": dp.adversary,
    }
    if secagg:
        try:
            field = modulus_for(n, QUANTIZATION_RANGE)
        except ValueError as exc:
            raise ConfigError(f"run-config 'secure-aggregation' = true with {n} clients: {exc}") from None
        mechanism.update(quantization_bits=int(math.log2(QUANTIZATION_RANGE)), field_bits=int(math.log2(field)))
    t = dp.rounds
    return {"mechanism": mechanism, "epsilon_budget": dp.epsilon(),
            "every_client": {
                # worst case against the server: the client takes part in all T rounds, each unamplified, at the
                # multiplier the server sees (the sum's with SecAgg+, one update's without)
                "epsilon_vs_server": epsilon_of([(dp.budget_noise_multiplier, 1.0, t)], dp.delta, dp.accountant),
                "epsilon_vs_release": dp.epsilon_vs_release(), "delta": dp.delta}}


def _record_level(cfg: RunConfig, n: int, dpsgd: bool) -> dict[str, Any]:
    from fedapp.client_data import client_train_sizes
    from fedapp.privacy_profiles import federation_profiles
    from fedapp.training import dpsgd_sample_rate, steps_per_epoch

    profiles = federation_profiles(cfg, n)
    sizes = client_train_sizes(cfg, n)
    clients = []
    for p, n_i in zip(profiles, sizes):
        row: dict[str, Any] = {"client_id": p.client_id, "num_examples": int(n_i), "delta": p.delta,
                               # local DP: the client's own noise, so the same ε against the server and the release
                               "epsilon_vs_server": p.epsilon, "epsilon_vs_release": p.epsilon}
        if dpsgd:  # DP-SGD's Poisson batches: q_i = 1/⌈N_i/b_i⌉, K_i⌈N_i/b_i⌉ steps a round
            row.update(batch_size=p.batch_size, sample_rate=dpsgd_sample_rate(n_i, p.batch_size) if n_i else None,
                       steps_per_round=p.local_epochs * steps_per_epoch(n_i, p.batch_size))
        clients.append(row)
    return {"mechanism": {"name": "local DP-SGD / noisy local estimator on each client (noise added before "
                                  "anything leaves it); each client calibrates its own noise to its ε_i over "
                                  "dp-rounds before round 1", "clip": float(cfg["clip-norm"]),
                          "accountant": str(cfg["accountant"])},
            "per_client": clients}
