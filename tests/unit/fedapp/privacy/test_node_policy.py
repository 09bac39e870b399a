"""A node's privacy policy is its own: on a SuperNode the run-config (the server's) may not seed the noise, pick the
release adversary, allow a large δ or add/remove neighbours, or plan more ε than the node's cap;
and a client caps r_t at the cohort its own SecAgg+ state shows."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from conftest import client_context
from flwr.app import ConfigRecord, RecordDict
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE
from flwr.compat.common.recorddict_compat import fitins_to_recorddict

from fedapp.clients import guard
from fedapp.config import ConfigError, resolve_config
from fedapp.privacy.node_policy import NodePolicy, planned_epsilon
from fedapp.privacy.secure_aggregation import FIT_CONFIG, clamp_round_clients, cohort_seen
from fedapp.run.deploy import check_node_policies, node_configs, parse_node_config
from strategies.client_level import CFG_ROUND_CLIENTS

NODE = {"partition-id": 0, "num-partitions": 4}
CLIENT_LEVEL = {"strategy": "dp-fedavg", "num-clients": 4, "target-epsilon": 2.0, "num-server-rounds": 5}


@pytest.mark.parametrize(("setting", "key"), [
    ({"seeded-noise": True}, "allow-seeded-noise"),
    ({"client-dp-adversary": "release", "secagg-mechanism": "gaussian"}, "allow-release-adversary"),
    ({"allow-large-delta": True}, "allow-large-delta"),
    ({"record-neighbours": "add-remove", "strategy": "dpsgd-fedavg"}, "allow-add-remove"),
])
def test_a_supernode_with_default_node_config_refuses_what_weakens_its_guarantee(setting, key):
    cfg = resolve_config(None, {**CLIENT_LEVEL, **setting})
    reason = NodePolicy.from_node_config(NODE, on_supernode=True).refusal(cfg, None)
    assert reason is not None and key in reason
    assert NodePolicy.from_node_config({**NODE, key: True}, on_supernode=True).refusal(cfg, None) is None
    # in a simulation the submitter runs every node: accepted unless the node-config says otherwise
    assert NodePolicy.from_node_config(NODE, on_supernode=False).refusal(cfg, None) is None
    assert key in (NodePolicy.from_node_config({**NODE, key: "false"}, on_supernode=False).refusal(cfg, None) or "")


def test_the_defaults_are_accepted_everywhere():
    for strategy in ("dp-fedavg", "robust-hdp", "dp2-fedsam", "soteriafl-sgd", "fedavg"):
        cfg = resolve_config(None, {"strategy": strategy})
        assert NodePolicy.from_node_config(NODE, on_supernode=True).refusal(cfg, None) is None


def test_max_epsilon_caps_the_planned_epsilon_against_the_server():
    cfg = resolve_config(None, CLIENT_LEVEL)
    against_server = planned_epsilon(cfg, NODE)
    assert against_server == pytest.approx(2.0, rel=2e-3)  # calibrated for the server (q = 1)
    policy = NodePolicy.from_node_config({**NODE, "max-epsilon": 1.5}, on_supernode=True)
    assert "max-epsilon" in (policy.refusal(cfg, against_server) or "")
    # the release adversary's σ is smaller: against the server the same target-epsilon is worth far more
    released = resolve_config(None, {**CLIENT_LEVEL, "client-dp-adversary": "release", "secagg-mechanism": "gaussian",
                                     "clients-per-round": 2, "allow-large-delta": True})  # 2 of 4: δ (secure_minimum)
    assert planned_epsilon(released, NODE) > 2.5
    record = resolve_config(None, {"strategy": "robust-hdp", "privacy-dist": "fixed", "epsilon": 3.0})
    assert planned_epsilon(record, NODE) == 3.0 and planned_epsilon(record, {**NODE, "epsilon": 1.0}) == 1.0
    assert planned_epsilon(resolve_config(None, {"strategy": "fedavg"}), NODE) is None
    for bad in ("lots", -1.0, True):
        with pytest.raises(ConfigError, match="max-epsilon"):
            NodePolicy.from_node_config({**NODE, "max-epsilon": bad}, on_supernode=True)
    with pytest.raises(ConfigError, match="allow-seeded-noise"):
        NodePolicy.from_node_config({**NODE, "allow-seeded-noise": "yes"}, on_supernode=True)


def test_the_guarded_client_refuses_on_a_supernode_before_it_trains(monkeypatch):
    """guard_client on a SuperNode (Flower's ClientApp runtime loaded): the reply is a refusal naming the node-config
    key, and the family's client is never asked to fit."""
    monkeypatch.setattr(guard, "on_supernode", lambda: True)
    cfg = resolve_config(None, {**CLIENT_LEVEL, "seeded-noise": True})

    class Inner:
        def fit(self, ins):  # pragma: no cover - must not be reached
            raise AssertionError("trained despite the node's policy")

    ctx = client_context(node=NODE, run_id=0, node_id=1)
    client = guard.guard_client(Inner(), ctx, cfg.general, cfg.data, cfg.training, cfg.deployment, cfg)
    res = client.fit(FitIns(Parameters(tensors=[], tensor_type="numpy.ndarray"), {"server-round": 1}))
    assert res.metrics["status"] == "refused" and "allow-seeded-noise" in str(res.metrics["reason"])
    assert res.parameters.tensors == [] and res.num_examples == 0

    class Ok:
        def fit(self, ins):
            return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.zeros(2)]), 1,
                          {"client_id": 0, "status": "ok"})

    allowed = client_context(node={**NODE, "allow-seeded-noise": True}, run_id=0, node_id=1)
    res = guard.guard_client(Ok(), allowed, cfg.general, cfg.data, cfg.training, cfg.deployment, cfg).fit(
        FitIns(Parameters(tensors=[], tensor_type="numpy.ndarray"), {"server-round": 1}))
    assert res.metrics["status"] == "ok"


def test_the_deploy_launcher_refuses_before_any_process_starts():
    cfg = resolve_config(None, {**CLIENT_LEVEL, "num-clients": 3, "seeded-noise": True})
    with pytest.raises(ConfigError, match="SuperNode 0: .*allow-seeded-noise"):
        check_node_policies(cfg, node_configs(3))
    check_node_policies(cfg, node_configs(3, [f"{i}:allow-seeded-noise=true" for i in range(3)]))
    assert parse_node_config("allow-release-adversary=false max-epsilon=4") == {"allow-release-adversary": False,
                                                                                "max-epsilon": 4.0}
    with pytest.raises(ConfigError, match="'allow-seeded-noise' expects true or false"):
        parse_node_config("allow-seeded-noise=1")


def secagg_context(sample: int, share: int, keys: int):
    ctx = client_context(node=NODE, run_id=0, node_id=1)
    state = SecAggPlusState(current_stage="share_keys", nid=1, sample_num=sample, share_num=share, threshold=2)
    state.public_keys_dict = {i: (b"pk1", b"pk2") for i in range(keys)}
    ctx.state.config_records[RECORD_KEY_STATE] = ConfigRecord(state.to_dict())  # as Flower's secaggplus_mod stores it
    return ctx


def fit_message(r_t: int) -> SimpleNamespace:
    """The content of a SecAgg+ collect stage's train message (the fit config as Flower's compat layer records it)."""
    content: RecordDict = fitins_to_recorddict(FitIns(Parameters(tensors=[], tensor_type="numpy.ndarray"),
                                                      {CFG_ROUND_CLIENTS: r_t, "server-round": 1}), keep_input=True)
    return SimpleNamespace(content=content)


def test_r_t_is_capped_at_the_cohort_the_clients_own_secagg_state_shows():
    ctx = secagg_context(sample=5, share=5, keys=4)  # one sampled client dropped before the keys were shared
    assert cohort_seen(ctx) == 4
    msg = fit_message(50)  # a server claiming 50 clients would cut each noise share by √10
    clamp_round_clients(msg, ctx)
    assert msg.content.config_records[FIT_CONFIG][CFG_ROUND_CLIENTS] == 4
    honest = fit_message(4)
    clamp_round_clients(honest, ctx)
    assert honest.content.config_records[FIT_CONFIG][CFG_ROUND_CLIENTS] == 4
    partial = secagg_context(sample=9, share=5, keys=5)  # neighbours are a subset: only the sample size is known
    assert cohort_seen(partial) == 9
    assert cohort_seen(client_context(node=NODE, run_id=0, node_id=1)) is None  # no SecAgg+ state: unchanged
