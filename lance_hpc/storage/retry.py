"""Reads that survive a misbehaving store: the transient errors of a batch read are retried with
exponential backoff and jitter for up to ``data.io_timeout_s``, counted in the batch's
:class:`~lance_hpc.loading.reader.ReadStats`; past that, :class:`StoreUnavailable` says which store,
which read and for how long it was tried.

Two layers retry. Inside Lance, object_store retries each failed request a few times within
seconds (``client_max_retries``, 3; ``client_retry_timeout``, 180 s; a 30 s request ``timeout``),
and Lance retries a failed read of a file on top (``download_retry_count``, 3): 503s, resets and
short stalls mostly end there, unseen. When Lance gives up, the whole read is retried here. On
a store that hangs, Lance's layers can hold one read for many minutes, so each attempt on an
object store runs in a helper thread and is abandoned at the deadline: the job stops on time
even then (the thread dies with the process, which is about to exit).

Errors that retrying cannot mend are never retried: a data file missing or cut short becomes a
:class:`~lance_hpc.storage.integrity.DamagedDataset` that names the file; anything else unexpected
goes up unchanged.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from typing import Any, Callable, Mapping, TypeVar

from lance_hpc.errors import worker_message
from lance_hpc.storage.options import is_remote, redact

log = logging.getLogger("lance_hpc.data")
T = TypeVar("T")

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 15.0
# The least time an attempt gets, so the one that starts at the deadline is still a real try.
LAST_ATTEMPT_S = 5.0
# A read still failing after this long is worth one warning while it keeps trying.
WARN_AFTER_S = 30.0
# Error text that a later attempt may not see: throttling, server errors, broken connections, timeouts.
TRANSIENT = re.compile(
    r"SlowDown|Service Unavailable|Too Many Requests|Internal Server Error|Bad Gateway|Gateway Time|"
    r"InternalError|RequestTimeout|status code: (?:429|5\d\d)|error sending request|connection|"
    r"broken pipe|timed out|timeout|deadline|error decoding response body|body error|dns error|"
    r"stale file handle|input/output error|temporarily unavailable",
    re.IGNORECASE,
)
# Error text of a data file that is gone or shorter than Lance expects.
DAMAGED = re.compile(
    r"not found|NoSuchKey|no such file|Invalid range .* for object of size|unexpected end of file|"
    r"out of range of file|file size",
    re.IGNORECASE,
)


class StoreUnavailable(Exception):
    """The store failed a read for longer than ``data.io_timeout_s``. Not the user's mistake, so
    the rank exits 1, but with this one message instead of a traceback."""

    def __init__(self, message: str = "") -> None:
        super().__init__(worker_message(message, type(self).__name__))


class _Overdue(Exception):
    """An attempt still running at the deadline."""


def is_transient(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, (OSError, RuntimeError, ValueError)) and bool(TRANSIENT.search(text)) and not DAMAGED.search(text)


def is_damage(error: BaseException) -> bool:
    return isinstance(error, (OSError, RuntimeError, ValueError)) and bool(DAMAGED.search(str(error)))


def short_error(error: BaseException, options: Mapping[str, str] | None = None) -> str:
    """The part of a Lance error a person needs: no wrapper prefixes, no Rust source locations."""
    if isinstance(error, _Overdue):
        return str(error)
    text = redact(str(error), options or {}).strip()
    text = re.sub(r"(LanceError\(\w+\):\s*|Generic [\w/ ]+ error:\s*)", "", text)
    text = re.split(r", /\S+\.rs:\d+", text)[0]
    text = re.sub(r"<\?xml.*?<Code>(\w+)</Code>.*", r"\1", text, flags=re.DOTALL)
    text = re.sub(r"Error performing (\w+) (\S+) in [^-]*- ", r"\1 \2: ", text)
    return " ".join(text.split()) or type(error).__name__


def backoff_s(retry: int, rng: random.Random | None = None) -> float:
    """Seconds before retry number ``retry`` (0-based): doubling from FIRST_BACKOFF_S up to
    MAX_BACKOFF_S, each drawn from [half, all] of that so ranks and workers hit by the same fault
    do not come back in step."""
    ceiling = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2**retry)
    return (rng or random).uniform(ceiling / 2, ceiling)


def within(call: Callable[[], T], timeout_s: float) -> T:
    """``call()``, or :class:`_Overdue` after ``timeout_s`` with the call left running in its
    (daemon) thread."""
    outcome: dict[str, Any] = {}
    finished = threading.Event()

    def attempt() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # handed to the waiting thread
            outcome["error"] = error
        finally:
            finished.set()

    threading.Thread(target=attempt, name="lance-hpc-store-read", daemon=True).start()
    if not finished.wait(max(timeout_s, 0.0)):
        raise _Overdue("the store did not answer")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def endpoint_of(uri: str, options: Mapping[str, str]) -> str:
    if not is_remote(uri):
        return "the local filesystem"
    return f"the object store at {options.get('endpoint') or 'its default endpoint'}"


def retrying(
    call: Callable[[], T],
    *,
    what: str,
    uri: str,
    options: Mapping[str, str],
    timeout_s: float,
    on_retry: Callable[[], None],
    explain: Callable[[BaseException], BaseException] | None = None,
    rank: int = 0,
    sleep: Callable[[float], Any] = time.sleep,
) -> T:
    """``call()`` (one read of ``uri``, described by ``what``), retried on transient errors until
    ``timeout_s`` after the first attempt; ``on_retry`` counts each retry. Any other error is
    raised at once, as ``explain`` (if given) turns it: a damaged data file, for one."""
    started = time.monotonic()
    deadline = started + timeout_s
    remote = is_remote(uri)
    attempts, warned = 0, False
    while True:
        attempts += 1
        try:
            if remote:
                return within(call, max(deadline - time.monotonic(), LAST_ATTEMPT_S))
            return call()
        except Exception as error:
            if not isinstance(error, _Overdue) and not is_transient(error):
                explained = explain(error) if explain is not None else error
                if explained is error:
                    raise
                raise explained from None
            last_error = error
        elapsed = time.monotonic() - started
        if isinstance(last_error, _Overdue) or elapsed >= timeout_s:
            raise StoreUnavailable(
                f"rank {rank}: {endpoint_of(uri, options)} failed for {elapsed:.0f} s, the limit set by "
                f"data.io_timeout_s ({timeout_s:g} s): {what} was tried {attempts} time(s); last error: "
                f"{short_error(last_error, options)}. Training stopped; the latest checkpoint is intact: run the "
                "job again once the store answers (or raise data.io_timeout_s to wait out longer outages)"
            )
        delay = min(backoff_s(attempts - 1), timeout_s - elapsed)
        if elapsed >= WARN_AFTER_S and not warned:
            warned = True
            log.warning(
                "rank %d: %s has failed for %.0f s (%s): %s; retrying for up to %g s in all",
                rank,
                endpoint_of(uri, options),
                elapsed,
                what,
                short_error(last_error, options),
                timeout_s,
            )
        else:
            log.debug("retrying %s in %.1f s: %s", what, delay, short_error(last_error, options))
        on_retry()
        sleep(delay)
