"""fedapp.lean_ray: a local Ray head without the autoscaler monitor, log monitor and dashboard API server."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from fedapp.lean_ray import lean_local_ray_head  # noqa: E402


def test_the_lean_head_runs_tasks_without_the_unused_daemons_and_the_patch_is_undone():
    from ray._private import ray_constants
    from ray._private.node import Node

    original = Node.__init__
    assert not ray.is_initialized()
    try:
        with lean_local_ray_head() as patched:
            assert patched  # this Ray (pinned by flwr) has the internals the patch sets
            ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        assert Node.__init__ is original
        started = set(ray._private.worker._global_node.all_processes)
        assert {ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET} <= started
        assert not started & {ray_constants.PROCESS_TYPE_MONITOR, ray_constants.PROCESS_TYPE_LOG_MONITOR,
                              ray_constants.PROCESS_TYPE_DASHBOARD}, started

        @ray.remote
        def square(v: int) -> int:
            return v * v

        assert ray.get([square.remote(i) for i in range(4)]) == [0, 1, 4, 9]
    finally:
        ray.shutdown()
