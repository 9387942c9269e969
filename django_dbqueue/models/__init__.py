"""The model layer: the queue's tables and every statement on them.

This is the bottom of the package's layers (over ``db``, ``conf``,
``signals``, ``validation`` and ``exceptions``): the rest of django-dbqueue
changes queue rows only through the methods of these models, their
querysets and managers. The tables' layouts are a documented contract
(docs/table-layout.md) for producers that write plain SQL.
"""

from .archive import ArchivedMessage, ArchivedMessageQuerySet, DeadLetter, Outcome
from .flow import FlowGroup, RateSlot, UniqueWindow
from .messages import Message, MessageManager, MessageQuerySet, MessageState
from .queues import QueueStat, QueueState, Subscription
from .schedules import Fired, Schedule, ScheduleRun, ScheduleTrigger
from .workers import Worker
from .workflows import StepState, WorkflowEdge, WorkflowOutcome, WorkflowRun, WorkflowStep

__all__ = [
    "ArchivedMessage",
    "ArchivedMessageQuerySet",
    "DeadLetter",
    "Fired",
    "FlowGroup",
    "Message",
    "MessageManager",
    "MessageQuerySet",
    "MessageState",
    "Outcome",
    "QueueStat",
    "QueueState",
    "RateSlot",
    "Schedule",
    "ScheduleRun",
    "ScheduleTrigger",
    "StepState",
    "Subscription",
    "UniqueWindow",
    "Worker",
    "WorkflowEdge",
    "WorkflowOutcome",
    "WorkflowRun",
    "WorkflowStep",
]
