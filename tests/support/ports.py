"""Free TCP ports on loopback for the servers the tests start."""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """``count`` different ports that nothing listens on now (all held open while they are chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]
