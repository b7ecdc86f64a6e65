"""TLS and mutual TLS on the gRPC ports: TorchServe's ``enable_grpc_ssl`` keys, plus
``client_ca_file`` (``--tls-client-ca``) for client certificates, which TorchServe does not
offer. See docs/security.md."""

from __future__ import annotations

from pathlib import Path

import grpc

from inference_service.config import ConfigError, Settings


def validate(settings: Settings) -> None:
    """Check the TLS settings fit together (files are read at start).

    Raises:
        ConfigError: TLS on without a certificate or key, or a certificate,
            key or client CA given while TLS is off.
    """
    if settings.enable_grpc_ssl:
        missing = [key for key, value in (("certificate_file", settings.certificate_file),
                                          ("private_key_file", settings.private_key_file)) if value is None]
        if missing:
            raise ConfigError(f"enable_grpc_ssl=true needs {' and '.join(missing)} (--tls-cert / --tls-key)")
    elif settings.client_ca_file is not None:
        raise ConfigError("client_ca_file (--tls-client-ca) needs TLS: set enable_grpc_ssl=true with "
                          "certificate_file and private_key_file (or --tls-cert and --tls-key)")


def _read(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise OSError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN" not in data:
        raise OSError(f"the TLS {what} {path} is not PEM")
    return data


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """The credentials of both gRPC ports (``None``: plaintext).

    Raises:
        OSError: a certificate, key or CA file cannot be read or is not PEM
            (the message names it).
    """
    if not settings.enable_grpc_ssl:
        return None
    assert settings.certificate_file is not None and settings.private_key_file is not None
    chain = _read(settings.certificate_file, "certificate_file")
    key = _read(settings.private_key_file, "private_key_file")
    ca = _read(settings.client_ca_file, "client_ca_file") if settings.client_ca_file is not None else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca, require_client_auth=ca is not None)


def add_port(server: grpc.aio.Server, target: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind ``target`` ("host:port") with TLS when ``credentials`` are given; returns the port (0: failed)."""
    if credentials is None:
        return server.add_insecure_port(target)
    return server.add_secure_port(target, credentials)
