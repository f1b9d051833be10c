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
does. A lone surrogate is valid JSON when spelled as an escape (C{"\\ud800"}), but it is not
text: UTF-8 cannot carry it back out in a reply, a C{status} or a metric label. So every
field an op reads (L{TEXT_FIELDS}) must be Unicode text; one that is not is an C{error} reply
naming the field, and nothing of that message is stored.

Output is bounded per connection (a peer that sends requests and never reads the replies must
not make the daemon buffer them): the connection is a streaming producer on its own transport.
When the transport's unwritten output passes its buffer size (64 KiB) it pauses the connection,
which stops reading the peer and leaves any complete lines it already read unhandled until the
output drains; nothing is lost, and the peer's further requests wait in the kernel's socket
buffers, not in the daemon. Only what the daemon must send unasked while paused (grants) still
adds to the output; past L{MAX_OUTPUT_BYTES} of that the peer is disconnected, as for the input
rule, and its buffers go with the connection.

Each op maps to one scheduler call; C{granted} replies, direct or queued, are written by
L{deliver_grant}, the scheduler's C{on_grant} callback, to the connection that asked.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.interfaces import IAddress, IPushProducer, IReactorTime
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure
from zope.interface import implementer

from loopd.queue.policy import PolicySyntaxError, decode_json
from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_types import Grant, Tier

__all__ = [
    "COUNTED_OPS",
    "MAX_LINE_BYTES",
    "MAX_OUTPUT_BYTES",
    "TEXT_FIELDS",
    "LeaseFactory",
    "LeaseProtocol",
    "deliver_grant",
    "encode_message",
    "granted_message",
    "is_text",
]

#: How Twisted's log lines name the lease protocol's server side (the C{logPrefix} of
#: its protocols and factories), instead of a private class name.
LOG_PREFIX = "llmqueue"

#: The longest line a peer may send, in bytes without its newline ("100 KB", DESIGN §11).
MAX_LINE_BYTES = 102_400

#: Bytes a paused connection may be sent on top of its transport's full buffer (grants that
#: cannot wait) before the peer is disconnected for not reading.
MAX_OUTPUT_BYTES = 1_048_576

#: The state-touching ops that make a connection a counted client (seed, Idle-exit).
COUNTED_OPS = frozenset({"acquire", "renew", "role", "cancel"})

_KEYED_OPS = frozenset({"acquire", "release", "cancel"})
_TIERS: Mapping[object, Tier] = {"parent": "parent", "child": "child"}


#: The string fields the ops read; each must be Unicode text wherever it appears.
TEXT_FIELDS = ("op", "queueKey", "sessionKey", "role", "group")

# One encoder for every reply: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
_ASCII_ENCODER = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=False)


def encode_message(message: Mapping[str, object]) -> bytes:
    """
    Return one wire line: compact JSON in UTF-8 and its newline.

    A string that UTF-8 cannot carry (a lone surrogate) never gets this far from a peer, but
    should one come from elsewhere, the line is written with every non-ASCII character
    escaped (C{\\ud800}), as JavaScript's C{JSON.stringify} does: still one valid line.
    """
    text = _ENCODER.encode(message)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        data = _ASCII_ENCODER.encode(message).encode("ascii")
    return data + b"\n"


def is_text(value: str) -> bool:
    """
    Return whether C{value} is Unicode text: no lone surrogate, which a JSON escape can
    spell (C{"\\ud800"}, valid JSON as C{JSON.parse} reads it) but UTF-8 cannot carry.
    """
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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


@implementer(IPushProducer)
class LeaseProtocol(Protocol):
    """
    One client connection. It is its own scheduler connection key: every lease and waiter
    it creates is tied to it and goes away with it. It is also the producer of its replies
    (see the module's note on bounded output).
    """

    factory: LeaseFactory
    # A real socket transport (IUNIXTransport plus IConsumer and IPushProducer), or a test's
    # StringTransport: ITransport alone does not name the producer methods used here.
    transport: Any

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def __init__(self) -> None:
        """
        Start with an empty line buffer, not yet a counted client.
        """
        self._buffer = b""
        self._gone = False
        self._counted = False
        self._paused = False
        self._sent_while_paused = 0
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

    def connectionMade(self) -> None:
        """
        Register as the producer of this connection's output, so the transport can pause it.
        """
        if self.transport is not None:
            self.transport.registerProducer(self, True)

    def dataReceived(self, data: bytes) -> None:
        """
        Buffer C{data} and handle every complete line (while not paused); drop the peer on
        an over-long line.
        """
        if self._gone:
            return
        self._buffer += data
        self._handle_lines()

    def pauseProducing(self) -> None:
        """
        The transport's output is full: stop reading the peer and handling its lines.
        """
        if self._paused or self._gone:
            return
        self._paused = True
        self._sent_while_paused = 0
        if self.transport is not None:
            self.transport.pauseProducing()

    def resumeProducing(self) -> None:
        """
        The output drained: handle the lines held meanwhile, then read the peer again.
        """
        if not self._paused or self._gone:
            return
        self._paused = False
        self._handle_lines()
        if not self._paused and not self._gone and self.transport is not None:
            self.transport.resumeProducing()

    def stopProducing(self) -> None:
        """
        The transport is going away; L{connectionLost} does the cleaning up.
        """

    def _handle_lines(self) -> None:
        """
        Handle every complete line in the buffer until it is empty, the connection is
        paused or gone; drop the peer on an over-long line.
        """
        while not self._gone and not self._paused:
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
        if self._gone or self.transport is None:
            return
        data = encode_message(message)
        if self._paused:
            self._sent_while_paused += len(data)
            if self._sent_while_paused > MAX_OUTPUT_BYTES:
                self._drop(abort=True)
                return
        self.transport.write(data)

    # -- input -------------------------------------------------------------------------

    def _drop(self, abort: bool = False) -> None:
        """
        Disconnect a peer that overran the line limit (nothing of that line is parsed) or,
        with C{abort}, the output limit (its unread output is thrown away with the
        connection, not written first).
        """
        self._buffer = b""
        self._forget()
        self._gone = True
        if self.transport is None:
            return
        if abort:
            self.transport.abortConnection()
        else:
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
        for name in TEXT_FIELDS:
            value = message.get(name)
            if isinstance(value, str) and not is_text(value):
                self._error(f"{name} must be Unicode text (got a lone surrogate)")
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

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

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
