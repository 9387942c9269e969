"""The progress reporter: a bar on a terminal, throttled lines in a log, nothing with -v0."""

import io
import threading

import pytest

from django_dbqueue.progress import NullProgress, Progress, duration, per_second, progress_for, progress_to
from tests.support.terminal import SteppedClock, Terminal


def test_a_terminal_gets_one_line_redrawn_with_bar_percentage_rate_and_time_left():
    out, clock = Terminal(), SteppedClock()
    progress = progress_for(out, tty=True, verbosity=1, clock=clock, width=200)
    progress.start("exporting", total=1000)
    clock.advance(2)
    progress.update(250)
    assert out.getvalue().count("\n") == 0  # redrawn in place, never a new line while running
    assert out.lines()[-1] == "exporting: [#####...............] 250/1,000 rows (25%), 125 rows/s, 6s left"
    clock.advance(2)
    progress.advance(250, detail="archive")
    assert out.lines()[-1] == "exporting: [##########..........] 500/1,000 rows (50%), 125 rows/s, 4s left, archive"
    progress.finish()
    assert out.getvalue().endswith("\n")
    assert out.lines()[-2] == "exporting: 500 rows in 4.0s (125 rows/s), archive"


def test_a_shorter_redraw_erases_what_the_longer_one_left():
    out, clock = Terminal(), SteppedClock()
    progress = progress_for(out, tty=True, clock=clock, width=200)
    progress.start("x", total=None)
    clock.advance(1)
    progress.update(10, detail="a rather long detail")
    clock.advance(1)
    progress.update(20, detail="")
    assert out.lines()[-1] == "x: 20 rows, 10 rows/s"


def test_the_terminal_bar_is_throttled_by_the_clock():
    out, clock = Terminal(), SteppedClock()
    progress = progress_for(out, tty=True, clock=clock, width=200)
    progress.start("t", total=100)
    draws = out.getvalue().count("\r")
    for done in range(1, 50):
        progress.update(done)  # the clock stands still: no redraw
    assert out.getvalue().count("\r") == draws
    clock.advance(0.1)
    progress.update(50)
    assert out.getvalue().count("\r") == draws + 1
    assert "50/100" in out.lines()[-1]


def test_without_a_total_there_is_no_bar_and_no_time_left():
    out, clock = Terminal(), SteppedClock()
    progress = progress_for(out, tty=True, clock=clock, width=200)
    progress.start("pruning", unit="batches")
    clock.advance(4)
    progress.update(2)
    assert out.lines()[-1] == "pruning: 2 batches, 0.5 batches/s"


def test_finish_without_keep_leaves_the_terminal_line_blank():
    out, clock = Terminal(), SteppedClock()
    progress = progress_for(out, tty=True, clock=clock, width=200)
    progress.start("stage 3", total=8, unit="tasks")
    clock.advance(1)
    progress.update(4)
    progress.finish(keep=False)
    assert out.lines() == [""]
    assert not out.getvalue().endswith("\n")


def test_a_narrow_terminal_gets_a_cut_line_never_a_wrapped_one():
    out, clock = Terminal(), SteppedClock()
    progress = progress_for(out, tty=True, clock=clock, width=30)
    progress.start("a long label for a narrow terminal", total=10)
    assert len(out.lines()[-1]) == 29


def test_a_log_gets_a_line_every_few_seconds_and_none_for_a_short_task():
    out, clock = io.StringIO(), SteppedClock()
    progress = progress_for(out, tty=False, verbosity=2, clock=clock)
    progress.start("short", total=10)
    progress.update(10)
    progress.finish()
    assert out.getvalue() == ""  # done within the interval: nothing to say
    progress.start("long", total=1000)
    for second in range(1, 12):
        clock.advance(1)
        progress.update(second * 50)
    progress.finish()
    assert out.getvalue().splitlines() == [
        "long: 250/1,000 rows (25%), 50 rows/s, 15s left",
        "long: 500/1,000 rows (50%), 50 rows/s, 10s left",
        "long: 550 rows in 11.0s (50 rows/s)",
    ]
    assert "\r" not in out.getvalue()


@pytest.mark.parametrize(("tty", "verbosity"), [(True, 0), (False, 0), (False, 1)])
def test_quiet_at_verbosity_0_and_on_a_non_terminal_at_the_default_verbosity(tty, verbosity):
    out = Terminal() if tty else io.StringIO()
    progress = progress_for(out, tty=tty, verbosity=verbosity, clock=SteppedClock(auto=60))
    assert isinstance(progress, NullProgress)
    assert not progress.active
    progress.start("x", total=10)
    progress.update(5)
    progress.advance(5)
    progress.finish()
    assert out.getvalue() == ""


def test_progress_to_asks_the_stream_whether_it_is_a_terminal():
    assert type(progress_to(Terminal())) is Progress
    assert isinstance(progress_to(io.StringIO()), NullProgress)
    assert type(progress_to(io.StringIO(), verbosity=2)) is Progress
    assert isinstance(progress_to(Terminal(), verbosity=0), NullProgress)


@pytest.mark.parametrize("verbosity", [-1, "1", 1.5, True])
def test_a_bad_verbosity_is_refused(verbosity):
    with pytest.raises(ValueError, match="verbosity must be a non-negative integer"):
        progress_for(io.StringIO(), tty=True, verbosity=verbosity)


def test_updates_before_a_start_or_after_the_finish_are_ignored():
    out = Terminal()
    progress = progress_for(out, tty=True, clock=SteppedClock(auto=1), width=200)
    progress.update(5)
    progress.advance(1)
    progress.finish()
    assert out.getvalue() == ""


def test_starting_a_task_finishes_the_one_before_on_its_own_line():
    out, clock = Terminal(), SteppedClock()
    progress = progress_for(out, tty=True, clock=clock, width=200)
    progress.start("archive", total=2)
    clock.advance(1)
    progress.update(2)
    progress.start("live", total=3)
    assert out.lines() == ["archive: 2 rows in 1.0s (2 rows/s)", "live: [....................] 0/3 rows (0%)"]


def test_threads_updating_at_once_lose_no_count():
    out = Terminal()
    progress = progress_for(out, tty=True, clock=SteppedClock(auto=0.05), width=200)
    progress.start("threads", total=8000)
    workers = [threading.Thread(target=lambda: [progress.advance() for _ in range(2000)]) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    progress.finish()
    assert out.lines()[-2].startswith("threads: 8,000 rows in ")


@pytest.mark.parametrize(
    ("rate", "text"), [(0.25, "0.2"), (0.5, "0.5"), (3, "3"), (9.96, "10"), (12.4, "12"), (4e4, "40,000")]
)
def test_rates_keep_a_decimal_only_when_small(rate, text):
    assert per_second(rate) == text


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "0s"), (0.2, "1s"), (59, "59s"), (60, "1m00s"), (245, "4m05s"), (7380, "2h03m")]
)
def test_durations_are_short(seconds, text):
    assert duration(seconds) == text


def test_a_failing_poller_says_so_in_the_log_and_stops_polling(caplog):
    from django_dbqueue.contrib.spark.progress import Poller

    calls = []

    def poll():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the status tracker went away")

    poller = Poller(poll, every=0.01).start()
    poller._thread.join(timeout=30)  # it ends by itself, at the failure
    assert not poller._thread.is_alive()
    assert poller.failed
    assert len(calls) == 3
    record = next(r for r in caplog.records if "watching Spark failed" in r.getMessage())
    assert record.levelname == "ERROR"
    assert "the status tracker went away" in caplog.text  # with its traceback
    poller.stop()  # stopping a poller that already ended is fine


def test_a_stopped_poller_polls_once_more_and_ends():
    from django_dbqueue.contrib.spark.progress import Poller

    seen = []
    poller = Poller(lambda: seen.append(len(seen)), every=30).start()
    poller.stop()
    assert seen == [0]  # the last look, so the display ends on the final figures
    assert not poller._thread.is_alive()
    assert not poller.failed
