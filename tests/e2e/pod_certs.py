"""A cluster's shared gRPC identity as cert-manager writes it into a kubernetes.io/tls Secret:
``ca.crt``, and ``tls.crt``/``tls.key`` for one DNS name only (no address), as files."""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NAME = "baton-internal"
"""k8s/base/configmap.yaml's GRPC_TLS_SERVER_NAME."""


def _pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_tls_dir(folder: Path, dns_name: str = NAME) -> Path:
    """What cert-manager writes into a kubernetes.io/tls Secret, as files: ``ca.crt`` (a fresh
    CA), ``tls.crt``/``tls.key`` (one identity for ``dns_name`` only, server and client auth)."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def build(subject: str, issuer: str, key, signer, ca: bool):
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns_name)]), critical=False)
            usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build("baton-ca", "baton-ca", ca_key, ca_key, ca=True)
    (folder / "ca.crt").write_bytes(_pem(ca))
    (folder / "tls.crt").write_bytes(_pem(build("baton", "baton-ca", key, ca_key, ca=False)))
    (folder / "tls.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return folder
