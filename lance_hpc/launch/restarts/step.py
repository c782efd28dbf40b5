"""One srun of the job: an attempt, or a standby step (the next attempt started ahead)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from lance_hpc.launch.restarts.causes import StepReport

STANDBY_CANCEL_S = 10.0  # how long a standby step gets to end on SIGTERM before srun is killed


class Step:
    """One srun: its stderr passed on line by line and read for failures (:class:`StepReport`).

    A standby step (``go`` set) is the next attempt started ahead: its ranks import everything,
    then wait for ``go`` (:func:`lance_hpc.kinds.standby.wait_if_standby`), which says either
    what they need to know of the failure before them, or that they are not needed."""

    def __init__(self, command: list[str], environ: dict[str, str], nodes: list[str], go: Path | None = None) -> None:
        self.nodes, self.go = nodes, go
        self.announced = False
        self.report = StepReport()
        self.process = subprocess.Popen(command, env=environ, stderr=subprocess.PIPE)
        self.reader = threading.Thread(target=self._forward, name="srun-stderr", daemon=True)
        self.reader.start()

    def _forward(self) -> None:
        assert self.process.stderr is not None
        for raw in iter(self.process.stderr.readline, b""):
            sys.stderr.buffer.write(raw)
            sys.stderr.flush()
            self.report.read(raw.decode(errors="replace").rstrip("\n"))

    def running(self) -> bool:
        return self.process.poll() is None

    def wait(self) -> int:
        code = self.process.wait()
        self.reader.join(timeout=10)
        return code if code >= 0 else 128 - code

    def ready(self, ranks: int) -> bool:
        """Whether every rank of this standby step is waiting (each marks it beside the go file)."""
        return self.go is not None and len(list(self.go.parent.glob(f"{self.go.name}.ready-*"))) >= ranks

    def release(self, environ: dict[str, str]) -> None:
        """Start the waiting ranks as the next attempt, with ``environ`` added to theirs."""
        self._say_go({"environ": environ})

    def cancel(self) -> None:
        """End a standby step that is not needed: waiting ranks read so and exit; ranks still
        starting get SIGTERM through srun (a waiting rank exits quietly on it too)."""
        self._say_go({"cancel": True})
        for end, wait_s in ((None, 1.0), (self.process.terminate, STANDBY_CANCEL_S), (self.process.kill, None)):
            if end is not None:
                end()
            try:
                self.process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.reader.join(timeout=10)

    def _say_go(self, message: dict[str, Any]) -> None:
        assert self.go is not None
        temporary = self.go.with_name(self.go.name + ".tmp")
        temporary.write_text(json.dumps(message))
        os.replace(temporary, self.go)  # the ranks read it whole or not at all
