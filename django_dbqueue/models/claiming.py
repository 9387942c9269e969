"""The claim: leasing up to N claimable messages of some queues in one short transaction.

The plain claim walks the claim index (`statements.claim_rows`); a queue
under flow rules goes through the flow plan (`flow.claim_controlled`). A
claim whose reply was lost is answered by the leases it left. The model is
reached through ``self``: this module sits below `messages` and never
imports it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from .. import validation
from ..conf import database_for, queue_options
from ..db.clock import DbNow, db_now
from ..db.errors import DATABASE_TROUBLE, outcome_unknown, with_retries
from ..db.transactions import short_transaction, write_transaction
from ..exceptions import InvalidOption
from . import events, flow, landed, workflows
from .finishing import Finishing
from .protocols import Live, LiveMessage
from .statements import claim_is_one_statement, claim_rows


def default_worker_name() -> str:
    """How a claim names its worker when the caller does not: host and process."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Claimed(list[Any]):
    """What a claim leased, in claim order.

    ``retry_in``: when a rate limit held messages back, the seconds until it lets more through.
    The statements build its messages from the app registry's model, which is the
    claiming queryset's: ``Any`` here, ``list[Live]`` as `Claiming.claim` returns it.
    """

    retry_in: float | None = None


class Claiming(Finishing[Live]):
    """The claim, on top of the reads, inserts, leases and finishes it composes with."""

    def any_claimable(self, queues: Iterable[str]) -> bool:
        """Whether a claim on any of ``queues`` would find something now (``--until-empty``'s last look).

        On a queue with group rules, a message they hold back does not count
        (`flow.any_eligible`); one a rate holds back does.
        """
        return any(self._any_claimable(queue) for queue in queues)

    def _any_claimable(self, queue: str) -> bool:
        options = queue_options(queue)
        if options.flow_controlled:  # a claim may have set rows aside, which are not claimable as they stand
            return flow.any_eligible(self.db, queue, options)
        return self.filter(queue=queue).claimable(options.max_attempts).exists()

    def next_waits(self, queues: Iterable[str]) -> dict[str, float | None]:
        """Per queue, the seconds the message a claim would take next has waited; None when none waits.

        An autoscaled pool's measure of its backlog (docs/workers.md,
        "Autoscaling"): one read of the database's clock, then one read per
        queue that walks the claim index in claim order and stops at the
        first claimable row (``LIMIT 1``), as the claim does. A message given
        back keeps its place, and its wait. On a flow-controlled queue the
        wait counts only when a claim could take something (`flow.any_eligible`,
        the ``--until-empty`` look): a backlog that group rules hold back, or
        that a claim set aside, would not run sooner with more processes; one
        that only a rate holds back counts.
        """
        now = db_now(self.db)
        waits: dict[str, float | None] = {}
        for queue in queues:
            options = queue_options(queue)
            head = (
                self.filter(queue=queue)
                .claimable(options.max_attempts)
                .order_by("priority", "available_at", "id")
                .values_list("available_at", flat=True)
                .first()
            )
            if head is None or (options.flow_controlled and not flow.any_eligible(self.db, queue, options)):
                waits[queue] = None
            else:
                waits[queue] = max(0.0, (now - head).total_seconds())
        return waits

    # --- claiming --------------------------------------------------------------

    def claim(
        self,
        queues: str | Iterable[str],
        limit: int = 1,
        *,
        visibility_timeout: float | timedelta | None = None,
        worker: str | None = None,
    ) -> list[Live]:
        """Lease up to ``limit`` claimable messages of ``queues`` in one short transaction.

        ``SELECT ... FOR UPDATE SKIP LOCKED`` walking the claim index, then one
        UPDATE per lease length; retried on the database's weather. See
        `django_dbqueue.claim`. The list is a `Claimed`: its
        ``retry_in`` says when a rate limit that held messages back lets more through.
        """
        names = validation.validate_queues(queues if isinstance(queues, str) else list(queues))
        timeout = _claim_options(limit, visibility_timeout)
        using = database_for(names, self.db if self.chosen_db() else None)
        worker = worker or default_worker_name()
        manager = self.using(using)
        token = uuid.uuid4().hex
        unsure: list[BaseException] = []

        def run() -> Claimed:
            if unsure:  # the last try lost its connection: did its claim commit?
                leased = manager.claimed_under(token)
                if leased:
                    return leased
            try:
                return manager._claim(names, limit, timeout, worker, token)
            except DATABASE_TROUBLE as exc:
                if outcome_unknown(exc, using):
                    unsure.append(exc)
                raise

        claimed = with_retries(using, run, what="claim")
        events.claimed(claimed, using, worker)
        return claimed

    def claimed_under(self, token: str) -> Claimed:
        """The messages a claim leased under ``token`` whose lease still holds, in the claim index's order.

        A claim whose COMMIT succeeded but whose reply was lost leased them:
        its retry answers with them instead of leasing others.
        """
        rows = self.filter(lease_token=token, available_at__gt=DbNow()).order_by("priority", "first_available_at", "id")
        return Claimed(rows)

    def _claim(
        self, queues: list[str], limit: int, timeout: float | None, worker: str, token: str, *, within: bool = False
    ) -> Claimed:
        """One transaction (on PostgreSQL one statement per queue): see `statements.claim_rows`.

        ``within``: the caller's transaction holds the claim (`ack_then_claim`).
        """
        claimed = Claimed()
        controlled = any(queue_options(name).flow_controlled for name in queues)
        # One statement is a transaction of its own; several are wrapped in one.
        alone = within or (len(queues) == 1 and claim_is_one_statement(self.db) and not controlled)
        # Rate slots go through the ORM, which needs Django's own transaction.
        begin = write_transaction if any(queue_options(name).rate_limit for name in queues) else short_transaction
        with contextlib.nullcontext() if alone else begin(self.db):
            for name in queues:
                wanted = limit - len(claimed)
                if wanted <= 0:
                    break
                options = queue_options(name)
                seconds = timeout or options.visibility_timeout
                if not options.flow_controlled:
                    claimed += claim_rows(self.db, name, wanted, options.max_attempts, seconds, token, worker)
                    continue
                taken, retry_in = flow.claim_controlled(self.db, name, wanted, options, seconds, token, worker)
                claimed += taken
                if retry_in is not None:
                    claimed.retry_in = retry_in if claimed.retry_in is None else min(claimed.retry_in, retry_in)
        return claimed

    def ack_then_claim(
        self,
        messages: Iterable[Live],
        queues: list[str],
        limit: int,
        *,
        worker: str,
        results: Mapping[int, Any] | None = None,
        visibility_timeout: float | timedelta | None = None,
        token: str | None = None,
        again: bool = False,
    ) -> tuple[list[bool | None], list[Live]]:
        """`ack_many`, and where the acks' workflow steps released others on ``queues``, a claim of up
        to ``limit`` messages of ``queues`` for ``worker`` in the acknowledging transaction.

        A chain's next step exists only once its parent's ack commits: a
        worker that acked and then claimed paid a claim's transaction per
        step, and one more that found nothing while the ack was written.
        The claim here is the claim plan itself (priorities, and the flow
        rules of any such queue in ``queues``: a worker leaves those out), so
        it may take other messages than the released ones. A try that failed
        after claiming, whose commit may have landed, is answered by the
        leases under the claim's ``token`` (`claimed_under`); ``again``: an
        earlier call with this token failed and may have committed, so its
        acks are answered from the archive (`landed`) and its claim by the
        token's leases.
        """
        names = validation.validate_queues(queues)
        timeout = _claim_options(limit, visibility_timeout)
        messages = list(messages)
        after = _ClaimAfterAck(self, names, limit, timeout, worker, token or uuid.uuid4().hex)
        if again:  # the earlier call may have committed: its acks are answered from the archive, its claim by the token
            after.unsure.update(m._state.db or "default" for m in messages)
            for message in messages:
                message.__dict__[landed.UNSURE] = True
        answers = self.ack_many(messages, worker=worker, results=results, then=after)
        return answers, after.taken()


def _claim_options(limit: int, visibility_timeout: float | timedelta | None) -> float | None:
    """A claim's ``limit`` checked, and its ``visibility_timeout`` in seconds (None: the queue's)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidOption(f"limit must be a positive integer, not {limit!r}")
    if visibility_timeout is None:
        return None
    return validation.seconds(visibility_timeout, "visibility_timeout", allow_zero=False)


class _ClaimAfterAck:
    """`Claiming.ack_then_claim`'s claim, per database, inside the acknowledging transaction."""

    def __init__(
        self, manager: Claiming[Any], queues: list[str], limit: int, timeout: float | None, worker: str, token: str
    ) -> None:
        self.manager, self.queues, self.limit, self.timeout = manager, queues, limit, timeout
        self.worker, self.token = worker, token
        self.claims: dict[str, Claimed] = {}
        self.unsure: set[str] = set()

    def begin(self, using: str) -> None:
        if self.claims.pop(using, None) is not None:  # an earlier try claimed, then failed: did it commit?
            self.unsure.add(using)

    def released(self, using: str, messages: list[LiveMessage]) -> None:
        wanted = self.limit - sum(len(c) for db, c in self.claims.items() if db != using)
        if wanted <= 0 or not any(m.queue in self.queues for m in messages):
            return
        manager = self.manager.using(using)
        claimed = manager._claim(self.queues, wanted, self.timeout, self.worker, self.token, within=True)
        ready = {m.pk for m in messages}
        for message in claimed:
            if message.pk in ready:  # its step's row was just read, locked: no lookup before it runs
                message.__dict__[workflows.STEP_PRESENT] = True
        events.claimed(claimed, using, self.worker)
        self.claims[using] = claimed

    def taken(self) -> list[Any]:
        for using in self.unsure:
            known = {m.pk for m in self.claims.get(using, ())}
            manager = self.manager.using(using)
            leased = with_retries(using, lambda: manager.claimed_under(self.token), what="claim after acks")  # noqa: B023
            events.claimed([m for m in leased if m.pk not in known], using, self.worker)
            self.claims[using] = leased
        return [message for claimed in self.claims.values() for message in claimed]
