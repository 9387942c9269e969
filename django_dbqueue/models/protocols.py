"""What the modules below `messages` use of a message: a typing protocol, and their querysets' type variable.

`messages` imports the modules its model and queryset are made of, so
they, and the statements, flow control and the archive below them, never
import it, not even for an annotation: they name a message `LiveMessage`,
which `Message` satisfies, and their querysets are generic in `Live`,
which `MessageQuerySet` binds to `Message`, so the public types stay exact.
Only the type checker reads what is here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar, Protocol, Self, TypeVar

from django.db.models.base import ModelState
from django.db.models.options import Options


class LiveMessage(Protocol):
    """A row of the live table, as the modules below `messages` see it: `Message` is the one implementation."""

    # The model's manager, ``Message.objects``. Its queryset's methods are defined
    # above this module, so it is not typed here: the querysets (generic in `Live`) are.
    objects: Any
    _meta: ClassVar[Options[Any]]

    # Django's (`models.Model`)
    pk: Any
    _state: ModelState

    # The columns (docs/table-layout.md)
    queue: str
    kind: str
    key: str | None
    group: str | None
    payload: Any
    headers: Any
    priority: int
    expires_at: datetime | None
    lease_token: str | None
    claimed_by: str
    claimed_at: datetime | None
    attempts: int
    max_attempts: int | None
    deferrals: int
    last_error: str
    replay_of: int | None
    progress: Any
    meta: Any

    # Datetimes; but None on a message not inserted yet, and, set for its INSERT,
    # the database's clock (an expression): no one type says all three.
    available_at: Any
    first_available_at: Any
    created_at: Any

    # Not columns: set by the insert path and the worker (see `Message`).
    _dbqueue_created: bool
    _dbqueue_window: float | None
    _dbqueue_debounce: float | None
    retry_in: float | None

    def __init__(self, *args: Any, **kwargs: Any) -> None: ...  # Message(**fields)
    @classmethod
    def unsaved(cls, **fields: Any) -> Self: ...
    @classmethod
    def from_row(cls, using: str, names: list[str], values: list[Any]) -> Self: ...
    def save(self, *, using: str | None = None, force_insert: bool = False) -> None: ...
    def with_payload(self, payload: Any, headers: dict[str, Any], text: str | None = None) -> Self: ...
    def keep_payload_json(self, text: str) -> None: ...
    def payload_json(self) -> str: ...
    @property
    def was_created(self) -> bool: ...
    def max_attempts_allowed(self) -> int: ...
    def attempts_left(self) -> bool: ...
    def deferral_refused(self) -> str | None: ...
    def unreported(self) -> tuple[int, dict[str, Any]] | None: ...
    def reported(self, reports: int) -> None: ...


# What the querysets below `messages` are generic in: `MessageQuerySet` binds it to `Message`.
Live = TypeVar("Live", bound=LiveMessage)
