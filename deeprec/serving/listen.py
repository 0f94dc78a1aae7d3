"""The one way `deeprec serve` binds a port (HTTP, gRPC's check, the --workers supervisor's hold)."""
from __future__ import annotations

import socket

from deeprec.errors import ConfigError


def bound(host: str, port: int, option: str = "--port", *, reuse_port: bool = False) -> socket.socket:
    """A socket bound to host:port (0: a free port), not listening, with SO_REUSEADDR, and SO_REUSEPORT if
    `reuse_port` (processes that share the port). A ConfigError naming `option` if it cannot be bound (in
    use, or an address this host does not have)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"--host {host} {option} {port}: cannot listen there ({err.strerror}); give another "
                          f"{option} (0: any free one)") from None
    return sock
