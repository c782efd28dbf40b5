"""What a process prints, as a person reads it in a terminal or in a log file.

- :func:`whole_lines`: every line goes out in one write. A job's ranks share their output (a local
  run's terminal or file, ``srun --label``'s stream), and Python run unbuffered (``python -u``,
  ``PYTHONUNBUFFERED``, as submitit starts its tasks) writes each piece of a ``print`` on its own,
  so two ranks' lines could interleave mid-line.
- :func:`progress_bar`: a tqdm bar on a terminal; in a file (a redirected run, a SLURM log), where
  a bar redrawn with carriage returns becomes one endless line, a plain line now and then instead.
- :func:`printable`: text read from a file or dataset anyone may have written, safe to print: a
  control character in it (an escape sequence, a newline) is shown, never obeyed by the terminal.
"""

from __future__ import annotations

import io
import sys
import time
from typing import Any, Protocol, TextIO

# How often a progress line is printed into a log file (and always at the end).
LINE_EVERY_S = 30.0


class ProgressDisplay(Protocol):
    """What a loop tells its progress display: tqdm's interface, the part lance_hpc uses."""

    def update(self, n: int = 1) -> Any: ...

    def set_postfix(self, values: dict[str, Any]) -> Any: ...

    def close(self) -> Any: ...

    def __enter__(self) -> ProgressDisplay: ...

    def __exit__(self, *exc_info: object) -> Any: ...


def whole_lines() -> None:
    """stdout and stderr line-buffered: each line is written whole, in one write, as it ends."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def printable(text: str) -> str:
    """``text`` with each character a terminal would act on instead of show (control characters,
    escape sequences, line breaks, bidirectional overrides) written as its escape: ``\\x1b``,
    ``\\n``, ``\\u202e``. A value read from a shared dataset or directory could otherwise set the
    terminal's title, clear it or forge lines of the report."""
    return "".join(char if char.isprintable() or char == " " else char.encode("unicode_escape").decode() for char in text)


def progress_bar(
    total: int, desc: str, *, done: int = 0, unit: str = "it", enabled: bool = True, stream: TextIO | None = None
) -> ProgressDisplay:
    """A tqdm bar when ``stream`` (default stdout) is a terminal, else :class:`ProgressLines`."""
    stream = stream or sys.stdout
    if stream.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=done, desc=desc, unit=unit, leave=False, disable=not enabled, file=stream)
    return ProgressLines(total, desc, done=done, unit=unit, enabled=enabled, stream=stream)


class ProgressLines:
    """Progress for a log file: ``epoch 2: 120/270 steps (44%), 3.1 steps/s, loss 0.412``, a line at
    most every ``every_s`` seconds and one at the end (once the last values are set, or when it
    closes), each written whole."""

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        done: int = 0,
        unit: str = "it",
        enabled: bool = True,
        stream: TextIO | None = None,
        every_s: float = LINE_EVERY_S,
    ) -> None:
        self.total, self.desc, self.count, self.unit, self.enabled = total, desc, done, unit, enabled
        self.stream, self.every_s = stream or sys.stdout, every_s
        self.postfix: dict[str, Any] = {}
        self._started = self._shown = time.monotonic()
        self._first, self._printed = done, done

    def update(self, n: int = 1) -> None:
        self.count += n
        if time.monotonic() - self._shown >= self.every_s:
            self._print()

    def set_postfix(self, values: dict[str, Any]) -> None:
        self.postfix = dict(values)
        if self.count >= self.total and self.count != self._printed:  # the last step's values: its line now,
            self._print()  # before the lines that follow the end (an evaluation)

    def close(self) -> None:
        if self.count != self._printed:
            self._print()

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def line(self) -> str:
        """The line as it stands now."""
        parts = [f"{self.count:,}/{self.total:,} {self.unit} ({self.count / max(self.total, 1):.0%})"]
        seconds = time.monotonic() - self._started
        if self.count > self._first and seconds > 0:
            rate = (self.count - self._first) / seconds
            parts.append(f"{rate:,.{0 if rate >= 100 else 2}f} {self.unit}/s")
        parts += [f"{name} {value}" for name, value in self.postfix.items()]
        return f"{self.desc}: {', '.join(parts)}"

    def _print(self) -> None:
        self._shown, self._printed = time.monotonic(), self.count
        if self.enabled:
            self.stream.write(self.line() + "\n")
            self.stream.flush()
