"""The operators' admin: live messages, the archive, dead letters, the queues' overview, subscriptions.

Every action calls `django_dbqueue.control` (never writes fields
itself), is a POST through the admin's CSRF-protected views, and needs its
own permission: ``cancel_message`` (cancel, run now, release),
``replay_archivedmessage`` (replay, edit and replay, replay a workflow's
dead steps), ``pause_queue`` (pause, resume), ``cancel_workflowrun``
(cancel a workflow), ``delete_deadletter`` (purge). Seeing needs the
model's view permission. Payloads and errors are escaped wherever they are shown.

Importing this package (Django's admin autodiscovery does) registers:

- ``messages``: live messages (`MessageAdmin`);
- ``archive``: the archive and its dead letters (`ArchiveAdmin`, `DeadLetterAdmin`);
- ``overview``: the Queues page with pause and resume (`QueueOverviewAdmin`);
- ``subscriptions`` and ``stats``: topic subscriptions, the analytics' hourly figures;
- ``schedules``: the schedules, with enable/disable and run now (`ScheduleAdmin`, docs/schedules.md);
- ``workflows``: the workflows, their graphs, cancel and replay of dead steps (`WorkflowRunAdmin`, docs/workflows.md).

``base`` holds what they share, ``filters`` their list filters, ``charts`` the overview's SVG, ``graphs`` a workflow's.
"""

from .archive import ArchiveAdmin, DeadLetterAdmin
from .messages import MessageAdmin
from .overview import QueueOverviewAdmin
from .schedules import ScheduleAdmin
from .stats import QueueStatAdmin
from .subscriptions import SubscriptionAdmin
from .workflows import WorkflowRunAdmin

__all__ = [
    "ArchiveAdmin",
    "DeadLetterAdmin",
    "MessageAdmin",
    "QueueOverviewAdmin",
    "QueueStatAdmin",
    "ScheduleAdmin",
    "SubscriptionAdmin",
    "WorkflowRunAdmin",
]
