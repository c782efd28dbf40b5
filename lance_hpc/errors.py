"""The one exception type for mistakes a user can fix: the command line prints its message,
which says what is wrong and how to fix it, and exits non-zero without a traceback."""


class UserError(Exception):
    """A problem with the user's input or environment, with its fix in the message."""
