"""Flower's simulation engine with its ClientApps on the engine's own threads (``fedapp.compat.thread_backend``)."""

from __future__ import annotations

import inspect
import os
import threading

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import ClientAppException
from flwr.supercore.task_identity import TaskIdentity

from fedapp.compat import surface, thread_backend
from fedapp.compat.thread_backend import ENV, RAY_BACKEND, backend_class, install, uninstall, workers_and_threads


def test_as_many_clientapps_at_once_as_rays_pool_would_hold_actors(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert workers_and_threads({"client_resources": {"num_cpus": 1}, "init_args": {}}) == (4, 1)
    assert workers_and_threads({"client_resources": {"num_cpus": 2}, "init_args": {}}) == (2, 2)
    assert workers_and_threads({"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 8}}) == (8, 1)
    assert workers_and_threads({"client_resources": {"num_cpus": 8}, "init_args": {}}) == (1, 8)
    with pytest.raises(ValueError, match="trains on the CPU"):
        workers_and_threads({"client_resources": {"num_cpus": 1, "num_gpus": 0.5}, "init_args": {}})


@pytest.fixture(autouse=True)
def in_a_simulation_runtime(monkeypatch) -> None:
    """Flower stamps every Message with the running task's identity, which the engine's process has."""
    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def _message(content: RecordDict, node_id: int = 7) -> Message:
    return Message(content, dst_node_id=node_id, message_type="train")


def _context(node_id: int = 7) -> Context:
    return Context(run_id=1, node_id=node_id, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                   run_config={})


def _backend(app: ClientApp, cpus: int = 1):
    backend = backend_class()({"client_resources": {"num_cpus": cpus}, "init_args": {"num_cpus": 2 * cpus}})
    backend.build(lambda: app)
    return backend


def test_the_clientapp_gets_copies_and_a_failure_leaves_the_nodes_state_as_it_was():
    """As Ray's serialization: the grid's content object is shared by every node's message (SecAgg+'s mod pops its
    stage from it), so a ClientApp must not change it; the node's Context changes only when the app returns."""
    app = ClientApp()
    seen: list[str] = []

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        seen.append(str(msg.content.config_records["config"].pop("stage")))  # what secaggplus_mod does
        context.state["calls"] = ConfigRecord({"n": 1 + int(context.state.config_records.get("calls", {"n": 0})["n"])})
        if msg.content.config_records["config"]["fail"]:
            raise RuntimeError("this client fails")
        return Message(RecordDict({"reply": ConfigRecord({"ok": True})}), reply_to=msg)

    backend = _backend(app)
    shared = RecordDict({"config": ConfigRecord({"stage": "setup", "fail": False})})
    context = _context()
    for _ in range(2):  # the same content object, twice: a ClientApp that popped from it would fail the second time
        reply, context = backend.process_message(_message(shared), context)
        assert reply.content.config_records["reply"]["ok"]
    assert seen == ["setup", "setup"] and "stage" in shared.config_records["config"]
    assert context.state.config_records["calls"]["n"] == 2
    failing = RecordDict({"config": ConfigRecord({"stage": "setup", "fail": True})})
    with pytest.raises(ClientAppException, match="this client fails"):
        backend.process_message(_message(failing), context)
    assert context.state.config_records["calls"]["n"] == 2  # the failed call's change did not reach the node


def test_a_clientapp_that_exits_fails_its_message_not_the_process():
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        raise SystemExit(3)

    with pytest.raises(ClientAppException, match="SystemExit: 3"):
        _backend(app).process_message(_message(RecordDict({"config": ConfigRecord({})})), _context())


def test_each_worker_thread_runs_torch_with_the_clients_cpus_and_the_caller_keeps_its_own():
    app = ClientApp()
    threads_seen: list[int] = []

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        threads_seen.append(torch.get_num_threads())
        return Message(RecordDict(), reply_to=msg)

    before = torch.get_num_threads()
    backend = _backend(app, cpus=1)
    worker = threading.Thread(target=backend.process_message,
                              args=(_message(RecordDict({"config": ConfigRecord({})})), _context()))
    worker.start()
    worker.join()
    assert threads_seen == [1]
    assert torch.get_num_threads() == before
    assert backend.num_workers == 2 and backend.is_worker_idle()


def test_install_makes_the_engine_build_the_thread_backend_only_when_asked(monkeypatch):
    """``start_vce``'s ``backend_fn`` builds ``RayBackend(backend_config)`` from its module when the engine starts:
    the name :func:`install` replaces (the contract, beside the signatures of the ``thread-backend`` group)."""
    from flwr.server.superlink.fleet.vce import vce_api

    assert "RayBackend(backend_config)" in inspect.getsource(vce_api.start_vce)
    assert surface.problems(thread_backend.GROUP) == []
    ray_backend = surface.resolve(RAY_BACKEND)
    monkeypatch.delenv(ENV, raising=False)
    assert not install() and surface.resolve(RAY_BACKEND) is ray_backend
    monkeypatch.setenv(ENV, "threads")
    try:
        assert install() and install()  # idempotent
        built = surface.resolve(RAY_BACKEND)({"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 3}})
        assert built.num_workers == 3 and isinstance(built, thread_backend.ThreadBackend)
    finally:
        uninstall()
    assert surface.resolve(RAY_BACKEND) is ray_backend


def test_in_a_process_without_flowers_ray_backend_module_install_never_imports_ray():
    """The engine's process (``flwr-simulation``) imports the ClientApp module, which installs the thread backend,
    before the engine imports ``raybackend``: the stand-in module gives the engine the thread backend, and Ray (28 MB)
    is never imported."""
    import subprocess
    import sys

    from conftest import REPO

    code = (
        "import sys\n"
        "from fedapp.compat import thread_backend as tb\n"
        "assert tb.install()\n"
        "from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend\n"  # as start_vce's backend_fn
        "built = RayBackend({'client_resources': {'num_cpus': 1}, 'init_args': {'num_cpus': 2}})\n"
        "assert isinstance(built, tb.ThreadBackend) and built.num_workers == 2\n"
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))\n"
        "tb.uninstall()\n"
        "from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend\n"
        "assert not getattr(RayBackend, 'dpfl_threads', False) and 'ray' in sys.modules\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, ENV: "threads", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
