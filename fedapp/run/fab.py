"""The folder ``flwr run`` packs into the Flower App Bundle (FAB), staged small.

``flwr run <app>`` builds the FAB by walking *every* file under ``<app>`` — the virtual environment,
results and caches included; ``flwr.cli.utils.collect_files`` resolves each path — and only then filters
by ``.gitignore`` and ``[tool.flwr.app]`` include/exclude. With this project's ``.venv`` that walk took
5.2 s of every launch on the 2-core reference machine (``build_fab_from_disk``), for a 1 MB FAB.

:func:`stage_app` copies what the ServerApp and ClientApp need — ``pyproject.toml``, ``README.md``,
``.gitignore`` and the packages named by ``[tool.setuptools.packages.find] include`` (here ``fedapp*``,
``strategies*``) less the subpackages ``[tool.dpfl.app-bundle] exclude`` names (here the launcher and the
experiments, ``fedapp.run`` and ``fedapp.experiments``, which no ServerApp or ClientApp imports: the
layers contract in pyproject.toml keeps it so) — into a folder of its own, and the launchers run ``flwr run``
on that folder. The FAB then holds the apps and what they import, without the docs, tests, benchmarks,
launcher and experiments. An app without that ``include`` list is run from its own folder, as Flower would.
``flwr run .`` in the project folder itself packs the same packages with the launcher and the experiments
(``fab-include`` in pyproject.toml), never the docs, tests, benchmarks or committed sweep results.
"""

from __future__ import annotations

import fnmatch
import shutil
import tempfile
from pathlib import Path

import tomllib

#: top-level files of the app folder that go into the staged copy when present
APP_FILES = ("pyproject.toml", "README.md", ".gitignore")
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo", ".*")


def package_patterns(app: Path) -> list[str]:
    """``[tool.setuptools.packages.find] include`` of ``app``'s pyproject.toml ([] when absent)."""
    data = tomllib.loads((app / "pyproject.toml").read_text(encoding="utf-8"))
    include = data.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {}).get("include", [])
    return [str(p) for p in include]


def excluded_subpackages(app: Path) -> list[str]:
    """``[tool.dpfl.app-bundle] exclude`` of ``app``'s pyproject.toml: dotted subpackages left out of the FAB."""
    data = tomllib.loads((app / "pyproject.toml").read_text(encoding="utf-8"))
    exclude = data.get("tool", {}).get("dpfl", {}).get("app-bundle", {}).get("exclude", [])
    return [str(p) for p in exclude]


def stage_app(app: Path, parent: Path) -> Path:
    """A new folder under ``parent`` holding ``app``'s FAB files (see the module docstring); ``app`` itself
    when it names no packages. The caller removes the folder when the run has ended."""
    app = app.resolve()
    patterns = package_patterns(app)
    if not patterns:
        return app
    parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix="app-", dir=parent))
    excluded = {app.joinpath(*name.split(".")) for name in excluded_subpackages(app)}

    def ignore(folder: str, names: list[str]) -> set[str]:
        return set(_SKIP(folder, names)) | {n for n in names if Path(folder, n) in excluded}

    try:
        for name in APP_FILES:
            if (app / name).is_file():
                shutil.copy2(app / name, staged / name)
        for entry in sorted(app.iterdir()):
            is_package = entry.is_dir() and not entry.is_symlink() and (entry / "__init__.py").is_file()
            if is_package and any(fnmatch.fnmatch(entry.name, p) for p in patterns):
                shutil.copytree(entry, staged / entry.name, ignore=ignore)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return staged
