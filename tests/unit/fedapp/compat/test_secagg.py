"""fedapp.compat.secagg: Flower's SecAgg+ Shamir functions replaced only after the version and signature checks."""

from __future__ import annotations

import sys

import pytest

from fedapp.compat import secagg, surface
from fedapp.privacy import shamir


def _flowers_own(monkeypatch, paths: tuple[str, ...]) -> dict[str, object]:
    """Flower's own functions at ``paths`` back in place (restored after the test, whatever it leaves)."""
    originals = {}
    for path in paths:
        owner = surface.resolve(path.rpartition(".")[0])
        originals[path] = surface.library_object(path)
        monkeypatch.setattr(owner, path.rpartition(".")[2], originals[path])
    return originals


@pytest.fixture
def flowers_own(monkeypatch) -> dict[str, object]:
    return _flowers_own(monkeypatch, secagg.SHAMIR_CALLERS)


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


@pytest.fixture
def flowers_own_keys(monkeypatch) -> dict[str, object]:
    return _flowers_own(monkeypatch, secagg.KEY_CALLERS)


def test_the_key_patch_points_both_ends_at_x25519_once(flowers_own_keys) -> None:
    from fedapp.privacy import key_agreement

    secagg.use_key_agreement(key_agreement)
    assert all(surface.resolve(p) is getattr(key_agreement, p.rpartition(".")[2]) for p in secagg.KEY_CALLERS)
    assert [surface.library_object(p) for p in secagg.KEY_CALLERS] == list(flowers_own_keys.values())
    secagg.use_key_agreement(key_agreement)  # idempotent
    assert surface.problems(secagg.KEYS) == []
    # the client mod's names and the workflow's agree: a key pair made by one end is usable by the other
    mod, workflow = (sys.modules[m] for m in (secagg._MOD, secagg._WORKFLOW))
    sk_a, pk_a = mod.generate_key_pairs()
    sk_b, pk_b = mod.generate_key_pairs()
    a_side = mod.generate_shared_key(sk_a, mod.bytes_to_public_key(mod.public_key_to_bytes(pk_b)))
    b_side = workflow.generate_shared_key(workflow.bytes_to_private_key(mod.private_key_to_bytes(sk_b)),
                                          workflow.bytes_to_public_key(mod.public_key_to_bytes(pk_a)))
    assert a_side == b_side


def test_a_key_replacement_with_other_parameters_is_refused(flowers_own_keys) -> None:
    import types

    from fedapp.privacy import key_agreement

    broken = types.SimpleNamespace(**{n: getattr(key_agreement, n) for n in dir(key_agreement) if not n.startswith("_")})
    broken.generate_shared_key = lambda sk, pk: b""
    with pytest.raises(RuntimeError, match=r"cannot replace flwr\.client\.mod\.secure_aggregation\.secaggplus_mod\."
                                           r"generate_shared_key"):
        secagg.use_key_agreement(broken)  # type: ignore[arg-type]
    assert [surface.resolve(p) for p in secagg.KEY_CALLERS] == list(flowers_own_keys.values())


@pytest.fixture
def flowers_own_masks(monkeypatch) -> dict[str, object]:
    return _flowers_own(monkeypatch, secagg.MASK_CALLERS)


def test_the_mask_patch_points_both_ends_at_the_aes_generator_once(flowers_own_masks) -> None:
    from fedapp.privacy import masks

    secagg.use_masks(masks.pseudo_rand_gen)
    assert [surface.resolve(p) for p in secagg.MASK_CALLERS] == [masks.pseudo_rand_gen] * 2
    assert [surface.library_object(p) for p in secagg.MASK_CALLERS] == list(flowers_own_masks.values())
    secagg.use_masks(masks.pseudo_rand_gen)  # idempotent
    assert surface.problems(secagg.MASKS) == []

    def other(seed, num_range, dims):  # type: ignore[no-untyped-def]
        return []

    with pytest.raises(RuntimeError, match=r"other\(seed, num_range, dims\) cannot replace"):
        secagg.use_masks(other)
