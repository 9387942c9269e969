"""Testing code that enqueues: run handlers in the test's process, assert what was enqueued, move time.

``QueueTestTools`` holds the methods; the pytest plugin's ``dbqueue``
fixture is one, and `QueueTestMixin` gives them to a Django
``TestCase``. See docs/testing.md.

The names load lazily: pytest imports the plugin in this package before
Django is set up, and the tools need the models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tools import QueueStillBusy as QueueStillBusy
    from .tools import QueueTestMixin as QueueTestMixin
    from .tools import QueueTestTools as QueueTestTools
    from .tools import contains as contains

__all__ = ["QueueStillBusy", "QueueTestMixin", "QueueTestTools", "contains"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import tools

        return getattr(tools, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
