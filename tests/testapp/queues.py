"""Handlers the worker tests run, discovered like any app's ``queues.py``.

Handlers that other processes run write a line per event to the file named
by ``DBQUEUE_TEST_MARKS`` (``event id pid``), so a test sees what happened
inside a worker it started.
"""

import os
import signal
import time
from datetime import datetime

import django_dbqueue


def mark(event: str, message) -> None:
    path = os.environ.get("DBQUEUE_TEST_MARKS")
    if path:
        with open(path, "a") as marks:
            marks.write(f"{event} {message.pk} {os.getpid()}\n")


@django_dbqueue.handler("w-ok")
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
