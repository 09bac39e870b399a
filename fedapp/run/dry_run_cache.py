"""The launcher's dry run, remembered: a configuration that passed it once is not built again before the next run.

The dry run (:func:`fedapp.apps.server_app.dry_run`, in a spawned child) builds the strategy, its mechanism and one
client to catch a bad configuration before any process starts: ~2 s of a launch on 2 cores, most of it importing
torch and Flower in the child. Whether it passes is a function of the resolved run-config, the federation size, the
project's code, the installed libraries and the data files; when all of them are what they were at a dry run that
passed, the launcher reuses that outcome (the keys it reported as unused) instead of building everything again.

What the key holds (:func:`dry_run_fields`): every run-config value; ``--num-supernodes``; the path, size and mtime of
every ``.py`` file of the ``fedapp`` and ``strategies`` packages that run the dry run (the launcher's own) and of the
app's ``pyproject.toml``; the versions of
the libraries that build the components; the path, size and mtime of every file under ``data-dir`` (at most
:data:`MAX_DATA_FILES`); Python's executable and version and ``CUDA_VISIBLE_DEVICES``. Not cached at all: ``hf:``
datasets (their files live elsewhere), ``resume-from`` (a checkpoint is read) and a failed dry run.

Skipping it costs no safety: the dry run is an early copy of what the ServerApp and the ClientApps build anyway, so a
stale entry (say, a file changed without its mtime) can only let a configuration error surface in the run instead of
before it, never change what the run does. ``DPFL_CACHE_DIR=off`` turns the cache off (:mod:`fedapp.state.cache`).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedapp.state.cache import fingerprint, library_versions, lookup, store

NAMESPACE = "dry-runs"
#: the folder holding the ``fedapp`` and ``strategies`` packages that run the dry run (this module's project)
CODE_ROOT = Path(__file__).resolve().parents[2]
#: data folders with more files than this are not fingerprinted (the dry run then always runs)
MAX_DATA_FILES = 5000
#: the libraries whose behaviour decides whether a configuration builds
LIBRARIES = ("torch", "flwr", "opacus", "numpy", "scipy", "dp-accounting")


def dry_run_fields(run_config: Mapping[str, Any], num_clients: int, app: Path,
                   code_root: Path = CODE_ROOT) -> dict[str, Any] | None:
    """The cache key of a dry run of ``run_config`` for ``num_clients`` clients of the app at ``app`` by the code under
    ``code_root`` (default: the project this module belongs to), or None when such a dry run is not cached (module
    docstring)."""
    dataset, data_dir = str(run_config.get("dataset", "")), run_config.get("data-dir")
    if dataset.startswith("hf:") or run_config.get("resume-from"):
        return None
    data = _data_files(Path(str(data_dir))) if data_dir else []
    if data is None:
        return None
    code = [p for pkg in ("fedapp", "strategies") for p in (code_root / pkg).rglob("*.py")]
    code += [app / "pyproject.toml"] if (app / "pyproject.toml").is_file() else []
    return {"config": {k: _jsonable(v) for k, v in sorted(run_config.items())}, "num_clients": int(num_clients),
            "code": fingerprint(code), "data": fingerprint(data, str(data_dir)), "libraries": library_versions(*LIBRARIES),
            "python": [sys.executable, platform.python_version()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def passed_before(fields: dict[str, Any] | None) -> list[str] | None:
    """The unused keys a dry run with exactly ``fields`` reported when it passed, or None (never passed, not cached)."""
    value = lookup(NAMESPACE, fields) if fields is not None else None
    return [str(k) for k in value] if isinstance(value, list) else None


def remember_pass(fields: dict[str, Any] | None, unused: list[str]) -> None:
    """Record that the dry run with ``fields`` passed and reported ``unused``."""
    if fields is not None:
        store(NAMESPACE, fields, list(unused))


def _data_files(folder: Path) -> list[Path] | None:
    files: list[Path] = []
    if not folder.is_dir():
        return files
    for root, _, names in os.walk(folder):
        files += [Path(root, n) for n in names]
        if len(files) > MAX_DATA_FILES:
            return None
    return files


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)
