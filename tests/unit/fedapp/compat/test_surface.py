"""The Flower/Ray surface fedapp.compat patches or overrides, against the installed libraries (fedapp.compat.surface).

After a Flower or Ray upgrade, run this file first: a failure names the symbol whose signature, attributes or value
changed; re-read it, adapt the workaround, then re-record the entry.
"""

from __future__ import annotations

import inspect
import re
import sys
import types
import warnings

import pytest
import tomllib
from conftest import REPO

from fedapp.compat import early_ray, lean_ray, secagg, surface, wakeups


@pytest.mark.parametrize("symbol", surface.SURFACE, ids=lambda s: s.path)
def test_each_symbol_is_as_recorded(symbol: surface.Symbol) -> None:
    obj = surface.library_object(symbol.path)  # imports it; Flower's or Ray's own object even where patched
    if symbol.signature is not None:
        assert surface.signature_of(obj) == symbol.signature
    for name in symbol.attributes:
        assert surface._has_attribute(obj, name), f"{symbol.path} lacks {name}"
    if symbol.value is not None:
        assert repr(obj) == symbol.value
    assert surface.check(symbol) == []


@pytest.mark.parametrize("library", sorted(surface.TESTED))
def test_the_installed_libraries_are_the_tested_releases(library: str) -> None:
    assert surface.version_supported(library), surface.version_problem(library)
    assert surface.problems(*surface.GROUPS) == []


def test_every_patched_name_is_registered() -> None:
    patched = [*secagg.SHAMIR_CALLERS, wakeups.FEEDER, early_ray.INIT_RAY, lean_ray.NODE_INIT]
    assert all(path in surface.SYMBOLS for path in patched)
    assert len(surface.SYMBOLS) == len(surface.SURFACE)  # one entry a path
    assert wakeups.PATCHED_FLOWER == early_ray.PATCHED_FLOWER == surface.releases("flwr") == "1.41.x or 1.42.x"
    assert lean_ray.PATCHED_RAY == surface.releases("ray")
    hook_env = surface.SYMBOLS["ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR"]
    assert hook_env.value == repr(lean_ray.ACTOR_HOOK_ENV)


@pytest.fixture
def fake_library(monkeypatch) -> types.ModuleType:
    """A library ``fakelib`` 0.1.3, tested as 0.1, with one function and one class."""
    module = types.ModuleType("fakelib")
    module.__version__ = "0.1.3"  # type: ignore[attr-defined]

    def f(a, b=1):  # type: ignore[no-untyped-def]
        return a

    class Thing:
        def __init__(self) -> None:
            self.kept = 1

    module.f, module.Thing = f, Thing  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fakelib", module)
    monkeypatch.setitem(surface.TESTED, "fakelib", ("0.1",))
    return module


def test_the_checker_fails_on_a_changed_signature(fake_library) -> None:
    same = surface.Symbol("fakelib.f", "(a, b=1)", "fake", "test")
    changed = surface.Symbol("fakelib.f", "(a, b=2)", "fake", "test")
    assert surface.check(same) == []
    found = surface.check(changed)
    assert len(found) == 1 and "fakelib.f(a, b=1) differs from the recorded fakelib.f(a, b=2)" in found[0]
    with pytest.raises(RuntimeError, match=r"fakelib\.f\(a, b=1\) differs .* \(fakelib 0\.1\.3 installed\)"):
        surface.require(symbols=[changed])
    surface.require(symbols=[same])


def test_the_checker_fails_on_a_missing_symbol_attribute_or_value(fake_library) -> None:
    assert "is missing" in surface.check(surface.Symbol("fakelib.gone", None, "fake", "test"))[0]
    assert surface.check(surface.Symbol("fakelib.Thing", None, "fake", "test", attributes=("kept",))) == []
    assert "lacks other" in surface.check(surface.Symbol("fakelib.Thing", None, "fake", "test",
                                                         attributes=("kept", "other")))[0]
    assert "not the recorded" in surface.check(surface.Symbol("fakelib.f", None, "fake", "test", value="'x'"))[0]


def test_the_checker_fails_on_another_release(fake_library, monkeypatch) -> None:
    symbol = surface.Symbol("fakelib.f", "(a, b=1)", "fake", "test")
    monkeypatch.setattr(fake_library, "__version__", "0.2.0")
    with pytest.raises(RuntimeError, match=r"fakelib 0\.2\.0 is installed; .* fakelib 0\.1\.x"):
        surface.require(symbols=[symbol])
    import flwr

    monkeypatch.setattr(flwr, "__version__", "1.43.0")
    assert any("flwr 1.43.0 is installed" in p and "1.41.x or 1.42.x" in p for p in surface.problems("secagg.shamir"))
    monkeypatch.setattr(flwr, "__version__", "1.42.0")  # recorded against 1.41 and checked on 1.42: supported
    assert not surface.problems("secagg.shamir")
    with pytest.raises(ValueError, match="no surface group"):
        surface.problems("no-such-group")


def test_replace_keeps_the_original_for_the_checks_and_restore_undoes_it(fake_library, monkeypatch) -> None:
    symbol = surface.Symbol("fakelib.f", "(a, b=1)", "fake", "test")
    monkeypatch.setitem(surface.SYMBOLS, symbol.path, symbol)
    original = fake_library.f

    def patched(x):  # another signature: the check must still see the library's own
        return x

    previous = surface.replace(symbol.path, patched)
    try:
        assert previous is original and fake_library.f is patched and surface.resolve(symbol.path) is patched
        assert surface.library_object(symbol.path) is original and surface.check(symbol) == []
    finally:
        surface.restore(symbol.path, previous)
    assert fake_library.f is original and surface.library_object(symbol.path) is original
    with pytest.raises(RuntimeError, match="not in fedapp.compat.surface.SURFACE"):
        surface.replace("fakelib.Thing", object())


def _error_filter() -> str:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    errors = [f for f in config["tool"]["pytest"]["ini_options"]["filterwarnings"] if f.startswith("error:")]
    assert len(errors) == 1 and errors[0].endswith(":DeprecationWarning")
    return errors[0].split(":")[1]


#: registered, but its deprecation is not an error: ``flwr.simulation.run_simulation`` is deprecated in favour of
#: ``flwr run`` and the tests run it on purpose; the lean actor depends on the package layout, not on that function
NOT_AN_ERROR = {"flwr.simulation"}


@pytest.mark.parametrize("symbol", [s for s in surface.SURFACE if s.path not in NOT_AN_ERROR], ids=lambda s: s.path)
def test_a_deprecation_naming_a_registered_symbol_is_an_error_in_the_tests(symbol: surface.Symbol) -> None:
    parent, _, name = symbol.path.rpartition(".")
    if inspect.isclass(surface.resolve(parent)):  # a method as a deprecation names it: Class.method
        name = f"{parent.rpartition('.')[2]}.{name}"
    assert re.match(_error_filter(), f"`{name}` is deprecated, use something else", re.I), name


def test_pytest_applies_the_deprecation_filters() -> None:
    with pytest.raises(DeprecationWarning, match="unmask_stage"):
        warnings.warn("SecAggPlusWorkflow.unmask_stage is deprecated", DeprecationWarning, stacklevel=1)
    with warnings.catch_warnings(record=True) as caught:  # keeps the configured filters, records what they show
        for module in ("flwr.common.thing", "ray.util.thing", "opacus.thing", "torch.thing", "flwr_datasets.thing"):
            warnings.warn_explicit(f"{module} is deprecated", DeprecationWarning, "x.py", 1, module=module,
                                   registry={})
    assert sorted(str(w.message).split()[0] for w in caught) == ["flwr.common.thing", "opacus.thing", "ray.util.thing"]
