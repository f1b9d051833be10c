# -*- test-case-name: loopd.test.test_queue_client -*-
"""
The lease client's one persistent connection to the daemon, and the replies it answers in
order.

The connection is made on the first op that needs it and again whenever one needs it after
it died; ops that ask while a connect is under way wait for it and go out in the order they
asked. The daemon answers C{release} and the bare heartbeat with C{ok}, C{status} with
C{status}, and a refused request with C{error}, in the order it got them, so those replies
are matched first-in first-out; an C{ok} or C{status} that nothing waits for is dropped.
Keyed replies (C{granted}, a keyed beat's C{ok}) go to the client, which matches them by key.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.failure import Failure

from loopd.queue.client_connect import LeaseWire, connect_daemon
from loopd.queue.client_lease import ClientClosed, QueueError, QueueReplyError, QueueUnavailable
from loopd.reactor import IUnixReactor

__all__ = ["DaemonLink"]


class DaemonLink:
    """
    Connects on demand, writes messages, matches in-order replies, and closes with C{bye}.
    """

    def __init__(
        self,
        reactor: IUnixReactor,
        path: str,
        *,
        spawn: Callable[[], object] | None,
        spawn_retry_ms: int,
        spawn_wait_ms: int,
        on_keyed: Callable[[LeaseWire, dict[str, Any]], None],
        on_lost: Callable[[LeaseWire, QueueError], None],
    ) -> None:
        """
        @param reactor: provides C{IReactorUNIX} and C{IReactorTime}.
        @param path: the daemon's socket.
        @param spawn: run once per connect attempt that finds no daemon.
        @param on_keyed: receives every C{granted} and keyed C{ok} reply.
        @param on_lost: told when the connection died, after the in-order requests on it
            are answered, with the error ops that needed it fail with.
        """
        self._reactor = reactor
        self._path = path
        self._spawn = spawn
        self._spawn_retry_ms = spawn_retry_ms
        self._spawn_wait_ms = spawn_wait_ms
        self._on_keyed = on_keyed
        self._on_lost = on_lost
        self.wire: LeaseWire | None = None
        self.closed = False
        self._attempt: Deferred[LeaseWire] | None = None
        self._connect_waiters: list[Deferred[LeaseWire]] = []
        self._in_order: deque[tuple[str, Deferred[Any] | None]] = deque()
        self._close_waiters: list[Deferred[None]] = []

    def connection(self) -> Deferred[LeaseWire]:
        """
        Return the connection, connecting (and spawning) first if there is none; fails with
        L{QueueUnavailable}, or L{ClientClosed} once closed.
        """
        if self.closed:
            return fail(ClientClosed("the lease client is closed"))
        if self.wire is not None:
            return succeed(self.wire)
        waiter: Deferred[LeaseWire] = Deferred()
        self._connect_waiters.append(waiter)
        if self._attempt is None:
            attempt = connect_daemon(
                self._reactor,
                self._path,
                lambda: LeaseWire(self._on_message, self._lost),
                self._spawn,
                self._spawn_retry_ms,
                self._spawn_wait_ms,
            )
            self._attempt = attempt
            attempt.addCallbacks(self._connected, self._connect_failed)
        return waiter

    def send(self, message: dict[str, object]) -> Deferred[None]:
        """
        Write a message that gets no reply, connecting first if needed; fire once written.
        """
        return self.connection().addCallback(lambda wire: wire.send(message))

    def request(self, message: dict[str, object], kind: str) -> Deferred[Any]:
        """
        Write a message, connecting first if needed, and fire with its in-order reply: the
        C{queues} of a C{status} (C{kind="status"}), C{None} for an C{ok}.
        """

        def ask(wire: LeaseWire) -> Deferred[Any]:
            """
            Register the expected reply before writing, so that replies match requests in order.
            """
            answered: Deferred[Any] = Deferred()
            self.expect(kind, answered)
            wire.send(message)
            return answered

        return self.connection().addCallback(ask)

    def expect(self, kind: str, answered: Deferred[Any] | None) -> None:
        """
        Note that the next message written expects an in-order C{kind} reply; C{answered}
        (if any) fires with it. A connection that dies first settles an C{ok} request (the
        disconnect did what a C{release} asks) and fails any other.
        """
        self._in_order.append((kind, answered))

    def close(self) -> Deferred[None]:
        """
        Say C{bye}, close the connection and fire when it is closed; later ops fail with
        L{ClientClosed}.
        """
        done: Deferred[None] = Deferred()
        if self.closed and not self._close_waiters:
            done.callback(None)
            return done
        self._close_waiters.append(done)
        if self.closed:
            return done
        self.closed = True
        waiters, self._connect_waiters = self._connect_waiters, []
        for waiter in waiters:
            waiter.errback(ClientClosed("the lease client is closed"))
        if self._attempt is not None:
            self._attempt.cancel()
        if self.wire is None:
            self._closed_now()
        else:
            self.wire.send({"op": "bye"})
            self.wire.close()
        return done

    def _connected(self, wire: LeaseWire) -> None:
        """
        Hand the new connection to every op waiting for it, in the order they asked.
        """
        self._attempt = None
        if self.closed:
            wire.close()
            return
        if wire.lost:
            self._connect_failed(Failure(QueueUnavailable("the queue daemon hung up")))
            return
        self.wire = wire
        waiters, self._connect_waiters = self._connect_waiters, []
        for waiter in waiters:
            waiter.callback(wire)

    def _connect_failed(self, failure: Failure) -> None:
        """
        Fail every op waiting for the connection.
        """
        self._attempt = None
        waiters, self._connect_waiters = self._connect_waiters, []
        for waiter in waiters:
            waiter.errback(failure)

    def _lost(self, wire: LeaseWire, reason: Failure) -> None:
        """
        The connection died: answer what waits on it, then tell the client.
        """
        if wire is not self.wire:
            return
        self.wire = None
        gone: QueueError = QueueUnavailable(
            f"the connection to the queue daemon was lost: {reason.value}"
        )
        if self.closed:
            gone = ClientClosed("the lease client is closed")
        entries = list(self._in_order)
        self._in_order.clear()
        for kind, answered in entries:
            if answered is not None and kind == "ok":
                answered.callback(None)
            elif answered is not None:
                answered.errback(Failure(gone))
        self._on_lost(wire, gone)
        if self.closed:
            self._closed_now()

    def _closed_now(self) -> None:
        """
        Fire every L{close} waiter.
        """
        waiters, self._close_waiters = self._close_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def _on_message(self, wire: LeaseWire, message: dict[str, Any]) -> None:
        """
        Route one reply: keyed ones to the client, in-order ones to their request.
        """
        op = message.get("op")
        if op == "granted" or (op == "ok" and "queueKey" in message):
            self._on_keyed(wire, message)
        elif op == "ok":
            self._answer_in_order("ok", None)
        elif op == "status":
            queues = message.get("queues")
            self._answer_in_order("status", queues if isinstance(queues, list) else [])
        elif op == "error" and self._in_order:
            _kind, answered = self._in_order.popleft()
            if answered is not None:
                answered.errback(QueueReplyError(str(message.get("reason"))))

    def _answer_in_order(self, kind: str, value: object) -> None:
        """
        Fire the oldest request waiting for a C{kind} reply; drop the reply if none waits.
        """
        for index, (expected, answered) in enumerate(self._in_order):
            if expected == kind:
                del self._in_order[index]
                if answered is not None:
                    answered.callback(value)
                return
