"""The worker: threads that claim messages and run their handlers.

``runqueueworker`` is a :class:`QueueWorker` (:mod:`.process`), built of:

- :mod:`.config`: :class:`WorkerConfig` (what it can be told) and :class:`ExitStatus`;
- :mod:`.ledger`: the one object that owns what the worker holds (claimed,
  running, waiting for its ack) and its counters;
- :mod:`.lifecycle`: the events its threads share; a crashed thread stops the worker;
- :mod:`.consumer`: the claim/run/ack loop of one thread;
- :mod:`.writing`: writing an outcome, retried through database trouble;
- :mod:`.heartbeat`: the worker's row, lease extension, the periodic summary;
- :mod:`.listener`: PostgreSQL ``LISTEN`` wake-ups.

Running one message through its handler is :mod:`django_dbqueue.running`;
the ``--reap`` thread is :meth:`django_dbqueue.reaper.Reaper.loop`.
See docs/workers.md, "How the worker is built".
"""

from .config import ExitStatus, WorkerConfig
from .ledger import Ledger
from .process import QueueWorker

__all__ = ["ExitStatus", "Ledger", "QueueWorker", "WorkerConfig"]
