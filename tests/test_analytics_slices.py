"""How a read of a partitioned archive is cut into Spark tasks: each inside one partition, together the whole tail.

Plain Python (no Spark, no database): `aligned_slices` only computes times.
The Spark read of a real partitioned archive is in test_analytics_partitioned.py.
"""

from datetime import UTC, datetime, timedelta
from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st

from django_dbqueue.contrib.spark.source import aligned_slices

DAY = timedelta(days=1)
MAR = [datetime(2026, 3, d, tzinfo=UTC) for d in range(1, 8)]


def partition_of(moment: datetime, uppers: list[datetime | None]) -> int:
    """The index of the partition ``moment`` lies in (the catch-all last)."""
    ranged = sorted(u for u in uppers if u is not None)
    return next((i for i, upper in enumerate(ranged) if moment < upper), len(ranged))


def assert_aligned(slices, uppers, floor):
    # From the floor on with no gap or overlap, open at the end: every row from floor on is read once.
    assert slices[0][0] == floor and slices[-1][1] is None
    assert all(a[1] == b[0] for a, b in pairwise(slices))
    assert all(upper is None or lower < upper for lower, upper in slices)
    # Each inside one partition: its last instant lies where its first does.
    for lower, upper in slices:
        if upper is not None:
            assert partition_of(lower, uppers) == partition_of(upper - timedelta(microseconds=1), uppers)
        else:
            assert partition_of(lower, uppers) == len([u for u in uppers if u is not None])


def test_a_window_across_midnight_gets_a_task_per_core_none_across_a_partition_bound():
    uppers = [MAR[1], MAR[2], MAR[3], None]
    floor, until = MAR[0] + timedelta(hours=21), MAR[1] + timedelta(hours=3)
    slices = aligned_slices(uppers, floor, until, tasks=4)
    assert slices == [
        (floor, MAR[0] + timedelta(hours=22, minutes=30)),
        (MAR[0] + timedelta(hours=22, minutes=30), MAR[1]),
        (MAR[1], MAR[1] + timedelta(hours=1, minutes=30)),
        (MAR[1] + timedelta(hours=1, minutes=30), until),
        (until, MAR[2]),  # rows created in the window that finished after it, in the rest of that day
        (MAR[2], MAR[3]),
        (MAR[3], None),
    ]
    assert_aligned(slices, uppers, floor)


def test_partitions_enough_for_the_cores_are_read_one_task_each_and_those_below_the_floor_not_at_all():
    uppers = [*MAR[1:], None]
    floor = MAR[2] + timedelta(hours=5)
    slices = aligned_slices(uppers, floor, MAR[6], tasks=2)
    assert slices == [(floor, MAR[3]), (MAR[3], MAR[4]), (MAR[4], MAR[5]), (MAR[5], MAR[6]), (MAR[6], None)]


def test_a_window_past_the_last_range_is_cut_in_the_catch_all():
    uppers = [MAR[1], None]
    floor, until = MAR[2], MAR[2] + timedelta(hours=2)
    slices = aligned_slices(uppers, floor, until, tasks=2)
    assert slices == [(floor, floor + timedelta(hours=1)), (floor + timedelta(hours=1), until), (until, None)]


@given(
    days=st.lists(st.integers(0, 40), max_size=12, unique=True),
    catch_all=st.booleans(),
    floor_minutes=st.integers(-3000, 60_000),
    window_minutes=st.integers(1, 20_000),
    tasks=st.integers(1, 16),
)
def test_any_layout_is_read_whole_once_each_task_inside_one_partition(
    days, catch_all, floor_minutes, window_minutes, tasks
):
    uppers: list[datetime | None] = [MAR[0] + d * DAY for d in sorted(days)] + ([None] if catch_all else [])
    floor = MAR[0] + timedelta(minutes=floor_minutes)
    until = floor + timedelta(minutes=window_minutes)
    slices = aligned_slices(uppers, floor, until, tasks)
    assert_aligned(slices, uppers, floor)
    assert sum(1 for lower, _ in slices if lower < until) >= tasks
