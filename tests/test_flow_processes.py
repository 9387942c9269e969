"""Flow control under real OS processes racing on a real database (docs/flow-control.md).

Workers are ``runqueueworker`` processes; producers are children of
tests/support/child.py that start at one wall-clock instant. The handlers
(tests/testapp/queues.py) return when they ran, so each test checks what
happened from the archive, not from timings it hopes for.
"""

import os
import signal
import threading
import time
from collections import Counter, defaultdict
from datetime import timedelta

import pytest
from django.db import connections
from django.db.models import Count

import django_dbqueue
from django_dbqueue.models import ArchivedMessage, Message, Outcome
from tests.support.processes import read_marks, results, start, start_worker, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

WORKERS = 8


def finish(workers, timeout=300):
    """Wait for ``--until-empty`` workers; fail with the stderr of one that did not exit cleanly."""
    for worker in workers:
        _, stderr = worker.communicate(timeout=timeout)
        assert worker.returncode == 0, stderr[-4000:]


def most_at_once(intervals):
    """The largest number of (start, end) intervals that overlap at one instant."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, step in events:  # at a tie an end (-1) sorts first: touching is not overlapping
        running += step
        peak = max(peak, running)
    return peak


def acked_once(queue, total):
    rows = list(ArchivedMessage.objects.filter(queue=queue).values_list("message_id", "outcome"))
    counts = Counter(pk for pk, _ in rows)
    assert len(counts) == total and max(counts.values()) == 1, "every message archived exactly once"
    assert {outcome for _, outcome in rows} == {Outcome.ACKED}
    assert not Message.objects.filter(queue=queue).exists()


def test_8_workers_on_200_groups_with_a_limit_of_2_never_run_3_of_a_group_at_once():
    groups, per_group = 200, 4
    # Each group's messages one after another in the claim order: every claim meets a group at its limit.
    for g in range(groups):
        django_dbqueue.enqueue_many("fc-groups", [{"sleep": 0.02}] * per_group, group=f"customer-{g}")
    seen: Counter = Counter()
    stop = threading.Event()

    def sample():
        """What the database says is in flight per group, read over and over while the workers run."""
        try:
            while not stop.is_set():
                for group, n in (
                    Message.objects.filter(queue="fc-groups").in_flight().values_list("group").annotate(n=Count("id"))
                ):
                    seen[group] = max(seen[group], n)
                time.sleep(0.005)
        finally:
            connections.close_all()

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        workers = [start_worker("fc-groups", "--until-empty", "--batch-size", "4") for _ in range(WORKERS)]
        finish(workers)
    finally:
        stop.set()
        sampler.join(30)
    assert seen and max(seen.values()) <= 2
    acked_once("fc-groups", groups * per_group)
    by_group = defaultdict(list)
    for group, result in ArchivedMessage.objects.filter(queue="fc-groups").values_list("group", "result"):
        by_group[group].append((result["start"], result["end"]))
    assert len(by_group) == groups
    assert max(most_at_once(runs) for runs in by_group.values()) <= 2
    assert len({result["pid"] for result in ArchivedMessage.objects.values_list("result", flat=True)}) > 1


def test_a_rate_of_50_per_second_holds_in_every_second_under_8_workers_and_reaches_most_of_it():
    total, rate = 500, 50
    django_dbqueue.enqueue_many("fc-rate", [{"n": n} for n in range(total)])
    workers = [start_worker("fc-rate", "--until-empty", "--batch-size", "10") for _ in range(WORKERS)]
    finish(workers)
    acked_once("fc-rate", total)
    claims = sorted(ArchivedMessage.objects.filter(queue="fc-rate").values_list("claimed_at", flat=True))
    # In whole microseconds, as the database stores them: a slot is free again exactly one second after
    # its claim, and seconds as floats could count that next claim inside the window it starts.
    us = [(c - claims[0]) // timedelta(microseconds=1) for c in claims]
    # Every window of one second that starts at a claim (the windows that can hold the most) holds at most 50.
    fullest = max(sum(1 for t in us[i:] if t < start + 1_000_000) for i, start in enumerate(us))
    assert fullest <= rate
    # The first 50 go at once; the other 450 at well over half the rate. A limiter that counted a use
    # twice, or kept a freed slot, would halve it; how near it comes to 100% depends on how busy the
    # machine is (8 workers on 2 shared cores reached 87% and 89% at a load average of 12 to 15),
    # which docs/benchmarks.md measures and this test does not.
    achieved = (total - rate) / (us[-1] / 1e6)
    assert achieved >= 0.6 * rate, f"{achieved:.1f} claims per second"


def test_8_producers_racing_on_a_unique_window_make_one_message_even_after_it_finished():
    start_at = time.time() + 3
    outcomes = results([start("unique-window", "emails", "window", 600, start_at) for _ in range(8)])
    assert sum(o["created"] for o in outcomes) == 1
    (first,) = Message.objects.claim("emails")
    assert first.ack()
    start_at = time.time() + 3
    again = results([start("unique-window", "emails", "window", 600, start_at) for _ in range(8)])
    assert sum(o["created"] for o in again) == 0  # the window outlives the message
    assert ArchivedMessage.objects.filter(queue="emails", key="window").count() == 1
    assert not Message.objects.filter(queue="emails").exists()


def test_8_producers_debouncing_one_key_leave_one_message_with_the_last_payload():
    start_at = time.time() + 3
    writes = 20
    outcomes = results([start("debounce", "emails", "debounced", writes, start_at) for _ in range(8)])
    assert sum(o["created"] for o in outcomes) == 1
    assert len({o["id"] for o in outcomes}) == 1
    (message,) = Message.objects.filter(queue="emails", key="debounced")
    # Each producer's writes are in order, so the last write of all is some producer's last.
    assert message.payload["seq"] == writes - 1
    assert message.lease_token is None and message.attempts == 0


def test_fifo_groups_keep_their_order_through_retries_racing_producers_and_a_killed_worker(tmp_path):
    marks = tmp_path / "marks"
    # Group "killed": its first message hangs on its first attempt, and the worker running it is killed.
    django_dbqueue.enqueue("fc-fifo", {"hang": True}, group="killed")
    for n in range(3):
        django_dbqueue.enqueue("fc-fifo", {"n": n}, group="killed")
    start_at = time.time() + 3
    producers = [start("grouped", "fc-fifo", 6, 4, start_at) for _ in range(8)]
    results(producers)
    total = 4 + 8 * 6 * 4
    # Not --until-empty: a group behind a head that backs off, or that a killed worker holds, leaves the
    # queue empty for it (docs/flow-control.md). The workers run until the table is empty, then are stopped.
    args = ("fc-fifo", "--batch-size", "3", "--max-poll-interval", "0.2", "--visibility-timeout", "3")
    workers = [start_worker(*args, "--max-runtime", "280", marks=marks) for _ in range(4)]
    hung = wait_for(lambda: [pid for event, _, pid in read_marks(marks) if event == "hang"], timeout=120, what="hang")
    os.kill(hung[0], signal.SIGKILL)
    killed = next(w for w in workers if w.pid == hung[0])
    killed.wait(30)
    wait_for(lambda: not Message.objects.filter(queue="fc-fifo").exists(), timeout=240, interval=0.2, what="a drain")
    for worker in workers:
        if worker is not killed:
            worker.send_signal(signal.SIGTERM)
    finish([w for w in workers if w is not killed])
    acked_once("fc-fifo", total)
    rows = ArchivedMessage.objects.filter(queue="fc-fifo").order_by("message_id")
    by_group = defaultdict(list)
    for row in rows:
        by_group[row.group].append(row)
    assert len(by_group) == 7
    assert by_group["killed"][0].attempts == 2 and by_group["killed"][0].payload == {"hang": True}
    assert any(row.attempts == 2 for row in rows if row.payload.get("fail"))  # retried, and held its group
    # The handlers' marks, one file appended to by every worker, are the order things happened in. The
    # archive's times cannot give it: claimed_at is when the claim's statement began, and that statement
    # may meet the group's head gone a moment later, when the head's acknowledgement has committed.
    group_of = {row.message_id: row.group for row in rows}
    elders = {
        row.message_id: [r.message_id for r in by_group[row.group] if r.message_id < row.message_id] for row in rows
    }
    started, ended = defaultdict(list), set()
    for event, pk, _ in read_marks(marks):
        if event == "start":
            # Every attempt (failed, killed or not) began only after every earlier message of its group
            # had run to its end, and within a group the ids never go back.
            assert all(elder in ended for elder in elders[pk]), (group_of[pk], pk, set(elders[pk]) - ended)
            started[group_of[pk]].append(pk)
        elif event == "end":
            ended.add(pk)
    assert ended == set(group_of)
    assert sum(len(ids) for ids in started.values()) > total  # the retries and the killed attempt are in
    for group, ids in started.items():
        assert ids == sorted(ids), group
