"""examples/own-model-app: a user's own Flower app (own model, data and loss) trained with `flwr run` through
fedapp.library's Robust-HDP strategy, started by a Message-API ServerApp (MessageStrategy), and Opacus DP-SGD clients, on a private SuperLink stopped by PID afterwards."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO

from fedapp.run.processes import (
    CONNECTION,
    Processes,
    flower_env,
    free_port,
    start_superlink,
    venv_bin,
    wait_http_health,
    write_flower_config,
)

APP = REPO / "examples" / "own-model-app"


@pytest.mark.slow
def test_the_example_app_trains_with_robust_hdp_and_reports_each_clients_epsilon(tmp_path: Path) -> None:
    home, out = tmp_path / "flwr-home", tmp_path / "out"
    port = free_port()
    write_flower_config(home, f"127.0.0.1:{port}")
    env = flower_env(home)  # FLWR_HOME in tmp_path, no runtime dependency installation
    procs = Processes()
    run_id = None
    try:
        superlink = procs.add(start_superlink(home, port, env=env))
        procs.watch()
        wait_http_health(port, proc=superlink)
        # `flwr run` without --stream returns once the run is submitted: the run's end is its summary.json
        done = subprocess.run(
            [venv_bin("flwr"), "run", str(APP), CONNECTION, "--format", "json",
             "--run-config", f"num-server-rounds=2 output-dir='{out}'",
             "--federation-config", "num-supernodes=3 client-resources-num-cpus=1"],
            env=env, capture_output=True, text=True, timeout=120)
        reply = json.loads(done.stdout[done.stdout.index("{"):]) if "{" in done.stdout else {}
        assert done.returncode == 0 and reply.get("success"), done.stdout + done.stderr
        run_id = int(reply["run-id"])
        summary_path = out / f"run-{run_id}" / "summary.json"
        deadline = time.monotonic() + 150
        while not summary_path.exists():
            assert superlink.poll() is None, (home / f"superlink-{port}.out").read_text()[-3000:]
            if time.monotonic() > deadline:
                log = subprocess.run([venv_bin("flwr"), "log", str(run_id), CONNECTION, "--show"], env=env,
                                     capture_output=True, text=True, timeout=60)
                pytest.fail(f"no {summary_path} within 150 s; flwr log:\n{(log.stdout + log.stderr)[-4000:]}")
            time.sleep(0.5)
        # the example's ServerApp is a Message-API one: fedapp.library.MessageStrategy.start drove the rounds
        shown = subprocess.run([venv_bin("flwr"), "log", str(run_id), CONNECTION, "--show"], env=env,
                               capture_output=True, text=True, timeout=60)
        assert "Starting MessageStrategy strategy" in shown.stdout + shown.stderr, (shown.stdout + shown.stderr)[-3000:]
    finally:
        leftovers = procs.stop_all(5.0)
    assert not leftovers, f"processes left running: {leftovers}"
    summary = json.loads(summary_path.read_text())
    rounds = [json.loads(line) for line in (summary_path.parent / "rounds.jsonl").read_text().splitlines()]
    assert summary["rounds_completed"] == 2 and [r["round"] for r in rounds] == [1, 2]
    for record in rounds:  # every client trained and was charged by the server's ledger, within its budget
        clients = {c["client_id"]: c for c in record["clients"]}
        assert sorted(clients) == [0, 1, 2] and {c["status"] for c in clients.values()} == {"ok"}, record["clients"]
        for cid, c in clients.items():
            budget = 1.0 + 3.0 * cid / 2  # epsilon-min = 1, epsilon-max = 4 over 3 clients
            assert c["epsilon_budget"] == pytest.approx(budget) and 0 < c["epsilon_spent"] <= budget * 1.001
    spent = summary["epsilon_spent_by_client"]
    assert [spent[str(i)] for i in range(3)] == pytest.approx([1.0, 2.5, 4.0], rel=2e-3)  # T = 2 rounds spend ε_i
    final = summary["final_metrics"]
    assert final["clients_ok"] == 3 and final["mean_update_norm"] > 0 and 0.0 <= final["accuracy"] <= 1.0
    # Robust-HDP weighs by the noise it estimates in each update: the ε = 1 client's noisier update counts least
    weights = {c["client_id"]: c["aggregation_weight"] for c in rounds[-1]["clients"]}
    assert weights[0] < weights[2], weights
