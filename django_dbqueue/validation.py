"""Checks run on every value a producer hands us, before anything is written."""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from .exceptions import InvalidOption, InvalidQueueName, PayloadNotSerializable

QUEUE_NAME_MAX_LENGTH = 64
KIND_MAX_LENGTH = 100
KEY_MAX_LENGTH = 255
# Letters, digits and ``_ . : -``, starting with a letter or digit.
QUEUE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]*")
PRIORITY_RANGE = range(-32768, 32768)
JSON_SCALARS = (str, int, float, bool, type(None))


def queue_name_problem(name: Any, what: str = "queue") -> str | None:
    """Why ``name`` is not a valid queue name (``what="topic"``: topic name), or None."""
    if not isinstance(name, str):
        return f"a {what} name must be a string, not {type(name).__name__}"
    if not name:
        return f"a {what} name must not be empty"
    if len(name) > QUEUE_NAME_MAX_LENGTH:
        return f"{what} name {name[:20]!r}... is {len(name)} characters; the limit is {QUEUE_NAME_MAX_LENGTH}"
    if not QUEUE_NAME_RE.fullmatch(name):
        return (
            f"{what} name {name!r} may only hold letters, digits and '_', '.', ':', '-', "
            "and must start with a letter or digit"
        )
    return None


def validate_queue_name(name: Any) -> str:
    if (why := queue_name_problem(name)) is not None:
        raise InvalidQueueName(why)
    return name


def validate_topic_name(name: Any) -> str:
    """Topic names follow the rules of queue names."""
    if (why := queue_name_problem(name, "topic")) is not None:
        raise InvalidQueueName(why)
    return name


def validate_queues(queues: str | list[str] | tuple[str, ...]) -> list[str]:
    names = [queues] if isinstance(queues, str) else list(queues)
    if not names:
        raise InvalidQueueName("no queue named: pass a queue name or a non-empty list of them")
    return [validate_queue_name(name) for name in names]


def json_problem(value: Any, path: str) -> str | None:
    """Name the first part of ``value`` that is not plain JSON, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path} is {value!r}, which JSON cannot represent"
    if isinstance(value, JSON_SCALARS):
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{path} has a key {key!r} of type {type(key).__name__}; JSON object keys are strings"
            if (why := json_problem(item, f"{path}[{key!r}]")) is not None:
                return why
        return None
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            if (why := json_problem(item, f"{path}[{index}]")) is not None:
                return why
        return None
    return f"{path} is a {type(value).__name__} ({value!r:.60}), which is not JSON-serialisable"


def validate_payload(payload: Any) -> Any:
    if payload is None:
        raise PayloadNotSerializable("payload is None; pass {} for an empty payload")
    if (why := json_problem(payload, "payload")) is not None:
        raise PayloadNotSerializable(why)
    return payload


def validate_headers(headers: Any) -> dict[str, Any]:
    if headers is None:
        return {}
    if not isinstance(headers, dict):
        raise PayloadNotSerializable(f"headers must be a dict, not {type(headers).__name__}")
    if (why := json_problem(headers, "headers")) is not None:
        raise PayloadNotSerializable(why)
    return headers


def validate_kind(kind: Any) -> str:
    if not isinstance(kind, str):
        raise InvalidOption(f"kind must be a string, not {type(kind).__name__}")
    if len(kind) > KIND_MAX_LENGTH:
        raise InvalidOption(f"kind is {len(kind)} characters; the limit is {KIND_MAX_LENGTH}")
    return kind


def validate_key(key: Any) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise InvalidOption(f"key must be a non-empty string or None, not {key!r}")
    if len(key) > KEY_MAX_LENGTH:
        raise InvalidOption(f"key is {len(key)} characters; the limit is {KEY_MAX_LENGTH}")
    return key


def validate_priority(priority: Any) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int) or priority not in PRIORITY_RANGE:
        raise InvalidOption(f"priority must be an integer from -32768 to 32767 (smaller runs first), not {priority!r}")
    return priority


def seconds(value: Any, name: str, *, allow_zero: bool = True) -> float:
    """A delay or timeout given as seconds or a timedelta, as float seconds."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidOption(f"{name} must be a number of seconds or a timedelta, not {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InvalidOption(f"{name} must be {'>= 0' if allow_zero else '> 0'} seconds, not {value!r}")
    return float(value)


def aware_datetime(value: Any, name: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidOption(f"{name} must be a datetime, not {type(value).__name__}")
    if timezone.is_naive(value):
        raise InvalidOption(f"{name} must be timezone-aware (got naive {value.isoformat()})")
    return value


def validate_max_attempts(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 32767:
        raise InvalidOption(f"max_attempts must be an integer from 1 to 32767, not {value!r}")
    return value
