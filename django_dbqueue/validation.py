"""Checks run on every value a producer hands us, before anything is written."""

from __future__ import annotations

import json
import math
import re
import textwrap
import threading
import uuid
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from itertools import repeat
from typing import Any, NoReturn, cast

from django.db.models import Model
from django.utils import timezone

from .exceptions import InvalidOption, InvalidQueueName, PayloadNotSerializable

QUEUE_NAME_MAX_LENGTH = 64
KIND_MAX_LENGTH = 100
KEY_MAX_LENGTH = 255
# Letters, digits and ``_ . : -``, starting with a letter or digit.
QUEUE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]*")
# The column's largest value is flow control's: a message set aside has it (docs/flow-control.md).
SET_ASIDE_PRIORITY = 32767
PRIORITY_RANGE = range(-32768, SET_ASIDE_PRIORITY)
JSON_SCALARS = (str, int, float, bool, type(None))


def queue_name_problem(name: Any, what: str = "queue") -> str | None:
    """Why ``name`` is not a valid queue name (``what="topic"``: topic name), or None."""
    return name_problem(name, what, QUEUE_NAME_MAX_LENGTH)


def name_problem(name: Any, what: str, max_length: int) -> str | None:
    """Why ``name`` is not a valid name of a queue, topic or schedule (they share one alphabet), or None."""
    if not isinstance(name, str):
        return f"a {what} name must be a string, not {type(name).__name__}"
    if not name:
        return f"a {what} name must not be empty"
    if len(name) > max_length:
        return f"{what} name {name[:20]!r}... is {len(name)} characters; the limit is {max_length}"
    if not QUEUE_NAME_RE.fullmatch(name):
        return (
            f"{what} name {name!r} may only hold ASCII letters, digits and '_', '.', ':', '-', "
            "and must start with a letter or digit"
        )
    return None


def validate_queue_name(name: Any) -> str:
    if (why := queue_name_problem(name)) is not None:
        raise InvalidQueueName(why)
    return cast(str, name)  # queue_name_problem() found a str


def validate_topic_name(name: Any) -> str:
    """Topic names follow the rules of queue names."""
    if (why := queue_name_problem(name, "topic")) is not None:
        raise InvalidQueueName(why)
    return cast(str, name)  # queue_name_problem() found a str


def validate_queues(queues: str | list[str] | tuple[str, ...]) -> list[str]:
    names = [queues] if isinstance(queues, str) else list(queues)
    if not names:
        raise InvalidQueueName("no queue named: pass a queue name or a non-empty list of them")
    return [validate_queue_name(name) for name in names]


# Limits every database can store, documented in docs/reliability.md. JSON
# nested deeper than MariaDB's JSON functions accept (32 levels) is refused
# everywhere, with room to spare for the headers the queue adds; a payload
# larger than MAX_JSON_BYTES would be refused by MySQL's max_allowed_packet
# (16 MiB by default) once a batch of them is inserted together.
MAX_JSON_DEPTH = 24
MAX_JSON_BYTES = 1_000_000
# The longest delay anything accepts: ten years. A delay past year 9999
# overflows every database's timestamp.
MAX_DELAY_SECONDS = 10 * 365 * 86400.0
# The latest time a run_at or expires_at may name, in UTC: MySQL's DATETIME and
# Python's datetime end with year 9999, and a time zone's offset must not carry
# a value past that end when it is converted (a day spare).
LATEST_TIME = datetime(9999, 12, 30, tzinfo=UTC)
# Integers longer than this are refused: Python reads no longer one from JSON
# (``sys.set_int_max_str_digits``), so a worker could not load the message.
MAX_INT_DIGITS = 4300
_INT_LIMIT = 10**MAX_INT_DIGITS


def _unencodable(value: Any) -> NoReturn:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# Each thread's kept encoder, between two calls.
_KEPT = threading.local()
_PURE_PYTHON = json.JSONEncoder(allow_nan=False).encode


def _new_encoder() -> Any:
    """json's C encoder as ``json.dumps(value, allow_nan=False)`` makes it; None without the C accelerator."""
    make = getattr(json.encoder, "c_make_encoder", None)
    # JSONEncoder's arguments: markers (for cycles), default, string encoder, indent, separators, sort_keys,
    # skipkeys, allow_nan.
    return make and make({}, _unencodable, json.encoder.encode_basestring_ascii, None, ": ", ", ", False, False, False)


def _encode(value: Any) -> str:
    """The JSON text ``json.dumps(value, allow_nan=False)`` writes, by an encoder kept per thread.

    ``json.dumps`` makes its C encoder anew on every call, which cost twice
    the encoding of a small payload. A kept one holds the markers of the
    containers it is inside, so it is taken out while it encodes and put
    back only after a success: a call nested in this one (a dict subclass
    whose ``items()`` calls back in) makes its own, and an error drops it
    with whatever markers it left.
    """
    kept = _KEPT.__dict__  # this thread's
    chunks = kept.pop("encoder", None) or _new_encoder()
    if chunks is None:
        return _PURE_PYTHON(value)
    text = "".join(chunks(value, 0))
    kept["encoder"] = chunks
    return text


def text_problem(text: str, path: str) -> str | None:
    """Why a string cannot be stored as given on every database, or None.

    PostgreSQL refuses NUL in text and JSON; a lone surrogate is not UTF-8
    and no driver encodes it. The other databases would store either, so the
    same value would behave differently per database: refuse both everywhere.
    """
    if "\x00" in text:
        return f"{path} holds a NUL character (\\x00), which PostgreSQL cannot store; remove or encode it"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"{path} holds a lone surrogate ({text[exc.start]!r} at {exc.start}), which is not valid UTF-8"
    return None


def json_problem(value: Any, path: str, *, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Name the first part of ``value`` that is not plain, storable JSON, or None.

    Walks iteratively: a value nested thousands deep gets a clear refusal,
    not a RecursionError.
    """
    stack: list[tuple[Any, str, int]] = [(value, path, 1)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            if (why := text_problem(item, where)) is not None:
                return why
            continue
        if isinstance(item, float) and not math.isfinite(item):
            return f"{where} is {item!r}, which JSON cannot represent"
        if isinstance(item, int) and not -_INT_LIMIT < item < _INT_LIMIT:
            return (
                f"{where} is an integer of more than {MAX_INT_DIGITS:,} digits, which a JSON reader refuses "
                "(Python's int_max_str_digits); store it as a string"
            )
        if isinstance(item, JSON_SCALARS):
            continue
        if not isinstance(item, dict | list | tuple):
            kind = type(item).__name__
            return f"{where} is of type {kind} ({short_repr(item)}), which is not JSON-serialisable{json_hint(item)}"
        if depth > max_depth:
            return f"{path} is nested more than {max_depth} levels deep (at {where}); the limit is {max_depth}"
        children: list[tuple[Any, str, int]] = []
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    return (
                        f"{where} has a key {_key_text(key)} of type {type(key).__name__}; JSON object keys are strings"
                    )
                if (why := text_problem(key, f"{where} key {key!r:.40}")) is not None:
                    return why
                children.append((child, f"{where}[{key!r}]", depth + 1))
        else:
            children = [(child, f"{where}[{index}]", depth + 1) for index, child in enumerate(item)]
        stack.extend(reversed(children))
    return None


def _key_text(key: Any) -> str:
    """``repr(key)``, or a stand-in where Python will not write it (an integer past int_max_str_digits)."""
    try:
        return repr(key)
    except ValueError:
        return "(one Python will not write as text)"


def short_repr(value: Any, width: int = 80) -> str:
    """``repr(value)`` in at most about ``width`` characters, cut between words, never inside one."""
    return textwrap.shorten(repr(value), width, placeholder=" ...")


def json_hint(value: Any) -> str:
    """What to pass instead of ``value``, which JSON cannot hold (a clause to append), or "".

    The queue stores plain JSON, which every database and every consumer
    (SQL, other languages) reads the same way: the producer converts.
    """
    if isinstance(value, datetime | date | time):
        # The class whose fromisoformat reads it back: datetime first, which is a date too.
        parse = "datetime" if isinstance(value, datetime) else "date" if isinstance(value, date) else "time"
        return f"; pass value.isoformat() and parse it back in the handler ({parse}.fromisoformat)"
    if isinstance(value, timedelta):
        return "; pass value.total_seconds()"
    if isinstance(value, Decimal):
        return "; pass str(value) to keep every digit (and Decimal(text) in the handler)"
    if isinstance(value, uuid.UUID):
        return "; pass str(value)"
    if isinstance(value, Model):
        return (
            "; pass its primary key (value.pk) and load the row in the handler, which then sees it as it is"
            " when the handler runs"
        )
    if isinstance(value, set | frozenset):
        return "; pass a list (sorted(value))"
    if isinstance(value, bytes | bytearray):
        return "; pass text (value.decode()) or base64 (base64.b64encode(value).decode())"
    return "; convert it to JSON first: a dict of its fields, str(value), or its id, and rebuild it in the handler"


def _plain_json(value: Any) -> str | None:
    """``value``'s JSON text when it plainly passes `json_problem`; None when only that walk can tell.

    The walk looks at every scalar in Python, and it was most of the cost
    of building a message. Here the JSON encoder (in C) refuses what is not
    JSON, NaN and infinities; its ASCII text shows any NUL (``\\u0000``)
    and any surrogate (``\\udXXX``, lone or in a pair: then the walk
    decides). What is left is the containers: keys that are not strings
    (which the encoder turns into strings) and depth. The text's brackets
    bound the containers (a string's brackets only add to the count), so a
    payload with no object and few lists, or one flat object, needs no walk
    at all. None sends the caller to the walk, which names the problem.
    """
    try:
        text = _encode(value)
    except (TypeError, ValueError, RecursionError):
        return None
    if "\\u0000" in text or "\\ud" in text:
        return None
    objects = text.count("{")
    if objects == 0 and text.count("[") <= MAX_JSON_DEPTH:
        return text  # no keys to check, and too few containers to nest too deep
    if objects == 1 and "[" not in text and isinstance(value, dict):
        return text if all(map(isinstance, value, repeat(str))) else None  # one flat object: its keys
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list | tuple) else []
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return None
        children = item.values() if isinstance(item, dict) else item
        if isinstance(item, dict) and not all(type(key) is str for key in item):
            return None
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list | tuple))
    return text


def json_size_problem(value: Any, path: str, limit: int = MAX_JSON_BYTES, *, text: str | None = None) -> str | None:
    """Why ``value`` (already plain JSON) is too large to store, or None.

    The limit counts the text that is written: ``json.dumps``'s, which
    escapes every non-ASCII character (``\\u00e9``), up to three times its
    UTF-8 size. ``text``: that text, when the caller has it already.
    """
    size = len(json.dumps(value) if text is None else text)
    if size > limit:
        return (
            f"{path} is {size:,} bytes as stored JSON (non-ASCII text is written escaped); the limit is "
            f"{limit:,} bytes (store large data elsewhere and pass a reference)"
        )
    return None


def validate_payload(payload: Any) -> Any:
    payload_json(payload)
    return payload


def payload_json(payload: Any) -> str:
    """Check a payload and return the JSON text an INSERT stores: one ``json.dumps`` serves the check and the write.

    The limit counts this text, as written (non-ASCII escaped).
    """
    if payload is None:
        raise PayloadNotSerializable("payload is None; pass {} for an empty payload")
    text = _plain_json(payload)
    if text is None:
        if (why := json_problem(payload, "payload")) is not None:
            raise PayloadNotSerializable(why)
        text = json.dumps(payload)
    if len(text) > MAX_JSON_BYTES and (why := json_size_problem(payload, "payload", text=text)) is not None:
        raise PayloadNotSerializable(why)
    return text


def validate_headers(headers: Any) -> dict[str, Any]:
    if headers is None:
        return {}
    if not isinstance(headers, dict):
        raise PayloadNotSerializable(f"headers must be a dict, not {type(headers).__name__}")
    if (why := json_problem(headers, "headers") or json_size_problem(headers, "headers")) is not None:
        raise PayloadNotSerializable(why)
    return headers


def storable_text(text: str, limit: int | None = 65_536) -> str:
    """Text the queue writes itself (errors, tracebacks, output tails), made storable everywhere.

    NUL and lone surrogates are escaped (visibly: ``\\x00``, ``\\ud800``), and
    text past ``limit`` characters (None: no limit) keeps its head and its
    tail, where a traceback says what happened.
    """
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if limit is not None and len(text) > limit:
        cut = len(text) - limit
        head = limit // 4
        text = f"{text[:head]}\n[... {cut:,} characters cut ...]\n{text[head + cut + 40 :]}"
    return text


def storable_result(value: Any) -> tuple[Any, str | None]:
    """A handler's return value as the archive keeps it: (value or None, why it was not kept)."""
    if value is None:
        return None, None
    why = json_problem(value, "the handler's result") or json_size_problem(value, "the handler's result")
    return (None, why) if why else (value, None)


def validate_kind(kind: Any) -> str:
    if not isinstance(kind, str):
        raise InvalidOption(f"kind must be a string, not {type(kind).__name__}")
    if len(kind) > KIND_MAX_LENGTH:
        raise InvalidOption(f"kind is {len(kind)} characters; the limit is {KIND_MAX_LENGTH}")
    if (why := text_problem(kind, "kind")) is not None:
        raise InvalidOption(why)
    return kind


def validate_key(key: Any, what: str = "key") -> str | None:
    """A message's key or group: None, or a non-empty storable string of at most 255 characters."""
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise InvalidOption(f"{what} must be a non-empty string or None, not {key!r}")
    if len(key) > KEY_MAX_LENGTH:
        raise InvalidOption(f"{what} is {len(key)} characters; the limit is {KEY_MAX_LENGTH}")
    if (why := text_problem(key, what)) is not None:
        raise InvalidOption(why)
    return key


def validate_priority(priority: Any) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int) or priority not in PRIORITY_RANGE:
        raise InvalidOption(f"priority must be an integer from -32768 to 32766 (smaller runs first), not {priority!r}")
    return priority


def seconds(value: Any, name: str, *, allow_zero: bool = True) -> float:
    """A delay or timeout given as seconds or a timedelta, as float seconds."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidOption(f"{name} must be a number of seconds or a timedelta, not {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InvalidOption(f"{name} must be {'>= 0' if allow_zero else '> 0'} seconds, not {value!r}")
    if value > MAX_DELAY_SECONDS:
        raise InvalidOption(f"{name} is {value:g} seconds; the limit is {MAX_DELAY_SECONDS:g} (ten years)")
    return float(value)


def aware_datetime(value: Any, name: str) -> datetime | None:
    """A timezone-aware datetime that every database stores (not past ``LATEST_TIME``), or None."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidOption(f"{name} must be a datetime, not {type(value).__name__}")
    if timezone.is_naive(value):
        raise InvalidOption(f"{name} must be timezone-aware (got naive {value.isoformat()})")
    try:
        late = value > LATEST_TIME
    except OverflowError:  # its offset carries it past year 9999 in UTC
        late = True
    if late:
        raise InvalidOption(
            f"{name} is {value.isoformat()}; the latest time a message may name is {LATEST_TIME:%Y-%m-%d} UTC"
        )
    return value


def message_id(value: Any, what: str = "message") -> int:
    """A message's id: a positive integer. Django would make 15 of 15.5 (and match nothing with None): refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidOption(f"{what} must be a Message or its integer id, not {value!r} ({type(value).__name__})")
    if value < 1:
        raise InvalidOption(f"{what} id must be a positive integer, not {value!r}")
    return value


def validate_max_attempts(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 32767:
        raise InvalidOption(f"max_attempts must be an integer from 1 to 32767, not {value!r}")
    return value
