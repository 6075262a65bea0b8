"""One error type the CLI turns into a single clear line (and a non-zero exit) instead of a traceback."""

from __future__ import annotations


class GymvError(Exception):
    """A user-facing error: what went wrong, where, and how to fix it.

    `where` is a location such as ``recipes/a.yaml:12`` or ``data.jsonl line 7``; `fix` says what to do.
    `exit_code` follows the CLI convention: 2 for usage, input or I/O errors, 1 for failed work.
    """

    def __init__(self, message: str, *, where: str | None = None, fix: str | None = None, exit_code: int = 2):
        self.message = message
        self.where = where
        self.fix = fix
        self.exit_code = exit_code
        super().__init__(self.one_line())

    def one_line(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.fix:
            text += f" (fix: {self.fix})"
        return text


class WriteError(GymvError):
    """A file could not be written (a full disk, a read-only folder, no permission): the work that was to be
    saved is intact, the disk is not, so a caller may retry or stop saying how to continue."""
