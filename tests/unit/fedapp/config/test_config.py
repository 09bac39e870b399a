"""Config schema vs pyproject, and the bad-input cases of the foundation (clear errors, nothing written)."""

from __future__ import annotations

import pytest
import tomllib
from conftest import REPO

from fedapp.apps.server_app import make_prevalidate
from fedapp.config import SCHEMA, ConfigError, resolve_config
from fedapp.privacy.profiles import client_profile, distribution_mean, sample_epsilons


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
    ({"round-timeout": 0.5}, "'round-timeout' = 0.5 is invalid: must be 0 (no timeout) or >= 1 s"),
    ({"dataset": "a9a", "model": "cnn-digits"}, "'model' = 'cnn-digits' does not fit dataset 'a9a'"),
    ({"model": "cnn-cifar"}, "'model' = 'cnn-cifar' does not fit dataset 'digits'"),
    ({"clients-per-round": 3, "num-clients": 2}, "'clients-per-round' = 3 exceeds the 2 clients"),
    ({"falsify-client": 2, "num-clients": 2}, "'falsify-client' = 2 is not a client of this federation"),
    ({"epsilon": 3.0, "privacy-dist": "dist5"}, "'epsilon' = 3.0 would have no effect: privacy-dist = 'dist5'"),
])
def test_bad_run_config_is_rejected_with_key_and_value(overrides, needle):
    with pytest.raises(ConfigError) as err:
        resolve_config(overrides=overrides)
    assert needle in str(err.value)


def test_round_timeout_zero_means_none_and_one_second_is_the_shortest():
    assert resolve_config(overrides={"round-timeout": 0})["round-timeout"] == 0.0
    assert resolve_config(overrides={"round-timeout": 1})["round-timeout"] == 1.0


def test_a_user_set_key_is_refused_only_where_the_run_ignores_it():
    from fedapp.config import ignored_keys

    assert resolve_config(overrides={"epsilon": 0.5, "privacy-dist": "fixed"})["epsilon"] == 0.5
    assert resolve_config(overrides={"strategy": "dp-fedavg", "target-epsilon": 4.0})["target-epsilon"] == 4.0
    cfg = resolve_config(overrides={"partitioner": "dirichlet", "dirichlet-alpha": 0.1})
    assert ignored_keys(cfg) == {} and ignored_keys({**cfg, "partitioner": "iid"}).keys() == {"dirichlet-alpha"}
    with pytest.raises(ConfigError) as err:  # every ignored key is named at once
        resolve_config(overrides={"epsilon": 0.5, "shards-per-client": 2})
    assert "'epsilon' = 0.5" in str(err.value) and "'shards-per-client' = 2" in str(err.value)
    # a key a whole strategy family never reads stays a warning (unused_keys): one run-config may serve several
    assert resolve_config(overrides={"strategy": "fedavg", "rpca-tol": 1e-3})["rpca-tol"] == 1e-3


# every model x input shape: the torch-free verdict (config check, before data) against a real forward pass
INPUT_SHAPES_TRIED = [(1, 8, 8), (1, 28, 28), (3, 32, 32), (123,), (1, 12, 12), (3, 30, 30), (1, 31, 31),
                      (1, 32, 32), (3, 37, 40), (1, 4, 4), (2, 11, 9), (1, 64)]


@pytest.mark.parametrize("model_name", ["cnn-mnist", "cnn-fmnist", "cnn-cifar", "mlp-sigmoid", "logreg",
                                        "resnet18-gn", "cnn-digits", "mlp-digits"])
def test_the_catalog_knows_which_inputs_each_model_takes(model_name):
    import torch

    from fedapp.models.catalog import FLAT_INPUT_MODELS, MODEL_NAMES, model_input_problem
    from fedapp.models.zoo import MODELS, build_model

    assert model_name in MODEL_NAMES
    built: dict[int, torch.nn.Module] = {}  # image models: one per channel count (their layers are size-free)
    for shape in INPUT_SHAPES_TRIED:
        problem = model_input_problem(model_name, shape)
        if model_name in FLAT_INPUT_MODELS:
            net = build_model(model_name, shape, 10)
        else:
            net = built.setdefault(shape[0], MODELS[model_name](shape[0], 10))
        try:
            with torch.no_grad():
                fits = tuple(net.eval()(torch.zeros(2, *shape)).shape) == (2, 10)
        except (RuntimeError, ValueError):
            fits = False
        assert fits == (problem is None), f"{model_name} on {shape}: forward {'ran' if fits else 'failed'}, catalog " \
                                          f"says {problem!r}"
        if problem is not None:
            with pytest.raises(ConfigError, match=f"'model' = '{model_name}' does not fit"):
                build_model(model_name, shape, 10)


def test_every_named_dataset_fits_its_default_model():
    from fedapp.config import DATASETS
    from fedapp.models.catalog import DEFAULT_MODEL, INPUT_SHAPES, model_input_problem

    assert set(INPUT_SHAPES) == set(DATASETS) == set(DEFAULT_MODEL)
    assert {d: model_input_problem(DEFAULT_MODEL[d], INPUT_SHAPES[d]) for d in DATASETS} == dict.fromkeys(DATASETS)


def test_declared_input_shapes_are_what_the_loaders_give(shared_data):
    from fedapp.data.datasets import load_dataset
    from fedapp.models.catalog import INPUT_SHAPES

    names = ["digits", "mnist"] + (["a9a"] if (shared_data / "a9a" / "a9a").is_file() else [])
    for name in names:
        train, test = load_dataset(name, "" if name == "digits" else str(shared_data))
        assert train.input_shape == test.input_shape == INPUT_SHAPES[name], name


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
    cfg = resolve_config()
    with pytest.raises(ConfigError) as err:
        client_profile(cfg.general, cfg.training, cfg.data, node_config)
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


def test_a_privacy_distributions_mean_is_that_of_its_table7_spec_and_of_its_draws():
    assert distribution_mean("dist2") == pytest.approx(0.2 * 0.2 + 0.6 * 1.0 + 0.2 * 5.0)
    assert distribution_mean("dist3") == pytest.approx(2.6) and distribution_mean("dist8") == pytest.approx(0.32)
    for dist in ("dist2", "dist4", "dist6", "dist8", "dist9"):  # the floor redraws too few draws to move the mean
        assert sample_epsilons(dist, 20_000, seed=5).mean() == pytest.approx(distribution_mean(dist), rel=0.03)
    with pytest.raises(ConfigError, match="dist0"):
        distribution_mean("dist0")


def test_falsified_epsilon_is_reported_not_trained_with():
    cfg = resolve_config(overrides={"falsify-client": 2, "falsify-epsilon": 9.0})
    p = client_profile(cfg.general, cfg.training, cfg.data, {"partition-id": 2, "num-partitions": 5})
    assert p.reported_epsilon == 9.0 and p.epsilon != 9.0
    q = client_profile(cfg.general, cfg.training, cfg.data, {"partition-id": 1, "num-partitions": 5})
    assert q.reported_epsilon == q.epsilon


import numpy as np  # noqa: E402


def test_config_reference_is_generated_from_schema():
    from fedapp.config import CONFIG_DOC, TABLE_START, doc_with_table

    doc = (REPO / CONFIG_DOC).read_text()
    assert TABLE_START in doc and doc == doc_with_table(doc), "run: python -m fedapp.config --write-docs"


@pytest.mark.parametrize("strategy,key,value,unused", [
    ("soteriafl-sgd", "target-epsilon", 5.0, True),  # SoteriaFL reads 'epsilon' under privacy-dist = fixed
    ("dp-fedavg", "target-epsilon", 5.0, False),
    ("dp-fedavg", "privacy-dist", "dist4", True),  # record-level budgets mean nothing to client-level DP
    ("robust-hdp", "rpca-tol", 1e-3, False),
    ("weiavg", "sam-rho", 0.3, True),
    ("dp2-fedsam", "compression-ratio", 0.1, True),
    ("dp2-fedsam", "epsilon", 0.5, True),  # client-level DP: target-epsilon (and node-config budgets) instead
    ("dpsgd-fedavg", "epsilon", 0.5, False),  # (with privacy-dist = fixed, below)
])
def test_keys_a_strategy_does_not_read_are_reported(strategy, key, value, unused):
    from fedapp.config import unused_keys
    from fedapp.registry import get_spec

    cfg = resolve_config({}, {"strategy": strategy, key: value, **({"privacy-dist": "fixed"} if key == "epsilon" else {})})
    assert (key in unused_keys(cfg, get_spec(strategy).family)) is unused


def test_a_run_where_nothing_trained_is_not_finished():
    from fedapp.state.results import summarize

    idle = [{"round": r, "metrics": {"clients_ok": 0}, "clients": []} for r in (1, 2)]
    summary = summarize(idle, 1.0, done=True)
    assert not summary["finished"] and summary["rounds_trained"] == 0 and "no client update" in summary["stopped_reason"]
    assert summarize([{"round": 1, "metrics": {"clients_ok": 2}, "clients": []}], 1.0, done=True)["finished"]


def test_secagg_share_counts_flower_cannot_run_are_refused() -> None:
    """Flower's SecAgg+ builds a ring of neighbours: an even count makes every client fail its key sharing."""
    for bad in (2.0, 20.0, 4.5):
        with pytest.raises(ConfigError, match="'secagg-num-shares' .* odd integer >= 3"):
            resolve_config(None, {"secagg-num-shares": bad})
    for good in (0.5, 1.0, 3.0, 21.0):
        assert resolve_config(None, {"secagg-num-shares": good})["secagg-num-shares"] == good


def test_run_config_sections_are_typed_frozen_and_read_as_a_mapping():
    """One frozen dataclass per concern; the same values by key name; every key in exactly one section."""
    import dataclasses

    from fedapp.config import RunConfig
    from fedapp.config.sections import SECTION_CLASSES

    cfg = resolve_config(None, {"partitioner": "dirichlet", "dirichlet-alpha": 0.3, "num-server-rounds": 7})
    assert cfg.data.partitioner == "dirichlet" and cfg["dirichlet-alpha"] == cfg.data.dirichlet_alpha == 0.3
    assert cfg.general.num_server_rounds == cfg.rounds == 7 and isinstance(cfg.general.num_server_rounds, int)
    assert dict(cfg) == {**{k: key.default for k, key in SCHEMA.items()}, "partitioner": "dirichlet",
                         "dirichlet-alpha": 0.3, "num-server-rounds": 7}
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.partitioner = "iid"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg["partitioner"] = "iid"  # type: ignore[index]
    fields = [f.name for cls in SECTION_CLASSES.values() for f in dataclasses.fields(cls)]
    assert len(fields) == len(set(fields)) == len(SCHEMA)
    assert RunConfig.from_values(dict(cfg)) == cfg
    with pytest.raises(ConfigError, match="no-such-key"):
        RunConfig.from_values({"no-such-key": 1})


def test_resolve_config_validates_once_per_input(tmp_path, monkeypatch):
    """A ClientApp resolves the same run-config for every message: the checks run once per distinct input."""
    from fedapp.config import run_config

    calls = []
    monkeypatch.setattr(run_config, "validate_cross_fields", lambda cfg: calls.append(cfg))
    first = resolve_config({"num-server-rounds": 4}, {"output-dir": str(tmp_path)})
    assert resolve_config({"num-server-rounds": 4}, {"output-dir": str(tmp_path)}) is first and len(calls) == 1
    assert resolve_config({"num-server-rounds": 5}, {"output-dir": str(tmp_path)}) is not first and len(calls) == 2
    with pytest.raises(ConfigError, match="num-server-rounds"):  # a bad value is refused every time, never cached
        resolve_config({"num-server-rounds": 0})
    with pytest.raises(ConfigError, match="num-server-rounds"):
        resolve_config({"num-server-rounds": 0})
