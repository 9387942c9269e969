"""The worker: threads that claim messages and run their handlers.

``runqueueworker`` is a `QueueWorker` (`process`), built of:

- `config`: `WorkerConfig` (what it can be told) and `ExitStatus`;
- `ledger`: the one object that owns what the worker holds (claimed,
  running, waiting for its ack) and its counters;
- `lifecycle`: the events its threads share; a crashed thread stops the worker;
- `consumer`: the claim/run/ack loop of one thread;
- `writing`: writing an outcome, retried through database trouble;
- `heartbeat`: the worker's row, lease extension, the periodic summary;
- `listener`: PostgreSQL ``LISTEN`` wake-ups;
- `supervisor`: ``runqueueworker --processes``, a pool of such workers, and
  `tether`, a child's line to its supervisor.

Running one message through its handler is `django_dbqueue.running`;
the ``--reap`` thread is `django_dbqueue.reaper.Reaper.loop`.
See docs/workers.md, "How the worker is built".
"""

from .config import ExitStatus, WorkerConfig
from .ledger import Ledger
from .process import QueueWorker

__all__ = ["ExitStatus", "Ledger", "QueueWorker", "WorkerConfig"]
