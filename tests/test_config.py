"""Config schema vs pyproject, and the bad-input cases of the foundation (clear errors, nothing written)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from fedapp.config import SCHEMA, ConfigError, resolve_config
from fedapp.privacy_profiles import client_profile, sample_epsilons
from fedapp.server_app import make_prevalidate

REPO = Path(__file__).resolve().parents[1]


def test_pyproject_defaults_equal_schema_defaults():
    resolve_config()
    toml = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert set(toml) == set(SCHEMA), f"only in pyproject: {set(toml) - set(SCHEMA)}; only in schema: {set(SCHEMA) - set(toml)}"
    for name, key in SCHEMA.items():
        assert toml[name] == key.default, f"{name}: pyproject {toml[name]!r} != schema {key.default!r}"


@pytest.mark.parametrize("overrides,needle", [
    ({"epsilon": 0.0}, "'epsilon' = 0.0"),
    ({"epsilon": -1}, "'epsilon'"),
    ({"delta": 1.0}, "'delta' = 1.0"),
    ({"delta": 0}, "'delta'"),
    ({"batch-size": -4}, "'batch-size' = -4"),
    ({"dataset": "imagenet"}, "'dataset' = 'imagenet'"),
    ({"strategy": "fedsgd-magic"}, "unknown strategy 'fedsgd-magic'"),
    ({"privacy-dist": "dist10"}, "'privacy-dist' = 'dist10'"),
    ({"num-server-rounds": "ten"}, "'num-server-rounds' expects an integer, got 'ten'"),
    ({"lr": "fast"}, "'lr' expects a number, got 'fast'"),
    ({"dataset": "mnist"}, "needs run-config 'data-dir'"),
    ({"dataset": "mnist", "data-dir": "/nonexistent/dir"}, "'/nonexistent/dir' is not a readable folder"),
    ({"num-clients": 1}, "at least 2 clients"),
    ({"min-available-clients": 1}, "'min-available-clients' = 1"),
    ({"batch-size-choices": "16,abc"}, "'batch-size-choices'"),
    ({"no-such-key": 1}, "unknown run-config key 'no-such-key'"),
])
def test_bad_run_config_is_rejected_with_key_and_value(overrides, needle):
    with pytest.raises(ConfigError) as err:
        resolve_config(overrides=overrides)
    assert needle in str(err.value)


def test_unknown_strategy_lists_valid_names():
    with pytest.raises(ConfigError, match="valid strategies: .*dpsgd-fedavg"):
        resolve_config(overrides={"strategy": "nope"})


def test_batch_larger_than_local_dataset_fails_before_round_one():
    cfg = resolve_config(overrides={"batch-size": 500})
    with pytest.raises(ConfigError, match="batch-size 500 > its dataset size"):
        make_prevalidate(cfg)(4)


@pytest.mark.parametrize("node_config,needle", [
    ({"partition-id": 0}, "needs 'partition-id' and 'num-partitions'"),
    ({"partition-id": 5, "num-partitions": 3}, "outside 0..2"),
    ({"partition-id": 0, "num-partitions": 1}, "at least 2 clients"),
    ({"partition-id": 0, "num-partitions": 3, "epsilon": -0.5}, "epsilon = -0.5"),
    ({"partition-id": 0, "num-partitions": 3, "delta": 2.0}, "delta = 2.0"),
    ({"partition-id": 0, "num-partitions": 3, "batch-size": "big"}, "'batch-size' expects int, got 'big'"),
])
def test_bad_node_config(node_config, needle):
    with pytest.raises(ConfigError) as err:
        client_profile(resolve_config(), node_config)
    assert needle in str(err.value)


def test_privacy_distributions_are_deterministic_positive_and_table7_shaped():
    a = sample_epsilons("dist2", 2000, seed=3)
    assert (a == sample_epsilons("dist2", 2000, seed=3)).all() and (a >= 0.05).all()
    assert abs((a < 0.5).mean() - 0.2) < 0.04  # N(0.2, .) component has weight 0.2
    u = sample_epsilons("dist9", 2000, seed=3)
    assert u.min() >= 0.2 and u.max() <= 0.5
    d1 = sample_epsilons("dist1", 5000, seed=1)
    assert d1.min() >= 0.05 and abs(np.median(d1) - 2.0) < 0.1  # redrawn (truncated), not clipped to a point mass
    assert (d1 == 0.05).sum() == 0


def test_falsified_epsilon_is_reported_not_trained_with():
    cfg = resolve_config(overrides={"falsify-client": 2, "falsify-epsilon": 9.0})
    p = client_profile(cfg, {"partition-id": 2, "num-partitions": 5})
    assert p.reported_epsilon == 9.0 and p.epsilon != 9.0
    q = client_profile(cfg, {"partition-id": 1, "num-partitions": 5})
    assert q.reported_epsilon == q.epsilon


import numpy as np  # noqa: E402


def test_readme_config_table_is_generated_from_schema():
    from fedapp.config import readme_with_table

    readme = (REPO / "README.md").read_text()
    assert readme == readme_with_table(readme), "run: python -m fedapp.config --write-readme"


@pytest.mark.parametrize("strategy,key,value,unused", [
    ("soteriafl-sgd", "target-epsilon", 5.0, True),  # SoteriaFL reads 'epsilon' under privacy-dist = fixed
    ("dp-fedavg", "target-epsilon", 5.0, False),
    ("dp-fedavg", "privacy-dist", "dist4", True),  # record-level budgets mean nothing to client-level DP
    ("robust-hdp", "rpca-tol", 1e-3, False),
    ("weiavg", "sam-rho", 0.3, True),
    ("dp2-fedsam", "compression-ratio", 0.1, True),
])
def test_keys_a_strategy_does_not_read_are_reported(strategy, key, value, unused):
    from fedapp.config import unused_keys
    from fedapp.registry import get_spec

    cfg = resolve_config({}, {"strategy": strategy, key: value})
    assert (key in unused_keys(cfg, get_spec(strategy).family)) is unused


def test_a_run_where_nothing_trained_is_not_finished():
    from fedapp.results import summarize

    idle = [{"round": r, "metrics": {"clients_ok": 0}, "clients": []} for r in (1, 2)]
    summary = summarize(idle, 1.0, done=True)
    assert not summary["finished"] and summary["rounds_trained"] == 0 and "no client update" in summary["stopped_reason"]
    assert summarize([{"round": 1, "metrics": {"clients_ok": 2}, "clients": []}], 1.0, done=True)["finished"]
