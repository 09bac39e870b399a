"""fedapp.privacy.key_agreement: X25519 in Flower's SecAgg+ key-agreement signatures, Flower's derivation."""

from __future__ import annotations

import base64

import pytest
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedapp.privacy import key_agreement as ka


def test_both_sides_derive_the_same_fernet_key_from_raw_32_byte_keys() -> None:
    sk_a, pk_a = ka.generate_key_pairs()
    sk_b, pk_b = ka.generate_key_pairs()
    raw = [ka.private_key_to_bytes(sk_a), ka.public_key_to_bytes(pk_a)]
    assert [len(b) for b in raw] == [32, 32]
    a_side = ka.generate_shared_key(ka.bytes_to_private_key(raw[0]), ka.bytes_to_public_key(ka.public_key_to_bytes(pk_b)))
    b_side = ka.generate_shared_key(sk_b, ka.bytes_to_public_key(raw[1]))
    assert a_side == b_side and len(base64.urlsafe_b64decode(a_side)) == 32
    assert Fernet(b_side).decrypt(Fernet(a_side).encrypt(b"share")) == b"share"  # Flower encrypts shares with it
    # Flower's derivation (HKDF-SHA256, 32 bytes, no salt, no info) of the X25519 secret
    expected = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=None).derive(sk_a.exchange(pk_b))
    assert a_side == base64.urlsafe_b64encode(expected)
    assert ka.generate_shared_key(sk_a, ka.generate_key_pairs()[1]) != a_side


@pytest.mark.parametrize("size", [0, 31, 33, 215])  # 215: a PEM P-384 public key from Flower's own functions
def test_a_malformed_key_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        ka.bytes_to_public_key(b"\x01" * size)
    with pytest.raises(ValueError, match="32 bytes"):
        ka.bytes_to_private_key(b"\x01" * size)


def test_a_small_order_public_key_gives_no_shared_key() -> None:
    """A neighbour that sends the all-zero point would make the shared secret zero (a mask the server can compute):
    the exchange refuses."""
    sk, _ = ka.generate_key_pairs()
    with pytest.raises(ValueError):
        ka.generate_shared_key(sk, ka.bytes_to_public_key(bytes(32)))


def test_a_stage_loads_its_private_key_once_and_a_new_key_replaces_it() -> None:
    """Flower's mod passes the same private key's bytes for every neighbour of a stage: the key is loaded once (loading
    computes the public key); other bytes give their own key, never the last one."""
    sk_a, _ = ka.generate_key_pairs()
    sk_b, pk_b = ka.generate_key_pairs()
    raw_a, raw_b = ka.private_key_to_bytes(sk_a), ka.private_key_to_bytes(sk_b)
    first = ka.bytes_to_private_key(raw_a)
    assert ka.bytes_to_private_key(bytes(raw_a)) is first
    other = ka.bytes_to_private_key(raw_b)
    assert other is not first and ka.private_key_to_bytes(other) == raw_b
    assert ka.public_key_to_bytes(other.public_key()) == ka.public_key_to_bytes(pk_b)
    assert ka.private_key_to_bytes(ka.bytes_to_private_key(raw_a)) == raw_a
