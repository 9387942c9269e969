"""Spark's progress on the driver: its stages' tasks, polled from a thread, told to a reporter.

Spark's own console bar is off (``spark.ui.showConsoleProgress``: it writes
to stderr whatever the verbosity, between log lines); `watch_stages`
shows the same through a `Progress`, which
knows a terminal from a log and ``-v0`` from ``-v1``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ...progress import Progress

if TYPE_CHECKING:
    from pyspark import SparkContext

logger = logging.getLogger("django_dbqueue")
POLL_EVERY = 0.25  # seconds between two looks at Spark's status


class Poller:
    """Calls ``poll`` every ``every`` seconds on a daemon thread, and once more when stopped.

    A failing poll is logged with its traceback and ends the polling (the
    progress display stops; the work it watched goes on): it never dies
    without a word, and never takes the job down with it.
    """

    def __init__(
        self, poll: Callable[[], object], *, every: float | None = None, name: str = "dbqueue-progress"
    ) -> None:
        self.poll = poll
        self.every = POLL_EVERY if every is None else every  # read at call time: tests poll faster
        self.failed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Poller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self.every)
            try:
                self.poll()
            except Exception:
                self.failed = True
                logger.exception("progress: watching Spark failed; no more progress is shown (the work goes on)")
                return
            if stopping:
                return


class StageWatch:
    """One poll of Spark's status tracker: the active stages' tasks, done out of all."""

    def __init__(self, context: SparkContext, progress: Progress) -> None:
        self.context = context
        self.progress = progress
        self.shown: tuple[int, ...] = ()

    def __call__(self) -> None:
        tracker = self.context.statusTracker()
        stages = [info for info in map(tracker.getStageInfo, sorted(tracker.getActiveStageIds())) if info is not None]
        ids = tuple(info.stageId for info in stages)
        running = f"{sum(info.numActiveTasks for info in stages)} running"
        if ids != self.shown:
            self.progress.finish(keep=False)  # a stage's count is noise once it is done
            self.shown = ids
            if ids:
                label = f"Spark stage {ids[0]}" if len(ids) == 1 else f"Spark stages {', '.join(map(str, ids))}"
                # The detail is drawn with the bar: a stage shorter than a redraw still shows it.
                self.progress.start(label, total=sum(info.numTasks for info in stages), unit="tasks", detail=running)
        if ids:
            self.progress.update(sum(info.numCompletedTasks for info in stages), detail=running)

    def close(self) -> None:
        self.progress.finish(keep=False)


@contextlib.contextmanager
def watch_stages(context: SparkContext, progress: Progress, *, every: float | None = None) -> Iterator[Poller | None]:
    """Show the tasks of Spark's active stages on ``progress`` while the block runs (nothing if it is silent)."""
    if not progress.active:
        yield None
        return
    watch = StageWatch(context, progress)
    poller = Poller(watch, every=every, name="dbqueue-spark-stages").start()
    try:
        yield poller
    finally:
        poller.stop()
        watch.close()


@contextlib.contextmanager
def watch_counters(
    context: SparkContext, progress: Progress, label: str, total: int, *, every: float | None = None
) -> Iterator[tuple[Any, Any]]:
    """Two accumulators, (units done, rows): executors add to them, the driver shows them as they arrive.

    Spark merges a task's accumulator updates on the driver as soon as the
    task finishes, so polling them shows each partition the moment it is done
    (a retried task may count twice: it is a display, not a result).
    """
    done, rows = context.accumulator(0), context.accumulator(0)
    if not progress.active:
        yield done, rows
        return
    progress.start(label, total=total, unit="partitions")
    poller = Poller(lambda: progress.update(done.value, detail=f"{rows.value:,} rows"), every=every).start()
    try:
        yield done, rows
    finally:
        poller.stop()
        progress.finish()
