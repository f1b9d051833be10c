# -*- test-case-name: loopd.test.test_queue_show -*-
"""
C{loopd queue status}: ask a lease socket for its C{status} and print it as the seed's
C{/queue} does: per queue the slots in use out of the slot count (or C{passthrough}), with a
transient over-capacity such as C{2/1} marked, the switch count, every holder and every
waiter as C{sessionKey tier [group]}, and the waiting depth per tier.

When the lease socket is loopd's own, its gateway is asked too (C{GET /v1/queue} on the
gateway's socket) for each endpoint's health state (up, down, probing, and why), printed
after the queues (L{render_endpoints}); the lease protocol's own C{status} reply has no such
field, so C{twist llmqueue} is printed as before.

L{render_status} and L{render_endpoints} are pure; L{fetch_status} and L{fetch_endpoints}
each do one round trip.

A socket that speaks HTTP (loopd's gateway, given by mistake) is told at once
(L{NotLeaseSocketError}) instead of after the timeout: the C{status} line ends in C{\r\n}, which
the lease protocol reads as JSON whitespace before its newline and an HTTP server as the end
of a request line it answers with a 400 at once, and an answer starting C{HTTP/} is not
taken for a lease reply.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.protocol import Factory
from twisted.protocols.basic import LineOnlyReceiver
from twisted.python.failure import Failure

from loopd import http, strict_json
from loopd.queue.protocol import MAX_LINE_BYTES, encode_message
from loopd.reactor import IUnixReactor
from loopd.unixsocket import UnixSocketError, check_peer_socket

__all__ = [
    "NotLeaseSocketError",
    "QueueStatusError",
    "fetch_endpoints",
    "fetch_status",
    "queue_status_command",
    "render_endpoints",
    "render_status",
]

#: How Twisted's log lines name C{loopd queue status} (the C{logPrefix} of its protocols and
#: factories), instead of a private class name.
LOG_PREFIX = "loopd.queue.status"


class QueueStatusError(Exception):
    """
    The lease socket could not be asked: unreachable, silent, or it answered nonsense.
    """


class NotLeaseSocketError(QueueStatusError):
    """
    The socket answered HTTP: it is an HTTP server (loopd's gateway, most likely), not a
    lease socket.
    """


def _entry(item: Mapping[str, Any]) -> str:
    """One holder or waiter as C{sessionKey tier [group]}."""
    text = f"{item.get('sessionKey') or '(anonymous)'} {item.get('role', 'parent')}"
    group = item.get("group")
    return f"{text} [{group}]" if group else text


def render_status(queues: Sequence[Mapping[str, Any]]) -> str:
    """
    Return the text of a C{status} reply's C{queues}, one block per queue.
    """
    if not queues:
        return "no queues yet (none has been used since the daemon started)\n"
    lines: list[str] = []
    for queue in queues:
        holders = list(queue.get("holders") or ())
        waiting = list(queue.get("waiting") or ())
        limit = queue.get("maxStreams")
        if limit is None:
            slots = f"passthrough, {len(holders)} holding"
        else:
            slots = f"{len(holders)}/{limit} slots"
            if len(holders) > limit:
                slots += " (over capacity until holders release)"
        lines.append(f"{queue.get('queueKey')}: {slots}, switches {queue.get('switches', 0)}")
        for holder in holders:
            lines.append(f"  holding  {_entry(holder)}")
        if waiting:
            parents = sum(1 for w in waiting if w.get("role", "parent") == "parent")
            depth = f"parent {parents}, child {len(waiting) - parents}"
            lines.append(f"  waiting  {len(waiting)} ({depth}), in enqueue order:")
            for number, waiter in enumerate(waiting, 1):
                lines.append(f"    {number}. {_entry(waiter)}")
    return "\n".join(lines) + "\n"


def render_endpoints(endpoints: Mapping[str, Any]) -> str:
    """
    Return the text of the gateway's C{endpoints} (C{GET /v1/queue}): one line per endpoint
    with its health state and, when it is not up, why.
    """
    if not endpoints:
        return ""
    width = max(len(name) for name in endpoints)
    lines = ["endpoints:"]
    for name, health in endpoints.items():
        known = health if isinstance(health, Mapping) else {}
        state = str(known.get("state", "unknown"))
        detail = known.get("detail")
        line = f"  {name:<{width}}  {state}"
        if state != "up" and detail:
            line += f": {detail}"
        lines.append(line)
    return "\n".join(lines) + "\n"


class _StatusAsker(LineOnlyReceiver):
    """Sends one C{status} and fires with the first C{status} reply."""

    delimiter = b"\n"
    MAX_LENGTH = MAX_LINE_BYTES * 64

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def __init__(self, answer: Deferred[list[dict[str, Any]]], socket_path: str = "") -> None:
        """
        @param answer: fires with the queues, or fails with L{QueueStatusError}.
        @param socket_path: the socket asked, named by the errors.
        """
        self._answer = answer
        self._socket = socket_path

    def connectionMade(self) -> None:
        """
        Ask, in a line ending in C{\r\n}: the same message to the lease protocol (the
        C{\r} is JSON whitespace), and one that an HTTP server refuses at once.
        """
        assert self.transport is not None
        self.transport.write(encode_message({"op": "status"})[:-1] + b"\r\n")

    def lineReceived(self, line: bytes) -> None:
        """Take the first line as the reply; an HTTP status line is L{NotLeaseSocketError}."""
        if line.startswith(b"HTTP/"):
            status = line.rstrip(b"\r")[:80].decode("ascii", "replace")
            error = NotLeaseSocketError(
                f"{self._socket} is an HTTP socket (it answered {status!r}), not a lease "
                "socket: it is loopd's gateway, or another HTTP server"
            )
            if not self._answer.called:
                self._answer.errback(error)
            if self.transport is not None:
                self.transport.loseConnection()
            return
        try:
            message = strict_json.decode(line)
        except ValueError:
            self._fail("the socket answered something that is not JSON")
            return
        if isinstance(message, dict) and message.get("op") == "status":
            queues = message.get("queues")
            if isinstance(queues, list):
                self._done(queues)
                return
        self._fail(f"unexpected reply: {line[:200].decode('utf-8', 'replace')}")

    def lineLengthExceeded(self, line: bytes) -> None:
        """A reply beyond any sane size."""
        self._fail("the status reply is too long")

    def connectionLost(self, reason: Failure | None = None) -> None:
        """Closed without a reply (a no-op after one)."""
        self._fail("the socket closed before it answered")

    def _done(self, queues: list[dict[str, Any]]) -> None:
        """Fire with the queues, once, and close the connection."""
        if not self._answer.called:
            self._answer.callback(queues)
        if self.transport is not None:
            self.transport.loseConnection()

    def _fail(self, why: str) -> None:
        """Fail with L{QueueStatusError} saying C{why}, once, and close the connection."""
        if not self._answer.called:
            self._answer.errback(QueueStatusError(why))
        if self.transport is not None:
            self.transport.loseConnection()


def fetch_status(
    reactor: IUnixReactor, socket_path: str, timeout: float = 5.0
) -> Deferred[list[dict[str, Any]]]:
    """
    Ask the lease socket at C{socket_path} for its C{status}; fire with its C{queues}.

    A C{status}-only connection never counts as a client, so asking never keeps an idle
    daemon alive.

    @param reactor: provides C{IReactorUNIX} and C{IReactorTime}.
    @raise QueueStatusError: (as the Deferred's failure) when the socket is not safe to
        connect to (L{check_peer_socket}), cannot be reached, stays silent for C{timeout}
        seconds, or answers something else.
    """
    answer: Deferred[list[dict[str, Any]]] = Deferred()
    try:
        check_peer_socket(socket_path)
    except UnixSocketError as e:
        answer.errback(QueueStatusError(f"not connecting: {e}"))
        return answer
    endpoint = UNIXClientEndpoint(reactor, socket_path, timeout=timeout)
    connecting = endpoint.connect(Factory.forProtocol(lambda: _StatusAsker(answer, socket_path)))

    def unreachable(reason: Failure) -> None:
        """
        The connection was not made: fail with L{QueueStatusError}, unless the answer has
        fired already (the timeout came first).
        """
        if not answer.called:
            answer.errback(
                QueueStatusError(f"cannot reach {socket_path}: {reason.getErrorMessage()}")
            )

    connecting.addErrback(unreachable)
    answer.addTimeout(timeout, reactor, lambda r, t: _silent(r, socket_path, t))
    return answer


def _silent(result: object, socket_path: str, timeout: float) -> object:
    """Turn the timeout's cancellation into a L{QueueStatusError}."""
    if isinstance(result, Failure) and not result.check(QueueStatusError):
        return Failure(QueueStatusError(f"{socket_path} did not answer within {timeout:g} s"))
    return result


def fetch_endpoints(
    reactor: IUnixReactor, gateway_path: str, timeout: float = 5.0
) -> Deferred[Any]:
    """
    Ask loopd's gateway at C{gateway_path} for C{GET /v1/queue}; fire with its C{endpoints}
    (each endpoint's health state).

    @raise QueueStatusError: (as the Deferred's failure) when the socket is not safe to
        connect to, cannot be reached, does not answer within C{timeout} seconds, or answers
        something else.
    """
    try:
        check_peer_socket(gateway_path)
    except UnixSocketError as e:
        failed: Deferred[Any] = Deferred()
        failed.errback(QueueStatusError(f"not connecting: {e}"))
        return failed

    def read(response: http.HttpResponse) -> Deferred[bytes]:
        """The body of the answer (under the client's default cap)."""
        return response.read_body()

    connecting = http.request(reactor, gateway_path, "GET", "/v1/queue", connect_timeout=timeout)
    asking: Deferred[bytes] = connecting.addCallback(read)
    asking.addTimeout(timeout, reactor)

    def endpoints(body: bytes) -> Any:
        """The C{endpoints} of the answer; L{QueueStatusError} when it has none."""
        try:
            answer = strict_json.decode(body.decode("utf-8", "replace"))
        except ValueError:
            raise QueueStatusError("the gateway answered something that is not JSON") from None
        if not isinstance(answer, dict) or not isinstance(answer.get("endpoints"), dict):
            raise QueueStatusError("the gateway's /v1/queue has no endpoints")
        return answer["endpoints"]

    def unreachable(reason: Failure) -> Failure:
        """Any failure but L{QueueStatusError} as one, naming the socket."""
        if reason.check(QueueStatusError):
            return reason
        return Failure(QueueStatusError(f"cannot ask {gateway_path}: {reason.getErrorMessage()}"))

    answered: Deferred[Any] = asking.addCallback(endpoints)
    return answered.addErrback(unreachable)


def queue_status_command(
    reactor: IUnixReactor,
    socket_path: str,
    write: Callable[[str], None],
    err: Callable[[str], None],
    gateway_path: str | None = None,
    lease_socket: str | None = None,
) -> Deferred[int]:
    """
    C{loopd queue status}: print the status of the lease socket at C{socket_path}; fire
    with 0, or with 1 after saying on C{err} why it could not be asked.

    @param gateway_path: loopd's gateway socket, when the lease socket is loopd's own: each
        endpoint's health state is printed after the queues (a gateway that cannot be asked
        is said on C{err}, and the exit status stays 0).
    @param lease_socket: the lease socket to name when C{socket_path} turns out to be an
        HTTP socket (L{NotLeaseSocketError}): the one C{loopd queue status} asks by default.
    """

    def show(queues: list[dict[str, Any]]) -> int | Deferred[int]:
        """Print the rendered status, then the endpoints' states; exit status 0."""
        write(render_status(queues))
        if gateway_path is None:
            return 0

        def states(endpoints: Any) -> int:
            """Print the endpoints' states; exit status 0."""
            write(render_endpoints(endpoints))
            return 0

        def no_states(reason: Failure) -> int:
            """Say on C{err} why there are no states; exit status 0 all the same."""
            reason.trap(QueueStatusError)
            err(f"loopd queue status: no endpoint states: {reason.getErrorMessage()}\n")
            return 0

        asking: Deferred[int] = fetch_endpoints(reactor, gateway_path).addCallback(states)
        return asking.addErrback(no_states)

    def failed(reason: Failure) -> int:
        """
        Say on C{err} why the status could not be had; exit status 1. Failures other than
        L{QueueStatusError} pass on.
        """
        reason.trap(QueueStatusError)
        err(f"loopd queue status: {reason.getErrorMessage()}\n")
        if reason.check(NotLeaseSocketError) and lease_socket and lease_socket != socket_path:
            err(f"loopd queue status: the lease socket is {lease_socket}; ask it with --socket\n")
        return 1

    return fetch_status(reactor, socket_path).addCallbacks(show, failed)
