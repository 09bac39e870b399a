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
