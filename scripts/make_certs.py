"""Create a local CA, a SuperLink TLS certificate and SuperNode authentication keys.

Uses the ``cryptography`` package only (no openssl binary)::

    python scripts/make_certs.py --out certs --hosts 127.0.0.1,localhost --supernodes 3

writes ``certs/ca.crt`` (give it to every SuperNode and to ``flwr``: ``--root-certificates``),
``certs-ca/ca.key`` (the CA private key, in a folder of its own — ``--ca-key-dir``, default ``<out>-ca`` —
never in the folder the SuperLink reads; move it offline, or pass ``--ca-key-dir ''`` to discard it
after signing), ``certs/server.pem`` + ``certs/server.key`` (the SuperLink's
``--ssl-certfile/--ssl-keyfile``, valid for every name in ``--hosts``) and, for each SuperNode
``i``, an EC P-384 key pair in OpenSSH format ``certs/supernode-i`` / ``certs/supernode-i.pub``
(``flower-supernode --auth-supernode-private-key``; the ``.pub`` is what the operator
registers with ``flwr supernode register``). Private keys are written with mode 0600.

What it protects: TLS authenticates the SuperLink to SuperNodes and encrypts the channel;
SuperNode authentication lets the SuperLink refuse nodes whose key was not registered. Neither
is differential privacy — it protects the transport and membership, not the updates' content.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write(path: Path, data: bytes, private: bool = False) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption())


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_ca(days: int = 30) -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
    """A self-signed CA certificate (RSA 2048, CA:TRUE, key cert sign)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dpfl-flower local CA")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_server_cert(ca_key, ca_cert: x509.Certificate, hosts: Sequence[str],
                     days: int = 30) -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
    """A server certificate signed by the CA, valid for every host/IP in ``hosts`` (SAN)."""
    if not hosts:
        raise ValueError("the server certificate needs at least one host name or IP address")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def make_supernode_keys(out: Path, name: str) -> tuple[Path, Path]:
    """An EC P-384 key pair in OpenSSH format (what Flower's SuperNode authentication expects)."""
    key = ec.generate_private_key(ec.SECP384R1())
    priv = out / name
    pub = out / f"{name}.pub"
    _write(priv, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                   serialization.NoEncryption()), private=True)
    _write(pub, key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    return priv, pub


def make_all(out: str | os.PathLike, hosts: Sequence[str] = ("127.0.0.1", "localhost"), supernodes: int = 0,
             days: int = 30, ca_key_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Write CA certificate, server certificate and ``supernodes`` key pairs under ``out``; returns their paths.

    The CA private key goes to ``ca_key_dir`` (which must not be ``out``), or nowhere when it is None:
    it is only needed to sign, and must not sit next to what the SuperLink reads."""
    if supernodes < 0:
        raise ValueError(f"--supernodes must be >= 0, got {supernodes}")
    root = Path(out)
    if ca_key_dir is not None and Path(ca_key_dir).resolve() == root.resolve():
        raise ValueError(f"--ca-key-dir must differ from --out ({root}): the CA key does not belong next to the "
                         "SuperLink's certificates")
    root.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = make_ca(days)
    srv_key, srv_cert = make_server_cert(ca_key, ca_cert, list(hosts), days)
    paths = {"ca": root / "ca.crt", "cert": root / "server.pem", "key": root / "server.key"}
    _write(paths["ca"], ca_cert.public_bytes(serialization.Encoding.PEM))
    if ca_key_dir is not None:
        Path(ca_key_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        paths["ca_key"] = Path(ca_key_dir) / "ca.key"
        _write(paths["ca_key"], _pem_key(ca_key), private=True)
    _write(paths["cert"], srv_cert.public_bytes(serialization.Encoding.PEM))
    _write(paths["key"], _pem_key(srv_key), private=True)
    for i in range(supernodes):
        paths[f"supernode-{i}"], paths[f"supernode-{i}.pub"] = make_supernode_keys(root, f"supernode-{i}")
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="certs", help="output folder (default: certs)")
    parser.add_argument("--hosts", default="127.0.0.1,localhost",
                        help="comma-separated IPs/DNS names the SuperLink is reached at (certificate SAN)")
    parser.add_argument("--supernodes", type=int, default=0, help="number of SuperNode auth key pairs to create")
    parser.add_argument("--days", type=int, default=30, help="validity in days")
    parser.add_argument("--ca-key-dir", default=None,
                        help="folder for the CA private key (default: <out>-ca; '' = discard it after signing)")
    args = parser.parse_args(argv)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    ca_key_dir = f"{args.out.rstrip('/')}-ca" if args.ca_key_dir is None else (args.ca_key_dir or None)
    paths = make_all(args.out, hosts, args.supernodes, args.days, ca_key_dir=ca_key_dir)
    for name, path in paths.items():
        print(f"{name:>16}: {path}")
    if "ca_key" in paths:
        print(f"\nThe CA private key is in {paths['ca_key']}: move it off the SuperLink host (offline storage); it is "
              f"needed only to sign new certificates. The SuperLink reads only {args.out}/ca.crt, server.pem, server.key.")
    else:
        print("\nThe CA private key was discarded after signing: new certificates need a new CA.")


if __name__ == "__main__":
    main()
