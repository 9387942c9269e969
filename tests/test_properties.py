"""A stateful property test: random producers, consumers, reapers and clocks against a model of the docs.

Hypothesis drives random sequences of enqueue, enqueue_many and publish
(groups, keys, unique windows, debounce, delays, priorities), claims on
queues under every flow-control rule (tests/settings.py, ``pp-*``), ack,
fail, release, snooze, cancel, reaper passes and clock advances. A plain
Python model (:class:`Model`) says what the documented semantics
(docs/concepts.md, api.md, flow-control.md) make of each step, and after
every step the database must agree:

- nothing lost: every message is live or archived, with the outcome the
  model expects, and none is both;
- each live message is in the state (ready, scheduled, in flight), with the
  attempts, group, key, priority and payload the model expects;
- no group has more in flight than its limit; on ordered queues only a
  group's oldest live message is in flight;
- no rate period holds more claims than the limit; no key gets a second
  message inside its unique window;
- a claim never returns nothing while the model says a message is eligible,
  takes only eligible messages, and takes the first eligible one.

Time is the model's, never the wall clock's: every delay, lease, backoff,
window and rate period is a multiple of ``TICK`` seconds, and a clock
advance moves every time the queue keeps (the live messages', the rate
slots', the unique windows') back by whole ticks. The real time an example
takes (well under a tick) can then never tip a comparison, so the outcome
of each step is exact on every database.

Bounded by a profile per database (``PROFILES``); ``DBQUEUE_PROPERTIES=long``
selects the long run whose result docs/reliability.md records.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import django_dbqueue
from django_dbqueue import control
from django_dbqueue.conf import queue_options
from django_dbqueue.db.clock import db_now
from django_dbqueue.exceptions import NotClaimed
from django_dbqueue.models import ArchivedMessage, FlowGroup, Message, RateSlot, UniqueWindow, flow
from django_dbqueue.reaper import Reaper
from tests.support.doc_models import Rules, claimable
from tests.support.machines import Profiles, advance, run_machine

pytestmark = pytest.mark.django_db(transaction=True)

TICK = 30  # seconds: every time below is a multiple of it
LEASE = 2 * TICK  # the pp-* queues' VISIBILITY_TIMEOUT
QUEUES = ["pp-plain", "pp-groups", "pp-fifo", "pp-rate", "pp-rate-group", "pp-groups-rate", "pp-fifo-rate"]
TOPIC = "pp-news"  # subscribers: pp-fifo, pp-plain (tests/settings.py)
TOPIC_QUEUES = ["pp-fifo", "pp-plain"]

PROFILES: Profiles = {
    # name: (max_examples, stateful_step_count) per database vendor
    "ci": {"sqlite": (40, 50), "mysql": (25, 50), "postgresql": (25, 50)},
    "long": {"sqlite": (200, 50), "mysql": (200, 50), "postgresql": (200, 50)},
}


# --- the model -----------------------------------------------------------------------------


@dataclass
class Model:
    """One live message as the docs say it is. Times are the model's seconds; ``seq`` orders equal times."""

    id: int
    queue: str
    kind: str
    key: str | None
    group: str | None
    priority: int
    payload: Any
    available: tuple[int, int]  # (time, seq): the time, and which step wrote it (the order of equal times)
    first: tuple[int, int]
    attempts: int = 0
    token: str | None = None  # the lease token of the last claim; cleared when the lease is given up
    deferrals: int = 0
    flagged: bool = False  # cancel requested while it ran

    def in_flight(self, now: int) -> bool:
        return self.token is not None and self.available[0] > now

    def ready(self, now: int) -> bool:
        return self.available[0] <= now

    def state(self, now: int) -> str:
        if self.ready(now):
            return "ready"
        return "in_flight" if self.token is not None else "scheduled"

    def exhausted(self) -> bool:
        """Leased with no attempts left: no claim takes it again (a poison message, the reaper's)."""
        return self.token is not None and self.attempts >= queue_options(self.queue).max_attempts

    def claim_order(self) -> tuple[int, int, int, int]:
        return (self.priority, *self.available, self.id)


@dataclass
class World:
    """The model of the whole queue: live messages, outcomes, claims made, unique windows, the clock."""

    now: int = 0
    live: dict[int, Model] = field(default_factory=dict)
    archived: dict[int, str] = field(default_factory=dict)
    claims: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (queue, group or "") -> claim times
    windows: dict[tuple[str, str], int] = field(default_factory=dict)  # (queue, key) -> until

    def of_key(self, queue: str, key: str) -> Model | None:
        return next((m for m in self.live.values() if m.queue == queue and m.key == key), None)

    def eligible(self, queue: str, limit: int) -> tuple[list[Model], set[int]]:
        """What a claim of ``limit`` may take now: the greedy pick in claim order, and every eligible id."""
        rules = Rules.of(queue)
        now = self.now
        period = rules.rate[1] if rules.rate is not None else 0
        return claimable(
            rules,
            [m for m in self.live.values() if m.queue == queue],
            limit,
            ready=lambda m: m.ready(now) and not m.exhausted(),
            in_flight=lambda m: m.in_flight(now),
            claim_order=Model.claim_order,
            fifo_order=lambda m: m.id,
            used=lambda scope: sum(1 for t in self.claims.get((queue, scope), []) if t > now - period),
        )


# What each live message must match in its row, besides its state.
COMPARED = ("queue", "kind", "key", "group", "priority", "payload", "attempts")


# --- the database's side -------------------------------------------------------------------


def empty_tables() -> None:
    for model in (Message, ArchivedMessage, FlowGroup, RateSlot, UniqueWindow):
        model.objects.all().delete()


def backoff(attempts: int) -> int:
    """The pp-* queues' backoff after attempt ``attempts`` (BACKOFF_BASE 30 s, no jitter): whole ticks."""
    options = queue_options("pp-plain")
    return int(min(options.backoff_max, options.backoff_base * 2 ** max(attempts - 1, 0)))


# "a", "A" and "a " are three names (docs/design.md, decision 9).
groups = st.sampled_from([None, "a", "b", "A", "a "])
keys = st.sampled_from([None, "k1", "K1", "k1 "])
key_rules = st.sampled_from(["live", "live", f"unique:{TICK}", f"unique:{3 * TICK}", f"debounce:{TICK}"])
delays = st.sampled_from([0, 0, TICK, 2 * TICK])
priorities = st.sampled_from([0, 0, -1, 1])
kinds = st.sampled_from(["", "", "solo"])
handles = st.integers(min_value=0, max_value=1_000)
limits = st.sampled_from([1, 1, 2, 3])
actions = st.sampled_from(
    [
        "ack",
        "ack",
        "fail:retry",
        "fail:no",
        "release",
        f"snooze:{TICK}",
        f"snooze:{2 * TICK}",
        f"reject:{TICK}",
        "reject:no",
        f"extend:{2 * TICK}",
    ]
)


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        empty_tables()
        self.world = World()
        self.seq = itertools.count(1)
        self.step = 0
        self.handles: list[Message] = []  # claimed messages, some of them with leases long lost
        self.known: list[int] = []  # every id the machine has seen, live or archived

    @initialize(chosen=st.lists(st.sampled_from(QUEUES), min_size=1, max_size=2, unique=True))
    def choose_queues(self, chosen):
        """The example's producers write to one or two queues (and the topic's): backlogs build up there."""
        self.queues = chosen

    # --- helpers ---

    def tick(self) -> int:
        self.step = next(self.seq)
        return self.step

    def track(self, message: Message, queue: str, payload: Any, options: dict[str, Any]) -> None:
        """Record an enqueue's result against what the model expects of it."""
        w = self.world
        key, group = options.get("key"), options.get("group")
        delay = options.get("delay", 0)
        step = self.tick()
        rule_name, _, amount = options.pop("_rule", "live::").partition(":")
        if key is None:
            assert message.was_created, f"an unkeyed enqueue into {queue} created nothing"
            self._add(message.pk, queue, payload, options, (w.now + delay, step))
            return
        live = w.of_key(queue, key)
        if rule_name == "debounce":
            due = (w.now + int(amount), step)
            if live is None:
                assert message.was_created, f"debounce of a key not live in {queue} inserted nothing"
                self._add(message.pk, queue, payload, options, due)
            elif live.token is None and live.attempts == 0:  # waiting, never started: replaced
                assert not message.was_created, f"debounce of waiting message {live.id} inserted {message.pk}"
                if message.pk != live.id:  # replaced by a new row (a new place in its group's order)
                    del w.live[live.id]
                    self._add(message.pk, queue, payload, options, due)
                else:
                    live.payload, live.kind, live.group = payload, options.get("kind", ""), group
                    live.priority = options.get("priority", 0)
                    live.available = live.first = due
            else:  # running or retrying: left alone
                assert not message.was_created and message.pk == live.id, (
                    f"debounce of running message {live.id} gave {message.pk} (created: {message.was_created})"
                )
            return
        if rule_name == "unique":
            until = w.windows.get((queue, key))
            if until is not None and until > w.now:
                assert not message.was_created, f"key {key!r} of {queue} enqueued again inside its unique window"
                assert message.pk == (live.id if live else None), "a refused enqueue returns the live message or none"
                return
            if live is not None:
                assert not message.was_created and message.pk == live.id, f"key {key!r} live in {queue} inserted again"
                return
            assert message.was_created, f"key {key!r} of {queue}: its window passed and nothing is live, yet refused"
            w.windows[(queue, key)] = w.now + int(amount)
            self._add(message.pk, queue, payload, options, (w.now + delay, step))
            return
        if live is not None:
            assert not message.was_created and message.pk == live.id, f"key {key!r} live in {queue} inserted again"
        else:
            assert message.was_created, f"key {key!r} not live in {queue}, yet nothing was inserted"
            self._add(message.pk, queue, payload, options, (w.now + delay, step))

    def _add(self, pk: int, queue: str, payload: Any, options: dict[str, Any], when: tuple[int, int]) -> None:
        assert pk is not None and pk not in self.world.live and pk not in self.world.archived, f"id {pk} reused"
        self.world.live[pk] = Model(
            pk,
            queue,
            options.get("kind", ""),
            options.get("key"),
            options.get("group"),
            options.get("priority", 0),
            payload,
            when,
            when,
        )
        self.known.append(pk)

    def finished(self, pk: int, outcome: str) -> None:
        del self.world.live[pk]
        self.world.archived[pk] = outcome

    def held(self, handle: Message) -> Model | None:
        """The model's message if ``handle``'s lease still holds, else None."""
        m = self.world.live.get(handle.pk)
        if m is not None and m.token == handle.lease_token and m.in_flight(self.world.now):
            return m
        return None

    # --- producers ---

    def options(self, group, key, key_rule, delay, priority, kind) -> dict[str, Any]:
        options: dict[str, Any] = {"group": group, "priority": priority, "kind": kind}
        if key is not None:
            options["key"] = key
            name, _, amount = key_rule.partition(":")
            if name == "unique":
                options["unique"] = timedelta(seconds=int(amount))
            elif name == "debounce":
                options["debounce"] = timedelta(seconds=int(amount))
            options["_rule"] = key_rule
        if "debounce" not in options and delay:
            options["delay"] = delay
        return options

    @rule(
        which=st.integers(min_value=0, max_value=1),
        group=groups,
        key=keys,
        key_rule=key_rules,
        delay=delays,
        priority=priorities,
        kind=kinds,
    )
    def enqueue(self, which, group, key, key_rule, delay, priority, kind):
        queue = self.queues[which % len(self.queues)]
        options = self.options(group, key, key_rule, delay, priority, kind)
        payload = {"n": self.step + 1}
        sent = {k: v for k, v in options.items() if not k.startswith("_")}
        message = django_dbqueue.enqueue(queue, payload, **sent)
        self.track(message, queue, payload, options)

    @rule(which=st.integers(min_value=0, max_value=1), group=groups, key=keys, delay=delays)
    def enqueue_more(self, which, group, key, delay):
        self.enqueue(which, group, key, "live", delay, 0, "")

    @rule(
        which=st.integers(min_value=0, max_value=1),
        count=st.sampled_from([1, 2, 3, 12]),  # 12: a backlog longer than a claim reads ahead (limit + 10)
        group=groups,
        delay=delays,
        priority=priorities,
        kind=kinds,
    )
    def enqueue_many(self, which, count, group, delay, priority, kind):
        queue = self.queues[which % len(self.queues)]
        options = self.options(group, None, "live", delay, priority, kind)
        payloads = [{"n": self.step + 1, "i": i} for i in range(count)]
        messages = django_dbqueue.enqueue_many(queue, payloads, **options)
        assert len(messages) == count
        step = self.tick()
        for message, payload in zip(messages, payloads, strict=True):
            assert message.was_created
            self._add(message.pk, queue, payload, options, (self.world.now + delay, step))

    @rule(which=st.integers(min_value=0, max_value=1), count=st.sampled_from([3, 12]), delay=delays)
    def enqueue_spread(self, which, count, delay):
        """One message into each of ``count`` groups of their own: many groups, each using its own budget."""
        for n in range(count):
            self.enqueue(which, f"s{n}", None, "live", delay, 0, "")

    @rule(group=groups, key=keys, key_rule=key_rules, delay=delays, priority=priorities)
    def publish(self, group, key, key_rule, delay, priority):
        options = self.options(group, key, key_rule, delay, priority, "")
        payload = {"n": self.step + 1}
        sent = {k: v for k, v in options.items() if not k.startswith("_")}
        copies = django_dbqueue.publish(TOPIC, payload, **sent)
        assert [c.queue for c in copies] == TOPIC_QUEUES
        for copy in copies:
            # Each copy is an enqueue into its queue, with the topic in its headers.
            self.track(copy, copy.queue, payload, dict(options))

    # --- consumers ---

    @rule(index=handles, limit=limits)
    def claim(self, index, limit):
        """Claim from a queue that holds live messages (most claims of an empty queue would test little)."""
        busy = sorted({m.queue for m in self.world.live.values()}) or QUEUES
        self.claim_from(busy[index % len(busy)], limit)

    def claim_from(self, queue: str, limit: int) -> None:
        w = self.world
        picks, allowed = w.eligible(queue, limit)
        claimed = django_dbqueue.claim(queue, limit)
        got = [m.pk for m in claimed]
        # A claim that set held-back rows aside for as many windows as it may read, and stopped short, says
        # so: retry_in 0, claim again at once (docs/flow-control.md, "Held-back messages are set aside").
        assert claimed or not picks or claimed.retry_in == 0, (
            f"claim({queue!r}, {limit}) returned nothing while {[m.id for m in picks]} are eligible"
        )
        if not claimed and picks:
            return
        # The first eligible message, or one level with it: on SQLite two writes in one millisecond
        # get the same time, and then the lower id comes first whichever was written first.
        level = [m.id for m in picks if m.claim_order()[:2] == picks[0].claim_order()[:2]] if picks else []
        assert not picks or set(level) & set(got), (
            f"claim({queue!r}, {limit}) took {got}, not the first eligible message {picks[0].id}"
        )
        assert len(got) <= limit and len(set(got)) == len(got)
        assert set(got) <= allowed, f"claim({queue!r}, {limit}) took {got}; only {sorted(allowed)} are eligible"
        step = self.tick()
        rules = Rules.of(queue)
        for message in claimed:
            m = w.live[message.pk]
            m.attempts += 1
            assert message.attempts == m.attempts, f"message {m.id}: attempts {message.attempts}, not {m.attempts}"
            m.token = message.lease_token
            m.available = (w.now + LEASE, step)
            if rules.rate is not None:
                gk = (m.group or "") if rules.rate[2] else ""
                w.claims.setdefault((queue, gk), []).append(w.now)
        self.handles = (self.handles + list(claimed))[-8:]

    # Hypothesis draws rules with fewer arguments more often (it sorts them first): the claim of one
    # message from the example's first queue has none, and with claim_more claims come up most.
    @rule()
    def claim_one(self):
        self.claim_from(self.queues[0], 1)

    @rule(index=handles, limit=limits)
    def claim_more(self, index, limit):
        self.claim(index, limit)

    @precondition(lambda self: self.handles)
    @rule(index=handles, action=actions)
    def consume(self, index, action):
        """One consumer operation on a claimed message, whose lease may hold or be long lost."""
        handle = self.handles[index % len(self.handles)]
        if handle.lease_token is None:  # given up by an earlier operation of this machine
            with pytest.raises(NotClaimed):
                handle.ack()
            return
        m = self.held(handle)
        name, _, argument = action.partition(":")
        if name == "ack":
            done = handle.ack()
        elif name == "fail":
            done = handle.fail("boom", retry=argument == "retry")
        elif name == "release":
            done = handle.release()
        elif name == "reject":
            done = handle.reject(requeue=argument != "no", delay=0 if argument == "no" else int(argument))
        elif name == "extend":
            done = handle.extend_lease(int(argument))
        else:
            done = handle.snooze(delay=int(argument))
        assert done is (m is not None), f"{action} of {handle.pk} answered {done}; the model says held={m is not None}"
        step = self.tick()
        if m is None:
            return
        options = queue_options(m.queue)
        if name == "ack":
            self.finished(m.id, "acked")
        elif name == "fail" and (argument != "retry" or m.attempts >= options.max_attempts):
            self.finished(m.id, "dead")
        elif name == "fail":
            m.token = None
            m.available = (self.world.now + backoff(m.attempts), step)
        elif name == "reject" and (argument == "no" or m.attempts >= options.max_attempts):
            self.finished(m.id, "dead")  # a requeue on the last attempt dead-letters
        elif name == "reject":
            m.token = None
            m.available = (self.world.now + int(argument), step)
        elif name == "extend":
            m.available = (self.world.now + int(argument), step)
        elif name == "release":
            m.token = None
            m.attempts -= 1
            m.available = m.first
        elif m.deferrals >= options.max_deferrals:
            self.finished(m.id, "dead")
        else:
            m.token = None
            m.attempts -= 1
            m.deferrals += 1
            m.available = (self.world.now + int(argument), step)

    @precondition(lambda self: self.handles)
    @rule(index=handles, action=actions)
    def consume_more(self, index, action):
        self.consume(index, action)

    @precondition(lambda self: self.handles)
    @rule(indices=st.lists(handles, min_size=1, max_size=4))
    def ack_many(self, indices):
        """A batch acknowledgement: each message's answer is whether its own lease held."""
        batch = {id(h): h for h in (self.handles[i % len(self.handles)] for i in indices) if h.lease_token}
        handles = list(batch.values())
        if not handles:
            return
        held = [self.held(h) for h in handles]
        # One claim of a message at a time holds its lease; an older handle of it in the same batch is refused.
        done = django_dbqueue.ack_many(handles)
        assert done == [m is not None for m in held], f"ack_many of {[h.pk for h in handles]} answered {done}"
        self.tick()
        for m in held:
            if m is not None:
                self.finished(m.id, "acked")

    @precondition(lambda self: self.known)
    @rule(index=handles, by=st.sampled_from(["", "ops"]))
    def cancel(self, index, by):
        pk = self.known[index % len(self.known)]
        m = self.world.live.get(pk)
        result = control.cancel(pk, by=by)
        self.tick()
        if m is None:
            assert result == control.CancelResult.GONE, f"cancel of finished {pk}: {result!r}"
        elif m.in_flight(self.world.now):
            assert result == control.CancelResult.REQUESTED, f"cancel of running {pk}: {result!r}"
            m.flagged = True
        else:
            assert result == control.CancelResult.ARCHIVED, f"cancel of idle {pk}: {result!r}"
            self.finished(pk, "cancelled")

    # --- housekeeping and time ---

    @rule(ticks=st.integers(min_value=0, max_value=3), passes=st.integers(min_value=0, max_value=2))
    def wait(self, ticks, passes):
        """Time passes (``ticks`` of it), then the reaper makes ``passes`` passes, as ``reapqueue --loop`` would.

        A second pass right after the first finds nothing left to do.
        """
        if ticks:
            advance(ticks * TICK)
            self.world.now += ticks * TICK
        for n in range(passes):
            self.reap(first=n == 0)
        self.tick()

    def reap(self, first: bool) -> None:
        report = Reaper().run_once()
        assert report is not None
        now = self.world.now
        cancelled = [m.id for m in self.world.live.values() if m.flagged and m.token is not None and m.ready(now)]
        for pk in cancelled:
            self.finished(pk, "cancelled")
        poison = [m.id for m in self.world.live.values() if m.exhausted() and m.ready(now)]
        for pk in poison:
            self.finished(pk, "dead")
        assert first or not (cancelled or poison)
        assert (report.cancelled, report.poison, report.expired) == (len(cancelled), len(poison), 0), str(report)

    # --- what must hold after every step ---

    @invariant()
    def agrees_with_the_model(self):
        w = self.world
        now = db_now("default")
        rows = {
            row["id"]: row
            for row in Message.objects.values(
                "id",
                "queue",
                "kind",
                "key",
                "group",
                "priority",
                "payload",
                "attempts",
                "lease_token",
                "available_at",
                "held_priority",
            )
        }
        archive = list(ArchivedMessage.objects.values_list("message_id", "outcome"))
        archived = dict(archive)
        assert len(archived) == len(archive), "a message archived twice"
        assert not set(rows) & set(archived), f"both live and archived: {sorted(set(rows) & set(archived))}"
        assert set(rows) == set(w.live), f"live: {sorted(rows)}, the model says {sorted(w.live)}"
        assert archived == w.archived, f"archived: {archived}, the model says {w.archived}"
        for pk, m in w.live.items():
            row = rows[pk]
            state = (
                "ready" if row["available_at"] <= now else "scheduled" if row["lease_token"] is None else "in_flight"
            )
            if row["held_priority"] is not None:  # set aside (docs/flow-control.md): its own priority is kept
                # never in flight: a lease it carries ran out (a dead worker's), and no longer holds
                assert row["priority"] == flow.SET_ASIDE and (row["lease_token"] is None or state == "ready"), row
                row["priority"] = row["held_priority"]
            got = tuple(row[name] for name in COMPARED)
            want = tuple(getattr(m, name) for name in COMPARED)
            assert got == want, f"message {pk}: {got}, the model says {want}"
            assert state == m.state(w.now), f"message {pk} is {state}, the model says {m.state(w.now)}"
        # No group over its limit; on ordered queues, only a group's oldest live message runs.
        running: dict[tuple[str, str, str], int] = {}
        oldest: dict[tuple[str, str], int] = {}
        for row in rows.values():
            if row["group"] is not None:
                where = (row["queue"], row["group"])
                oldest[where] = min(oldest.get(where, row["id"]), row["id"])
        for row in rows.values():
            if row["group"] is None or row["lease_token"] is None or row["available_at"] <= now:
                continue
            rules = Rules.of(row["queue"])
            cls, limit = rules.limit_of(row["kind"])
            where = (row["queue"], row["group"], cls)
            running[where] = running.get(where, 0) + 1
            assert limit is None or running[where] <= limit, f"group {where} runs {running[where]} (limit {limit})"
            if rules.ordered:
                head = oldest[(row["queue"], row["group"])]
                assert row["id"] == head, f"{row['queue']}/{row['group']}: {row['id']} runs before its head {head}"
        # No rate period holds more claims than the limit.
        for (queue, gk), times in w.claims.items():
            rate = Rules.of(queue).rate
            assert rate is not None
            count, period, _ = rate
            for t in times:
                inside = sum(1 for u in times if t - period < u <= t)
                assert inside <= count, f"{queue}/{gk or '*'}: {inside} claims in the period ending at {t}"


def test_the_queue_keeps_its_documented_promises_under_random_steps(monkeypatch):
    # Claim windows of a message or two: held-back rows are set aside and brought back at almost every
    # step, so the examples' few messages exercise what a backlog of thousands does (docs/flow-control.md).
    for name, value in {"EXTRA_CANDIDATES": 0, "FIRST_SCAN": 1, "MIN_SCAN": 1, "SCAN": 2}.items():
        monkeypatch.setattr(flow, name, value)
    run_machine(QueueMachine, PROFILES)
