"""SIGTERM and SIGINT handlers that never wait for a lock the main thread may hold.

A Python signal handler runs on the main thread between two bytecodes,
possibly while that thread holds a lock: the worker's main loop waits on its
stopping Event, and as the wait wakes it holds the Event's own lock. A
handler that set that Event waited for itself, and the worker never stopped
(seen once in a full run: a worker still running 60 s after SIGTERM). Each
test holds the lock as the loop does when the signal comes, in a child
process, so that a hang is a timeout, not a stuck suite.
"""

import subprocess
import sys
import textwrap

import pytest

from tests.support.processes import ROOT, child_env

pytestmark = pytest.mark.django_db(transaction=True)


def run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_workers_handler_only_notes_the_signal_and_the_loop_stops():
    out = run(
        """
        import os, signal, threading, time
        import django
        django.setup()
        from django_dbqueue.worker import QueueWorker, WorkerConfig

        worker = QueueWorker(WorkerConfig(queues=["sig"], handler=lambda message: None))
        worker._install_signals()
        with worker.lifecycle.stopping._cond:  # as the main loop's wait holds it when it wakes
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs here
        print("noted", worker._signalled == signal.SIGTERM, worker.lifecycle.stopping.is_set())
        """
    )
    assert out.split() == ["noted", "True", "False"]


def test_a_worker_signalled_as_its_loop_wakes_stops(tmp_path):
    out = run(
        """
        import os, signal, threading, time
        import django
        django.setup()
        from django_dbqueue.worker import QueueWorker, WorkerConfig

        worker = QueueWorker(WorkerConfig(queues=["sig"], handler=lambda message: None, poll_interval=0.05))
        stopping = worker.lifecycle.stopping
        wait = stopping.wait

        def wait_then_signal(timeout=None):
            # The main loop's first wait (helper threads wait on the Event too): the signal comes while
            # the main thread holds the Event's lock.
            if threading.current_thread() is not threading.main_thread():
                return wait(timeout)
            stopping.wait = wait
            with stopping._cond:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)
            return wait(timeout)

        stopping.wait = wait_then_signal
        started = time.monotonic()
        status = worker.run()
        print("stopped", int(status), worker.lifecycle.why, round(time.monotonic() - started) < 30)
        """
    )
    assert out.split() == ["stopped", "0", "got", "SIGTERM", "True"]


def test_the_commands_handler_sets_their_stop_event_from_another_thread():
    out = run(
        """
        import os, signal, time
        from django_dbqueue.management.stopping import stop_on_signals

        with stop_on_signals() as stop:
            with stop._cond:  # as a command's loop holds it when its wait wakes
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)
            print("stopped", stop.wait(10))
        """
    )
    assert out.split() == ["stopped", "True"]
