"""secaggmodel: the mechanism and SecAgg+ settings server and clients must share, read from the run-config once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedapp.library import SecAggSettings, client_level_mechanism
from strategies.privacy.mechanisms import ClientLevelDP


def secagg_settings(cfg: Mapping[str, Any]) -> SecAggSettings:
    """The secure sum (its noise, field, shares, threshold, stage timeout): the server runs it, the clients check it."""
    return SecAggSettings(mechanism=str(cfg["secagg-mechanism"]), bits=int(cfg["secagg-bits"]),
                          num_shares=float(cfg["secagg-num-shares"]),
                          reconstruction_threshold=float(cfg["secagg-threshold"]),
                          round_timeout=float(cfg["round-timeout"]))


def mechanism(cfg: Mapping[str, Any]) -> ClientLevelDP:
    """Client-level DP calibrated for the secure sum: num-server-rounds rounds of it spend target-epsilon against the
    server, which sees only each round's sum (every round charged unamplified)."""
    return client_level_mechanism(num_clients=int(cfg["num-clients"]), rounds=int(cfg["num-server-rounds"]),
                                  clip=float(cfg["clip-norm"]), target_epsilon=float(cfg["target-epsilon"]),
                                  clients_per_round=int(cfg["clients-per-round"]), secure_aggregation=True)
