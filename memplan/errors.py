"""The one error type for user mistakes.

The CLI turns a :class:`MemplanError` into a single stderr line, ``FILE: FIELD: reason``, and
exit code 2 (``MEMPLAN_DEBUG=1`` shows the traceback instead).
"""

from __future__ import annotations


class MemplanError(Exception):
    """A user mistake: bad input file, bad field, impossible plan.

    ``source`` names where the input came from (a file path, ``--tp``, a profile name) and
    ``field`` the field path inside it (``plan.tp``, ``moe.top_k``).
    """

    def __init__(self, reason: str, *, source: str | None = None, field: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.source = source
        self.field = field

    def __str__(self) -> str:
        parts = [p for p in (self.source, self.field) if p]
        return ": ".join([*parts, self.reason])

    def located(self, source: str) -> MemplanError:
        """The same error with ``source`` filled in when it was not known where it was raised."""
        return self if self.source else MemplanError(self.reason, source=source, field=self.field)
