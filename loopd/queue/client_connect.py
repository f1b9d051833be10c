# -*- test-case-name: loopd.test.test_queue_client -*-
"""
The lease client's connection: the newline-JSON line protocol, connecting to the daemon's
Unix socket (spawning the daemon when none answers), and the detached daemon spawn itself.

The spawn follows the seed's client contract: it runs once per connect attempt that found no
daemon (connection refused: a stale socket file; or no such file), and the connect is then
retried on reactor time for a bounded window. The daemon resolves a spawn race itself (a live
socket makes the second daemon exit 0), so there is no liveness probe and no lockfile.
"""

from __future__ import annotations

import errno
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.error import ConnectError, ConnectionRefusedError
from twisted.internet.interfaces import IProcessTransport, IReactorProcess
from twisted.internet.protocol import ClientFactory, ProcessProtocol, connectionDone
from twisted.internet.task import deferLater
from twisted.protocols.basic import LineReceiver
from twisted.python.failure import Failure

from loopd import strict_json
from loopd.queue.client_lease import QueueUnavailable
from loopd.queue.protocol import encode_message
from loopd.reactor import IUnixReactor
from loopd.unixsocket import UnixSocketError, check_peer_socket

__all__ = ["LeaseWire", "connect_daemon", "no_daemon", "spawn_daemon"]

#: How Twisted's log lines name the lease client's connections (the C{logPrefix} of
#: its protocols and factories), instead of a private class name.
LOG_PREFIX = "llmqueue.client"

# Run by the spawned interpreter: leave our session (the daemon must outlive a terminal's
# Ctrl-C and its parent, as a detached spawn does), then become the daemon itself.
_DETACH = "import os, sys; os.setsid(); os.execv(sys.executable, [sys.executable] + sys.argv[1:])"


class LeaseWire(LineReceiver):
    """
    One connection to the daemon: writes messages as lines and hands every reply that is a
    JSON object to C{on_message}; lines that are not are dropped.
    """

    delimiter = b"\n"
    # A status reply lists every holder and waiter: it may be long, but is never unbounded.
    MAX_LENGTH = 64 * 1024 * 1024

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def __init__(
        self,
        on_message: Callable[[LeaseWire, dict[str, Any]], None],
        on_lost: Callable[[LeaseWire, Failure], None],
    ) -> None:
        """
        @param on_message: called with each reply object.
        @param on_lost: called once when the connection is gone.
        """
        self._on_message = on_message
        self._on_lost = on_lost
        self.lost = False

    def send(self, message: dict[str, object]) -> None:
        """
        Write one message as a line.
        """
        if self.transport is not None:
            self.transport.write(encode_message(message))

    def close(self) -> None:
        """
        Close the connection after the written lines are sent.
        """
        if self.transport is not None:
            self.transport.loseConnection()

    def lineReceived(self, line: bytes) -> None:
        """
        Decode one reply; anything but a JSON object is dropped.
        """
        try:
            message = strict_json.decode(line.decode("utf-8", errors="replace"))
        except ValueError:
            return
        if isinstance(message, dict):
            self._on_message(self, message)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """
        Tell the client the connection is gone.
        """
        self.lost = True
        self._on_lost(self, reason)


class _WireFactory(ClientFactory):
    """
    Builds the one L{LeaseWire} of a connect attempt.
    """

    noisy = False

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def __init__(self, build: Callable[[], LeaseWire]) -> None:
        """Build wires with C{build}."""
        self._build = build

    def buildProtocol(self, addr: object) -> LeaseWire:
        """
        Return a new wire.
        """
        return self._build()


def no_daemon(error: BaseException) -> bool:
    """
    Whether a connect error means no daemon serves the socket: refused (a stale socket file)
    or no such file.
    """
    if isinstance(error, ConnectionRefusedError):
        return True
    return isinstance(error, ConnectError) and error.osError == errno.ENOENT


def _check(path: str) -> None:
    """
    @raise QueueUnavailable: the socket at C{path} is not safe to connect to (its
        L{UnixSocketError} is the cause).
    """
    try:
        check_peer_socket(path)
    except UnixSocketError as e:
        raise QueueUnavailable(f"not connecting to the queue daemon: {e}") from e


async def _connect(
    reactor: IUnixReactor,
    path: str,
    build: Callable[[], LeaseWire],
    spawn: Callable[[], object] | None,
    retry_interval_ms: int,
    spawn_wait_ms: int,
) -> LeaseWire:
    """
    Connect once; when no daemon answers and C{spawn} is given, spawn it and retry every
    C{retry_interval_ms} for up to C{spawn_wait_ms}. Before every attempt the socket is
    checked (L{check_peer_socket}): a socket or directory that another user controls is
    never connected to, and no daemon is spawned for it.
    """
    endpoint = UNIXClientEndpoint(reactor, path)
    factory = _WireFactory(build)
    _check(path)
    try:
        wire: LeaseWire = await endpoint.connect(factory)
        return wire
    except Exception as e:
        if spawn is None or not no_daemon(e):
            raise QueueUnavailable(f"cannot reach the queue daemon at {path}: {e}") from e
    try:
        spawn()
    except Exception as e:
        raise QueueUnavailable(f"cannot spawn the queue daemon: {e}") from e
    last: Exception | None = None
    for _ in range(max(1, math.ceil(spawn_wait_ms / max(1, retry_interval_ms)))):
        await deferLater(reactor, retry_interval_ms / 1000.0, lambda: None)
        _check(path)
        try:
            wire = await endpoint.connect(factory)
            return wire
        except Exception as e:
            if not no_daemon(e):
                raise QueueUnavailable(f"cannot reach the queue daemon at {path}: {e}") from e
            last = e
    raise QueueUnavailable(
        f"the spawned queue daemon did not answer at {path} within {spawn_wait_ms} ms: {last}"
    )


def connect_daemon(
    reactor: IUnixReactor,
    path: str,
    build: Callable[[], LeaseWire],
    spawn: Callable[[], object] | None = None,
    retry_interval_ms: int = 100,
    spawn_wait_ms: int = 3000,
) -> Deferred[LeaseWire]:
    """
    Connect to the daemon's socket at C{path}.

    @param reactor: provides C{IReactorUNIX} and C{IReactorTime}.
    @param build: returns the protocol of the connection.
    @param spawn: run once if no daemon answers, before the retries; C{None}: no retries.
    @return: a C{Deferred} that fires with the connected wire, or fails with
        L{QueueUnavailable}.
    """
    return Deferred.fromCoroutine(
        _connect(reactor, path, build, spawn, retry_interval_ms, spawn_wait_ms)
    )


def spawn_daemon(
    reactor: IReactorProcess, agent_dir: str, protocol: ProcessProtocol | None = None
) -> IProcessTransport:
    """
    Start C{sys.executable -m twisted llmqueue --agent-dir AGENT_DIR} detached: in a session
    of its own, with stdin, stdout and stderr on C{/dev/null} (its C{logFile} is its only
    durable record). A daemon that finds a live socket exits 0, so a racing spawn is harmless.

    Use C{lambda: spawn_daemon(reactor, agent_dir)} as a L{LeaseClient}'s C{spawn}.

    @param reactor: provides C{IReactorProcess}.
    @param protocol: watches the process (its end, in tests); none by default.
    """
    argv = [sys.executable, "-c", _DETACH, "-m", "twisted", "llmqueue", "--agent-dir", agent_dir]
    null = os.open(os.devnull, os.O_RDWR)
    try:
        transport: IProcessTransport = reactor.spawnProcess(
            protocol or ProcessProtocol(),
            sys.executable,
            argv,
            env=dict(os.environ),
            childFDs={0: null, 1: null, 2: null},
        )
    finally:
        os.close(null)
    return transport
