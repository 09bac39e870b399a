"""The privacy plan of a run, before anything runs: mechanism, its parameters and the planned ε per adversary.

``python -m fedapp.run.launch --plan ...`` validates the run-config and builds everything (the dry run), then prints
this plan and starts nothing; every run keeps it in ``config.json`` (``privacy_plan``). Planned values assume the
run goes as planned: a client-level client takes part in every round (the worst case against the server) and
every sampled client survives; the ledger then charges what actually happened.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedapp.apps.mechanisms import secure_payload_dim
from fedapp.config import resolve_config
from fedapp.config.run_config import record_canaries
from fedapp.registry import get_spec

__all__ = ["privacy_plan", "secure_payload_dim"]


def privacy_plan(run_config: Mapping[str, Any], num_clients: int, payload_dim: int | None = None) -> dict[str, Any]:
    """The plan of ``run_config`` for a federation of ``num_clients`` (see the module docstring). ``payload_dim``: the
    length of a client's privatized vector, from the run's built strategy when there is one (the distributed
    discrete Gaussian is sized for it); without it, :func:`secure_payload_dim` builds a strategy to ask."""
    cfg = resolve_config(run_config)
    spec = get_spec(cfg.general.strategy)
    plan: dict[str, Any] = {"strategy": spec.name, "threat_model": spec.privacy, "rounds": int(cfg.rounds),
                            "dp_rounds": int(cfg.dp_rounds), "clients": int(num_clients),
                            "seeded_noise": cfg.general.seeded_noise}
    plan.update(spec.mechanism.plan(cfg, num_clients, payload_dim))  # fedapp.apps.mechanisms
    if plan["seeded_noise"]:
        plan["note"] = "seeded-noise = true: the server knows the noise seed, so no ε holds against it"
    k = cfg.general.audit_canaries
    if k and record_canaries(cfg.general):  # fedapp.privacy.record_audit
        plan["audit"] = {"canary_records": k, "slots": f"slot j in client j mod {num_clients}'s training data, one "
                                                       "of two random records by a secret coin",
                         "seed": cfg.general.audit_seed,
                         "estimator": "one-run lower bound (Steinke et al. 2023) for the final model, beside the "
                                      "largest epsilon of the clients holding canaries"}
    elif k:  # fedapp.privacy.audit
        plan["audit"] = {"canaries": k, "canary_clients": f"{num_clients - k}..{num_clients - 1} (of {num_clients})",
                         "seed": cfg.general.audit_seed,
                         "estimator": "one-shot (Andrew et al. 2024): final model and all iterates, beside "
                                      "epsilon_vs_release"}
    return plan


