"""``baton secrets DIR``: what a cluster's services share to trust each other, made once.

compose.yaml runs it as a one-shot service into a volume that Redis and every Baton service mount,
so ``docker compose up`` locks its doors with nothing to set: Redis asks a password, worker
records in Redis carry an HMAC, and the internal gRPC runs on mutual TLS. Only missing files are
written, so a restart (or a second ``up``) keeps what the running services hold.

Files: ``redis-password`` (Redis's default user: the operator's, probes, an exporter),
``redis-password-gateway``, ``-prefill``, ``-decode`` (each role's ACL user, ``common/index/acl.py``:
the gateway only reads), ``redis.conf`` (``requirepass`` and the roles' ``user`` lines for
``redis-server``; it holds their SHA-256, not the passwords), ``cluster-secret``
(the HMAC key of worker records), ``ca.crt`` with ``tls.crt``/``tls.key`` (one identity for every
service, for the name ``baton-internal``: channels check that name with ``--grpc-tls-server-name``,
since the addresses workers advertise are not known in advance). The CA's key is not kept: nothing
else can be signed by it.
"""

from __future__ import annotations

import datetime
import os
import secrets
from pathlib import Path

from baton.common.index import acl

SERVER_NAME = "baton-internal"
"""The name on the shared certificate, checked by every channel (``--grpc-tls-server-name``)."""

READABLE = 0o644
"""Files that processes of other users (Redis, its exporter) read: the volume is theirs alone."""
PRIVATE = 0o600


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` under a temporary name and rename it: a reader sees all or none."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)  # whatever the umask took away
    tmp.replace(path)


def redis_conf(password: str, role_passwords: dict[str, str] | None = None) -> str:
    """redis-server's settings: the default user's password and the roles' ACL users; soft state
    only (workers republish it), so nothing is persisted."""
    users = acl.conf_lines(role_passwords) if role_passwords else ""
    return f'requirepass "{password}"\n{users}save ""\nappendonly no\nprotected-mode no\n'


def _certificates(days: int) -> tuple[bytes, bytes, bytes]:
    """(ca.crt, tls.crt, tls.key): a fresh CA and one identity for ``SERVER_NAME`` it signed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("baton-ca"))
        .issuer_name(name("baton-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name(SERVER_NAME))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return ca.public_bytes(pem), cert.public_bytes(pem), key_pem


def init(directory: Path, days: int = 825) -> list[str]:
    """Write what is missing under ``directory``; return the names written (empty: all there)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    # A volume made before the roles had users gets theirs, and a redis.conf that names them.
    for name in ("redis-password", *(f"redis-password-{role}" for role in acl.ROLES)):
        if not (directory / name).is_file():
            _write(directory / name, secrets.token_urlsafe(32).encode(), READABLE)
            written.append(name)
    if written or not (directory / "redis.conf").is_file():
        password = (directory / "redis-password").read_text()
        roles = {role: (directory / f"redis-password-{role}").read_text() for role in acl.ROLES}
        _write(directory / "redis.conf", redis_conf(password, roles).encode(), READABLE)
        written.append("redis.conf")
    if not (directory / "cluster-secret").is_file():
        _write(directory / "cluster-secret", secrets.token_urlsafe(32).encode(), PRIVATE)
        written.append("cluster-secret")
    if not all((directory / f).is_file() for f in ("ca.crt", "tls.crt", "tls.key")):
        ca, cert, key = _certificates(days)
        _write(directory / "ca.crt", ca, READABLE)
        _write(directory / "tls.crt", cert, READABLE)
        _write(directory / "tls.key", key, PRIVATE)
        written += ["ca.crt", "tls.crt", "tls.key"]
    return written
