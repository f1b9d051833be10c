# -*- test-case-name: loopd.test.test_queue_protocol -*-
"""
The lease protocol's wire layer: newline-delimited JSON over a Unix socket, bound to one
L{Scheduler}.

Framing (seed, DESIGN §3 decisions 11 and 12): bytes are buffered and split on C{b"\\n"};
each line is decoded on its own, so a message split inside a multi-byte UTF-8 character is
decoded whole. A line longer than L{MAX_LINE_BYTES} (102,400 bytes) disconnects the peer and
is never parsed; that holds whether or not its newline has arrived, so the outcome does not
depend on how the stream was split into reads. JSON follows JavaScript's C{JSON.parse}
(C{NaN}/C{Infinity} are invalid); invalid UTF-8 is replaced, as a non-fatal C{TextDecoder}
does.

Each op maps to one scheduler call; C{granted} replies, direct or queued, are written by
L{deliver_grant}, the scheduler's C{on_grant} callback, to the connection that asked.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.interfaces import IAddress, IReactorTime
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

from loopd.queue.policy import PolicySyntaxError, decode_json
from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_types import Grant, Tier

__all__ = [
    "COUNTED_OPS",
    "MAX_LINE_BYTES",
    "LeaseFactory",
    "LeaseProtocol",
    "deliver_grant",
    "encode_message",
    "granted_message",
]

#: The longest line a peer may send, in bytes without its newline ("100 KB", DESIGN §11).
MAX_LINE_BYTES = 102_400

#: The state-touching ops that make a connection a counted client (seed, Idle-exit).
COUNTED_OPS = frozenset({"acquire", "renew", "role", "cancel"})

_KEYED_OPS = frozenset({"acquire", "release", "cancel"})
_TIERS: Mapping[object, Tier] = {"parent": "parent", "child": "child"}


# One encoder for every reply: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode_message(message: Mapping[str, object]) -> bytes:
    """
    Return one wire line: compact JSON in UTF-8 and its newline.
    """
    return _ENCODER.encode(message).encode("utf-8") + b"\n"


def granted_message(grant: Grant) -> dict[str, object]:
    """
    Return the C{granted} reply of C{grant}: keyed by the key the client asked with, with
    the lease's terms (C{leaseTtlMs}, C{idleYieldMs}).
    """
    return {
        "op": "granted",
        "queueKey": grant.queue_key,
        "sessionKey": grant.session_key,
        **grant.terms().to_wire(),
    }


def deliver_grant(grant: Grant) -> None:
    """
    The scheduler's C{on_grant} callback for socket clients: write the C{granted} reply to
    the L{LeaseProtocol} that asked. A grant for any other kind of holder (a gateway request
    sharing the scheduler) is not this layer's, and is left alone.
    """
    if isinstance(grant.conn, LeaseProtocol):
        grant.conn.send(granted_message(grant))


def _session_key(message: Mapping[str, Any]) -> str:
    """
    Return the message's C{sessionKey}; an absent or non-string one is the anonymous
    session C{""}.
    """
    value = message.get("sessionKey")
    return value if isinstance(value, str) else ""


class LeaseProtocol(Protocol):
    """
    One client connection. It is its own scheduler connection key: every lease and waiter
    it creates is tied to it and goes away with it.
    """

    factory: LeaseFactory

    def __init__(self) -> None:
        """
        Start with an empty line buffer, not yet a counted client.
        """
        self._buffer = b""
        self._gone = False
        self._counted = False
        self._ops: Mapping[str, Callable[[Mapping[str, Any]], None]] = {
            "acquire": self._acquire,
            "release": self._release,
            "cancel": self._cancel,
            "role": self._role,
            "renew": self._renew,
            "status": self._status,
            "bye": self._bye,
        }

    # -- Twisted overrides -------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        """
        Buffer C{data} and handle every complete line; drop the peer on an over-long line.
        """
        if self._gone:
            return
        self._buffer += data
        while not self._gone:
            end = self._buffer.find(b"\n")
            if end < 0:
                if len(self._buffer) > MAX_LINE_BYTES:
                    self._drop()
                return
            if end > MAX_LINE_BYTES:
                self._drop()
                return
            line, self._buffer = self._buffer[:end], self._buffer[end + 1 :]
            self._handle_line(line)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """
        Release the connection's leases and drop its queued requests.
        """
        self._forget()
        self._gone = True
        self._buffer = b""

    # -- output ------------------------------------------------------------------------

    def send(self, message: Mapping[str, object]) -> None:
        """
        Write one message to the peer, unless the connection is gone.
        """
        if not self._gone and self.transport is not None:
            self.transport.write(encode_message(message))

    # -- input -------------------------------------------------------------------------

    def _drop(self) -> None:
        """
        Disconnect a peer that overran the line limit; nothing of that line is parsed.
        """
        self._buffer = b""
        self._forget()
        self._gone = True
        if self.transport is not None:
            self.transport.loseConnection()

    def _forget(self) -> None:
        """
        Tell the scheduler this connection is gone (its leases released, waiters dropped)
        and stop counting it as a client.
        """
        self.factory.scheduler.disconnect(self)
        if self._counted:
            self._counted = False
            self.factory.client_left()

    def _error(self, reason: str) -> None:
        """
        Reply with an C{error}; the connection stays usable.
        """
        self.send({"op": "error", "reason": reason})

    def _handle_line(self, line: bytes) -> None:
        """
        Decode one line and run its op; a blank line is ignored.
        """
        text = line.decode("utf-8", errors="replace")
        if not text.strip(" \t\r"):
            return
        try:
            message = decode_json(text)
        except PolicySyntaxError:
            self._error("invalid JSON")
            return
        if not isinstance(message, dict):
            self._error("message must be a JSON object")
            return
        op = message.get("op")
        if not isinstance(op, str) or op not in self._ops:
            self._error(f"unknown op: {json.dumps(op, ensure_ascii=False)}")
            return
        queue_key = message.get("queueKey")
        if op in _KEYED_OPS and not (isinstance(queue_key, str) and queue_key):
            self._error(f"{op} requires queueKey")
            return
        if op in COUNTED_OPS and not self._counted:
            self._counted = True
            self.factory.client_joined()
        self._ops[op](message)

    # -- ops ---------------------------------------------------------------------------

    def _acquire(self, message: Mapping[str, Any]) -> None:
        """
        Ask for a slot; the C{granted} reply comes through L{deliver_grant}, now or later.
        """
        group = message.get("group")
        self.factory.scheduler.acquire(
            self,
            message["queueKey"],
            _session_key(message),
            _TIERS.get(message.get("role"), "parent"),
            group if isinstance(group, str) else None,
            message.get("activity") is True,
        )

    def _release(self, message: Mapping[str, Any]) -> None:
        """
        Return a slot and reply C{ok} (also when it was not held, DESIGN §20).
        """
        self.factory.scheduler.release(message["queueKey"], _session_key(message))
        self.send({"op": "ok"})

    def _cancel(self, message: Mapping[str, Any]) -> None:
        """
        Drop a queued request and release a held slot; no reply.
        """
        self.factory.scheduler.cancel(message["queueKey"], _session_key(message))

    def _role(self, message: Mapping[str, Any]) -> None:
        """
        Re-tier the session's live waiters; no reply. A role that is neither C{parent} nor
        C{child} changes nothing (an absent one must not silently promote a child).
        """
        tier = _TIERS.get(message.get("role"))
        if tier is not None:
            self.factory.scheduler.role(_session_key(message), tier)

    def _renew(self, message: Mapping[str, Any]) -> None:
        """
        Bare heartbeat (no C{queueKey}) or keyed activity beat, each with its C{ok} reply.
        """
        queue_key = message.get("queueKey")
        if not (isinstance(queue_key, str) and queue_key):
            self.factory.scheduler.renew(self)
            self.send({"op": "ok"})
            return
        session_key = _session_key(message)
        granted = self.factory.scheduler.beat(queue_key, session_key)
        reply = {"op": "ok", "queueKey": queue_key, "sessionKey": session_key}
        self.send({**reply, "granted": granted})

    def _status(self, message: Mapping[str, Any]) -> None:
        """
        Reply with every queue's slots, holders and waiters.
        """
        self.send({"op": "status", "queues": self.factory.scheduler.status()})

    def _bye(self, message: Mapping[str, Any]) -> None:
        """
        Shutdown intent: clean up now as a disconnect would; no reply.
        """
        self._forget()


class LeaseFactory(Factory[LeaseProtocol]):
    """
    Builds a L{LeaseProtocol} per connection, all bound to one scheduler, and counts the
    connected clients (for idle exit). With a reactor and C{sweep_ms} it also runs the
    scheduler's sweep on that period while it is started.
    """

    # Twisted would log every start and stop of the factory: that is traffic.
    noisy = False

    def __init__(
        self,
        scheduler: Scheduler,
        on_clients: Callable[[int], None] | None = None,
        reactor: IReactorTime | None = None,
        sweep_ms: int | None = None,
    ) -> None:
        """
        @param scheduler: the scheduler every connection talks to; its C{on_grant} must
            call L{deliver_grant} for socket clients' grants to be answered.
        @param on_clients: told the new count each time a counted client joins or leaves.
        @param reactor: the clock the sweep runs on (needed with C{sweep_ms}).
        @param sweep_ms: the sweep period in milliseconds; C{None} runs no sweep here.
        """
        self.scheduler = scheduler
        self.clients = 0
        self._on_clients = on_clients
        self._sweep: LoopingCall | None = None
        if sweep_ms is not None:
            if reactor is None:
                raise ValueError("sweep_ms needs a reactor")
            self._sweep = LoopingCall(scheduler.sweep)
            self._sweep.clock = reactor
            self._sweep_seconds = sweep_ms / 1000.0

    def buildProtocol(self, addr: IAddress | None) -> LeaseProtocol:
        """
        Return a new connection bound to this factory.
        """
        connection = LeaseProtocol()
        connection.factory = self
        return connection

    def startFactory(self) -> None:
        """
        Start the sweep timer, if there is one.
        """
        if self._sweep is not None and not self._sweep.running:
            self._sweep.start(self._sweep_seconds, now=False)

    def stopFactory(self) -> None:
        """
        Stop the sweep timer, if it runs.
        """
        if self._sweep is not None and self._sweep.running:
            self._sweep.stop()

    def client_joined(self) -> None:
        """
        Count a connection that sent its first state-touching op.
        """
        self.clients += 1
        if self._on_clients is not None:
            self._on_clients(self.clients)

    def client_left(self) -> None:
        """
        Stop counting a connection that closed or said C{bye}.
        """
        self.clients -= 1
        if self._on_clients is not None:
            self._on_clients(self.clients)
