"""Crash-consistent resume with real processes, the commit order, and scale-safe defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from conftest import REPO, ledger_rows, read_rounds

from fedapp.config import resolve_config
from fedapp.state.checkpoint import COMMITTED_ROUND_KEY, CheckpointingRecorder, load_checkpoint


# ----------------------------------------------------------------------------- commit order (fast)
class _Writer:
    """Results writer double: records what reached rounds.jsonl, and when."""

    def __init__(self, root: Path) -> None:
        self.run_dir: Path | None = None
        self.root = root
        self.rounds: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {}

    def open(self) -> None:
        self.run_dir = self.root
        self.root.mkdir(exist_ok=True)

    def write_round(self, record: dict[str, Any]) -> None:
        self.rounds.append(record)

    def finish(self) -> None:
        pass


def test_checkpoint_is_written_before_rounds_jsonl_and_before_clients_are_told(tmp_path, monkeypatch) -> None:
    from strategies.base import DPFLStrategy

    cfg = resolve_config(overrides={"num-server-rounds": 5, "checkpoint-every": 2})
    strategy = DPFLStrategy(initial_weights=[np.zeros((2, 2), np.float32)], num_rounds=5)
    writer = _Writer(tmp_path / "run")
    rec = CheckpointingRecorder(writer, cfg, cfg.rounds, cfg.deployment.checkpoint_every, strategy)
    strategy.record_with(rec, rec.fit_config)
    assert strategy.round_fit_config(1)[COMMITTED_ROUND_KEY] == 0
    events: list[tuple] = []
    real_save = rec.save

    def save():
        events.append(("save", len(writer.rounds), strategy.round_fit_config(rnd)[COMMITTED_ROUND_KEY]))
        return real_save()

    monkeypatch.setattr(rec, "save", save)
    for rnd in range(1, 6):
        strategy.round_log.last_round = rnd
        rec.write_round({"round": rnd, "metrics": {}, "clients": []})
        events.append(("after", rnd, len(writer.rounds), strategy.round_fit_config(rnd + 1)[COMMITTED_ROUND_KEY]))
    assert events == [("after", 1, 0, 0), ("save", 0, 0), ("after", 2, 2, 2), ("after", 3, 2, 2),
                      ("save", 2, 2), ("after", 4, 4, 4), ("save", 4, 4), ("after", 5, 5, 5)]
    ckpt = load_checkpoint(writer.run_dir)
    assert [r["round"] for r in ckpt["rounds"]] == [1, 2, 3, 4, 5]


def test_default_batch_sizes_fit_sixty_clients_on_digits() -> None:
    from fedapp.apps.server_app import make_prevalidate
    from fedapp.data.client_data import client_train_sizes
    from fedapp.privacy.profiles import federation_profiles

    cfg = resolve_config(overrides={"num-clients": 60})
    make_prevalidate(cfg)(60)  # the pre-round checks pass
    sizes = client_train_sizes(cfg.data, cfg.general.seed, 60)
    batches = [p.batch_size for p in federation_profiles(cfg.general, cfg.training, cfg.data, 60)]
    assert all(b <= n for b, n in zip(batches, sizes)) and min(sizes) < 32  # the cap was needed
    default = resolve_config()
    small = federation_profiles(default.general, default.training, default.data, 3)
    assert small[0].batch_size in (8, 16, 24, 32)  # small federations: as drawn


def test_ca_private_key_is_never_in_the_superlink_folder(tmp_path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("mc", REPO / "scripts" / "make_certs.py")
    mc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mc)
    paths = mc.make_all(tmp_path / "certs", supernodes=1, ca_key_dir=tmp_path / "ca")
    assert paths["ca_key"] == tmp_path / "ca" / "ca.key" and oct(paths["ca_key"].stat().st_mode & 0o777) == "0o600"
    assert not any("PRIVATE" in p.read_text() and "BEGIN" in p.read_text() and p.name == "ca.key"
                   for p in (tmp_path / "certs").iterdir())
    assert sorted(p.name for p in (tmp_path / "certs").iterdir()) == [
        "ca.crt", "server.key", "server.pem", "supernode-0", "supernode-0.pub"]
    assert "ca_key" not in mc.make_all(tmp_path / "d", ca_key_dir=None)  # deploy: discarded after signing
    with pytest.raises(ValueError, match="must differ"):
        mc.make_all(tmp_path / "e", ca_key_dir=tmp_path / "e")


# ----------------------------------------------------------------------------- kill -9 and resume (slow)
# grad-sample-mode fixed: "auto" picks by timing and two modes agree only to the last float bit (bitwise checks below)
BASE = ("strategy='dpsgd-fedavg' seed=5 seeded-noise=true max-samples=450 batch-size=16 privacy-dist='fixed' "
        "epsilon=2.0 fraction-evaluate=0.0 num-server-rounds=4 dp-rounds=4 checkpoint-every=2 grad-sample-mode='hooks'")


def _launch(tmp_path: Path, name: str, extra: str) -> subprocess.Popen:
    env = {**os.environ, "FLWR_HOME": str(tmp_path / f"home-{name}")}
    cmd = [sys.executable, "-m", "fedapp.run.launch", "--num-supernodes", "3", "--run-config", f"{BASE} {extra}"]
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the test
    return subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, tmp_path: Path, name: str, timeout: float = 400) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError((tmp_path / f"{name}.log").read_text()[-3000:]) from None


def _run_dir(out: Path) -> Path:
    return max((p for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.stat().st_mtime)


def _kill_run_when(launcher: subprocess.Popen, tmp_path: Path, name: str, ready, timeout: float = 300) -> None:
    """kill -9 the launcher's SuperLink/ServerApp/simulation tree (by PID) as soon as ``ready()`` holds."""
    from conftest import follow_process_tree

    found: dict[int, psutil.Process] = {}

    def reached(seen: dict[int, psutil.Process]) -> bool:
        found.update(seen)
        return bool(ready())

    try:
        follow_process_tree(launcher, tmp_path / f"{name}.log", reached, timeout, poll=0.05)
    finally:
        for p in found.values():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def _checkpoint_round(out: Path) -> int:
    try:
        return int(load_checkpoint(_run_dir(out))["state"]["round"])
    except Exception:  # noqa: BLE001 - not there yet
        return 0


def _pending(out: Path, rnd: int) -> int:
    return len(list(out.glob(f".client-state/*/client-*/pending-{rnd}.npz")))


@pytest.mark.slow
def test_kill_9_at_two_points_then_resume_equals_the_uninterrupted_run(tmp_path) -> None:
    """The SuperLink tree is killed (1) right after the round-2 checkpoint and (2) after every client released
    its round-3 update but before the round-4 checkpoint; each resume (default client journal under
    output-dir) must equal the uninterrupted seeded run: model, server ledger, rounds.jsonl. A third resume,
    with the client state gone, cannot train: the launcher exits non-zero and says so."""
    full = _launch(tmp_path, "full", f"output-dir='{tmp_path / 'full'}'")
    points = {"after-ckpt": lambda out: _checkpoint_round(out) >= 2,
              "released-uncommitted": lambda out: _pending(out, 3) == 3 and _checkpoint_round(out) == 2}
    assert _finish(full, tmp_path, "full") == 0
    reference = _run_dir(tmp_path / "full")
    ref_ckpt, ref_rounds = load_checkpoint(reference), read_rounds(reference)
    killed_dirs: dict[str, Path] = {}
    for name, ready in points.items():
        out = tmp_path / name
        run = _launch(tmp_path, name, f"output-dir='{out}'")
        try:
            _kill_run_when(run, tmp_path, name, lambda r=ready, o=out: r(o))
            _finish(run, tmp_path, name, timeout=120)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
        killed = killed_dirs[name] = _run_dir(out)
        if name == "released-uncommitted":  # every client journaled round 3 before the kill: the replay path
            assert _pending(out, 3) == 3
        ckpt_round = int(load_checkpoint(killed)["state"]["round"])
        assert ckpt_round == 2, name
        # the checkpoint is the commit point and holds every committed round; rounds.jsonl follows it, so a kill
        # between the two leaves a prefix of the checkpoint's rounds there (the resume writes them all again)
        assert [r["round"] for r in load_checkpoint(killed)["rounds"]] == [1, 2], name
        written = [r["round"] for r in read_rounds(killed)]
        assert written == [1, 2][:len(written)], (name, written)  # never ahead of the checkpoint
        resumed_launch = _launch(tmp_path, f"{name}-resume", f"output-dir='{out}' resume-from='{killed}'")
        assert _finish(resumed_launch, tmp_path, f"{name}-resume") == 0, (tmp_path / f"{name}-resume.log").read_text()[-3000:]
        resumed = _run_dir(out)
        got = load_checkpoint(resumed)
        for wa, wb in zip(ref_ckpt["state"]["weights"], got["state"]["weights"]):
            np.testing.assert_array_equal(wa, wb)
        assert got["state"]["ledger"] == ref_ckpt["state"]["ledger"], name
        rounds = read_rounds(resumed)
        fields = ("status", "epsilon_spent", "client_epsilon_spent", "steps")
        assert ledger_rows(rounds, *fields) == ledger_rows(ref_rounds, *fields), name
        assert [r["metrics"]["accuracy"] for r in rounds] == [r["metrics"]["accuracy"] for r in ref_rounds]
        assert all("epsilon_mismatch" not in c for r in rounds for c in r["clients"])

    lost = _launch(tmp_path, "lost", f"output-dir='{tmp_path / 'lost'}' client-state-dir='{tmp_path / 'empty'}' "
                                     f"resume-from='{killed_dirs['after-ckpt']}'")
    code = _finish(lost, tmp_path, "lost")
    text = (tmp_path / "lost.log").read_text()
    assert code == 1 and "run failed" in text, text[-3000:]
    summary = json.loads((_run_dir(tmp_path / "lost") / "summary.json").read_text())
    assert summary["finished"] is False and "aggregated no client update" in summary["stopped_reason"]
    assert all(c["status"] == "refused" and "privacy state lost" in c["reason"]
               for r in read_rounds(_run_dir(tmp_path / "lost")) if r["round"] > 2 for c in r["clients"])
