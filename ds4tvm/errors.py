"""User-facing errors: one line naming the file, tensor, key, flag or field at fault."""


class Ds4Error(Exception):
    """A mistake in the user's input. The CLI prints it on one line to stderr and exits with 2."""

    def __init__(self, message: str):
        # One line, always: a multi-line message would look like a traceback in a terminal.
        super().__init__(" ".join(str(message).split()))

    @property
    def message(self) -> str:
        return self.args[0]


class Cancelled(Exception):
    """The caller stopped a long operation (a server client went away during a prefill)."""
