"""Exec mode: each message runs an outside command, so consumers can be in any language.

The command line is split with :func:`shlex.split` and run without a shell;
message data never enters it. The payload arrives as JSON on stdin, the
rest in environment variables. Exit status 0 acks; anything else fails the
attempt with the tail of stderr as the error (retried with backoff, dead
letter after the last attempt).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from typing import TYPE_CHECKING

from .exceptions import CommandFailed, InvalidOption

if TYPE_CHECKING:
    from .models import Message

TAIL = 4000  # characters of stderr (errors) and stdout (results) kept


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
            done = subprocess.run(
                self.argv,
                input=json.dumps(message.payload).encode(),
                env=self.environment(message),
                capture_output=True,
                timeout=self.timeout,
                check=False,
            )
        except OSError as exc:  # missing, not executable, ...
            raise CommandFailed(f"cannot run {self.argv[0]!r}: {exc.strerror or exc}") from exc
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace")[-TAIL:].strip()
            raise CommandFailed(f"{shlex.join(self.argv)} exited with status {done.returncode}\n{tail}".strip())
        # What the command printed is kept as the message's result (the tail, as text).
        return done.stdout.decode(errors="replace")[-TAIL:]
