"""A management command run with a fault injected: ``python -m tests.support.faulty FAULT COMMAND ARGS...``.

tests/test_faults.py starts real ``runqueueworker`` and ``reapqueue``
processes this way (see :func:`tests.support.processes.start_faulty`). Each
fault patches one seam of the package before the command runs, in the
process that runs it:

- ``unstorable-ack``: the database refuses every acknowledgement of a
  message whose payload has ``"unstorable": true`` (``ack``, and
  ``ack_many`` of a batch holding one) with a ``DataError``, as it would
  refuse a value it cannot store. A real one cannot be provoked any more:
  the model layer makes every value the queue writes storable before the
  write (``validation.storable_text`` / ``storable_result``), so this
  stand-in is the only way left to reach the worker's handling of a
  permanent error. Its dead letter (and every other write) goes through.
- ``consumer-crash``: the second claim of consumer thread 1 raises
  ``OverflowError``: a bug in the worker's own loop, not in a handler.
- ``reaper-pass-fails``: the first reaper pass raises ``RuntimeError``.
"""

from __future__ import annotations

import os
import sys
import threading

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

from django.db import DataError  # noqa: E402

from django_dbqueue.models import MessageQuerySet  # noqa: E402
from django_dbqueue.reaper import Reaper  # noqa: E402
from django_dbqueue.worker.consumer import Consumer  # noqa: E402

REFUSAL = "value too long for the column (injected by tests/support/faulty.py)"


def unstorable(message) -> bool:
    return isinstance(message.payload, dict) and message.payload.get("unstorable") is True


def unstorable_ack() -> None:
    real_finish, real_ack_many = MessageQuerySet.finish, MessageQuerySet.ack_many

    def finish(self, message, outcome, *args, **kwargs):
        if outcome == "acked" and unstorable(message):
            raise DataError(REFUSAL)
        return real_finish(self, message, outcome, *args, **kwargs)

    def ack_many(self, messages, **kwargs):
        messages = list(messages)
        if any(map(unstorable, messages)):
            raise DataError(REFUSAL)
        return real_ack_many(self, messages, **kwargs)

    MessageQuerySet.finish, MessageQuerySet.ack_many = finish, ack_many


def consumer_crash() -> None:
    real_claim = Consumer.claim
    claims = {"n": 0}
    lock = threading.Lock()

    def claim(self):
        if self.slot == 1:
            with lock:
                claims["n"] += 1
                if claims["n"] == 2:
                    raise OverflowError("injected: a bug in consumer thread 1")
        return real_claim(self)

    Consumer.claim = claim


def reaper_pass_fails() -> None:
    real_run_once = Reaper.run_once
    passes = {"n": 0}

    def run_once(self):
        passes["n"] += 1
        if passes["n"] == 1:
            raise RuntimeError("injected: the first reaper pass fails")
        return real_run_once(self)

    Reaper.run_once = run_once


FAULTS = {"unstorable-ack": unstorable_ack, "consumer-crash": consumer_crash, "reaper-pass-fails": reaper_pass_fails}

if __name__ == "__main__":
    from django.core.management import execute_from_command_line

    fault, *argv = sys.argv[1:]
    FAULTS[fault]()
    execute_from_command_line(["manage.py", *argv])
