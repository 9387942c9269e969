"""The ``async_io`` phase's handlers: ``IO_MS`` of simulated I/O per message, awaited or slept.

The same wait written twice: an ``async def`` handler that awaits
``asyncio.sleep`` (run on a worker's event loop, ``--async-concurrency``
at once) and a sync one that calls ``time.sleep`` (one message per thread).
As for ``cpu_bound``, they are registered (`register`) only in the worker
processes the phase starts, which get ``apps.IO_HANDLER_ENVIRONMENT``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ... import handlers

ASYNC_QUEUE = "queuebench.io-async"
SYNC_QUEUE = "queuebench.io-sync"


async def awaits_io(message: Any) -> None:
    await asyncio.sleep(float(message.payload["seconds"]))


def sleeps_io(message: Any) -> None:
    time.sleep(float(message.payload["seconds"]))


def register() -> None:
    handlers.handler(ASYNC_QUEUE)(awaits_io)
    handlers.handler(SYNC_QUEUE)(sleeps_io)
