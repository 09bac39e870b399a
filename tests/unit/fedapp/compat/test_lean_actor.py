"""fedapp.compat.lean_actor: the deferred ``flwr.simulation`` only under the Flower it was written for."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

from fedapp.compat import lean_actor

HOOK_RUN = """
import sys
import flwr
flwr.__version__ = sys.argv[1]
from fedapp.compat.lean_actor import defer_flower_simulation_package
defer_flower_simulation_package()
print(type(sys.modules["flwr.simulation"]).__name__ if "flwr.simulation" in sys.modules else "absent")
"""


@pytest.mark.parametrize(("version", "expected"), [("1.41.0", "_DeferredPackage"), ("1.42.0", "_DeferredPackage"),
                                                  ("1.43.0", "absent")])
def test_the_worker_hook_defers_the_package_only_under_the_patched_flower(version: str, expected: str) -> None:
    out = subprocess.run([sys.executable, "-c", HOOK_RUN, version], capture_output=True, text=True, timeout=120,
                         cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == expected


def test_the_lean_head_sets_the_hook_only_when_asked_and_under_the_patched_flower(monkeypatch) -> None:
    pytest.importorskip("ray")
    import flwr

    from fedapp.compat.lean_ray import ACTOR_HOOK_ENV, SWITCH, lean_local_ray_head

    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.delenv(ACTOR_HOOK_ENV, raising=False)
    assert lean_actor.applicable()
    with lean_local_ray_head(defer_actor_package=True) as patched:
        assert patched and os.environ[ACTOR_HOOK_ENV] == lean_actor.HOOK
    assert ACTOR_HOOK_ENV not in os.environ
    with lean_local_ray_head(defer_actor_package=False) as patched:
        assert patched and ACTOR_HOOK_ENV not in os.environ
    monkeypatch.setattr(flwr, "__version__", "1.43.0")
    assert not lean_actor.applicable()
    with lean_local_ray_head(defer_actor_package=True) as patched:
        assert patched and ACTOR_HOOK_ENV not in os.environ  # the Ray patch stays; Flower's package loads as usual
