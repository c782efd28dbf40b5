"""The one way every command ends on a mistake a user can fix: one message, exit code 2, no traceback."""

from __future__ import annotations

import os
import sys
from typing import Callable

from lance_hpc.errors import ExitCode, UserError


def run_reporting_errors(command: Callable[[], int], prefix: str = "error") -> int:
    """Run ``command`` and return its exit code.

    A :class:`UserError` becomes ``PREFIX: message`` on stderr and exit code 2 (its message says
    what is wrong and how to fix it), Ctrl-C a quiet exit 130, and a closed pipe on stdout
    (``lance-hpc logs ... | head``) a quiet end."""
    try:
        return command()
    except UserError as error:
        print(f"{prefix}: {error}", file=sys.stderr, flush=True)
        return ExitCode.USER_ERROR
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:  # the reader went away: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
