"""A command's progress reporter, from its ``stdout`` and ``--verbosity`` (see `django_dbqueue.progress`)."""

from __future__ import annotations

from django.core.management.base import OutputWrapper

from ..progress import Progress, progress_for


class _Raw:
    """Django's ``OutputWrapper`` ends every write with a newline; a bar redrawn with ``\\r`` must not."""

    def __init__(self, stdout: OutputWrapper) -> None:
        self.stdout = stdout

    def write(self, text: str, /) -> None:
        self.stdout.write(text, ending="")

    def flush(self) -> None:
        self.stdout.flush()


def command_progress(stdout: OutputWrapper, verbosity: int) -> Progress:
    """A bar when ``stdout`` is a terminal, lines with ``-v2`` when not, nothing with ``-v0``."""
    return progress_for(_Raw(stdout), tty=stdout.isatty(), verbosity=verbosity)
