"""A fault-injecting TCP proxy between a test's database connections and MariaDB or PostgreSQL.

Connections pointed at the proxy work as usual until a test arms a rule:
the proxy then cuts the connection (closes both sides) when a chosen
statement passes, either **before** it reaches the server (the server never
sees it) or **after** the server answered it (the server did the work, the
client never hears so: the lost reply of a COMMIT that succeeded). It can
also delay every message a client sends, and stall a chosen statement (hold
it, and the connection, until released).

A statement is matched by a substring of its SQL text. The proxy reads the
client's stream as protocol messages (MySQL packets; PostgreSQL's typed
messages, after the untyped start-up ones) so that each statement is seen
whole and counted once: ``COM_QUERY`` on MySQL, ``Query`` and ``Parse`` on
PostgreSQL. Encryption would hide the text, so the connections must not
use TLS (:func:`proxied_settings` turns it off). Every statement that
passes is recorded in :attr:`FaultProxy.statements`.

Deterministic "after": on MySQL the reply to a statement is sent once it is
done (a COMMIT's OK once the commit is durable); on PostgreSQL the proxy
waits for the server's ``ReadyForQuery``, the end of its answer, before it
cuts. Everything runs on one thread with its own event loop; the number of
connections and the size of a held message are bounded, and :meth:`stop`
ends it all within a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

MAX_CONNECTIONS = 64
MAX_MESSAGE = 64 * 1024 * 1024  # a held client message larger than this ends the connection
STOP_TIMEOUT = 10.0
CUT_GRACE = 0.1  # seconds between closing the server's side of a cut and the client's

# PostgreSQL's untyped first messages: their request codes.
PG_SSL_REQUEST = 80877103
PG_GSSENC_REQUEST = 80877104
PG_CANCEL_REQUEST = 80877102


@dataclass
class Rule:
    """One armed fault: ``action`` ("cut" or "stall") at the ``occurrence``-th statement holding ``match``."""

    match: str
    action: str
    when: str
    occurrence: int = 1
    following: str | None = None  # count only statements after one holding this, on the same connection
    seen: int = 0
    fired: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


class _Connection:
    """One client's connection and the server connection it is forwarded to."""

    def __init__(self, proxy: FaultProxy, client: tuple[Any, Any], server: tuple[Any, Any]) -> None:
        self.proxy = proxy
        self.client_reader, self.client_writer = client
        self.server_reader, self.server_writer = server
        self.started = proxy.protocol == "mysql"  # PostgreSQL starts with untyped messages
        self.cut_after: Rule | None = None  # cut once the server finished answering
        self.primed: set[int] = set()  # rules whose ``following`` statement passed here
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for writer in (self.server_writer, self.client_writer):
            with contextlib.suppress(Exception):
                writer.close()

    async def cut(self) -> None:
        """Close the server's side, give it time to roll back what was not committed, then the client's.

        So the client's retry never meets the locks of its own lost transaction.
        """
        with contextlib.suppress(Exception):
            self.server_writer.close()
        await asyncio.sleep(CUT_GRACE)
        self.close()

    # --- client to server -------------------------------------------------------------------

    def _split(self, buffer: bytearray) -> list[bytes]:
        """Take the complete client messages off the front of ``buffer``."""
        messages = []
        while True:
            if self.proxy.protocol == "mysql":
                if len(buffer) < 4:
                    break
                size = 4 + int.from_bytes(buffer[:3], "little")
            elif not self.started:
                if len(buffer) < 8:
                    break
                size = struct.unpack("!I", buffer[:4])[0]
            else:
                if len(buffer) < 5:
                    break
                size = 1 + struct.unpack("!I", buffer[1:5])[0]
            if len(buffer) < size:
                if size > MAX_MESSAGE:
                    raise ConnectionError("a client message past the proxy's bound")
                break
            message = bytes(buffer[:size])
            del buffer[:size]
            if self.proxy.protocol == "postgresql" and not self.started:
                code = struct.unpack("!I", message[4:8])[0]
                self.started = code not in (PG_SSL_REQUEST, PG_GSSENC_REQUEST, PG_CANCEL_REQUEST)
            messages.append(message)
        return messages

    def _statement(self, message: bytes) -> str | None:
        """The SQL text a client message carries, if it is a statement."""
        if self.proxy.protocol == "mysql":
            if len(message) > 4 and message[4] == 0x03:  # COM_QUERY
                return message[5:].decode("utf-8", "replace")
            return None
        kind = message[:1]
        if kind == b"Q":
            return message[5:].split(b"\0", 1)[0].decode("utf-8", "replace")
        if kind == b"P":
            parts = message[5:].split(b"\0", 2)
            return parts[1].decode("utf-8", "replace") if len(parts) > 1 else None
        return None

    async def client_to_server(self) -> None:
        buffer = bytearray()
        try:
            while not self.closed:
                data = await self.client_reader.read(65536)
                if not data:
                    break
                buffer += data
                out = bytearray()
                for message in self._split(buffer):
                    text = self._statement(message) if self.started else None
                    rule = self.proxy._matching(text, self) if text is not None else None
                    if rule is not None and rule.when == "before":
                        self._send(out)
                        await self._flush()
                        rule.fired.set()
                        if rule.action == "stall":
                            await self._stalled(rule)
                            if self.closed:
                                return
                            out += message
                            continue
                        await self.cut()
                        return
                    if text is not None:
                        self.proxy._record(text)
                    out += message
                    if rule is not None:  # when == "after"
                        self.cut_after = rule
                if self.proxy.delay_seconds:
                    await asyncio.sleep(self.proxy.delay_seconds)
                self._send(out)
                await self._flush()
        except (ConnectionError, OSError):
            pass
        finally:
            self.close()

    def _send(self, data: bytearray) -> None:
        if data and not self.closed:
            self.server_writer.write(bytes(data))
            data.clear()

    async def _flush(self) -> None:
        if not self.closed:
            await self.server_writer.drain()

    async def _stalled(self, rule: Rule) -> None:
        """Hold this connection until the rule is released (or the proxy stops)."""
        while not rule.release.is_set() and not self.proxy._stopping:
            await asyncio.sleep(0.02)
        if self.proxy._stopping:
            self.close()

    # --- server to client -------------------------------------------------------------------

    async def server_to_client(self) -> None:
        answer = bytearray()
        try:
            while not self.closed:
                data = await self.server_reader.read(65536)
                if not data:
                    break
                rule = self.cut_after
                if rule is None:
                    self.client_writer.write(data)
                    await self.client_writer.drain()
                    continue
                answer += data
                if not self._answered(answer):
                    continue
                rule.fired.set()
                if rule.action == "stall":
                    await self._stalled(rule)
                    if self.closed:
                        return
                    self.cut_after = None
                    self.client_writer.write(bytes(answer))
                    answer.clear()
                    await self.client_writer.drain()
                    continue
                await self.cut()  # the server did the work; its answer never reaches the client
                return
        except (ConnectionError, OSError):
            pass
        finally:
            self.close()

    def _answered(self, answer: bytearray) -> bool:
        """Whether the server finished answering: at once on MySQL, at ReadyForQuery on PostgreSQL."""
        if self.proxy.protocol == "mysql":
            return True
        at = 0
        while at + 5 <= len(answer):
            kind = answer[at : at + 1]
            size = 1 + struct.unpack("!I", answer[at + 1 : at + 5])[0]
            if at + size > len(answer):
                return False
            if kind == b"Z":
                return True
            at += size
        return False


class FaultProxy:
    """Forward ``127.0.0.1:port`` to ``target``; arm faults with :meth:`cut`, :meth:`stall`, :meth:`delay`.

    ``protocol``: ``"mysql"`` or ``"postgresql"``. :meth:`start` returns the
    port to point connections at; :meth:`stop` ends every connection.
    """

    def __init__(self, target_host: str, target_port: int, protocol: str) -> None:
        if protocol not in ("mysql", "postgresql"):
            raise ValueError(f"the proxy speaks mysql or postgresql, not {protocol!r}")
        self.target = (target_host, target_port)
        self.protocol = protocol
        self.port = 0
        self.statements: list[str] = []
        self.delay_seconds = 0.0
        self._rules: list[Rule] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._ready = threading.Event()
        self._stopping = False
        self._connections: set[_Connection] = set()
        self._server: asyncio.base_events.Server | None = None
        self._error: BaseException | None = None

    # --- the test's side ----------------------------------------------------------------------

    def start(self) -> int:
        self._thread.start()
        if not self._ready.wait(STOP_TIMEOUT) or self._error is not None:
            raise RuntimeError(f"the proxy did not start: {self._error!r}")
        return self.port

    def stop(self) -> None:
        """Close every connection and the listening socket; the thread ends within :data:`STOP_TIMEOUT`."""
        self._stopping = True
        for rule in self._rules:
            rule.release.set()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._shutdown)
        self._thread.join(STOP_TIMEOUT)
        if self._thread.is_alive():
            raise RuntimeError("the proxy's thread did not end")

    def cut(self, match: str, *, when: str = "before", occurrence: int = 1, following: str | None = None) -> Rule:
        """Cut the connection at the ``occurrence``-th statement holding ``match``, ``before`` or ``after`` it.

        ``following``: count only statements that come after one holding it on the
        same connection (the COMMIT of an acknowledgement, not of a claim).
        """
        return self._arm(Rule(match, "cut", self._when(when), occurrence, following))

    def stall(self, match: str, *, when: str = "before", occurrence: int = 1, following: str | None = None) -> Rule:
        """Hold the connection at that statement (or, ``after``, its answer) until ``rule.release.set()``."""
        return self._arm(Rule(match, "stall", self._when(when), occurrence, following))

    def delay(self, seconds: float) -> None:
        """Delay everything clients send by ``seconds`` (0: no delay)."""
        self.delay_seconds = seconds

    def disarm(self) -> None:
        with self._lock:
            self._rules.clear()

    def cut_all(self) -> None:
        """Cut every open connection now (as a server restart would)."""
        self._loop.call_soon_threadsafe(lambda: [c.close() for c in list(self._connections)])

    def recorded(self) -> list[str]:
        with self._lock:
            return list(self.statements)

    def forget(self) -> None:
        with self._lock:
            self.statements.clear()

    @staticmethod
    def _when(when: str) -> str:
        if when not in ("before", "after"):
            raise ValueError(f"when is 'before' or 'after', not {when!r}")
        return when

    def _arm(self, rule: Rule) -> Rule:
        if rule.occurrence < 1:
            raise ValueError("occurrence counts from 1")
        with self._lock:
            self._rules.append(rule)
        return rule

    # --- the loop's side ----------------------------------------------------------------------

    def _matching(self, text: str, connection: _Connection) -> Rule | None:
        """The armed rule this statement fires (it is disarmed then), if any."""
        with self._lock:
            for rule in self._rules:
                if rule.following is not None and id(rule) not in connection.primed:
                    if rule.following in text:
                        connection.primed.add(id(rule))
                    continue
                if rule.match in text:
                    rule.seen += 1
                    if rule.seen == rule.occurrence:
                        self._rules.remove(rule)
                        return rule
        return None

    def _record(self, text: str) -> None:
        with self._lock:
            self.statements.append(text)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    def _shutdown(self) -> None:
        for connection in list(self._connections):
            connection.close()
        if self._server is not None:
            self._server.close()
        self._loop.stop()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._stopping or len(self._connections) >= MAX_CONNECTIONS:
            writer.close()
            return
        try:
            server = await asyncio.wait_for(asyncio.open_connection(*self.target), STOP_TIMEOUT)
        except (TimeoutError, OSError):
            writer.close()
            return
        connection = _Connection(self, (reader, writer), server)
        self._connections.add(connection)
        try:
            await asyncio.gather(connection.client_to_server(), connection.server_to_client())
        finally:
            connection.close()
            self._connections.discard(connection)


# --- the fixture: a database alias whose connections go through a proxy -------------------------------

ALIAS = "faulty"
DEFAULT_PORTS = {"mysql": 3306, "postgresql": 5432}


def proxied_settings(settings_dict: dict[str, Any], port: int) -> dict[str, Any]:
    """``settings_dict`` (a server's alias, test database included) pointed at the proxy, without TLS."""
    options = dict(settings_dict.get("OPTIONS") or {})
    if settings_dict["ENGINE"].endswith("postgresql"):
        options.update(sslmode="disable", gssencmode="disable", connect_timeout=10)
    else:
        options.update(connect_timeout=10)
    return {**settings_dict, "HOST": "127.0.0.1", "PORT": str(port), "OPTIONS": options, "CONN_MAX_AGE": 0}


@pytest.fixture
def fault_proxy():
    """A :class:`FaultProxy` in front of the test database, and the alias :data:`ALIAS` pointed at it.

    The alias is in tests/settings.py (a mirror of ``default``); here its
    connections, in every thread, go through the proxy to the same test
    database. Tests that use it list it in ``django_db(databases=...)``.
    SQLite has no network connection to cut: skipped there.
    """
    from django.db import connections

    default = connections["default"]
    if default.vendor not in DEFAULT_PORTS:
        pytest.skip(f"{default.vendor} has no network connection for a proxy to cut")
    config = default.settings_dict
    proxy = FaultProxy(
        config["HOST"] or "127.0.0.1", int(config["PORT"] or DEFAULT_PORTS[default.vendor]), default.vendor
    )
    port = proxy.start()
    # New connections of any thread read connections.settings; this thread's is made already.
    shared = connections.settings[ALIAS]
    saved = dict(shared)
    shared.update(proxied_settings(config, port))
    connections[ALIAS].close()
    connections[ALIAS].settings_dict = dict(shared)
    try:
        yield proxy
    finally:
        proxy.disarm()
        with contextlib.suppress(Exception):
            connections[ALIAS].close()
        proxy.stop()
        shared.clear()
        shared.update(saved)
        connections[ALIAS].settings_dict = config
