# -*- test-case-name: loopd.test.test_inferproxy -*-
"""
inferproxy: a Unix-socket → TCP forwarder with hard limits, the only TCP client in loopd.

Each accepted Unix connection gets its own TCP connection upstream and the bytes are relayed
both ways without being parsed. What Twisted's own C{portforward} lacks is added here:

 - half-close: an EOF from one side becomes a C{shutdown(SHUT_WR)} towards the other, and a
   pair closes fully only once both directions are done;
 - teardown that cannot leak: the dead side is unregistered as its peer's producer before
   the peer is closed (twisted#6461), so a peer paused by backpressure still closes;
 - backpressure: each transport is the other's streaming producer, so a slow reader on either
   side pauses reading on the other and buffered bytes stay bounded;
 - limits: at most C{max_connections} pairs at a time and a token bucket on accept, both
   decided in L{InferProxyFactory.buildProtocol}. A connection over either limit gets a
   fixed, short HTTP 503 naming the limit (L{refusal_response}: an C{X-Inferproxy-Refused}
   header and C{Retry-After}), written blind (nothing the client sent is parsed, nothing goes
   upstream), so that a client can tell a full proxy from a dead server and wait instead of
   retrying as if the server had gone. The seed says such a connection is "closed at once";
   it is half-closed at once and dropped when the client closes, within
   L{REFUSAL_LINGER_SECONDS} (a full close with the client's request unread would reset the
   connection before the client read the answer); at most L{MAX_LINGERING_REFUSALS} linger,
   past that one is closed at once.
 - a client that closes is gone: on Linux an EOF from the Unix side that comes with
   C{POLLHUP} (the peer closed its socket, it did not just shut down its writing) closes the
   upstream connection too, at once. Without that, a client that gives up on a request to
   a frozen server (one that never reads or answers) would leave the pair open for ever,
   because the half-close forwarded to that server is never answered. A genuine half-close
   (C{shutdown(SHUT_WR)}, C{POLLRDHUP} without C{POLLHUP}) is forwarded as before.

Nothing about traffic is logged: one line at start, one per refused connection, one per failed
upstream connection attempt.
"""

from __future__ import annotations

import json
import math
import select
import sys
from dataclasses import dataclass
from typing import Any

from twisted.application.service import Service
from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import HostnameEndpoint, TCP4ClientEndpoint, TCP6ClientEndpoint
from twisted.internet.interfaces import (
    IAddress,
    IDelayedCall,
    IHalfCloseableProtocol,
    IListeningPort,
    IReactorTime,
    IReactorUNIX,
    IStreamClientEndpoint,
    ITCPTransport,
)
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from loopd.errors import ProxyRefused
from loopd.unixsocket import listen_unix

__all__ = [
    "InferProxyFactory",
    "InferProxyService",
    "ProxyLimits",
    "TokenBucket",
    "parse_upstream",
    "refusal_response",
    "upstream_endpoint",
]

#: How Twisted's log lines name the forwarder (the C{logPrefix} of its protocols and
#: factories), instead of a private class name.
LOG_PREFIX = "inferproxy"

_log = Logger(namespace="loopd.inferproxy")


@dataclass(frozen=True)
class ProxyLimits:
    """
    The forwarder's hard limits, with the seed's defaults.

    @ivar max_connections: pairs open at the same time; one more is refused.
    @ivar burst: accepts allowed back to back before the bucket runs dry.
    @ivar refill_per_second: tokens added to the bucket per second.
    @ivar connect_timeout: seconds to wait for the upstream TCP connection.
    """

    max_connections: int = 8
    burst: int = 10
    refill_per_second: float = 2.0
    connect_timeout: float = 10.0

    def __post_init__(self) -> None:
        """
        @raise ValueError: C{max_connections} or C{burst} below 1, or C{refill_per_second} or
            C{connect_timeout} not positive (NaN included).
        """
        if self.max_connections < 1 or self.burst < 1:
            raise ValueError("max_connections and burst must be at least 1")
        if not self.refill_per_second > 0 or not self.connect_timeout > 0:
            raise ValueError("refill_per_second and connect_timeout must be positive")


class TokenBucket:
    """
    A token bucket read from an injected clock: starts full with C{burst} tokens and gains
    C{refill_per_second} tokens a second, never more than C{burst}.
    """

    def __init__(self, clock: IReactorTime, burst: int, refill_per_second: float) -> None:
        """
        @param clock: where the time comes from.
        @param burst: the bucket's capacity, and its initial content.
        @param refill_per_second: the refill rate.
        """
        self._clock = clock
        self._burst = float(burst)
        self._rate = refill_per_second
        self._tokens = float(burst)
        self._stamp = clock.seconds()

    def take(self) -> bool:
        """
        Take one token if there is one.

        @return: whether a token was taken.
        """
        self._refill()
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def seconds_to_next(self) -> float:
        """
        How long until the bucket holds a whole token again (0 when it holds one now).
        """
        self._refill()
        return max(0.0, (1.0 - self._tokens) / self._rate)

    def _refill(self) -> None:
        """
        Add the tokens earned since the last look, up to the capacity.
        """
        now = self._clock.seconds()
        # A clock that steps backwards adds nothing rather than removing tokens.
        elapsed = max(0.0, now - self._stamp)
        self._tokens = min(self._burst, self._tokens + elapsed * self._rate)
        self._stamp = now


def _send_or_queue(transport: Any, data: bytes) -> None:
    """
    Send C{data} at once when the transport has nothing queued, else queue it.

    Twisted's C{write} always queues and sends on a later reactor turn, which costs a turn
    per hop; sending at once halves the latency the relay adds (see bench/proxy.py). What
    the kernel does not take goes through C{write}, so backpressure works as before. This
    reads L{twisted.internet.abstract.FileDescriptor}'s buffer attributes; a transport
    without them is simply written to.
    """
    queued = getattr(transport, "_tempDataLen", None)
    if (
        queued == 0
        and not transport.dataBuffer
        and transport.connected
        and not transport.disconnecting
    ):
        sent = transport.writeSomeData(data)
        if isinstance(sent, int) and sent > 0:
            data = data[sent:]
    if data:
        transport.write(data)


def refusal_response(limit: str, retry_after: int, detail: str) -> bytes:
    """
    The fixed answer to a connection over a limit: an HTTP/1.1 503 with C{Connection: close},
    the limit's name in L{ProxyRefused.HEADER}, C{Retry-After} and a small JSON error body in
    the OpenAI shape. It is written without reading anything from the client.

    @param limit: L{ProxyRefused.CONNECTIONS} or L{ProxyRefused.ACCEPT_RATE}.
    @param retry_after: whole seconds, at least 1.
    @param detail: the error message, e.g. C{"connection limit reached (8 open)"}.
    """
    body = json.dumps(
        {
            "error": {
                "message": f"inferproxy: {detail}",
                "type": "inferproxy_refused",
                "code": limit,
            }
        },
        separators=(",", ":"),
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"{ProxyRefused.HEADER}: {limit}\r\n"
        f"Retry-After: {retry_after}\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n"
        "\r\n"
    )
    return head.encode("ascii") + body


#: How long a refused connection is kept, its answer sent, for the client to read it.
REFUSAL_LINGER_SECONDS = 2.0
#: At most this many refused connections linger at a time; past it, one is closed at once.
MAX_LINGERING_REFUSALS = 32
#: Bytes a lingering refused connection may send (all dropped unread) before it is cut.
_REFUSAL_DRAIN_BYTES = 64 * 1024


class _Refusal(Protocol):
    """
    A connection over a limit: write the refusal, shut the writing side and drop whatever
    the client sends until it closes, for L{REFUSAL_LINGER_SECONDS} at most.

    Closing at once would lose the answer: a Unix socket closed with the client's request
    unread makes the client's next write fail (C{EPIPE}) and its read fail
    (C{ECONNRESET}), and the client would see a dead connection instead of the refusal.
    A half-close lets the client read the answer to its end; it then closes, and so does
    this side. With too many lingering already the connection is closed at once.
    """

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def __init__(self, response: bytes, clock: IReactorTime, lingering: _Lingering) -> None:
        """
        @param response: the bytes of L{refusal_response}.
        @param clock: runs the linger timer.
        @param lingering: the factory's count of lingering refusals.
        """
        self._response = response
        self._clock = clock
        self._lingering = lingering
        self._counted = False
        self._timer: IDelayedCall | None = None
        self._drained = 0

    def connectionMade(self) -> None:
        """
        Write the refusal, then half-close and linger, or close when too many linger.
        """
        transport: Any = self.transport
        _send_or_queue(transport, self._response)
        if self._lingering.count >= MAX_LINGERING_REFUSALS or not hasattr(
            transport, "loseWriteConnection"
        ):
            transport.loseConnection()
            return
        self._lingering.count += 1
        self._counted = True
        transport.loseWriteConnection()
        self._timer = self._clock.callLater(REFUSAL_LINGER_SECONDS, transport.abortConnection)

    def dataReceived(self, data: bytes) -> None:
        """
        What the client sends is dropped unread, up to a bound past which it is cut.
        """
        self._drained += len(data)
        if self._drained > _REFUSAL_DRAIN_BYTES:
            self.transport.abortConnection()  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """
        The refused connection is gone: stop its timer, give its lingering place back.
        """
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._counted:
            self._counted = False
            self._lingering.count -= 1


@dataclass
class _Lingering:
    """How many refused connections linger now (see L{_Refusal})."""

    count: int = 0


def _closed_by_peer(transport: Any) -> bool:
    """
    Whether the peer of a Unix socket closed it (C{POLLHUP}), rather than only shutting down
    its writing (C{POLLRDHUP} alone). Linux only; elsewhere, and for any transport without a
    descriptor, C{False}: an EOF is then taken for a half-close.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        fd = transport.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        events = poller.poll(0)
    except (AttributeError, OSError, ValueError):
        return False
    return any(mask & select.POLLHUP for _, mask in events)


@implementer(IHalfCloseableProtocol)
class _Relay(Protocol):
    """
    One side of a forwarding pair: what it reads, its peer writes.

    A side is finished when it has read EOF and its own write direction has been shut down;
    it then closes its socket. Both sides get there independently once both directions are
    done.
    """

    # A real socket transport: ITCPTransport or IUNIXTransport, plus IConsumer and
    # IPushProducer; no single Twisted interface names all that the relay uses.
    transport: Any
    peer: _Relay | None = None
    _pair: _Pair
    _read_closed = False
    _write_closed = False
    _lost = False

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def dataReceived(self, data: bytes) -> None:
        """
        Relay C{data} to the peer unchanged.
        """
        assert self.peer is not None
        _send_or_queue(self.peer.transport, data)

    def readConnectionLost(self) -> None:
        """
        Pass this side's EOF on as a half-close of the peer's write direction.
        """
        if self._read_closed:
            return
        self._read_closed = True
        peer = self.peer
        if peer is not None and peer.is_open():
            # Without this, a producer paused by backpressure would keep the peer's write
            # direction open forever once its buffer drains (see module docstring).
            peer.transport.unregisterProducer()
            peer.transport.loseWriteConnection()
        self._close_when_finished()

    def writeConnectionLost(self) -> None:
        """
        Record that this side's write direction has been shut down.
        """
        self._write_closed = True
        self._close_when_finished()

    def _close_when_finished(self) -> None:
        """
        Close this side's socket once both of its directions are done: EOF read and its write
        direction shut down.
        """
        if self._read_closed and self._write_closed:
            self.transport.loseConnection()

    def is_open(self) -> bool:
        """
        Whether this side's socket is connected and not yet closing.
        """
        return self.transport is not None and not self._lost and not self.transport.disconnecting

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """
        Close the peer too: after a clean finish it is closing already, after a failure this
        is what closes it. Bytes it has buffered are still delivered.
        """
        self._lost = True
        peer = self.peer
        if peer is not None and peer.is_open():
            peer.transport.unregisterProducer()
            peer.transport.loseConnection()
        self._pair.side_lost()


class _Pair:
    """
    The bookkeeping of one accepted connection: counts its open sides and gives its slot
    back to the factory when the last one is lost.
    """

    def __init__(self, factory: InferProxyFactory) -> None:
        """
        One side open, the accepted client; the factory has counted the pair already.
        """
        self._factory = factory
        self._open_sides = 1

    def side_opened(self) -> None:
        """
        The upstream side of the pair connected.
        """
        self._open_sides += 1

    def side_lost(self) -> None:
        """
        One side of the pair lost its connection.
        """
        self._open_sides -= 1
        if self._open_sides == 0:
            self._factory.pair_closed()


class _UpstreamSide(_Relay):
    """
    The TCP side of a pair, connected to the upstream server.
    """

    def __init__(self, pair: _Pair) -> None:
        """
        @param pair: the pair this side belongs to.
        """
        self._pair = pair

    def connectionMade(self) -> None:
        """
        Forward small writes at once: the relay already decides when to write.
        """
        if ITCPTransport.providedBy(self.transport):
            self.transport.setTcpNoDelay(True)
        self._pair.side_opened()


class _UpstreamFactory(Factory):
    """
    Builds the upstream side of one pair.
    """

    noisy = False

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def __init__(self, pair: _Pair) -> None:
        """
        @param pair: the pair the upstream side joins.
        """
        self._pair = pair

    def buildProtocol(self, addr: IAddress | None) -> _UpstreamSide:
        """
        The upstream side of the pair.
        """
        return _UpstreamSide(self._pair)


class _ClientSide(_Relay):
    """
    The Unix side of a pair: an accepted client connection.

    Nothing is read from the client until the upstream connection exists, so nothing needs
    buffering meanwhile.
    """

    _connecting: Deferred[Any] | None = None

    def __init__(self, factory: InferProxyFactory) -> None:
        """
        Start a pair for this accepted connection (L{InferProxyFactory.buildProtocol} has
        counted it already).
        """
        self._factory = factory
        self._pair = _Pair(factory)

    def connectionMade(self) -> None:
        """
        Pause the client and open the upstream connection.
        """
        self.transport.pauseProducing()
        connecting = self._factory.upstream.connect(_UpstreamFactory(self._pair))
        self._connecting = connecting
        connecting.addCallbacks(self._upstream_connected, self._upstream_failed)

    def _upstream_connected(self, upstream: _UpstreamSide) -> None:
        """
        Join the sides: each transport becomes the other's streaming producer, which is the
        backpressure both ways, and the client is read from at last.
        """
        self._connecting = None
        self.peer = upstream
        upstream.peer = self
        self.transport.registerProducer(upstream.transport, True)
        upstream.transport.registerProducer(self.transport, True)
        self.transport.resumeProducing()

    def _upstream_failed(self, failure: Failure) -> None:
        """
        No upstream connection: log it and abort the client. A cancelled attempt (the client
        has gone already) is silent.
        """
        self._connecting = None
        if failure.check(CancelledError):
            return
        _log.warn(
            "upstream {upstream} unreachable, client closed: {reason}",
            upstream=self._factory.upstream_label,
            reason=failure.getErrorMessage(),
        )
        self.transport.abortConnection()

    def readConnectionLost(self) -> None:
        """
        EOF from the client: a half-close is passed on; a client that closed its socket has
        gone, and the upstream side is aborted with it (see the module docstring). Once this
        side has shut its own writing, a half-close of the client's also reads as C{POLLHUP}:
        it is passed on then, as the end of an exchange that is finishing anyway.
        """
        if self._write_closed or not _closed_by_peer(self.transport):
            super().readConnectionLost()
            return
        self._read_closed = True
        peer = self.peer
        if peer is not None and peer.is_open():
            peer.transport.unregisterProducer()
            peer.transport.abortConnection()
        self.transport.unregisterProducer()
        self.transport.loseConnection()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """
        Abandon an upstream connection still being made, then close the pair.
        """
        if self._connecting is not None:
            self._connecting.cancel()
        super().connectionLost(reason)


class InferProxyFactory(Factory):
    """
    Builds one forwarding pair per accepted connection, within the connection cap and the
    accept-rate token bucket.

    @ivar upstream: the endpoint each pair connects to.
    @ivar upstream_label: how log lines name the upstream.
    @ivar limits: the limits in force.
    """

    # Twisted would log every start and stop of the factory: that is traffic.
    noisy = False

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def __init__(
        self,
        upstream: IStreamClientEndpoint,
        clock: IReactorTime,
        limits: ProxyLimits,
        upstream_label: str = "upstream",
    ) -> None:
        """
        @param upstream: the endpoint each pair connects to.
        @param clock: the time source of the token bucket.
        @param limits: the limits to enforce.
        @param upstream_label: how log lines name the upstream.
        """
        self.upstream = upstream
        self.upstream_label = upstream_label
        self.limits = limits
        self._bucket = TokenBucket(clock, limits.burst, limits.refill_per_second)
        self._clock = clock
        self._open_pairs = 0
        self._lingering = _Lingering()

    @property
    def open_pairs(self) -> int:
        """
        How many pairs are open now (accepted and not yet fully closed).
        """
        return self._open_pairs

    @property
    def lingering_refusals(self) -> int:
        """
        How many refused connections are open now, their answer sent (see L{_Refusal}).
        """
        return self._lingering.count

    def _refuse(self, response: bytes) -> Protocol:
        """The protocol of a refused connection: it sends C{response} and goes."""
        return _Refusal(response, self._clock, self._lingering)

    def buildProtocol(self, addr: IAddress | None) -> Protocol:
        """
        Accept a connection within the limits, or refuse it with L{refusal_response}.
        """
        if self._open_pairs >= self.limits.max_connections:
            _log.warn(
                "refused a connection: connection limit reached ({max_connections} open)",
                max_connections=self.limits.max_connections,
            )
            detail = f"connection limit reached ({self.limits.max_connections} open)"
            return self._refuse(refusal_response(ProxyRefused.CONNECTIONS, 1, detail))
        if not self._bucket.take():
            _log.warn(
                "refused a connection: accept rate limit (burst {burst}, refill {refill}/s)",
                burst=self.limits.burst,
                refill=self.limits.refill_per_second,
            )
            detail = (
                f"accept rate limit reached (burst {self.limits.burst},"
                f" refill {self.limits.refill_per_second:g}/s)"
            )
            wait = max(1, math.ceil(self._bucket.seconds_to_next()))
            return self._refuse(refusal_response(ProxyRefused.ACCEPT_RATE, wait, detail))
        self._open_pairs += 1
        return _ClientSide(self)

    def pair_closed(self) -> None:
        """
        Give back the slot of a pair whose sides are both closed.
        """
        self._open_pairs -= 1


def parse_upstream(value: str) -> tuple[str, int]:
    """
    Split C{HOST:PORT} (C{[v6addr]:PORT} for IPv6) into host and port.

    @raise ValueError: with a one-line reason.
    """
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"upstream must be HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"an IPv6 upstream must be written [ADDRESS]:PORT, got {value!r}")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"upstream port must be 1-65535, got {port_text!r}")
    return host, int(port_text)


def upstream_endpoint(
    reactor: object, host: str, port: int, timeout: float
) -> IStreamClientEndpoint:
    """
    The TCP endpoint for C{host}:C{port}: names resolve, IPv4 and IPv6 both work.

    An address is connected to directly: C{HostnameEndpoint} would send even an IP literal
    through the resolver's thread pool, which costs most of a millisecond per connection.

    @param reactor: a reactor providing TCP, time and name resolution.
    """
    if isIPAddress(host):
        return TCP4ClientEndpoint(reactor, host, port, timeout=timeout)
    if isIPv6Address(host):
        return TCP6ClientEndpoint(reactor, host, port, timeout=timeout)
    return HostnameEndpoint(reactor, host, port, timeout=timeout)


class InferProxyService(Service):
    """
    Listens on a Unix socket and forwards each connection through an L{InferProxyFactory}.
    """

    _port: IListeningPort | None = None

    def __init__(self, reactor: IReactorUNIX, listen_path: str, factory: InferProxyFactory) -> None:
        """
        @param reactor: the reactor to listen with.
        @param listen_path: the Unix socket path.
        @param factory: the forwarding factory.
        """
        self._reactor = reactor
        self.listen_path = listen_path
        self.factory = factory

    def startService(self) -> None:
        """
        Listen, or raise a L{loopd.unixsocket.UnixSocketError} saying why not.
        """
        self._port = listen_unix(self._reactor, self.listen_path, self.factory)
        super().startService()
        limits = self.factory.limits
        _log.info(
            "inferproxy listening on {path}, forwarding to {upstream} "
            "(max {max_connections} connections, burst {burst}, refill {refill}/s)",
            path=self.listen_path,
            upstream=self.factory.upstream_label,
            max_connections=limits.max_connections,
            burst=limits.burst,
            refill=limits.refill_per_second,
        )

    def stopService(self) -> Deferred[None] | None:
        """
        Stop listening; the socket file is removed when the returned Deferred fires.
        """
        super().stopService()
        port, self._port = self._port, None
        if port is None:
            return None
        return port.stopListening()
