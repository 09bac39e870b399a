"""grad-sample-mode = auto: the fastest supported Opacus mode, measured once, shared through the cache."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedapp.clients import grad_sample_mode as gsm
from fedapp.config import ConfigError, resolve_config
from fedapp.data.datasets import ArrayDataset
from fedapp.models.zoo import GRAD_SAMPLE_MODES, build_model


def _digits_like(n: int = 64) -> ArrayDataset:
    rng = np.random.default_rng(0)
    return ArrayDataset(rng.standard_normal((n, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, n), 10)


def _new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("cnn-digits", (1, 8, 8), 10)


def test_time_modes_runs_real_private_steps_in_every_mode():
    times = gsm.time_modes(_new_model, (1, 8, 8), 10, 16, torch.device("cpu"), GRAD_SAMPLE_MODES, steps=2, repeats=1)
    assert set(times) == set(GRAD_SAMPLE_MODES) and all(0 < t < 10 for t in times.values())


def test_auto_measures_once_then_reuses_the_choice_across_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gsm, "_CHOSEN", {})
    calls = []
    fake = {"hooks": 3.0, "ew": 1.0, "functorch": 2.0, "bk": 4.0}

    def timed(*args, **kwargs):
        calls.append(args[5])
        return {m: fake[m] for m in args[5]}

    monkeypatch.setattr(gsm, "time_modes", timed)
    data, device = _digits_like(), torch.device("cpu")
    assert gsm.resolve_grad_sample_mode("auto", "cnn-digits", _new_model, data, 32, device) == "ew"
    assert gsm.resolve_grad_sample_mode("auto", "cnn-digits", _new_model, data, 32, device) == "ew"
    assert len(calls) == 1  # memoized in this process
    monkeypatch.setattr(gsm, "_CHOSEN", {})  # a fresh process: the shared cache answers
    assert gsm.resolve_grad_sample_mode("auto", "cnn-digits", _new_model, data, 32, device) == "ew"
    assert len(calls) == 1
    assert gsm.resolve_grad_sample_mode("auto", "cnn-digits", _new_model, data, 64, device) == "ew"
    assert len(calls) == 2  # another batch size is measured anew
    assert gsm.resolve_grad_sample_mode("hooks", "cnn-digits", _new_model, data, 32, device) == "hooks"


_RACE = """
import sys, time, numpy as np, torch
from fedapp.clients import grad_sample_mode as gsm
from fedapp.data.datasets import ArrayDataset
from fedapp.models.zoo import build_model
def timed(*args, **kwargs):  # this process's load makes its own mode the fastest, after a second of measuring
    time.sleep(1.0)
    return {m: (0.5 if m == sys.argv[1] else 1.0) for m in args[5]}
gsm.time_modes = timed
data = ArrayDataset(np.zeros((8, 1, 8, 8), np.float32), np.zeros(8, np.int64), 10)
print(gsm.resolve_grad_sample_mode("auto", "cnn-digits", lambda: build_model("cnn-digits", (1, 8, 8), 10), data, 32,
                                   torch.device("cpu")))
"""


def test_processes_that_start_together_measure_once_and_share_one_mode(tmp_path):
    """Two processes resolving ``auto`` at once with an empty cache (a sweep's parallel cells, a simulation's actors),
    each finding a different mode fastest: the first to take the entry's lock measures, the other reads its choice."""
    env = {**os.environ, "DPFL_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, mode], env=env, stdout=subprocess.PIPE, text=True)
             for mode in ("hooks", "ew")]
    chosen = [proc.communicate(timeout=120)[0].strip() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert chosen[0] == chosen[1] and chosen[0] in ("hooks", "ew"), chosen


def test_auto_only_picks_modes_the_model_supports(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gsm, "_CHOSEN", {})
    monkeypatch.setitem(gsm.UNSUPPORTED_GRAD_SAMPLE_MODES, ("cnn-digits", "ew"), "test: pretend ew cannot run it")
    monkeypatch.setattr(gsm, "time_modes", lambda *a, **k: {m: {"hooks": 3.0, "ew": 1.0, "functorch": 2.0, "bk": 4.0}[m]
                                                             for m in a[5]})
    assert gsm.supported_modes("cnn-digits") == ("hooks", "functorch", "bk")
    assert gsm.resolve_grad_sample_mode("auto", "cnn-digits", _new_model, _digits_like(), 32,
                                        torch.device("cpu")) == "functorch"


def test_config_accepts_auto_and_still_names_a_bad_mode():
    assert resolve_config({"grad-sample-mode": "auto"})["grad-sample-mode"] == "auto"
    assert resolve_config({})["grad-sample-mode"] == "auto"
    with pytest.raises(ConfigError, match="grad-sample-mode"):
        resolve_config({"grad-sample-mode": "ghosts"})
