"""The launchers run ``flwr run`` on a staged copy of the app (fedapp/run/fab.py): its FAB must hold exactly the
project FAB's code and config, byte for byte, minus folders no ServerApp or ClientApp imports."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from flwr.cli.build import build_fab_from_disk

from fedapp.run.fab import stage_app
from fedapp.run.processes import PROJECT_ROOT


def _files(fab: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(fab)) as z:
        return {n: z.read(n) for n in z.namelist() if not n.startswith(".info/")}


def test_the_staged_fab_is_the_projects_fab_without_the_launcher_and_the_experiments(tmp_path: Path) -> None:
    staged = stage_app(PROJECT_ROOT, tmp_path)
    assert staged != PROJECT_ROOT and staged.parent == tmp_path
    ours, full = _files(build_fab_from_disk(staged)), _files(build_fab_from_disk(PROJECT_ROOT))
    assert {"pyproject.toml", "fedapp/apps/server_app.py", "fedapp/apps/client_app.py", "strategies/rpca.py"} <= set(ours)
    assert all(full.get(name) == data for name, data in ours.items())  # a subset, byte for byte
    # `flwr run .` in the project packs the apps' packages and the README (fab-include), not the docs, tests,
    # benchmarks and committed sweep results, which grow past Flower's 10 MiB limit on a FAB
    assert {name.split("/")[0] for name in full} == {"pyproject.toml", "README.md", "fedapp", "strategies"}
    # of fedapp/, only the launcher and the experiments stay behind
    assert {n.split("/")[1] for n in set(full) - set(ours)} == {"run", "experiments"}


def test_the_staged_apps_import_without_the_launcher_and_the_experiments(tmp_path: Path) -> None:
    """A SuperNode gets the apps and what they import: both apps load from the staged folder alone."""
    staged = stage_app(PROJECT_ROOT, tmp_path)
    assert not (staged / "fedapp" / "run").exists() and not (staged / "fedapp" / "experiments").exists()
    root, app = str(PROJECT_ROOT), str(staged)
    code = (f"import sys; sys.path = [p for p in sys.path if p not in ('', {root!r})]; sys.path.insert(0, {app!r}); "
            "import fedapp.apps.server_app, fedapp.apps.client_app, fedapp.apps.factories, fedapp; "
            f"assert fedapp.__file__.startswith({app!r}), fedapp.__file__")
    out = subprocess.run([sys.executable, "-c", code], cwd=staged, capture_output=True, text=True, timeout=120,
                         env={"PATH": os.environ["PATH"], "PYTHONNOUSERSITE": "1"})
    assert out.returncode == 0, out.stderr


def test_an_app_without_a_package_list_is_run_from_its_own_folder(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text('[project]\nname = "x"\n', encoding="utf-8")
    assert stage_app(app, tmp_path / "staged") == app.resolve()
