"""Handlers the worker tests run, discovered like any app's ``queues.py``.

Handlers that other processes run write a line per event to the file named
by ``DBQUEUE_TEST_MARKS`` (``event id pid``), so a test sees what happened
inside a worker it started.
"""

import os
import signal
import sys
import time
from datetime import datetime

import django_dbqueue

# An import error in a handler module, in a pool's children only (tests/test_pool.py): the
# supervisor starts, its children cannot, as after a deploy that broke the code.
if os.environ.get("DBQUEUE_TEST_BROKEN_CHILD") and "--pool-child-of" in sys.argv:
    import tests.testapp.no_such_module  # noqa: F401

# A pool's children that take DBQUEUE_TEST_SLOW_CHILD_START seconds more to start (tests/test_pool.py): a pool
# whose capacity dropped while a child starts would show a gap at least that long between two finished messages.
if os.environ.get("DBQUEUE_TEST_SLOW_CHILD_START") and "--pool-child-of" in sys.argv:
    time.sleep(float(os.environ["DBQUEUE_TEST_SLOW_CHILD_START"]))


def mark(event: str, message) -> None:
    path = os.environ.get("DBQUEUE_TEST_MARKS")
    if path:
        with open(path, "a") as marks:
            marks.write(f"{event} {message.pk} {os.getpid()}\n")


@django_dbqueue.handler("w-ok")
@django_dbqueue.handler("elsewhere")  # queues on other aliases (tests/settings.py)
@django_dbqueue.handler("cut-off")
def ok(message):
    mark("done", message)
    return message.payload


@django_dbqueue.handler("w-outcomes")
def outcomes(message):
    action = message.payload["action"]
    if action == "raise":
        raise ValueError(f"asked to fail: {message.payload}")
    if action == "reject":
        raise django_dbqueue.Reject("not for us")
    if action == "retry":
        raise django_dbqueue.Retry(delay=60, reason="try later")
    if action == "defer":
        raise django_dbqueue.Defer(delay=3600)
    if action == "bad-defer":
        raise django_dbqueue.Defer(until=datetime(2030, 1, 1))  # naive: refused when recorded
    return "fine"


@django_dbqueue.handler("w-slow")
def slow(message):
    """Sleeps ``sleep`` seconds on the first attempt only (a rerun is quick)."""
    mark("start", message)
    if message.attempts == 1:
        time.sleep(message.payload.get("sleep", 0))
    mark("done", message)


@django_dbqueue.handler("w-poison")
def poison(message):
    """Kills the process running it, every time: a poison message."""
    mark("start", message)
    os.kill(os.getpid(), signal.SIGKILL)


@django_dbqueue.handler("rr-echo")
def echo(message):
    """Answers a request() from another process; refuses ``{"action": "reject"}``."""
    if message.payload.get("action") == "reject":
        raise django_dbqueue.Reject("cannot answer that")
    django_dbqueue.reply(message, {"echo": message.payload, "pid": os.getpid()})
    return "answered"


@django_dbqueue.handler("w-sleep")
def sleep(message):
    """Sleeps ``sleep`` seconds on every attempt (a job of fixed length)."""
    mark("start", message)
    time.sleep(message.payload.get("sleep", 0))
    mark("done", message)


LEAKED: list[bytes] = []


@django_dbqueue.handler("w-leak")
def leak(message):
    """Keeps ``mb`` megabytes for good (a leak), written so that they are resident; then sleeps ``sleep``."""
    mark("start", message)
    LEAKED.append(b"\x01" * (message.payload.get("mb", 0) << 20))
    time.sleep(message.payload.get("sleep", 0))
    mark("done", message)


def starts(message) -> int:
    """How often a handler of this process or another started ``message`` (from the marks file)."""
    path = os.environ.get("DBQUEUE_TEST_MARKS")
    if not path or not os.path.exists(path):
        return 0
    with open(path) as marks:
        return sum(1 for line in marks if line.split()[:2] == ["start", str(message.pk)])


@django_dbqueue.handler("f-poison")
def poison_values(message):
    """Faults of tests/test_faults.py: unstorable values, and handlers that give up their own message."""
    mark("start", message)
    action = message.payload.get("action", "ok")
    if action == "result-nul":
        return {"text": "before\x00after"}
    if action == "result-huge":
        return "x" * 1_100_000
    if action == "error-nul":
        raise ValueError("cannot parse byte \x00 here")
    if action == "retry-forever":
        raise django_dbqueue.Retry(delay=1e12)
    if action == "defer-forever":
        raise django_dbqueue.Defer(delay=1e12)
    if action == "release-self" and starts(message) == 1:
        message.release()  # the first run gives it back; the next one acks
    if action == "fail-self":
        message.fail("failed by its own handler")
    if action == "ack-self":
        message.ack()
    mark("done", message)
    return action


@django_dbqueue.handler("w-defer-always")
def defer_always(message):
    """Puts its message off every time: the queue's MAX_DEFERRALS ends it."""
    raise django_dbqueue.Defer(delay=0)


@django_dbqueue.handler("w-cancel")
def cancellable(message):
    """Works ``steps`` steps of 0.1 s, reporting progress at each (a checkpoint); ``"report": false`` never does."""
    mark("start", message)
    steps = message.payload.get("steps", 600)
    for step in range(steps):
        if message.payload.get("report", True):
            message.set_progress(step, steps, note=f"step {step}")
            message.update_meta(step=step)
        time.sleep(0.1)
    mark("done", message)
    return "finished"


@django_dbqueue.handler("fc-groups")
@django_dbqueue.handler("fc-rate")
@django_dbqueue.handler("fc-rate-group")
@django_dbqueue.handler("fc-combined")
def timed(message):
    """Returns when it ran (wall clock, one machine): tests/test_flow_processes.py checks overlaps per group."""
    started = time.time()
    time.sleep(message.payload.get("sleep", 0))
    return {"start": started, "end": time.time(), "pid": os.getpid()}


@django_dbqueue.handler("fc-fifo")
def in_order(message):
    """Fails the first attempt of ``{"fail": true}``; hangs on the first of ``{"hang": true}`` (to be killed)."""
    started = time.time()
    mark("start", message)
    if message.payload.get("hang") and message.attempts == 1:
        mark("hang", message)
        time.sleep(600)
    if message.payload.get("fail") and message.attempts == 1:
        raise ValueError("first attempts of this one fail")
    time.sleep(0.01)
    mark("end", message)  # before its acknowledgement: the next of its group cannot start before this line
    return {"start": started, "end": time.time()}


# --- async def handlers (tests/test_async_handlers.py): they run on the worker's event loop ---------

IN_FLIGHT = [0]  # how many async handlers of this process are between their start and their end


@django_dbqueue.handler("a-sleep")
async def async_sleep(message):
    """Awaits ``sleep`` seconds (on the first attempt only, with ``first_only``); returns how many ran at its start."""
    import asyncio

    IN_FLIGHT[0] += 1
    try:
        mark("start", message)
        running = IN_FLIGHT[0]
        if message.attempts == 1 or not message.payload.get("first_only"):
            await asyncio.sleep(message.payload.get("sleep", 0))
        mark("done", message)
        return {"in_flight": running, "pid": os.getpid()}
    finally:
        IN_FLIGHT[0] -= 1


@django_dbqueue.handler("a-outcomes")
async def async_outcomes(message):
    """Raises, rejects, reports progress or blocks the loop, as the payload says; reads the ORM as async code does."""
    import asyncio

    from django_dbqueue.models import Message

    mark("start", message)
    action = message.payload.get("action")
    if action == "raise":
        raise ValueError(f"asked to fail: {message.payload}")
    if action == "reject":
        raise django_dbqueue.Reject("not for us")
    if action == "block":  # a blocking call on the loop: the worker warns
        time.sleep(message.payload.get("sleep", 0))
    if action == "progress":  # then awaits ``sleep`` seconds, if given
        message.set_progress(1, 2, note="half")
        message.update_meta(step="one")
        await asyncio.sleep(message.payload.get("sleep", 0))
    await asyncio.sleep(0)
    seen = await Message.objects.filter(pk=message.pk).aexists()  # the async ORM, on its own connection
    return {"seen": seen}


@django_dbqueue.handler("a-mixed", kind="sync")
def mixed_sync(message):
    mark("done", message)
    return {"how": "sync", "pid": os.getpid()}


@django_dbqueue.handler("a-mixed", kind="async")
async def mixed_async(message):
    import asyncio

    await asyncio.sleep(0.01)
    mark("done", message)
    return {"how": "async", "pid": os.getpid()}


@django_dbqueue.handler("wf-p")
@django_dbqueue.handler("wf-kill-a")
@django_dbqueue.handler("wf-kill-b")
def workflow_step(message):
    """A workflow step (tests/test_workflow_processes.py): marks ``step:NAME``, sleeps ``sleep``, returns its name."""
    name = message.headers["dbqueue_step"][1]
    time.sleep(message.payload.get("sleep", 0))
    mark(f"step:{message.headers['dbqueue_step'][0]}:{name}", message)
    return name


@django_dbqueue.handler("ha-drain")
@django_dbqueue.handler("ha-direct")
@django_dbqueue.handler("ha-bouncer")
def high_availability(message):
    """The high-availability tests' work (tests/test_ha_postgres.py): marks, sleeps ``sleep``, marks."""
    mark("start", message)
    time.sleep(message.payload.get("sleep", 0))
    mark("done", message)


def record_ack(sender, message, **extra):
    """``queue id pid time`` per ack this process saw committed, in ``DBQUEUE_TEST_ACKS`` (the failover test)."""
    path = os.environ.get("DBQUEUE_TEST_ACKS")
    if path and message.queue.startswith("ha-"):
        with open(path, "a") as acks:
            acks.write(f"{message.queue} {message.pk} {os.getpid()} {time.time():.3f}\n")


# Only in the processes that record: a receiver makes a batch's ack read its archive rows back.
if os.environ.get("DBQUEUE_TEST_ACKS"):
    django_dbqueue.signals.message_acked.connect(record_ack, dispatch_uid="tests.testapp.record_ack")


def write_order(message) -> None:
    """An order numbered after the message (``id:pid:time``): each run leaves a row, a run twice two."""
    from tests.testapp.models import Order

    Order.objects.create(number=f"{message.pk}:{os.getpid()}:{time.monotonic_ns() % 10**9}")
    mark("wrote", message)
    time.sleep(message.payload.get("sleep", 0))


# tests/test_atomic_handlers.py: the same work, in the ack's transaction and in its own.
django_dbqueue.handler("at-atomic", atomic=True)(write_order)
django_dbqueue.handler("at-plain")(write_order)
