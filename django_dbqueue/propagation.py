"""Hooks that add headers to every message built for enqueue: trace context (docs/tracing.md), or a project's own.

A hook is ``hook(queue, kind, headers) -> headers`` and must return a JSON
object. With none registered (the default) building a message costs one
test of an empty list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

HeaderHook = Callable[[str, str, dict[str, Any]], dict[str, Any]]

#: The registered hooks, in order; read by models.messages.build_message.
hooks: list[HeaderHook] = []


def add(hook: HeaderHook) -> None:
    """Register ``hook`` (once)."""
    if hook not in hooks:
        hooks.append(hook)


def remove(hook: HeaderHook) -> None:
    if hook in hooks:
        hooks.remove(hook)


def outgoing(queue: str, kind: str, headers: dict[str, Any]) -> dict[str, Any]:
    """The headers after every hook."""
    for hook in hooks:
        headers = hook(queue, kind, headers)
    return headers
