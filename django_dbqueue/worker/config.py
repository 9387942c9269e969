"""What a worker can be told, and what its exit status means."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..exceptions import InvalidOption
from ..handlers import Handler


class ExitStatus(enum.IntEnum):
    """The worker process's exit status: what happened."""

    OK = 0  # stopped as asked (signal, --until-empty, --max-messages, --max-runtime) with nothing left running
    ERROR = 1  # could not start, or one of its threads crashed (logged with its traceback)
    ABANDONED = 3  # the grace period ran out with handlers still running; their leases will expire
    FORCED = 4  # a second signal: exited at once; leases of running messages will expire


@dataclass
class WorkerConfig:
    """Everything ``runqueueworker`` can be told; None means "from the DBQUEUE setting"."""

    queues: list[str] = field(default_factory=list)
    concurrency: int = 1
    # Async handlers (worker/asyncloop.py): how many run at once on the process's event loop, and for how long.
    async_concurrency: int = 100
    async_timeout: float | None = None
    batch_size: int | None = None  # None: adaptive, sized by the handlers' durations (worker/sizing.py)
    poll_interval: float | None = None
    max_poll_interval: float | None = None
    visibility_timeout: float | None = None
    until_empty: bool = False
    max_messages: int | None = None
    max_runtime: float | None = None
    grace: float | None = None
    handler: Handler | None = None  # overrides the registry (exec mode)
    reap: bool = False
    schedules: bool = True  # fire the schedules of this database too (docs/schedules.md)
    # A pool's child (worker/supervisor.py): its supervisor's row, and the socket to it (worker/tether.py).
    supervisor: str = ""
    tether_fd: int | None = None
    # A pool's child's limits (worker/recycling.py): past one, it asks for its replacement.
    max_messages_per_child: int | None = None
    max_memory_per_child: float | None = None  # megabytes

    def __post_init__(self) -> None:
        """Refuse counts below one and negative durations (the command's parser does too; this is for code)."""
        for name in ("concurrency", "async_concurrency", "batch_size", "max_messages", "max_messages_per_child"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidOption(f"WorkerConfig {name} must be a whole number of at least 1, not {value!r}")
        for name in (
            "async_timeout",
            "poll_interval",
            "max_poll_interval",
            "visibility_timeout",
            "max_runtime",
            "max_memory_per_child",
        ):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and 0 < value < float("inf")):
                unit = "megabytes" if name == "max_memory_per_child" else "seconds"
                raise InvalidOption(f"WorkerConfig {name} must be a number of {unit} above 0, not {value!r}")
        if self.grace is not None and not (isinstance(self.grace, int | float) and 0 <= self.grace < float("inf")):
            raise InvalidOption(f"WorkerConfig grace must be a number of seconds of at least 0, not {self.grace!r}")
