"""A port held for a restarted attempt's rank 0, as the batch step holds one for the first.

The batch script's holder (:func:`lance_hpc.runtime.ports.master_port_lines`) hands its listening
socket to the first attempt's rank 0 and is gone; a later attempt would find MASTER_PORT unheld, and
on a shared node anything may have taken it since. So before each restart whose rank 0 runs on this
node, the supervisor runs the same program (:data:`~lance_hpc.runtime.ports.HOLD_PORT_PROGRAM`) and
gives the step the port it holds and the name rank 0 takes it over by. The holder ends once rank 0
has the socket, when the attempt ends (the supervisor stops it), or when the supervisor dies.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys

from lance_hpc.runtime.ports import HANDOFF_VARIABLE, HOLD_PORT_PROGRAM

HOLD_WAIT_S = 60.0  # how long the holder may take to name its port, as the batch script waits for it


class PortHolder:
    """One holder process, listening on the port it picked for ``job_id`` (the job's own port unless
    something holds it, else one drawn at random) until rank 0 takes the socket over."""

    def __init__(self, job_id: str) -> None:
        command = [sys.executable, "-I", "-c", HOLD_PORT_PROGRAM, job_id, str(os.getpid())]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        self.port, self.name = "", ""
        assert self.process.stdout is not None
        readable, _, _ = select.select([self.process.stdout], [], [], HOLD_WAIT_S)
        if readable:
            self.port, _, self.name = self.process.stdout.readline().strip().partition(" ")
        self.process.stdout.close()  # the holder says nothing more
        if not self.port:  # every port it tried is held, or it did not answer
            self.stop()

    def variables(self) -> dict[str, str]:
        """MASTER_PORT and the handoff's name for the ranks; empty when no port is held."""
        return {"MASTER_PORT": self.port, HANDOFF_VARIABLE: self.name} if self.port else {}

    def stop(self) -> None:
        """End the holder if rank 0 has not taken the socket (the port is free again)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
