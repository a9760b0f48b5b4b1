"""Throwaway certificates for the secured local servers: a CA, a server certificate for 127.0.0.1 and
localhost, a client certificate, and a second CA that signed none of them (an "untrusted" one).

Made per run with ``trustme`` (a test dependency, imported only here) into a directory the caller owns;
nothing of it is ever committed. Keys are written unencrypted (PKCS#8 PEM) with mode 0600.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class CertSet:
    """PEM files. ``server_pem`` holds the server's key and chain in one file (Kafka's PEM keystore)."""

    ca_file: Path
    server_cert: Path
    server_key: Path
    server_pem: Path
    client_cert: Path
    client_key: Path
    untrusted_ca_file: Path

    def private_keys(self) -> list[bytes]:
        """The private keys' base64 bodies (what a leak check looks for), one per key file."""
        out = []
        for p in (self.server_key, self.client_key):
            lines = p.read_text().splitlines()
            out.append("".join(ln for ln in lines if not ln.startswith("-----")).encode())
        return out


def _write(path: Path, data: bytes, secret: bool = False) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _pkcs8(pem: bytes) -> bytes:
    """The key as unencrypted PKCS#8 PEM ("BEGIN PRIVATE KEY"): Kafka's PEM keystore reads no other form,
    and trustme writes the traditional OpenSSL one."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pem, password=None)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_certs(directory: str | Path, client_name: str = "kiw-client") -> CertSet:
    """Writes a fresh CA, server and client certificates into ``directory`` (created if missing)."""
    import trustme

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name="kiw test CA")
    server = ca.issue_cert("127.0.0.1", "localhost")
    # trustme's leaf certificates allow both client and server authentication.
    client = ca.issue_cert(f"{client_name}.local", common_name=client_name)
    other = trustme.CA(organization_name="kiw untrusted CA")
    server_chain = b"".join(blob.bytes() for blob in server.cert_chain_pems)
    server_key, client_key = _pkcs8(server.private_key_pem.bytes()), _pkcs8(client.private_key_pem.bytes())
    return CertSet(
        ca_file=_write(d / "ca.pem", ca.cert_pem.bytes()),
        server_cert=_write(d / "server.crt", server_chain),
        server_key=_write(d / "server.key", server_key, secret=True),
        server_pem=_write(d / "server.pem", server_key + server_chain, secret=True),
        client_cert=_write(d / "client.crt", b"".join(blob.bytes() for blob in client.cert_chain_pems)),
        client_key=_write(d / "client.key", client_key, secret=True),
        untrusted_ca_file=_write(d / "untrusted-ca.pem", other.cert_pem.bytes()),
    )
