"""Run test roles in real OS processes against the test database.

A child is ``python -m tests.support.child ROLE ARGS...``; it reaches the same test
database as the pytest process through ``DBQUEUE_TEST_DATABASE_NAME`` and
prints one JSON line with its results.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from django.db import connection

ROOT = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["DBQUEUE_TEST_DATABASE_NAME"] = str(connection.settings_dict["NAME"])
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT prints every thread's stack: see stop()
    env.update(extra)
    return env


def start_module(module: str, *args: object, **env: str) -> subprocess.Popen[str]:
    """``python -m MODULE ARGS...`` against the test database, its output captured as text."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=ROOT,
        env=child_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def start(role: str, *args: object, **env: str) -> subprocess.Popen[str]:
    # Close our connection's transaction state first: children must see committed data.
    return start_module("tests.support.child", role, *args, **env)


def results(processes: list[subprocess.Popen[str]], timeout: float = 600) -> list[dict]:
    """Wait for every child; fail with its stderr if one did not exit cleanly."""
    out = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=timeout)
        assert process.returncode == 0, f"child exited {process.returncode}:\n{stderr[-4000:]}"
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def stop(process: subprocess.Popen[str], timeout: float = 60) -> tuple[str, str]:
    """SIGTERM ``process`` and wait for it; one that overstays is aborted, so its threads' stacks
    (faulthandler) are in the failure, and it cannot go on serving the next test's queue. For a single
    process (a pool's children are not signalled here)."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            _, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate(timeout=30)  # bounded: a child of its own may still hold the pipes
        raise AssertionError(
            f"process {process.pid} still ran {timeout}s after SIGTERM; its log:\n{err[-20000:]}"
        ) from None


def start_command(*argv: object, **env: str) -> subprocess.Popen[str]:
    """``manage.py``-style: ``python -m django ARGV...`` against the test database."""
    return start_module("django", *argv, **env)


def start_worker(*args: object, marks: Path | None = None, **env: str) -> subprocess.Popen[str]:
    if marks is not None:
        env["DBQUEUE_TEST_MARKS"] = str(marks)
    return start_command("runqueueworker", *args, **env)


def start_faulty(fault: str, *argv: object, marks: Path | None = None, **env: str) -> subprocess.Popen[str]:
    """A management command with a fault injected (see tests/support/faulty.py)."""
    if marks is not None:
        env["DBQUEUE_TEST_MARKS"] = str(marks)
    return start_module("tests.support.faulty", fault, *argv, **env)


def read_marks(path: Path) -> list[tuple[str, int, int]]:
    """The ``event id pid`` lines test handlers wrote (see tests/testapp/queues.py)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        event, pk, pid = line.split()
        rows.append((event, int(pk), int(pid)))
    return rows


# A transient error met and retried is logged in one of two forms: by the retry around one statement
# (``claim on 'default' hit ...; retry 1 of 5``) or, once those retries are spent, by the loop that
# runs it again (``worker w: ack failed (...); retrying``). Which one a fault shows depends on timing.
RETRIED = re.compile(r"; retry \d+ of \d+$|; retrying$", re.MULTILINE)


def retried(log: str) -> list[str]:
    """The lines of a process's log that say it met a transient database error and retried."""
    return [line for line in log.splitlines() if RETRIED.search(line)]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs; a zombie (exited, its parent not yet told) counts as gone.

    The process can be reaped between any two steps here: /proc then answers
    ENOENT at the open or ESRCH at the read, both gone.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_for(condition, timeout: float = 60, interval: float = 0.05, what: str = "condition"):
    """Poll ``condition`` until it returns something true; fail after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class LoggedCommands:
    """Starts ``runqueueworker`` commands for one test, each one's output in a file; kills what is left at the end."""

    what = "worker"

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, *args: object, marks: Path | None = None, **env: str) -> subprocess.Popen[bytes]:
        if marks is not None:
            env["DBQUEUE_TEST_MARKS"] = str(marks)
        log = open(self.tmp_path / f"{self.what}-{len(self.started)}.log", "wb")  # noqa: SIM115  (closed in close())
        process = subprocess.Popen(
            [sys.executable, "-m", "django", "runqueueworker", *map(str, args)],
            cwd=ROOT,
            env=child_env(**env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        process.log = log  # type: ignore[attr-defined]
        self.started.append(process)
        return process

    def output(self, process: subprocess.Popen[bytes]) -> str:
        process.log.flush()  # type: ignore[attr-defined]
        return Path(process.log.name).read_text(errors="replace")  # type: ignore[attr-defined]

    def finish(self, process: subprocess.Popen[bytes], timeout: float = 90) -> tuple[int, str]:
        """Wait for the command to exit; its status and output."""
        try:
            status = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the {self.what} did not exit in {timeout}s:\n{self.output(process)[-4000:]}"
            ) from None
        return status, self.output(process)

    def close(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
            process.log.close()  # type: ignore[attr-defined]
