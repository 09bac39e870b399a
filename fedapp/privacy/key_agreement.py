"""X25519 key agreement for Flower's SecAgg+, in place of its P-384 ECDH with PEM-encoded keys.

Flower's SecAgg+ gives each client two key pairs: one to encrypt the Shamir shares it sends its neighbours (via the
server), one whose pairwise agreements seed the masks that cancel in the sum. Each client runs 2(r − 1) agreements
a round with r neighbours, and Flower's functions parse a 306-byte PEM private key (0.32 ms) and a 215-byte PEM
public key for each, then run P-384 ECDH (0.59 ms): ~0.19 s a client at r = 100, the largest client-side cost of a
SecAgg+ round after Shamir's (docs/benchmarks.md, "10,000 clients").

These functions keep Flower's signatures and output (a 32-byte key from HKDF-SHA256 with no salt or info, urlsafe
base64 for Fernet) and swap the group: X25519 (RFC 7748) with raw 32-byte keys, ~0.05 ms an exchange and no
parsing. The security level stays that of the scheme: X25519 gives ~128-bit security, which is what the rest of
SecAgg+ provides (Fernet's AES-128 encrypts the shares; the masks come from AES-256-CTR keyed by the derived key,
:mod:`fedapp.privacy.masks`), so P-384's ~192 bits bought nothing end to end. An agreement with an all-zero result (a small-order public
key, which only a malicious neighbour sends) raises, as the ``cryptography`` library does for X25519.

Both ends must use them: the client mod creates and agrees keys, and the server workflow agrees a dropped client's
pairwise keys from its reconstructed secret. :func:`fedapp.compat.secagg.use_key_agreement` switches both on, on
the same SecAgg+ code paths that switch on the project's Shamir sharing.

Flower's client mod hands the same private key's bytes to :func:`bytes_to_private_key` once per neighbour (r − 1
times in each of two stages), and loading an X25519 private key computes its public key (a scalar multiplication,
~32 µs, as much as the agreement itself). The function keeps the last key it loaded and returns it for the same
bytes: one load a stage. It keeps that one key until the next load; the SecAgg+ state that passed its bytes holds them
as long (a client its own key for the round, the server workflow a dropped client's reconstructed key).
"""

from __future__ import annotations

import base64
import functools

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

KEY_BYTES = 32


def generate_key_pairs() -> tuple[X25519PrivateKey, X25519PublicKey]:
    """A fresh X25519 key pair from the OS CSPRNG."""
    private_key = X25519PrivateKey.generate()
    return private_key, private_key.public_key()


def private_key_to_bytes(private_key: X25519PrivateKey) -> bytes:
    """The raw 32-byte private key (RFC 7748)."""
    return private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def bytes_to_private_key(private_key_bytes: bytes) -> X25519PrivateKey:
    """The private key of 32 raw bytes (ValueError for any other length)."""
    if len(private_key_bytes) != KEY_BYTES:
        raise ValueError(f"an X25519 private key is {KEY_BYTES} bytes, got {len(private_key_bytes)}")
    return _load_private_key(bytes(private_key_bytes))


@functools.lru_cache(maxsize=1)
def _load_private_key(private_key_bytes: bytes) -> X25519PrivateKey:
    """The last key loaded, kept for the agreements of a stage (the module docstring says why)."""
    return X25519PrivateKey.from_private_bytes(private_key_bytes)


def public_key_to_bytes(public_key: X25519PublicKey) -> bytes:
    """The raw 32-byte public key (RFC 7748)."""
    return public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def bytes_to_public_key(public_key_bytes: bytes) -> X25519PublicKey:
    """The public key of 32 raw bytes (ValueError for any other length: a neighbour's malformed key)."""
    if len(public_key_bytes) != KEY_BYTES:
        raise ValueError(f"an X25519 public key is {KEY_BYTES} bytes, got {len(public_key_bytes)}")
    return X25519PublicKey.from_public_bytes(public_key_bytes)


def generate_shared_key(private_key: X25519PrivateKey, public_key: X25519PublicKey) -> bytes:
    """Flower's derivation on an X25519 secret: HKDF-SHA256 to 32 bytes, urlsafe base64 (a Fernet key)."""
    shared = private_key.exchange(public_key)
    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=None).derive(shared)
    return base64.urlsafe_b64encode(derived)
