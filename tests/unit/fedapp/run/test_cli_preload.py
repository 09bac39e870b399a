"""fedapp.run.cli_preload: ``flwr`` run in a child that imported Flower's CLI before the call."""

from __future__ import annotations

import os
import subprocess

import pytest

from fedapp.run.cli_preload import READY, PreloadedCommand
from fedapp.run.processes import flower_env, venv_bin


def _wait_ready(cli: PreloadedCommand, timeout: float = 60.0) -> None:
    """Until the child says the CLI is imported (read from its stderr, which run() then no longer has)."""
    assert cli.proc.stderr is not None
    line = cli.proc.stderr.readline()
    assert line.strip() == READY, line


def test_the_preloaded_command_prints_and_exits_as_the_flwr_script(tmp_path):
    """The same output and exit code as the ``flwr`` script, for a command that succeeds and one that fails (with
    ``--format json``, ``flwr run`` reports the failure in its JSON and exits 0)."""
    for i, args in enumerate((["--version"], ["run", str(tmp_path / "no-such-app"), "nowhere", "--format", "json"])):
        home = tmp_path / f"home-{i}"  # each its own FLWR_HOME: the first command there writes a default config
        script = subprocess.run([venv_bin("flwr"), *args], env=flower_env(home / "script"), cwd=str(tmp_path),
                                capture_output=True, text=True, timeout=120)
        cli = PreloadedCommand("flwr", flower_env(home / "preloaded"), tmp_path)
        pid = cli.proc.pid
        preloaded = cli.run(args, timeout=120)
        assert preloaded.returncode == script.returncode, (args, preloaded, script)
        assert preloaded.stdout.replace("/preloaded/", "/script/") == script.stdout
        assert pid != os.getpid() and cli.proc.returncode is not None  # ran in the child, which is gone
    assert '"success": false' in preloaded.stdout  # the second command failed: its error came back through the child


def test_the_cli_is_imported_before_the_call_and_the_call_runs_in_that_process(tmp_path):
    """The child says it imported Flower's CLI before it is given a command; the command then runs in it (its exit
    is the command's), not in a new interpreter."""
    env = flower_env(tmp_path / "flwr-home")
    cli = PreloadedCommand("flwr", env, tmp_path)
    _wait_ready(cli)  # no command given yet
    assert cli.proc.poll() is None  # waiting for it
    done = cli.run(["--version"], timeout=60)
    assert done.returncode == 0 and "Flower" in done.stdout
    assert cli.proc.returncode == 0  # the preloaded child ran it and exited with its code


def test_closing_unused_ends_the_child_and_a_dead_child_falls_back_to_the_script(tmp_path):
    env = flower_env(tmp_path / "flwr-home")
    cli = PreloadedCommand("flwr", env, tmp_path)
    proc = cli.proc
    cli.close()
    assert proc.returncode == 0  # stdin closed without a command: nothing ran
    with pytest.raises(RuntimeError, match="used or closed"):
        cli.run(["--version"], timeout=60)
    (tmp_path / "flwr").mkdir()  # a package that shadows Flower: the child cannot import the CLI
    (tmp_path / "flwr" / "__init__.py").write_text("raise ImportError('shadowed')\n")
    broken = PreloadedCommand("flwr", {**env, "PYTHONPATH": str(tmp_path)}, tmp_path)
    broken.proc.wait(timeout=60)
    assert broken.proc.returncode != 0
    with pytest.raises(subprocess.CalledProcessError):  # the script runs instead, under the same environment
        done = broken.run(["--version"], timeout=60)
        done.check_returncode()


def test_an_interrupted_call_stops_the_child(tmp_path, monkeypatch):
    """An interrupt (the launcher's signal handler raises one) while the command runs kills the child."""
    cli = PreloadedCommand("flwr", flower_env(tmp_path / "flwr-home"), tmp_path)
    proc = cli.proc
    real = proc.communicate

    def interrupted(input=None, timeout=None):  # noqa: A002 — Popen.communicate's parameter
        if input:
            raise KeyboardInterrupt  # arrives while the command would run
        return real(input, timeout)

    monkeypatch.setattr(proc, "communicate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.run(["--version"], timeout=60)
    assert proc.returncode is not None and proc.returncode < 0  # killed, and reaped


def test_start_leaves_the_command_running_in_the_child_or_in_the_script_when_the_child_is_gone(tmp_path):
    """``start`` (how the launcher runs the SuperExec): the preloaded child itself goes on as the command, its output
    in the given file; a child that could not import Flower is replaced by the script, same output file."""
    env = flower_env(tmp_path / "flwr-home")
    cli = PreloadedCommand("flwr", env, tmp_path, ["--version"], output=tmp_path / "out.txt")
    proc = cli.start()
    assert proc is cli.proc and proc.wait(timeout=60) == 0
    assert "Flower" in (tmp_path / "out.txt").read_text()
    (tmp_path / "shadow" / "flwr").mkdir(parents=True)
    (tmp_path / "shadow" / "flwr" / "__init__.py").write_text("raise ImportError('shadowed')\n")
    broken = PreloadedCommand("flwr", {**env, "PYTHONPATH": str(tmp_path / "shadow")}, tmp_path, ["--version"],
                              output=tmp_path / "broken.txt")
    broken.proc.wait(timeout=60)
    script = broken.start()
    assert script is not broken.proc and script.args[0].endswith("flwr")
    script.wait(timeout=60)
    # the child's failed import, then the script's, which met the same shadowed package: both in the file
    assert (tmp_path / "broken.txt").read_text().count("ImportError: shadowed") == 2
