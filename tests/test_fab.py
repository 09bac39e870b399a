"""The launchers run ``flwr run`` on a staged copy of the app (fedapp/fab.py): its FAB must hold exactly the
project FAB's code and config, byte for byte, minus folders no ServerApp or ClientApp imports."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

from flwr.cli.build import build_fab_from_disk

from fedapp.fab import stage_app
from fedapp.processes import PROJECT_ROOT


def _files(fab: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(fab)) as z:
        return {n: z.read(n) for n in z.namelist() if not n.startswith(".info/")}


def test_the_staged_fab_is_the_projects_fab_without_docs_tests_and_benchmarks(tmp_path: Path) -> None:
    staged = stage_app(PROJECT_ROOT, tmp_path)
    assert staged != PROJECT_ROOT and staged.parent == tmp_path
    ours, full = _files(build_fab_from_disk(staged)), _files(build_fab_from_disk(PROJECT_ROOT))
    assert {"pyproject.toml", "fedapp/server_app.py", "fedapp/client_app.py", "strategies/rpca.py"} <= set(ours)
    assert all(full.get(name) == data for name, data in ours.items())  # a subset, byte for byte
    left_out = {name.split("/")[0] for name in set(full) - set(ours)}
    assert left_out and left_out.isdisjoint({"fedapp", "strategies", "pyproject.toml"})


def test_an_app_without_a_package_list_is_run_from_its_own_folder(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text('[project]\nname = "x"\n', encoding="utf-8")
    assert stage_app(app, tmp_path / "staged") == app.resolve()
