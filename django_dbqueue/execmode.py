"""Exec mode: each message runs an outside command, so consumers can be in any language.

The command line is split with `shlex.split` and run without a shell;
message data never enters it. The payload arrives as JSON on stdin, the
rest in environment variables. Exit status 0 acks; anything else fails the
attempt with the tail of stderr as the error (retried with backoff, dead
letter after the last attempt). A command whose message is cancelled while
it runs gets SIGTERM in its process group, then SIGKILL after KILL_GRACE.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .exceptions import Cancelled, CommandFailed, InvalidOption
from .validation import storable_text

if TYPE_CHECKING:
    from .models import Message

TAIL = 4000  # characters of stderr (errors) and stdout (results) kept
KILL_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when a command outlives its timeout
PIPE_GRACE = 1.0  # seconds to drain the pipes after the command exited (a background child may hold them)
TIMED_OUT, CANCELLED = "timed out", "cancelled"  # why _communicate stopped a command


class Tail:
    """The last bytes a pipe delivered, bounded while the command runs (300 MB of output keeps 16 KB)."""

    def __init__(self, keep: int = TAIL * 4) -> None:
        self.keep = keep
        self.data = b""

    def add(self, chunk: bytes) -> None:
        self.data = (self.data + chunk)[-self.keep :]

    def text(self) -> str:
        return storable_text(self.data.decode(errors="replace")[-TAIL:])


class ExecHandler:
    """A handler that runs ``command`` for each message."""

    def __init__(self, command: str, *, timeout: float | None = None) -> None:
        try:
            self.argv = shlex.split(command)
        except ValueError as exc:
            raise InvalidOption(f"cannot parse --exec command {command!r}: {exc}") from exc
        if not self.argv:
            raise InvalidOption("--exec needs a command")
        self.timeout = timeout

    def environment(self, message: Message) -> dict[str, str]:
        return {
            **os.environ,
            "DBQUEUE_MESSAGE_ID": str(message.pk),
            "DBQUEUE_QUEUE": message.queue,
            "DBQUEUE_KIND": message.kind,
            "DBQUEUE_ATTEMPT": str(message.attempts),
            "DBQUEUE_HEADERS": json.dumps(message.headers),
        }

    def __call__(self, message: Message) -> str:
        try:
            process = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self.environment(message),
                start_new_session=True,  # its own process group: a timeout kills its children too
            )
        except OSError as exc:  # missing, not executable, ...
            raise CommandFailed(f"cannot run {self.argv[0]!r}: {exc.strerror or exc}") from exc
        out, err = Tail(), Tail()
        stopped = self._communicate(process, json.dumps(message.payload).encode(), out, err, message.cancel_requested)
        if stopped == CANCELLED:
            self._kill_group(process)
            raise Cancelled(f"{shlex.join(self.argv)} was stopped with its process group: cancel was asked")
        if stopped == TIMED_OUT:
            self._kill_group(process)
            raise CommandFailed(
                f"{shlex.join(self.argv)} ran longer than {self.timeout:g}s and was killed with its process group\n"
                f"{err.text()}".strip()
            )
        status = process.wait()
        if status != 0:
            raise CommandFailed(f"{shlex.join(self.argv)} exited with status {status}\n{err.text().strip()}".strip())
        # What the command printed is kept as the message's result (the tail, as text).
        return out.text()

    def _communicate(
        self, process: subprocess.Popen[bytes], payload: bytes, out: Tail, err: Tail, cancelled: Callable[[], bool]
    ) -> str | None:
        """Feed stdin and keep the output's tails until the command exits (None), it times out, or is cancelled.

        ``cancelled`` is asked every poll (a flag the worker's heartbeat sets).

        One thread, non-blocking pipes: a command that never reads its
        stdin cannot block us, output is never held whole, and once the
        command has exited we read for at most PIPE_GRACE more, so a
        background child that keeps the pipes open does not hold the message.
        """
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        stdin, stdout, stderr = process.stdin, process.stdout, process.stderr
        if stdin is None or stdout is None or stderr is None:  # Popen was given PIPE for all three
            raise RuntimeError("the command's pipes were not opened")
        pending = memoryview(payload)
        with selectors.DefaultSelector() as selector:
            # Each key carries the Tail its pipe feeds; stdin carries None.
            for pipe, kept in ((stdout, out), (stderr, err)):
                os.set_blocking(pipe.fileno(), False)
                selector.register(pipe, selectors.EVENT_READ, kept)
            os.set_blocking(stdin.fileno(), False)
            selector.register(stdin, selectors.EVENT_WRITE, None)
            exited_at: float | None = None
            try:
                while selector.get_map():
                    now = time.monotonic()
                    if exited_at is None and process.poll() is not None:
                        exited_at = now
                    if exited_at is not None and now - exited_at >= PIPE_GRACE:
                        break
                    if exited_at is None and deadline is not None and now >= deadline:
                        return TIMED_OUT
                    if exited_at is None and cancelled():
                        return CANCELLED
                    for key, _ in selector.select(timeout=0.05):
                        tail: Tail | None = key.data
                        if tail is None:  # stdin is writable
                            try:
                                written = os.write(key.fd, pending[:65536])
                            except BlockingIOError:
                                continue
                            except BrokenPipeError:
                                written = len(pending)  # it exited or closed stdin unread: its status tells
                            pending = pending[written:]
                            if not pending:
                                selector.unregister(stdin)
                                stdin.close()
                            continue
                        try:
                            chunk = os.read(key.fd, 65536)
                        except BlockingIOError:
                            continue
                        if chunk:
                            tail.add(chunk)
                        else:
                            selector.unregister(key.fileobj)
            finally:
                for pipe in (stdin, stdout, stderr):
                    with contextlib.suppress(OSError, ValueError):
                        pipe.close()
        # Every pipe closed before the command exited: wait for it, within the timeout, listening for a cancel.
        while exited_at is None and process.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                return TIMED_OUT
            if cancelled():
                return CANCELLED
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.05)
        return None

    @staticmethod
    def _kill_group(process: subprocess.Popen[bytes]) -> None:
        """SIGTERM to the command's process group, SIGKILL after KILL_GRACE if it is still there."""
        for signum in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, signum)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=KILL_GRACE)
                break
            except subprocess.TimeoutExpired:
                continue
