"""What a running handler tells the queue, and hears from it: progress, metadata, a cancel request.

A handler calls `set_progress`,
`update_meta` and `checkpoint`
as often as it likes: none of them touches the database. The worker's
heartbeat writes what changed since its last beat (at most one statement
per message per beat) and reads which of its messages an operator asked to
cancel, setting the flag these methods answer from.

The values are replaced, never mutated in place, so the heartbeat thread
can read them while the handler's thread reports without a lock.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from .. import validation
from ..exceptions import Cancelled, InvalidOption

MAX_NOTE = 255  # characters of a progress note


def progress_value(done: Any, total: Any = None, note: Any = "") -> dict[str, Any]:
    """The stored form of a progress report, validated: ``{"done": ..., "total": ..., "note": ...}``."""
    for name, value in (("done", done), ("total", total)):
        if value is None and name == "total":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise InvalidOption(f"progress {name} must be a finite number >= 0, not {value!r}")
    if total is not None and done > total:
        raise InvalidOption(f"progress done ({done!r}) is more than its total ({total!r})")
    if not isinstance(note, str):
        raise InvalidOption(f"progress note must be a string, not {type(note).__name__}")
    return {"done": done, "total": total, "note": validation.storable_text(note, MAX_NOTE)}


class HandlerReports:
    """Mixed into `Message`: what its handler reports while it runs."""

    # The columns used (Message's), declared for the type checker.
    pk: Any
    progress: Any
    meta: Any
    cancel_requested_at: datetime | None
    # Set by the heartbeat when the database says cancel was asked (or read with the row).
    _dbqueue_cancel: bool = False
    # Reports made (only the handler's thread counts) and the count the heartbeat wrote last.
    _dbqueue_reports: int = 0
    _dbqueue_written: int = 0

    def cancel_requested(self) -> bool:
        """Whether an operator asked to cancel this message while it runs (seen at the worker's heartbeat)."""
        return self._dbqueue_cancel or self.cancel_requested_at is not None

    def heard_cancel(self) -> None:
        """The worker's heartbeat found this message flagged for cancel."""
        self._dbqueue_cancel = True

    def checkpoint(self) -> None:
        """Raise `Cancelled` if cancel was asked: call it where stopping is safe."""
        if self.cancel_requested():
            raise Cancelled(f"message {self.pk}: cancel was asked")

    def set_progress(self, done: float, total: float | None = None, note: str = "") -> None:
        """Report how far the handler is; written at the next heartbeat, kept in the archive.

        A checkpoint too: raises `Cancelled` if cancel was asked.
        """
        self.progress = progress_value(done, total, note)
        self._dbqueue_reports += 1
        self.checkpoint()

    def update_meta(self, values: dict[str, Any] | None = None, /, **more: Any) -> None:
        """Merge ``values`` into ``message.meta`` (JSON); written at the next heartbeat, kept in the archive."""
        merged = {**(self.meta or {}), **(values or {}), **more}
        if (why := validation.json_problem(merged, "meta") or validation.json_size_problem(merged, "meta")) is not None:
            raise InvalidOption(why)
        self.meta = merged  # a new dict: the heartbeat may be reading the old one
        self._dbqueue_reports += 1

    def unreported(self) -> tuple[int, dict[str, Any]] | None:
        """What the handler reported since the heartbeat last wrote: ``(count, {column: value})``, else None."""
        reports = self._dbqueue_reports
        if reports == self._dbqueue_written:
            return None
        return reports, {"progress": self.progress, "meta": self.meta}

    def reported(self, reports: int) -> None:
        """The heartbeat wrote the values of report number ``reports``."""
        self._dbqueue_written = reports
