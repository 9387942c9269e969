"""Progress of long-running work: a bar on a terminal, periodic lines in a log, nothing when asked for quiet.

`progress_for` picks the reporter from where the output goes and the
command's verbosity:

- ``-v0``: nothing, ever;
- a terminal: one line redrawn in place (``\\r``), at most every
  ``REDRAW`` seconds, with a bar when the total is known;
- not a terminal: nothing at the default verbosity (a cron mail or a log
  should not fill with progress), a line every ``LINE_EVERY`` seconds with
  ``-v2`` or more, for logs that want to show a long run is alive.

Counts, the rate since the start and, when the total is known, the
percentage and the time left are shown. A reporter is safe to update from
several threads (Spark's stages are polled on one of their own).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

REDRAW = 0.1  # seconds between two redraws of a terminal's bar
LINE_EVERY = 5.0  # seconds between two progress lines when the output is not a terminal
BAR_WIDTH = 20


class Output(Protocol):
    """Where progress goes: anything with ``write`` and ``flush`` (a file, ``sys.stderr``, ...)."""

    def write(self, text: str, /) -> object: ...

    def flush(self) -> object: ...


def per_second(rate: float) -> str:
    """``40,000``, ``12``, ``0.5``: a slow rate keeps a decimal rather than reading 0."""
    return f"{rate:,.0f}" if rate >= 10 else f"{rate:.1f}".removesuffix(".0")


def duration(seconds: float) -> str:
    """``9s``, ``4m05s``, ``2h03m``: short enough for a progress line."""
    seconds = max(0, math.ceil(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


@dataclass
class _Task:
    label: str
    total: int | None
    unit: str
    started: float
    done: int = 0
    detail: str = ""


class Progress:
    """Reports the progress of one task at a time to ``output``.

    ``tty``: redraw one line in place (a terminal), or write whole lines at
    most every ``every`` seconds (a log). ``clock`` is injectable so tests
    can step time. Use `progress_for` rather than building one.
    """

    active = True  # False for the null reporter: callers skip work done only to report (counting a total)

    def __init__(
        self,
        output: Output,
        *,
        tty: bool,
        every: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        width: int = 100,
    ) -> None:
        self.output = output
        self.tty = tty
        self.every = (REDRAW if tty else LINE_EVERY) if every is None else every
        self.clock = clock
        self.width = width
        self._task: _Task | None = None
        self._shown_at: float | None = None
        self._drawn = 0  # characters of the bar on the terminal now
        self._lock = threading.Lock()

    # --- what callers say -----------------------------------------------------

    def start(self, label: str, total: int | None = None, unit: str = "rows", *, detail: str = "") -> None:
        """Begin a task (finishing the one before, if any); ``total`` when it is known, ``detail`` from the start."""
        with self._lock:
            if self._task is not None:
                self._finish(keep=True)
            self._task = _Task(label, total, unit, self.clock(), detail=detail)
            self._shown_at = None
            if self.tty:
                self._show(self._task, self._task.started)

    def update(self, done: int, *, total: int | None = None, detail: str | None = None) -> None:
        """The task has done ``done`` units so far (a total or a detail may change too)."""
        with self._lock:
            task = self._task
            if task is None:
                return
            task.done = done
            if total is not None:
                task.total = total
            if detail is not None:
                task.detail = detail
            self._maybe_show(task)

    def advance(self, count: int = 1, *, detail: str | None = None) -> None:
        """``count`` more units are done."""
        with self._lock:
            task = self._task
            if task is None:
                return
            task.done += count
            if detail is not None:
                task.detail = detail
            self._maybe_show(task)

    def finish(self, *, keep: bool = True) -> None:
        """End the task: its last figures stay on a line of their own, or with ``keep=False`` they go.

        ``keep=False`` is for a caller that prints its own summary next (or
        for steps, like Spark's stages, whose count would only be noise).
        """
        with self._lock:
            if self._task is not None:
                self._finish(keep=keep)

    # --- what is shown -----------------------------------------------------------

    def _text(self, task: _Task, now: float) -> str:
        """One line: label, counts, percentage and bar (on a terminal), rate, time left, detail."""
        elapsed = now - task.started
        rate = task.done / elapsed if elapsed > 0 else 0.0
        parts = []
        if task.total:
            fraction = min(1.0, task.done / task.total)
            filled = round(fraction * BAR_WIDTH)
            bar = f" [{'#' * filled}{'.' * (BAR_WIDTH - filled)}]" if self.tty else ""
            parts.append(f"{task.label}:{bar} {task.done:,}/{task.total:,} {task.unit} ({fraction:.0%})")
        else:
            parts.append(f"{task.label}: {task.done:,} {task.unit}")
        if task.done and elapsed > 0:
            parts.append(f"{per_second(rate)} {task.unit}/s")
            if task.total and task.done < task.total:
                parts.append(f"{duration((task.total - task.done) / rate)} left")
        if task.detail:
            parts.append(task.detail)
        return ", ".join(parts)

    def _summary(self, task: _Task, now: float) -> str:
        elapsed = now - task.started
        rate = f" ({per_second(task.done / elapsed)} {task.unit}/s)" if elapsed > 0 and task.done else ""
        detail = f", {task.detail}" if task.detail else ""
        return f"{task.label}: {task.done:,} {task.unit} in {elapsed:.1f}s{rate}{detail}"

    def _maybe_show(self, task: _Task) -> None:
        # A terminal's bar was drawn at the start; a log's first line comes `every`
        # seconds in, so a short task prints none.
        now = self.clock()
        if now - (task.started if self._shown_at is None else self._shown_at) >= self.every:
            self._show(task, now)

    def _show(self, task: _Task, now: float) -> None:
        self._shown_at = now
        if self.tty:
            line = self._text(task, now)[: self.width - 1]
            self._write("\r" + line + " " * max(0, self._drawn - len(line)))
            self._drawn = len(line)
        else:
            self._write(self._text(task, now) + "\n")

    def _finish(self, *, keep: bool) -> None:
        task, self._task = self._task, None
        assert task is not None
        now = self.clock()
        if self.tty:
            if keep:
                line = self._summary(task, now)[: self.width - 1]
                self._write("\r" + line + " " * max(0, self._drawn - len(line)) + "\n")
            elif self._drawn:
                self._write("\r" + " " * self._drawn + "\r")
            self._drawn = 0
        elif keep and self._shown_at is not None:  # a log that showed the task running also shows its end
            self._write(self._summary(task, now) + "\n")

    def _write(self, text: str) -> None:
        self.output.write(text)
        self.output.flush()


class NullProgress(Progress):
    """Reports nothing: ``-v0``, output that is not a terminal, or a caller that did not ask."""

    active = False

    def __init__(self) -> None:
        super().__init__(_Nowhere(), tty=False)

    def start(self, label: str, total: int | None = None, unit: str = "rows", *, detail: str = "") -> None:
        pass

    def update(self, done: int, *, total: int | None = None, detail: str | None = None) -> None:
        pass

    def advance(self, count: int = 1, *, detail: str | None = None) -> None:
        pass

    def finish(self, *, keep: bool = True) -> None:
        pass


class _Nowhere:
    def write(self, text: str, /) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def progress_for(
    output: Output,
    *,
    tty: bool,
    verbosity: int = 1,
    clock: Callable[[], float] = time.monotonic,
    width: int | None = None,
) -> Progress:
    """The reporter for ``output``: a bar on a terminal, lines with ``-v2`` elsewhere, nothing with ``-v0``."""
    if isinstance(verbosity, bool) or not isinstance(verbosity, int) or verbosity < 0:
        raise ValueError(f"verbosity must be a non-negative integer, not {verbosity!r}")
    if verbosity == 0 or (not tty and verbosity < 2):
        return NullProgress()
    if width is None:
        import shutil

        width = shutil.get_terminal_size().columns if tty else 200
    return Progress(output, tty=tty, clock=clock, width=width)


def progress_to(stream: Output, verbosity: int = 1) -> Progress:
    """The reporter for a stream such as ``sys.stderr``, asking it whether it is a terminal."""
    isatty = getattr(stream, "isatty", None)
    return progress_for(stream, tty=bool(isatty and isatty()), verbosity=verbosity)
