"""TLS for the internal gRPC (gateway -> decode -> prefill), off unless configured.

Every service has one identity, a PEM certificate chain and its key (``--grpc-tls-cert`` and
``--grpc-tls-key``), which its gRPC server presents and, when it calls another service, its
channels present too. ``--grpc-tls-ca`` names the CA that signed the peers' certificates: channels
verify servers against it (instead of the system's roots), and servers then *require* a client
certificate signed by it (mutual TLS), so that only services holding a certificate from that CA
reach a worker. Certificates must name the address the workers advertise (an IP SAN for an IP),
or, with ``--grpc-tls-server-name``, that one name: where addresses are not known when the
certificate is made (pods), every service shares a certificate for a fixed name and channels check
servers against that name instead of the address they dial.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class GrpcTLS:
    cert: str | None = None
    """This service's PEM certificate chain (server and client identity); None: plaintext gRPC."""
    key: str | None = None
    """Its PEM private key."""
    ca: str | None = None
    """PEM CA bundle that signed the peers: verifies servers and makes servers require client
    certificates (mutual TLS). None: servers ask for no client certificate, channels trust the
    system's roots."""
    server_name: str | None = None
    """The name channels check a server's certificate against instead of the address dialled
    (``grpc.ssl_target_name_override``); None: the address."""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
        if self.ca and not self.cert:
            raise ValueError("--grpc-tls-ca needs --grpc-tls-cert and --grpc-tls-key (one TLS identity)")
        if self.server_name and not self.cert:
            raise ValueError("--grpc-tls-server-name needs --grpc-tls-cert and --grpc-tls-key")
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"--grpc-tls-{name} {path}: no such file")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        assert self.cert and self.key
        ca = Path(self.ca).read_bytes() if self.ca else None
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), ca

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


PLAINTEXT = GrpcTLS()


def channel(address: str, tls: GrpcTLS, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``address``: TLS when ``tls`` is enabled, else plaintext."""
    if tls.enabled:
        if tls.server_name:
            options = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=list(options))
    return grpc.aio.insecure_channel(address, options=list(options))


def add_port(server: grpc.aio.Server, address: str, tls: GrpcTLS) -> int:
    """Bind ``server`` to ``address`` (TLS when enabled); returns the port bound."""
    if tls.enabled:
        return server.add_secure_port(address, tls.server_credentials())
    return server.add_insecure_port(address)
