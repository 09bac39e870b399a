"""examples/own-model-secagg-app: a user's own Flower app (own model, data and loss) running fedapp.library's DP-FedAvg
(client-level DP) under the project's SecAgg+ workflow with `flwr run`, 5 simulated SuperNodes, on a private SuperLink
stopped by PID afterwards."""

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
from strategies.privacy.mechanisms import cached_epsilon

APP = REPO / "examples" / "own-model-secagg-app"
NUM_CLIENTS = 5


@pytest.mark.slow
def test_the_secagg_example_aggregates_every_round_through_the_secure_sum(tmp_path: Path) -> None:
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
             "--run-config", f"num-server-rounds=2 num-clients={NUM_CLIENTS} output-dir='{out}'",
             "--federation-config", f"num-supernodes={NUM_CLIENTS} client-resources-num-cpus=1"],
            env=env, capture_output=True, text=True, timeout=120)
        reply = json.loads(done.stdout[done.stdout.index("{"):]) if "{" in done.stdout else {}
        assert done.returncode == 0 and reply.get("success"), done.stdout + done.stderr
        run_id = int(reply["run-id"])
        summary_path = out / f"run-{run_id}" / "summary.json"
        deadline = time.monotonic() + 200
        while not summary_path.exists():
            assert superlink.poll() is None, (home / f"superlink-{port}.out").read_text()[-3000:]
            if time.monotonic() > deadline:
                log = subprocess.run([venv_bin("flwr"), "log", str(run_id), CONNECTION, "--show"], env=env,
                                     capture_output=True, text=True, timeout=60)
                pytest.fail(f"no {summary_path} within 200 s; flwr log:\n{(log.stdout + log.stderr)[-4000:]}")
            time.sleep(0.5)
    finally:
        leftovers = procs.stop_all(5.0)
    assert not leftovers, f"processes left running: {leftovers}"
    summary = json.loads(summary_path.read_text())
    rounds = [json.loads(line) for line in (summary_path.parent / "rounds.jsonl").read_text().splitlines()]
    assert summary["rounds_completed"] == 2 and [r["round"] for r in rounds] == [1, 2]
    # the mechanism both sides built from the run-config (pyproject defaults: ε = 4 over T = 2 rounds, C = 1)
    from fedapp.library import client_level_mechanism

    mech = client_level_mechanism(num_clients=NUM_CLIENTS, rounds=2, clip=1.0, target_epsilon=4.0,
                                  secure_aggregation=True)
    budget = cached_epsilon(mech, None)
    assert budget == pytest.approx(4.0, rel=2e-3)
    for record in rounds:  # every round: the sum of all 5 shares, reconstructed by SecAgg+, a discrete Gaussian
        m = record["metrics"]
        assert m["secure_aggregation"] is True and m["secure_sum"] == "distributed discrete Gaussian", m
        assert m["epsilon_vs_server_proven"] is True and not m.get("round_withheld"), m
        assert m["clients_sampled"] == NUM_CLIENTS and m["noise_multiplier"] == pytest.approx(mech.noise_multiplier)
        clients = {c["client_id"]: c for c in record["clients"]}
        assert sorted(clients) == list(range(NUM_CLIENTS)), record["clients"]
        for c in clients.values():
            assert c["status"] == "ok" and c["uplink_bytes"] > 0, c  # the masked vector went through secagg_mod
            assert c["epsilon_budget"] == pytest.approx(budget)
    # each client's ledger: two unamplified rounds of the secure sum's (discrete) Gaussian equivalent, within budget
    final = {c["client_id"]: c for c in rounds[-1]["clients"]}
    first = {c["client_id"]: c for c in rounds[0]["clients"]}
    for cid in range(NUM_CLIENTS):
        assert 0 < first[cid]["epsilon_vs_server"] < final[cid]["epsilon_vs_server"] <= budget * 1.001
        assert final[cid]["epsilon_vs_server"] == pytest.approx(budget, rel=1e-3)  # T = 2 rounds spend ε
    spent = summary["epsilon_spent_by_client"]
    assert sorted(spent) == [str(i) for i in range(NUM_CLIENTS)]
    assert all(0 < eps <= budget * 1.001 for eps in spent.values()), spent
    assert 0.0 <= summary["final_metrics"]["accuracy"] <= 1.0
