"""Waking idle workers when messages arrive.

PostgreSQL has ``LISTEN/NOTIFY``: a statement-level trigger (installed by
migration 0002, whose SQL is frozen there) notifies once per INSERT
statement and queue, delivered at commit, so a worker never wakes for a
message it cannot see yet. Plain-SQL producers trigger it too.

MySQL/MariaDB and SQLite have no such thing. There each worker binds a UDP
socket (`NudgeReceiver`) and writes its address in its worker row;
after an enqueue commits, the producer sends the queue's name to the
workers of that queue (`nudge`). Datagrams can be lost, and
plain-SQL producers send none: it only shortens the wait, workers still
poll, and nothing depends on a nudge arriving.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

from django.db import connections

MAX_DATAGRAM = 512  # a queue name is at most 64 characters

logger = logging.getLogger("django_dbqueue")

NOTIFY_CHANNEL = "dbqueue"


def listen_alias(using: str) -> str | None:
    """The database whose connection LISTENs for ``using``: itself, or, behind a transaction
    pooler (``POOLED_DATABASES``), its direct alias; None when there is none (workers poll)."""
    from ..conf import get_settings

    pooled = get_settings().pooled_databases
    return pooled.get(using, using)


def can_listen(using: str) -> bool:
    """Whether workers of this database can wait for notifications instead of polling."""
    return connections[using].vendor == "postgresql" and listen_alias(using) is not None


def notifications(using: str, stop: Callable[[], bool], timeout: float = 1.0) -> Iterator[str | None]:
    """On PostgreSQL, yield the queue name of each NOTIFY (None every ``timeout`` seconds).

    Uses its own connection in autocommit, never Django's: LISTEN must not sit
    inside the claim transactions; behind a transaction pooler, it connects
    straight to the server (`listen_alias`). Elsewhere it returns at once
    (workers poll).
    """
    if not can_listen(using):
        return
    connection = connections[listen_alias(using) or using]
    import psycopg

    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as listener:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        while not stop():
            got = False
            for notify in listener.notifies(timeout=timeout, stop_after=1):
                got = True
                yield notify.payload
            if not got:
                yield None


def nudge_target(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"``) as a socket address."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class NudgeReceiver:
    """A worker's wake-up endpoint: a UDP socket on ``host``, any free port."""

    def __init__(self, host: str) -> None:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_DGRAM)[0]
        self.socket = socket.socket(family, kind, proto)
        try:
            self.socket.bind(sockaddr)
        except OSError:
            self.socket.close()
            raise
        self.socket.settimeout(1.0)  # how often run() looks at its stop flag

    @property
    def address(self) -> str:
        """Where producers send: ``host:port``, or ``[host]:port`` for IPv6."""
        host, port = self.socket.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def run(self, stop: Callable[[], bool], heard: Callable[[str], None], *, pause: float = 1.0) -> None:
        """Call ``heard(queue)`` for each datagram until ``stop()``; then close the socket.

        An error of the socket is logged and waited out (``pause`` seconds),
        never raised: the worker must not stop for want of a shortcut.
        """
        try:
            while not stop():
                try:
                    data = self.socket.recv(MAX_DATAGRAM)
                except TimeoutError:
                    continue
                except OSError as exc:
                    logger.warning("nudge socket %s failed (%s); polling until it recovers", self.address, exc)
                    time.sleep(pause)
                    continue
                heard(data.decode(errors="replace"))
        finally:
            self.socket.close()


_senders: dict[int, socket.socket] = {}
_senders_lock = threading.Lock()


def nudge(address: str, queue: str) -> None:
    """Send ``queue`` to the worker at ``address``; best effort: an error is dropped, never raised."""
    with contextlib.suppress(OSError, ValueError):
        host, port = nudge_target(address)
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with _senders_lock:  # one socket per address family and process, shared by its threads
            sender = _senders.get(family)
            if sender is None:
                sender = _senders[family] = socket.socket(family, kind, proto)
                sender.setblocking(False)  # a full buffer drops the nudge rather than wait
        sender.sendto(queue.encode(), sockaddr)
