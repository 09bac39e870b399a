"""A client-level DP client bounds what the server says with its own numbers: r_t, σ and the round count."""

from __future__ import annotations

import pytest
from conftest import client_context

from fedapp.clients.client_dp import ClientLevelDPClient
from fedapp.clients.client_level_guard import ClientFloors, floor_refusal, round_clients
from fedapp.clients.common import setup_client
from fedapp.config import ConfigError, resolve_config
from strategies.client_level import CFG_ROUND_CLIENTS
from strategies.privacy.mechanisms import ClientLevelDP

BASE = {"dataset": "digits", "strategy": "dp-fedavg", "privacy-dist": "fixed", "batch-size": 16, "local-steps": 2,
        "clip-norm": 0.5, "num-server-rounds": 3, "clients-per-round": 2, "noise-multiplier": 1.3,
        "secure-aggregation": True, "secagg-mechanism": "gaussian"}


def client(node_config: dict | None = None) -> ClientLevelDPClient:
    ctx = client_context(node=node_config, run_id=0, node_id=1)
    return ClientLevelDPClient(setup_client(ctx, BASE), resolve_config(None, BASE).client_dp, ctx, private=True)


def test_a_server_claiming_a_large_cohort_cannot_cut_the_noise_below_the_node_floor() -> None:
    dp = ClientLevelDP(1.0, 1.0, 20, 500, 10, 1e-4)
    claim = {CFG_ROUND_CLIENTS: 500}
    assert round_clients(claim, dp) == 500  # without a floor the client adds C·σ/√500
    assert round_clients(claim, dp, ClientFloors(min_round_clients=20)) == 20  # √25 = 5 times that noise
    assert dp.noise_std(round_clients(claim, dp, ClientFloors(20))) == pytest.approx(5 * dp.noise_std(500))


def test_a_sigma_below_the_node_floor_is_refused() -> None:
    c = client({"min-noise-multiplier": 2.0})
    arrays, _, metrics = c.fit(c.get_parameters({}), {"server-round": 1})
    assert metrics["status"] == "refused" and "min-noise-multiplier" in metrics["reason"] and arrays == []
    assert floor_refusal(ClientLevelDP(2.5, 1.0, 2, 4, 3, 1e-3), ClientFloors(min_noise_multiplier=2.0)) is None
    with pytest.raises(ConfigError, match="min-round-clients"):
        ClientFloors.from_node_config({"min-round-clients": "many"})


def test_a_server_repeating_round_one_cannot_make_the_client_exceed_its_budget() -> None:
    """The client counts its own releases: after dp-rounds = 3 of them it refuses, whatever round the server says."""
    c = client()
    params = c.get_parameters({})
    statuses = []
    for _ in range(5):
        _, _, metrics = c.fit(params, {"server-round": 1, CFG_ROUND_CLIENTS: 2})
        statuses.append(metrics["status"])
    assert statuses == ["ok", "ok", "ok", "refused", "refused"]
    assert "past dp-rounds=3" in metrics["reason"]
