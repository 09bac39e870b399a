"""fedapp.run.dry_run_cache: the launcher's dry run is skipped only for what passed it before, unchanged."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import REPO

from fedapp.config import resolve_config
from fedapp.run.dry_run_cache import dry_run_fields, passed_before, remember_pass


def _app(tmp_path: Path) -> Path:
    app = tmp_path / "app"
    for pkg in ("fedapp", "strategies"):
        (app / pkg).mkdir(parents=True)
        (app / pkg / "__init__.py").write_text("x = 1\n")
    (app / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    return app


def _touch_later(path: Path) -> None:
    later = time.time() + 5
    os.utime(path, (later, later))


def test_the_key_follows_config_federation_code_and_data(tmp_path):
    app, data = _app(tmp_path), tmp_path / "data"
    data.mkdir()
    (data / "train.bin").write_bytes(b"1234")
    cfg = resolve_config(None, {"data-dir": str(data), "output-dir": str(tmp_path / "out")})
    base = dry_run_fields(cfg, 4, app, app)
    assert base is not None and dry_run_fields(cfg, 4, app, app) == base
    assert dry_run_fields(cfg, 5, app, app) != base  # federation size
    other = resolve_config(None, {"data-dir": str(data), "output-dir": str(tmp_path / "out"), "seed": 3})
    assert dry_run_fields(other, 4, app, app) != base  # any run-config value
    _touch_later(app / "strategies" / "__init__.py")
    code_changed = dry_run_fields(cfg, 4, app, app)
    assert code_changed is not None and code_changed["code"] != base["code"]
    (data / "train.bin").write_bytes(b"12345")
    data_changed = dry_run_fields(cfg, 4, app, app)
    assert data_changed is not None and data_changed["data"] != code_changed["data"]


def test_datasets_and_resumes_it_cannot_fingerprint_are_never_cached(tmp_path):
    app = _app(tmp_path)
    base = dict(resolve_config(None, {}))
    assert dry_run_fields(base, 4, app) is not None
    assert dry_run_fields({**base, "dataset": "hf:ylecun/mnist"}, 4, app) is None
    assert dry_run_fields({**base, "resume-from": str(tmp_path / "run")}, 4, app) is None


def test_only_a_pass_is_remembered_and_the_cache_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path / "cache"))
    fields = dry_run_fields(resolve_config(None, {"output-dir": str(tmp_path / "o")}), 4, _app(tmp_path))
    assert fields is not None and fields == dry_run_fields(resolve_config(None, {"output-dir": str(tmp_path / "o")}), 4,
                                                           tmp_path / "app", REPO)  # the default code: this project
    assert passed_before(fields) is None
    remember_pass(fields, ["target-epsilon"])
    assert passed_before(fields) == ["target-epsilon"]
    monkeypatch.setenv("DPFL_CACHE_DIR", "off")
    assert passed_before(fields) is None


@pytest.mark.slow
def test_the_launcher_checks_a_config_once_and_then_trusts_its_pass(tmp_path, monkeypatch, capsys):
    """``--plan`` twice (every check, nothing started): the first builds everything in the child, the second says
    the dry run passed before; a changed value is checked again."""
    from fedapp.run.launch import plan

    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path / "cache"))
    run_config = f"strategy='dp-fedavg' max-samples=300 output-dir='{tmp_path / 'out'}'"
    first = plan(4, run_config, REPO)
    assert "passed the dry run before" not in capsys.readouterr().out
    assert plan(4, run_config, REPO) == first
    assert "passed the dry run before" in capsys.readouterr().out
    plan(4, run_config + " seed=5", REPO)
    assert "passed the dry run before" not in capsys.readouterr().out
