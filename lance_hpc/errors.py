"""The one exception type for mistakes a user can fix: the command line prints its message,
which says what is wrong and how to fix it, and exits non-zero without a traceback."""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input or environment, with its fix in the message."""

    def __init__(self, message: str = "", *rest: object) -> None:
        super().__init__(worker_message(message, type(self).__name__) if isinstance(message, str) else message, *rest)


def worker_message(message: str, name: str) -> str:
    """The original message of an exception that a DataLoader worker raised.

    torch re-raises a worker's exception in the main process as the same type, built from one
    string: "Caught NAME in DataLoader worker process N." and the worker's whole traceback, which
    ends with "module.NAME: message". The message is what the user needs; the rest is noise."""
    if not message.startswith(f"Caught {name} ") or "Original Traceback" not in message:
        return message
    marker = f"{name}: "
    position = message.rfind(marker)
    return message[position + len(marker):].strip() if position >= 0 else message
