"""A DP-FTRL client under SecAgg+ whose noise stream is lost after round 1 drops out instead of restarting it, so the
server leaves it out of P (the clients whose stream reached every released sum) and charges z √(|P|/n)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import analytic_gaussian_epsilon, client_manager
from flwr.common import Code, Context, FitRes, RecordDict, Status, ndarrays_to_parameters, parameters_to_ndarrays

from fedapp.clients.client_dp import FTRL_STREAM, FTRLClient
from fedapp.clients.common import setup_client
from fedapp.config import resolve_config
from strategies.dp_ftrl import DPFTRLStrategy

N = 4  # SecAgg+ unmasks no sum of fewer than 3 survivors
OV = {"strategy": "dp-ftrl", "secagg-mechanism": "gaussian", "num-server-rounds": 6, "noise-multiplier": 2.0,
      "clip-norm": 1.0, "privacy-dist": "fixed", "batch-size": 8, "local-steps": 1, "max-samples": 300}


def context(cid: int) -> Context:
    return Context(run_id=0, node_id=cid + 1, node_config={"partition-id": cid, "num-partitions": N},
                   state=RecordDict(), run_config={})


def client(ctx: Context) -> FTRLClient:
    """A fresh client object on ``ctx`` (as Flower builds one per message): its stream lives in ``ctx.state``."""
    return FTRLClient(setup_client(ctx, OV), resolve_config(None, OV).client_dp, ctx)


def test_a_client_whose_stream_is_lost_after_round_1_refuses_and_restarts_nothing():
    ctx = context(1)
    params = client(ctx).get_parameters({})
    _, _, metrics = client(ctx).fit(params, {"server-round": 1})
    assert metrics["status"] == "ok" and FTRL_STREAM in ctx.state
    lost = context(1)  # the same node after its state is gone (no journal to restore it from)
    arrays, n, metrics = client(lost).fit(params, {"server-round": 2})
    assert metrics["status"] == "refused" and arrays == [] and n == 0
    assert "noise stream is lost" in metrics["reason"] and "drops out" in metrics["reason"]
    assert FTRL_STREAM not in lost.state  # no restarted stream was drawn, nor kept for a later round
    arrays, _, metrics = client(lost).fit(params, {"server-round": 3})  # nor in any later round
    assert metrics["status"] == "refused" and arrays == []
    # its stream is never started after round 1, even by a direct call past the refusal
    fresh = client(context(2))
    with pytest.raises(RuntimeError, match="noise stream is lost"):
        fresh.privatize(np.zeros(5), [(5,)], {"server-round": 2}, fresh.mechanism(), np.random.default_rng(0))
    # the intact client goes on with its own stream
    _, _, metrics = client(ctx).fit(params, {"server-round": 2})
    assert metrics["status"] == "ok"


def _round(s: DPFTRLStrategy, rnd: int, contexts: list[Context]) -> list[dict]:
    """One SecAgg+ round in process: every sampled client fits; a reply that is not ``ok`` drops out of the sum (as
    :mod:`fedapp.privacy.secure_aggregation` drops it); each survivor carries the survivors' mean, as SecAgg+ hands it
    over. Returns the clients' metrics."""
    ins = s.configure_fit(rnd, ndarrays_to_parameters(s.current_weights), client_manager(N))
    replies, results = [], []
    for proxy, fit_ins in ins:
        cid = int(proxy.node_id) - 1
        arrays, n, metrics = client(contexts[cid]).fit(parameters_to_ndarrays(fit_ins.parameters), fit_ins.config)
        replies.append(metrics)
        if metrics["status"] == "ok":
            results.append((proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, metrics)))
    vectors = [parameters_to_ndarrays(res.parameters) for _, res in results]
    mean = [np.mean(layer, axis=0) for layer in zip(*vectors)]
    for _, res in results:
        res.parameters = ndarrays_to_parameters(mean)
    assert s.unmask_refusal(rnd, results) is None
    s.aggregate_fit(rnd, results, [])
    s.flush_round()
    return replies


def test_the_server_leaves_a_client_with_a_lost_stream_out_of_p():
    contexts = [context(cid) for cid in range(N)]
    probe = client(contexts[0])
    mech = probe.mechanism()
    assert mech.secure_aggregation and mech.num_clients == N
    s = DPFTRLStrategy(ftrl_factory=lambda n: mech, clip=mech.clip, secure_aggregation=True,
                       initial_weights=probe.get_parameters({}), num_rounds=mech.rounds, seed=0, sampling="fixed")
    replies = _round(s, 1, contexts)
    assert [r["status"] for r in replies] == ["ok"] * N and s.present_count() == N
    contexts[3] = context(3)  # client 3 loses its state between rounds 1 and 2
    replies = _round(s, 2, contexts)
    assert sorted((r["client_id"], r["status"]) for r in replies) == [(0, "ok"), (1, "ok"), (2, "ok"), (3, "refused")]
    assert s.present == {0, 1, 2} and s.present_count() == 3  # a restarted stream would have kept it in P
    expected = analytic_gaussian_epsilon(mech.noise_multiplier * math.sqrt(3 / N) / mech.sensitivity(2), mech.delta)
    assert s.ledger.population_epsilon() == pytest.approx(expected, rel=0.01)
    assert s.ledger.population_epsilon() > mech.epsilon(2)
