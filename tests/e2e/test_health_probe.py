"""The pods' gRPC TLS as k8s/ sets it up, against a real gRPC server: one certificate for one name
(no pod IP in it), dialled by IP with ``--grpc-tls-server-name``; and the exec probe
(``python -m baton.services.health_probe``) that stands in for the kubelet's plaintext gRPC probe,
run as the kubelet runs it, with the pod's own certificate folder."""

from __future__ import annotations

import datetime
import os
import subprocess
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.common.launch import python_module
from baton.services.grpc_tls import GrpcTLS
from baton.services.health_probe import check

NAME = "baton-internal"


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


def _tls(folder: Path, server_name: str | None = NAME) -> GrpcTLS:
    return GrpcTLS(str(folder / "tls.crt"), str(folder / "tls.key"), str(folder / "ca.crt"), server_name)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A gRPC health server on 127.0.0.1 with the shared identity, requiring client certificates."""
    folder = write_tls_dir(tmp_path_factory.mktemp("grpc-tls"))
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    port = srv.add_secure_port("127.0.0.1:0", _tls(folder).server_credentials())
    srv.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield folder, port, servicer
    srv.stop(0)


def test_one_certificate_for_one_name_serves_callers_that_dial_an_ip(server):
    folder, port, _ = server
    address = f"127.0.0.1:{port}"
    assert check(address, _tls(folder), 10) == "SERVING"
    # The certificate names no IP: checked against the address dialled, it is refused.
    assert check(address, _tls(folder, server_name=None), 10) == "UNAVAILABLE"
    assert check(address, _tls(folder, server_name="someone-else"), 10) == "UNAVAILABLE"


def test_the_server_name_needs_a_tls_identity():
    with pytest.raises(ValueError, match="--grpc-tls-server-name needs"):
        GrpcTLS(server_name=NAME)


def _probe(port: int, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*python_module("baton.services.health_probe"), "--port", str(port), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_the_exec_probe_passes_only_on_serving_over_the_pods_certificate(server, tmp_path):
    folder, port, servicer = server
    # As the pods run it: the Secret's folder, the name from the ConfigMap's GRPC_TLS_SERVER_NAME.
    ok = _probe(port, "--tls-dir", str(folder), env={"GRPC_TLS_SERVER_NAME": NAME})
    assert ok.returncode == 0, ok.stderr
    stranger = write_tls_dir(tmp_path / "other-ca")  # the right name, another CA
    refused = _probe(port, "--tls-dir", str(stranger), "--server-name", NAME)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
    plaintext = _probe(port)  # what the kubelet's own grpc probe would do
    assert plaintext.returncode == 1
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # a draining worker
    try:
        draining = _probe(port, "--tls-dir", str(folder), "--server-name", NAME)
        assert draining.returncode == 1 and "NOT_SERVING" in draining.stderr
    finally:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
