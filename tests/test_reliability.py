"""Reliability rules of the model layer, each guarding a defect seen before (issue 15).

Every test here failed on the code before its fix, or guards a quicker
path to the same rule; each runs on SQLite, MariaDB and PostgreSQL. Faults that need real worker processes are in
tests/test_faults.py.
"""

import ast
import contextlib
import enum
import json
import subprocess
import sys
import textwrap
import threading
import time
from decimal import Decimal
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

import django_dbqueue
from django_dbqueue import checks as dbqueue_checks
from django_dbqueue import control, validation
from django_dbqueue.db.clock import DbNow
from django_dbqueue.exceptions import InvalidOption, PayloadNotSerializable
from django_dbqueue.models import ArchivedMessage, Message, Worker
from django_dbqueue.models.consuming import backoff_delay
from django_dbqueue.models.workers import WorkerQuerySet
from django_dbqueue.operations import build_message, enqueue_built
from django_dbqueue.reaper import Reaper
from tests.support.factories import WorkerFactory
from tests.support.processes import ROOT, child_env

pytestmark = pytest.mark.django_db(transaction=True)


def nested(depth: int) -> list:
    """A JSON list nested ``depth`` levels deep."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


# --- values a producer hands in ----------------------------------------------------

UNSTORABLE = [
    # (payload, options, words): each stored by one database and refused by another, before this fix
    ({"note": "nul\x00inside"}, {}, "NUL character"),
    ({"note": "\ud800"}, {}, "lone surrogate"),
    ({"nul\x00key": 1}, {}, "NUL character"),
    ({}, {"headers": {"h": "a\x00b"}}, "NUL character"),
    ({}, {"kind": "k\x00"}, "NUL character"),
    ({}, {"key": "\udfff"}, "lone surrogate"),
    (nested(validation.MAX_JSON_DEPTH + 1), {}, f"the limit is {validation.MAX_JSON_DEPTH}"),
    (nested(2000), {}, f"the limit is {validation.MAX_JSON_DEPTH}"),  # was a bare RecursionError
    (
        {"blob": "x" * (validation.MAX_JSON_BYTES + 1)},
        {},
        "bytes as stored JSON .non-ASCII text is written escaped.; the limit is 1,000,000",
    ),
]


@pytest.mark.parametrize(("payload", "options", "words"), UNSTORABLE)
def test_values_some_database_cannot_store_are_refused_on_every_database(
    payload, options, words, archive_and_live_counts
):
    with pytest.raises((PayloadNotSerializable, InvalidOption), match=words):
        django_dbqueue.enqueue("q", payload, **options)
    with pytest.raises((PayloadNotSerializable, InvalidOption), match=words):
        django_dbqueue.enqueue_many("q", [payload], **options)
    if not options:
        with pytest.raises(PayloadNotSerializable, match=words):
            django_dbqueue.enqueue_many("q", [{"fine": 1}, payload])
    assert archive_and_live_counts() == (0, 0)


def nested_dicts(depth: int) -> dict:
    """A JSON object nested ``depth`` levels deep."""
    value: dict = {}
    for _ in range(depth - 1):
        value = {"k": value}
    return value


class Level(enum.IntEnum):
    HIGH = 1


class Subclassed(str):
    pass


def cyclic_list() -> list:
    """A list that holds itself: the kept encoder's markers catch it at its second visit."""
    value: list = [1]
    value.append(value)
    return value


def cyclic_dict() -> dict:
    value: dict = {"a": 1}
    value["self"] = value
    return value


# Values at the edges of what payload_json() takes: its quick check (json.dumps, then the containers) must
# give what the walk over every value gives, the text to store or the walk's refusal word for word.
EDGES = [
    {"n": 1, "s": "plain"},
    7,
    "text",
    [1, [2, (3, 4)], {"t": (5,)}],
    {"emoji": "😀", "é": "é"},  # a surrogate pair in the text: the walk decides, and takes it
    {"looks escaped": "\\u0000 and \\ud800"},  # backslashes, not a NUL or a surrogate
    ["a", 1, None, 2.5],  # no object: no key to check
    {"brackets": "a { [ b"},  # a string's brackets count as containers: the walk decides, and takes it
    {"k": 1, 2: "second key an int"},
    ["[" * 30],
    {"level": Level.HIGH, "big": 2**80, "f": -0.0, "none": None, "yes": True},
    {1: "int key"},
    {True: "bool key"},
    {None: "None key"},
    {"k": {2.5: "float key"}},
    {"nan": float("nan")},
    [float("-inf")],
    {"nul": "a\x00b"},
    {"pair": "\ud83d"},
    {"d": Decimal("1")},
    {"s": {1, 2}},
    {"b": b"bytes"},
    nested(validation.MAX_JSON_DEPTH),
    nested(validation.MAX_JSON_DEPTH + 1),
    nested_dicts(validation.MAX_JSON_DEPTH),
    nested_dicts(validation.MAX_JSON_DEPTH + 1),
    {"k": [nested_dicts(validation.MAX_JSON_DEPTH - 1)]},
    nested(2000),
    cyclic_list(),
    cyclic_dict(),
    {"long": 10 ** (validation.MAX_INT_DIGITS + 5)},  # past Python's int_max_str_digits
    [1, object()],
    {"sub": Subclassed("text")},
    {10 ** (validation.MAX_INT_DIGITS + 5): "a key Python will not write as text"},
]


@pytest.fixture(params=["C accelerator", "pure Python"])
def encoder(request, monkeypatch):
    """The kept encoder as made with json's C accelerator, and as made where there is none."""
    if request.param == "pure Python":
        monkeypatch.setattr(json.encoder, "c_make_encoder", None)
        monkeypatch.setattr(validation, "_KEPT", threading.local())  # this thread's next encoder made anew
    return request.param


@pytest.mark.parametrize("payload", EDGES, ids=range(len(EDGES)))
def test_the_payload_check_takes_and_refuses_what_the_walk_over_every_value_does(payload, encoder):
    why = validation.json_problem(payload, "payload")
    if why is None:
        assert validation.payload_json(payload) == json.dumps(payload)
    else:
        with pytest.raises(PayloadNotSerializable) as refused:
            validation.payload_json(payload)
        assert str(refused.value) == why


def test_a_cycle_is_refused_in_a_thread_with_a_small_stack():
    """A cycle must be caught by the encoder's markers: without them it ran the C stack down to the
    recursion limit, which a thread of 1 MiB (musl's images' default) did not survive on Python 3.13.
    In a child process, so that a crash fails this test instead of ending the suite. (On 3.11 and 3.12
    an encoder without markers ends in RecursionError, which is refused the same way: 3.13 is where this
    test tells the two apart.)"""
    code = textwrap.dedent(
        """
        import threading
        from django_dbqueue import validation
        from django_dbqueue.exceptions import PayloadNotSerializable

        cyclic = {"a": 1}
        cyclic["self"] = cyclic
        said = []

        def check():
            for _ in range(3):  # the markers an error left are cleared: the next call is not misled
                try:
                    validation.payload_json(cyclic)
                except PayloadNotSerializable as refused:
                    said.append(str(refused))
            said.append(validation.payload_json({"after": [1, {"ok": True}]}))

        threading.stack_size(1024 * 1024)
        thread = threading.Thread(target=check)
        thread.start()
        thread.join()
        print(said)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT, env=child_env()
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    said = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert len(said) == 4 and all("nested more than" in why for why in said[:3]), said
    assert said[3] == '{"after": [1, {"ok": true}]}'


def test_an_encoding_error_leaves_no_marker_behind():
    """The kept encoder remembers the containers it is inside; after an error the next call must not
    find them there (it would take the same container for a cycle)."""
    holder = {"n": 1, "bad": object()}
    with pytest.raises(PayloadNotSerializable):
        validation.payload_json(holder)
    del holder["bad"]
    assert validation._encode(holder) == '{"n": 1}'


class CallsBack(dict):
    """A dict whose items() checks another payload, which fails, while the encoder is inside it."""

    def items(self):
        with contextlib.suppress(PayloadNotSerializable):
            validation.payload_json({"bad": object()})
        return super().items()


def test_a_check_nested_in_another_on_one_thread_leaves_the_outer_one_whole():
    """The encoder is the thread's, and a dict subclass's Python code can run in the middle of its work."""
    assert validation.payload_json({"outer": [CallsBack(a=1)]}) == '{"outer": [{"a": 1}]}'


def test_the_limits_themselves_are_stored_on_every_database():
    deepest = nested(validation.MAX_JSON_DEPTH)
    big = {"blob": "x" * (validation.MAX_JSON_BYTES - 20)}
    django_dbqueue.enqueue("q", deepest, headers={"h": nested(validation.MAX_JSON_DEPTH - 1)})
    django_dbqueue.enqueue("q", big)
    stored = list(Message.objects.order_by("id").values_list("payload", flat=True))
    assert stored == [deepest, big]


# --- text the queue writes itself ----------------------------------------------------


def test_an_error_text_with_a_nul_is_recorded_escaped(settings):
    settings.DBQUEUE = {"BACKOFF_BASE": 0}
    django_dbqueue.enqueue("q", {}, max_attempts=2)
    [message] = django_dbqueue.claim("q")
    assert message.fail(ValueError("bad\x00byte \ud800"))  # refused by PostgreSQL before
    stored = Message.objects.get().last_error
    assert "bad\\x00byte \\ud800" in stored and "\x00" not in stored
    [message] = django_dbqueue.claim("q")
    assert message.fail("again\x00")  # the last attempt: archived as dead
    assert "again\\x00" in ArchivedMessage.objects.dead().get().last_error


def test_a_result_that_cannot_be_stored_does_not_stop_the_ack():
    django_dbqueue.enqueue("q", {"n": 1})
    django_dbqueue.enqueue("q", {"n": 2})
    django_dbqueue.enqueue("q", {"n": 3})
    first, second, third = django_dbqueue.claim("q", 3)
    assert first.ack(result={"text": "nul\x00"})
    huge = "y" * (validation.MAX_JSON_BYTES + 1)
    assert django_dbqueue.ack_many([second, third], results={second.pk: {"r": huge}, third.pk: {"ok": True}}) == [
        True,
        True,
    ]
    rows = {row.message_id: row for row in ArchivedMessage.objects.acked()}
    assert rows[first.pk].result is None and "result not kept" in rows[first.pk].last_error
    assert rows[second.pk].result is None and "the limit is 1,000,000" in rows[second.pk].last_error
    assert rows[third.pk].result == {"ok": True} and rows[third.pk].last_error == ""
    assert Message.objects.count() == 0


def test_long_error_texts_keep_their_head_and_tail():
    text = "head " + "x" * 200_000 + " tail"
    kept = validation.storable_text(text)
    assert len(kept) <= 65_536 and kept.startswith("head ") and kept.endswith(" tail") and "characters cut" in kept


# --- numbers -------------------------------------------------------------------------


@pytest.mark.parametrize("delay", [1e12, float("inf"), float("nan")])
def test_a_delay_past_any_timestamp_is_refused_and_changes_nothing(delay):
    django_dbqueue.enqueue("q", {})
    [message] = django_dbqueue.claim("q")
    before = Message.objects.values_list("available_at", "lease_token", "attempts").get()
    for operation in (
        lambda: message.reject(delay=delay),
        lambda: message.snooze(delay=delay),
        lambda: message.extend_lease(delay),
    ):
        with pytest.raises(InvalidOption, match=r"delay|seconds"):
            operation()
    assert Message.objects.values_list("available_at", "lease_token", "attempts").get() == before
    with pytest.raises(InvalidOption):
        django_dbqueue.enqueue("q", {}, delay=delay)


def test_backoff_is_capped_at_any_attempt_number(settings):
    settings.DBQUEUE = {"BACKOFF_BASE": 2.0, "BACKOFF_MAX": 60.0, "BACKOFF_JITTER": 0}
    message = Message(queue="q", attempts=1100)  # 2 ** 1099 overflowed a float before
    assert backoff_delay(message) == 60.0


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("VISIBILITY_TIMEOUT", float("nan"), "must be a finite number"),
        ("VISIBILITY_TIMEOUT", float("inf"), "must be a finite number"),
        ("VISIBILITY_TIMEOUT", 10**9, "must be <= 604800"),
        ("RETENTION_DAYS", 10**6, "must be <= 36500"),
        ("BACKOFF_MAX", 1e12, "must be <= 3.1536e+08"),
        ("MAX_ATTEMPTS", 40_000, "must be <= 32767"),
        ("HEARTBEAT_INTERVAL", float("nan"), "must be a finite number"),
    ],
)
def test_settings_past_their_bounds_are_system_check_errors(settings, key, value, words):
    settings.DBQUEUE = {key: value}
    [error] = dbqueue_checks.check_setting()
    assert error.id == "django_dbqueue.E001" and f"DBQUEUE[{key!r}] {words}" in error.msg


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e12"])
def test_command_line_durations_are_bounded(value):
    with pytest.raises(CommandError, match="invalid"):
        call_command("runqueueworker", "q", "--visibility-timeout", value)


# --- attempts, leases, replays -------------------------------------------------------


def test_a_requeue_on_the_last_attempt_dead_letters():
    django_dbqueue.enqueue("q", {}, max_attempts=1)
    [message] = django_dbqueue.claim("q")
    assert message.reject(requeue=True, reason="try later")
    assert django_dbqueue.claim("q") == []  # before the fix: claimed again and again
    dead = ArchivedMessage.objects.dead().get()
    assert "try later" in dead.last_error and "last attempt (1 of 1)" in dead.last_error


def test_ack_many_refuses_a_lease_that_ran_out():
    django_dbqueue.enqueue("q", {})
    [message] = django_dbqueue.claim("q", visibility_timeout=0.2)
    time.sleep(0.5)
    assert django_dbqueue.ack_many([message]) == [False]
    assert message.ack() is False
    assert Message.objects.count() == 1 and ArchivedMessage.objects.count() == 0


def test_a_forced_replay_never_reruns_an_acked_message():
    django_dbqueue.enqueue("q", {})
    [message] = django_dbqueue.claim("q")
    message.ack()
    with pytest.raises(InvalidOption, match="is acked"):
        control.replay(ArchivedMessage.objects.get(), force=True)
    assert Message.objects.count() == 0


def test_a_released_message_keeps_its_place():
    django_dbqueue.enqueue("q", {"n": "first"})
    [first] = django_dbqueue.claim("q")
    time.sleep(0.05)
    django_dbqueue.enqueue_many("q", [{"n": "later"}] * 3)
    assert first.release()
    [again] = django_dbqueue.claim("q")
    assert again.pk == first.pk and again.attempts == 1


def test_reply_goes_only_to_a_reply_queue_the_request_made():
    django_dbqueue.enqueue("q", {}, headers={"reply_to": "payments", "correlation_id": "abc"})
    [message] = django_dbqueue.claim("q")
    with pytest.raises(InvalidOption, match="not the reply queue"):
        django_dbqueue.reply(message, {"paid": True})
    assert not Message.objects.filter(queue="payments").exists()


def test_enqueue_many_survives_a_live_key_finishing_under_it(monkeypatch):
    live = django_dbqueue.enqueue("q", {"old": True}, key="k")
    original = Message.objects.model._default_manager.get_queryset().__class__.bulk_create
    calls = []

    def finish_the_live_one_first(self, objs, *args, **kwargs):
        created = original(self, objs, *args, **kwargs)
        if not calls:  # the live row finishes right after our INSERT skipped its key
            calls.append(1)
            Message.objects.filter(pk=live.pk).delete()
        return created

    monkeypatch.setattr(type(Message.objects.get_queryset()), "bulk_create", finish_the_live_one_first)
    pending = [build_message("q", {"new": True}, {"key": "k"}), build_message("q", {"other": True}, {"key": "k2"})]
    made = enqueue_built(pending, "default")  # the path of enqueue_many, publish and the outbox
    assert calls == [1]  # before the fix: KeyError, and the whole batch rolled back
    keyed = Message.objects.get(key="k")
    assert keyed.payload == {"new": True} and made[0].pk == keyed.pk and made[0].was_created
    assert [m.key for m in made] == ["k", "k2"] and Message.objects.count() == 2


def test_a_stale_worker_whose_heartbeat_returns_keeps_its_claims(monkeypatch):
    worker = WorkerFactory(stale=True, name="host:1:back")
    django_dbqueue.enqueue("q", {})
    django_dbqueue.claim("q", worker=worker.name)
    lock_if_stale = WorkerQuerySet.lock_if_stale

    def heartbeat_arrives_first(self, name, after):
        Worker.objects.filter(name=name).update(last_heartbeat_at=DbNow())
        return lock_if_stale(self, name, after)

    monkeypatch.setattr(WorkerQuerySet, "lock_if_stale", heartbeat_arrives_first)
    report = Reaper().run_once()
    assert report.released == 0 and report.stale_workers == 0
    assert Message.objects.get().lease_token is not None and Worker.objects.filter(name=worker.name).exists()


def test_a_stale_worker_still_silent_loses_its_claims():
    worker = WorkerFactory(stale=True)
    django_dbqueue.enqueue("q", {}, max_attempts=3)
    django_dbqueue.claim("q", worker=worker.name)
    report = Reaper().run_once()
    assert report.released == 1 and report.stale_workers == 1
    message = Message.objects.get()
    assert message.lease_token is None and message.available_at == message.first_available_at
    assert not Worker.objects.filter(name=worker.name).exists()


def test_the_limits_are_what_the_docs_say():
    text = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text()
    assert f"{validation.MAX_JSON_DEPTH} levels" in text and f"{validation.MAX_JSON_BYTES:,} bytes" in text
