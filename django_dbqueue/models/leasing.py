"""Leases held: changes guarded by a lease, extensions, cancel requests and handlers' reports.

Every write here matches a row only while its holder's lease holds
(`states.lease_held`), or only while nobody holds it. The model is reached
through ``self``: this module sits below `messages` and never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Self

from django.db.models.functions import Coalesce

from ..db.clock import DbNow
from ..db.errors import with_retries
from . import landed
from .inserting import Inserting
from .protocols import Live, LiveMessage
from .states import MessageState, lease_held, state_filters


class Leasing(Inserting[Live]):
    """Writes to leased (or idle) messages that leave them live (on top of the reads and the inserts)."""

    def update_leased(
        self, message: LiveMessage, what: str, *, landed_as: tuple[str, int] | None = None, **changes: Any
    ) -> bool:
        """Change a message only while its lease holds; False if the lease was lost.

        ``landed_as``: the worker and attempts that a change giving the lease
        up leaves on the row, by which a try whose reply was lost is known to
        have landed (`landed`); None for a change that can be made twice.
        """
        using = message._state.db or "default"
        on = self.using(using)
        leased = on.leased(message)

        def change() -> bool:
            return bool(leased.update(**changes) == 1)

        def found() -> bool:
            if landed_as is None:
                return False
            worker, attempts = landed_as
            return landed.changed(on, message, worker=worker, attempts=attempts)

        return with_retries(
            using, lambda: landed.guarded(using, message, change, found, False), what=f"{what} message {message.pk}"
        )

    def extend_leases(self, token: str, ids: list[int], seconds: float) -> int:
        """Push the leases of ``ids`` under ``token`` to ``seconds`` from now; a lease already lost stays lost."""
        return self.filter(lease_held(token, ids)).update(available_at=DbNow(seconds))

    # --- cancel and reports of running messages ------------------------------------

    def request_cancel(self, pk: int) -> bool:
        """Flag message ``pk`` for cancel if it is in flight (its worker stops it); False if it is not in flight.

        A second request keeps the first one's time.
        """
        flagged = self.filter(state_filters()[MessageState.IN_FLIGHT], pk=pk)
        requested_at = Coalesce("cancel_requested_at", DbNow())
        return with_retries(self.db, lambda: flagged.update(cancel_requested_at=requested_at) == 1, what="cancel")

    def cancel_flagged(self, ids: Iterable[int]) -> set[int]:
        """Which of ``ids`` an operator asked to cancel (the heartbeat's question, one query)."""
        return set(self.filter(pk__in=list(ids), cancel_requested_at__isnull=False).values_list("pk", flat=True))

    def reporting(self) -> Self:
        """In-flight messages whose handler reported progress, longest running first (the overview's list)."""
        return self.in_flight().filter(progress__isnull=False).order_by("claimed_at", "id")

    def abandoned_cancels(self) -> Self:
        """Messages flagged for cancel that no worker runs any more (their lease ran out): the reaper's to archive."""
        return self.ready().filter(cancel_requested_at__isnull=False, lease_token__isnull=False)

    def write_report(self, pk: int, token: str, values: Mapping[str, Any]) -> bool:
        """Write a running message's ``progress``/``meta`` while lease ``token`` holds (the heartbeat's write)."""
        return bool(self.filter(lease_held(token, [pk])).update(**values) == 1)

    def release_from(self, worker: str) -> int:
        """Give back every message ``worker`` holds (a dead worker's); the attempt it used counts."""
        return self.filter(claimed_by=worker).give_back(count_attempt=True)

    def run_now(self, pk: int) -> bool:
        """Make a scheduled (or backing-off) message ready now; in-flight ones are left alone."""
        return with_retries(
            self.db,
            lambda: self.filter(pk=pk, lease_token__isnull=True).update(available_at=DbNow()) == 1,
            what="run now",
        )
