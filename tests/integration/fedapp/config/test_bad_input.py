"""Bad-input battery: invalid configs, node-configs, checkpoints and payloads fail clearly, naming the
problem, before any training, and leave no results folder behind."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import REPO
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from fedapp.apps.server_app import build_components, make_prevalidate
from fedapp.config import ConfigError, resolve_config
from fedapp.privacy.profiles import client_profile
from fedapp.state.checkpoint import save_checkpoint
from strategies.base import DPFLStrategy


def _start_server(overrides: dict[str, Any], num_clients: int = 3) -> None:
    """Everything the server does before round 1: resolve, build (incl. resume/fault checks), prevalidate."""
    cfg = resolve_config(overrides=overrides)
    build_components(cfg)
    make_prevalidate(cfg)(num_clients)


def _checkpoint(tmp_path: Path, **config: Any) -> str:
    cfg = resolve_config(overrides={"num-server-rounds": 4, **config})
    weights = [np.zeros((2, 2), np.float32)]
    path = tmp_path / "ckpt" / "checkpoint.npz"
    path.parent.mkdir(exist_ok=True)
    save_checkpoint(path, {"lineage": "x", "config": dict(cfg), "rounds": [],
                           "state": {"round": 2, "weights": weights, "ledger_epsilon": {}}})
    return str(path)


CONFIG_CASES: dict[str, tuple[Any, str]] = {
    # name: (overrides or callable(tmp_path) -> overrides, regex the error must match)
    "unknown-key": ({"epsilom": 1.0}, r"unknown run-config key 'epsilom'"),
    "zero-rounds": ({"num-server-rounds": 0}, r"'num-server-rounds' = 0 is invalid: must be > 0"),
    "rounds-not-int": ({"num-server-rounds": "three"}, r"'num-server-rounds' expects an integer, got 'three'"),
    "delta-out-of-range": ({"delta": 1.5}, r"'delta' = 1.5 is invalid: must be in \(0, 1\)"),
    "epsilon-infinite": ({"epsilon": "inf"}, r"'epsilon' must be finite"),
    "negative-lr": ({"lr": -0.1}, r"'lr' = -0.1 is invalid: must be > 0"),
    "unknown-dataset": ({"dataset": "imagenet"}, r"'dataset' = 'imagenet' is not one of"),
    "unknown-strategy": ({"strategy": "fedprox"}, r"unknown strategy 'fedprox'; valid strategies:"),
    "bad-batch-list": ({"batch-size-choices": "8,x"}, r"'batch-size-choices' = '8,x' must be comma-separated"),
    "mnist-without-data-dir": ({"dataset": "mnist"}, r"dataset 'mnist' needs run-config 'data-dir'"),
    "missing-data-dir": ({"dataset": "mnist", "data-dir": "/nonexistent/dpfl"}, r"'data-dir' = '/nonexistent/dpfl' is not a readable folder"),
    "unknown-model": ({"model": "resnet999"}, r"'model' = 'resnet999' is not one of"),
    "one-client": ({"num-clients": 1}, r"'num-clients' = 1 is too small"),
    "fault-fraction-one": ({"fault-fraction": 1.0}, r"'fault-fraction' = 1.0 is invalid: must be in \[0, 1\)"),
    "fault-mode-unknown": ({"fault-mode": "explode"}, r"'fault-mode' = 'explode' is not one of"),
    "timeout-without-round-timeout": ({"fault-fraction": 0.2, "fault-mode": "timeout"}, r"needs 'round-timeout' > 0"),
    "resume-missing": ({"resume-from": "/nonexistent/run"}, r"'resume-from' = '/nonexistent/run/checkpoint.npz': no checkpoint|'resume-from' = '/nonexistent/run': no checkpoint"),
    "resume-garbage": (lambda t: {"resume-from": str(_garbage(t))}, r"is not a readable checkpoint"),
    "resume-other-seed": (lambda t: {"resume-from": _checkpoint(t, seed=1), "num-server-rounds": 4},
                          r"'seed' = 42 differs from the checkpoint's 1"),
    "resume-finished": (lambda t: {"resume-from": _checkpoint(t), "num-server-rounds": 2},
                        r"already completed round 2; nothing left to resume"),
    "resume-other-model-shapes": (lambda t: {"resume-from": _checkpoint(t), "num-server-rounds": 4},
                                  r"cannot restore the strategy: checkpoint weights have shapes"),
    "batch-larger-than-data": ({"batch-size": 500, "max-samples": 300}, r"client 0: batch-size 500 > its dataset size"),
    "num-clients-mismatch": ({"num-clients": 5}, r"'num-clients' = 5 but 3 clients connected"),
    # a model that cannot take the dataset's inputs: refused from the shapes alone, before any data is read
    "model-does-not-fit-a9a": (lambda t: {"dataset": "a9a", "data-dir": str(t), "model": "cnn-mnist"},
                               r"'model' = 'cnn-mnist' does not fit dataset 'a9a', whose inputs have shape \(123,\)"),
    "model-does-not-fit-digits": ({"model": "cnn-mnist"}, r"'model' = 'cnn-mnist' does not fit dataset 'digits'"),
    "cifar-model-on-mnist": ({"dataset": "mnist", "data-dir": "/", "model": "cnn-cifar"},
                             r"'model' = 'cnn-cifar' does not fit dataset 'mnist'.*images of 30..37 pixels a side"),
    "tiny-round-timeout": ({"round-timeout": 0.001},
                           r"'round-timeout' = 0.001 is invalid: must be 0 \(no timeout\) or >= 1 s"),
    # no noise multiplier reaches it: the clients' own calibration, run before round 1. RDP (add/remove) has an
    # ε floor set by δ; the replace-one PLD accountant reaches any ε > 0 (ε = 1e-9 at z ≈ 2e5)
    "unreachable-epsilon": ({"privacy-dist": "fixed", "epsilon": 1e-9, "record-neighbours": "add-remove"},
                            r"'epsilon' = 1e-09 cannot be reached: no noise multiplier achieves"),
    "unreachable-drawn-epsilon": ({"privacy-dist": "dist9", "delta": 1e-12, "record-neighbours": "add-remove"},
                                  r"ε_i = .* \(drawn from run-config 'privacy-dist' = 'dist9'.* cannot be reached: no "
                                  r"noise multiplier achieves"),
    "clients-per-round-above-num-clients": ({"clients-per-round": 10, "num-clients": 4},
                                            r"'clients-per-round' = 10 exceeds the 4 clients of this federation "
                                            r"\(run-config 'num-clients' = 4\)"),
    "clients-per-round-above-connected": ({"clients-per-round": 1000},
                                          r"'clients-per-round' = 1000 exceeds the 3 clients of this federation"),
    "client-level-clients-per-round": ({"strategy": "dp-fedavg", "clients-per-round": 4},
                                       r"'clients-per-round' = 4 exceeds the 3 clients"),
    "falsify-client-outside": ({"falsify-client": 99},
                               r"'falsify-client' = 99 is not a client of this federation: partition ids are 0..2"),
    "falsify-client-outside-num-clients": ({"falsify-client": 4, "num-clients": 4},
                                           r"'falsify-client' = 4 is not a client .*partition ids are 0..3"),
    # a key the run-config itself switches off: refused, naming both keys and how to make it count
    "epsilon-under-drawn-privacy-dist": ({"epsilon": 0.01},
                                         r"'epsilon' = 0.01 would have no effect: privacy-dist = 'dist2' draws each "
                                         r"client's ε_i .*set privacy-dist = 'fixed'"),
    "epsilon-floor-under-fixed": ({"privacy-dist": "fixed", "epsilon-floor": 0.5},
                                  r"'epsilon-floor' = 0.5 would have no effect: privacy-dist = 'fixed'"),
    "falsify-epsilon-without-client": ({"falsify-epsilon": 9.0}, r"'falsify-epsilon' = 9.0 would have no effect"),
    "batch-choices-under-fixed-batch": ({"batch-size": 16, "batch-size-choices": "4,8"},
                                        r"'batch-size-choices' = '4,8' would have no effect: batch-size = 16"),
    "dirichlet-alpha-under-iid": ({"dirichlet-alpha": 0.1},
                                  r"'dirichlet-alpha' = 0.1 would have no effect: partitioner = 'iid'"),
    "fault-delay-without-timeouts": ({"fault-delay": 60.0}, r"'fault-delay' = 60.0 would have no effect"),
    "target-epsilon-under-noise-multiplier": ({"strategy": "dp-fedavg", "noise-multiplier": 1.0, "target-epsilon": 4.0},
                                              r"'target-epsilon' = 4.0 would have no effect: noise-multiplier = 1.0 "
                                              r"sets σ directly"),
    "cuda-graphs-on-cpu": ({"cuda-graphs": True, "device": "cpu"},
                           r"'cuda-graphs' = true replays DP-SGD steps as CUDA graphs, but 'device' = 'cpu'"),
    "cuda-graphs-with-functorch": ({"cuda-graphs": True, "grad-sample-mode": "functorch"},
                                   r"'cuda-graphs' = true captures Opacus' hooks mode, but 'grad-sample-mode' = "
                                   r"'functorch'"),
    "secagg-threshold-without-secagg": ({"strategy": "dp-fedavg", "secure-aggregation": False, "secagg-threshold": 0.9},
                                        r"'secagg-threshold' = 0.9 would have no effect: secure-aggregation = false"),
}


def _garbage(tmp_path: Path) -> Path:
    path = tmp_path / "garbage.npz"
    path.write_bytes(b"PK\x03\x04 definitely not a checkpoint")
    return path


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_invalid_config_fails_before_anything_is_written(case: str, tmp_path: Path) -> None:
    spec, pattern = CONFIG_CASES[case]
    overrides = spec(tmp_path) if callable(spec) else dict(spec)
    out = tmp_path / "results"
    overrides["output-dir"] = str(out)
    with pytest.raises(ConfigError, match=pattern):
        _start_server(overrides)
    assert not out.exists() or not any(out.iterdir()), f"{case}: a results folder was written"


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where no CUDA device is available")
def test_cuda_graphs_without_a_cuda_device_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    out = tmp_path / "results"
    with pytest.raises(ConfigError, match=r"'cuda-graphs' = true needs a CUDA device, and none is available here"):
        _start_server({"cuda-graphs": True, "output-dir": str(out)})
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("node, pattern", [
    ({"partition-id": 3, "num-partitions": 3}, r"'partition-id' = 3 is outside 0..2"),
    ({"partition-id": 0}, r"node-config needs 'partition-id' and 'num-partitions'"),
    ({"partition-id": 0, "num-partitions": 3, "epsilon": "abc"}, r"node-config 'epsilon' expects float, got 'abc'"),
    ({"partition-id": 0, "num-partitions": 3, "delta": 2.0}, r"client 0: delta = 2.0 must be in \(0, 1\)"),
    ({"partition-id": 0, "num-partitions": 1}, r"'num-partitions' = 1: a federation needs at least 2"),
])
def test_invalid_node_config_names_the_key(node: dict[str, Any], pattern: str) -> None:
    cfg = resolve_config()
    with pytest.raises(ConfigError, match=pattern):
        client_profile(cfg.general, cfg.training, cfg.data, node)


def test_invalid_payloads_are_rejected_with_named_reasons() -> None:
    s = DPFLStrategy(initial_weights=[np.zeros(3, np.float32)], num_rounds=3)
    s.round_log.start(1)

    def res(arrays, metrics):
        return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 4, metrics)

    bad = {
        "nan": res([np.array([np.nan, 0, 0], np.float32)], {"client_id": 0}),
        "shape": res([np.zeros(4, np.float32)], {"client_id": 1}),
        "dtype": res([np.zeros(3, np.int64)], {"client_id": 2}),
        "metric": res([np.zeros(3, np.float32)], {"client_id": 3, "epsilon_spent": "lots"}),
    }
    s.aggregate_fit(1, [(SimpleNamespace(node_id=i), r) for i, r in enumerate(bad.values())], [])
    reasons = [c["reason"] for c in s.round_log.clients()]
    assert [c["status"] for c in s.round_log.clients()] == ["rejected"] * 4
    assert "NaN" in reasons[0] and "shape (4,)" in reasons[1] and "dtype int64" in reasons[2]
    assert "'epsilon_spent' = 'lots'" in reasons[3]
    np.testing.assert_array_equal(s.current_weights[0], np.zeros(3))


# ---------------------------------------------------------------- the launcher's dry run
LATE_FAILURES = {  # configs that used to fail 25-34 s later inside the SuperLink, some without naming the key
    "soteriafl-k-too-large": ({"strategy": "soteriafl-sgd", "soteriafl-k": 1_000_000}, "soteriafl-k"),
    "soteriafl-server-lr": ({"strategy": "soteriafl-sgd", "server-lr": 0.5}, "server-lr"),
    "topk-without-public-set": ({"strategy": "fed-smp-topk"}, "public-samples"),
    "resume-from-missing": ({"resume-from": "/nonexistent/run"}, "resume-from"),
    "unknown-dp2-head": ({"strategy": "dp2-fedsam", "dp2-head": "nope"}, "dp2-head"),
    "min-available-above-supernodes": ({"min-available-clients": 10}, "min-available-clients"),
    "client-delta-too-large": ({"strategy": "dp-fedavg", "client-delta": 0.2}, "client-delta"),
    "record-delta-too-large": ({"strategy": "dpsgd-fedavg", "delta": 0.05}, "delta"),
}


def test_a_tiny_target_epsilon_calibrates_to_a_non_negative_epsilon() -> None:
    """target-epsilon 1e-6 once gave ε = -0.113 (RDP conversion below 0) and every client was rejected."""
    from fedapp.privacy.profiles import client_level_mechanism

    cfg = resolve_config(None, {"strategy": "dp-fedavg", "target-epsilon": 1e-6})
    dp = client_level_mechanism(cfg.general, cfg.training, cfg.client_dp, 4)
    assert 0.0 <= dp.epsilon() <= 1e-6 and dp.epsilon(1) >= 0.0


@pytest.mark.parametrize("case", sorted(LATE_FAILURES))
def test_dry_run_names_the_key_before_anything_starts(case: str, tmp_path) -> None:
    from fedapp.apps.server_app import dry_run

    overrides, key = LATE_FAILURES[case]
    cfg = resolve_config(None, {"output-dir": str(tmp_path / "out"), "max-samples": 400, **overrides})
    with pytest.raises(ConfigError, match=key):
        dry_run(cfg, 4)
    assert not (tmp_path / "out").exists()  # nothing written


def test_dry_run_passes_a_good_config_and_reports_unused_keys(tmp_path) -> None:
    from fedapp.apps.server_app import dry_run

    cfg = resolve_config(None, {"strategy": "soteriafl-sgd", "target-epsilon": 5.0, "output-dir": str(tmp_path / "o"),
                                "max-samples": 400, "privacy-dist": "fixed", "allow-large-delta": True})
    assert dry_run(cfg, 4) == ["target-epsilon"]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("overrides,key", [({"seed": -1}, "'seed' = -1"), ({"device": "cuda"}, "'device' = 'cuda'")])
def test_more_values_refused_at_resolve_time(overrides, key, tmp_path) -> None:
    import torch

    if overrides.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ConfigError, match=key):
        resolve_config(None, overrides)


def test_output_dir_that_is_a_file_is_refused(tmp_path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ConfigError, match="output-dir"):
        resolve_config(None, {"output-dir": str(target)})


def test_an_assignment_without_value_is_refused() -> None:
    from fedapp.run.processes import parse_overrides

    with pytest.raises(ConfigError, match="'epsilon'"):
        parse_overrides("strategy='fedavg' epsilon= seed=3")
    assert parse_overrides("strategy='fedavg' seed=3") == {"strategy": "fedavg", "seed": 3}


@pytest.mark.parametrize("text", [
    "strategy='fedavg' seed=3", 'dataset="hf:ylecun/mnist" lr=0.05 secure-aggregation=true',
    "a.b=1 a.c='x y' d=-2.5e-3 e=false", "lr=1e-3, seed=4", "name='it''s'", "x=[1, 2]", "strategy=fedavg",
])
def test_run_config_strings_are_read_as_flwr_run_reads_them(text, tmp_path) -> None:
    """The launcher reads --run-config without importing flwr.common; the same text gives the same values (or
    fails on both sides) as Flower's own parser, which `flwr run` uses on what the launcher passes on."""
    from flwr.common.config import parse_config_args

    from fedapp.run.processes import parse_config_assignments

    try:
        expected: object = dict(parse_config_args([text]))
    except Exception:  # noqa: BLE001 — Flower refuses it (click.ClickException or ValueError)
        expected = "refused"
    try:
        ours: object = parse_config_assignments(text)
    except Exception:  # noqa: BLE001
        ours = "refused"
    assert ours == expected
    toml_file = tmp_path / "overrides.toml"
    toml_file.write_text('strategy = "dp-fedavg"\n[robust]\nrank = 3\n')
    assert parse_config_assignments(str(toml_file)) == dict(parse_config_args([str(toml_file)]))


def test_the_launchers_dry_run_raises_the_config_error_itself_from_its_child(tmp_path) -> None:
    """The launcher's dry run runs in a spawned child (memory freed at exit), also from a multi-threaded
    caller (this test process, plus one extra thread): the ConfigError naming the value comes back unchanged."""
    import threading

    from fedapp.run.launch import dry_run_in_child

    overrides, key = LATE_FAILURES[sorted(LATE_FAILURES)[0]]
    cfg = resolve_config(None, {"output-dir": str(tmp_path / "out"), "max-samples": 400, **overrides})
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        with pytest.raises(ConfigError, match=key):
            dry_run_in_child(cfg, 4)
    finally:
        stop.set()


@pytest.mark.parametrize("run_config,key", [
    ("clients-per-round=10", "'clients-per-round' = 10 exceeds the 4 clients of this federation (--num-supernodes 4)"),
    ("privacy-dist='fixed' epsilon=1e-9 record-neighbours='add-remove'",
     "'epsilon' = 1e-09 cannot be reached: no noise multiplier achieves"),
], ids=["clients-per-round", "unreachable-epsilon"])
def test_the_launcher_refuses_a_bad_config_before_starting_anything(run_config: str, key: str, tmp_path) -> None:
    """The real command line: exit code 2, the key and value on stderr, no Flower home (written just before the
    SuperLink starts) and no results folder: the first is refused by the launcher itself, the second by the dry
    run's noise calibration."""
    import os
    import subprocess
    import sys

    home, out = tmp_path / "flwr-home", tmp_path / "out"
    cmd = [sys.executable, "-m", "fedapp.run.launch", "--num-supernodes", "4", "--run-config",
           f"{run_config} output-dir='{out}'"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(REPO),
                          env={**os.environ, "FLWR_HOME": str(home)})
    assert done.returncode == 2, done.stderr
    assert f"[dpfl] configuration error: run-config {key}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not home.exists() and not out.exists()


def test_a_launchers_dry_run_leaves_the_launcher_torch_free(tmp_path) -> None:
    """The launcher stays light for the whole run: a valid dry run happens in the child, and the launcher,
    which has flwr (and so a second thread) loaded like the real one, never imports torch (it used to run
    its dry run in process and keep ~440 MB resident)."""
    import json
    import subprocess
    import sys

    code = ("import sys, json; import fedapp.clients.guard; from fedapp.run.launch import dry_run_in_child, resolve_config; "
            "cfg = resolve_config(None, json.loads(sys.argv[1])); dry_run_in_child(cfg, 4); "
            "print(json.dumps(sorted(m for m in ('torch', 'fedapp.apps.server_app', 'opacus') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code,
                          json.dumps({"max-samples": 400, "output-dir": str(tmp_path / "out")})],
                         capture_output=True, text=True, check=True, timeout=300)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
