"""The torchvision guard: defines only the missing op schemas, only when the extension fails to load."""

from __future__ import annotations

import json
import subprocess
import sys

from fedapp.tv_compat import UNGUARDED_OP_SCHEMAS, torchvision_extension_loads


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_guarded_import_works_and_defines_only_what_is_missing():
    proc = _run(
        "import json; from fedapp.tv_compat import import_torchvision, guard_state\n"
        "tv = import_torchvision()\n"
        "from torchvision.datasets import MNIST\n"
        "from fedapp.models import resnet18_groupnorm\n"
        "print(json.dumps(guard_state()))"
    )
    assert proc.returncode == 0, proc.stderr
    state = json.loads(proc.stdout.strip().splitlines()[-1])
    if state["extension_loaded"]:
        assert state["defined"] == []
    else:
        assert state["defined"] == sorted(UNGUARDED_OP_SCHEMAS) or set(state["defined"]) == set(UNGUARDED_OP_SCHEMAS)


def test_plain_import_fails_exactly_when_extension_cannot_load():
    """Documents the trap the guard exists for: without it, import fails iff ``_C`` does not load."""
    loads = torchvision_extension_loads()
    proc = _run("import torchvision")
    if loads:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode != 0
        assert "torchvision::nms does not exist" in proc.stderr


def test_guard_is_idempotent_and_after_import_a_noop():
    proc = _run(
        "from fedapp.tv_compat import ensure_torchvision_importable as g\n"
        "first = g(); second = g()\n"
        "import torchvision\n"
        "print(len(first) >= 0 and second == [])"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("True")
