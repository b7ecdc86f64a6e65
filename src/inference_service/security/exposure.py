"""Warnings for APIs bound beyond loopback without token authorization or TLS. See
docs/security.md.
"""

from __future__ import annotations

import ipaddress
import logging

log = logging.getLogger(__name__)


def is_loopback(address: str) -> bool:
    """Whether a bind address only accepts local connections (``localhost``, 127.0.0.0/8, ``::1``)."""
    host = address.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_exposed_binds(binds: dict[str, str], token_auth: bool, tls: bool,
                       tls_hint: str = "set enable_grpc_ssl") -> list[str]:
    """Log a loud WARNING for each API bound beyond loopback without token authorization, and
    a warning for one bound there without TLS (the gRPC ports and both HTTP APIs use it).

    Args:
        binds: API name (``inference``, ``HTTP management``...) -> bind address.
        token_auth: whether token authorization is on.
        tls: whether these ports use TLS.
        tls_hint: how to turn TLS on, for the warning.

    Returns:
        The warnings logged (for tests).
    """
    warnings = []
    for name, address in binds.items():
        if is_loopback(address):
            continue
        if not token_auth:
            warnings.append(
                f"SECURITY WARNING: the {name} API listens on {address} (not loopback) with token "
                f"authorization DISABLED: anyone who can reach this port can call it"
                + (" and register models (arbitrary code)" if "management" in name else ""))
        elif not tls:
            warnings.append(
                f"the {name} API listens on {address} without TLS: keys and data cross the network "
                f"in clear text ({tls_hint})")
    for message in warnings:
        log.warning("%s", message)
    return warnings
