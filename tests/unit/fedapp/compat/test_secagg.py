"""fedapp.compat.secagg: Flower's SecAgg+ Shamir functions replaced only after the version and signature checks."""

from __future__ import annotations

import sys

import pytest

from fedapp.compat import secagg, surface
from fedapp.privacy import shamir


@pytest.fixture
def flowers_own(monkeypatch) -> dict[str, object]:
    """Flower's own functions back in place (restored after the test, whatever it leaves)."""
    originals = {}
    for path in secagg.SHAMIR_CALLERS:
        owner = surface.resolve(path.rpartition(".")[0])
        originals[path] = surface.library_object(path)
        monkeypatch.setattr(owner, path.rpartition(".")[2], originals[path])
    return originals


def test_the_patch_points_flowers_secagg_at_the_replacements_once(flowers_own) -> None:
    secagg.use_shamir(shamir.create_shares, shamir.combine_shares)
    assert [surface.resolve(p) for p in secagg.SHAMIR_CALLERS] == [shamir.create_shares, shamir.combine_shares]
    assert [surface.library_object(p) for p in secagg.SHAMIR_CALLERS] == list(flowers_own.values())
    secagg.use_shamir(shamir.create_shares, shamir.combine_shares)  # idempotent
    assert surface.check(surface.SYMBOLS[secagg.CREATE_SHARES]) == []


def test_another_flower_release_is_refused_naming_the_symbols_and_the_version(flowers_own, monkeypatch) -> None:
    import flwr

    monkeypatch.setattr(flwr, "__version__", "1.43.0")
    with pytest.raises(RuntimeError, match=r"secaggplus_mod\.create_shares.* flwr 1\.43\.0"):
        secagg.use_shamir(shamir.create_shares, shamir.combine_shares)
    assert [surface.resolve(p) for p in secagg.SHAMIR_CALLERS] == list(flowers_own.values())  # left alone


def test_a_changed_flower_signature_is_refused(flowers_own, monkeypatch) -> None:
    def create_shares(secret, threshold, num, *, seed=0):  # type: ignore[no-untyped-def]  # a "Flower 1.4x"
        return []

    monkeypatch.setattr(surface, "_originals", {})  # as if never patched: the changed function is Flower's own
    monkeypatch.setattr(sys.modules[secagg.CREATE_SHARES.rpartition(".")[0]], "create_shares", create_shares)
    with pytest.raises(RuntimeError, match=r"secaggplus_mod\.create_shares\(secret, threshold, num, \*, seed=0\) "
                                           r"differs .* \(flwr 1\.4[12]\.\d+ installed\)"):
        secagg.use_shamir(shamir.create_shares, shamir.combine_shares)
    assert surface.resolve(secagg.CREATE_SHARES) is create_shares


def test_a_replacement_with_other_parameters_is_refused(flowers_own) -> None:
    def create_shares(secret, k, n):  # type: ignore[no-untyped-def]
        return []

    with pytest.raises(RuntimeError, match=r"create_shares\(secret, k, n\) cannot replace "
                                           r"flwr\.client\.mod\.secure_aggregation\.secaggplus_mod\.create_shares"):
        secagg.use_shamir(create_shares, shamir.combine_shares)
    assert [surface.resolve(p) for p in secagg.SHAMIR_CALLERS] == list(flowers_own.values())
