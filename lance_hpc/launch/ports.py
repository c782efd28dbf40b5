"""A free TCP port on loopback, for the MASTER_PORT of ranks started on this machine (the local
launcher, the loader benchmark's DDP runs). Kept apart from both so that neither pulls the other's
imports (the launcher's are torch and the data layer)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
