# -*- test-case-name: loopd.test.test_llama_pacing -*-
"""
Pacing: loopd's own connections to one endpoint, kept under the limits of the inferproxy in
front of it.

An inferproxy holds at most C{--max-connections} connections at a time and takes a token
from a bucket (C{--burst} tokens, refilled at C{--refill} a second) for each one it accepts;
a connection over either limit is refused at once (with a short 503, L{ProxyRefused}). The
defaults (8, 10, 2 a second) stop retry storms, and loopd lives with them: it opens one
connection per request (DESIGN decision 1), and more for C{/slots} polls, C{/props},
C{/health}, the reasoning_end control and the self-test.

L{Pacer} mirrors both limits on loopd's side, from the endpoint's C{proxy_max_connections},
C{proxy_burst} and C{proxy_refill_per_second}: a connection opens when the pacer's bucket
holds a token and fewer than the cap of loopd's connections to the endpoint are open;
otherwise it waits, first come first served, until both hold. So a request waits for its
token (half a second at most at the default refill, when it is alone) instead of being
refused and retried 2 s later. The wait is bounded by C{pacing_wait_ms}: a connection that
the bucket's schedule shows would wait longer fails at once with L{Busy}, and one still
waiting when the bound passes (the cap did not free) fails then. L{PacingStats} counts the
connections, those that waited and the time they waited, the L{Busy} ones and the refusals
that came all the same.

The pacing is also a ceiling, and an honest one: after the burst, no more than
C{proxy_refill_per_second} connections a second reach the endpoint, so with the defaults
no more than about 2 requests a second, whatever loopd does. To go faster, raise the
inferproxy's C{--burst} and C{--refill} (and C{--max-connections}) and the endpoint's fields
with them.

L{PacedOpener} is the L{loopd.http.Opener} of one endpoint that goes through its pacer. It
gives the pacer's place back when the connection closes, and it reads what still goes
wrong:

 - L{ProxyRefused} for the accept rate (the proxy is shared with another client, or loopd
   started while the proxy's bucket was low): the pacer's bucket is emptied, since the
   proxy's is, and the connection waits for the next token, within the same bound. Nothing
   reached the server, so sending the request again is safe.
 - L{ProxyRefused} for the connection cap (someone else holds the proxy's connections, which
   does not clear in milliseconds): fails at once, named for the endpoint, never retried.
 - L{Connect}: named for the endpoint; the socket's path goes to the log only, never into
   the message a client of loopd may see.

A refusal is never a dead endpoint: it is its own kind, not L{Connect}.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from loopd import http
from loopd.errors import Busy, Connect, ProxyRefused
from loopd.reactor import IUnixReactor
from loopd.settings import Endpoint

__all__ = ["PacedOpener", "Pacer", "PacingStats", "Ticket"]

_log = Logger(namespace="loopd.llama.pacing")

# A bucket that has refilled to within this of a whole token counts as holding one: the
# clock's float sums would otherwise leave a waiter a hair short at its due time.
_EPSILON = 1e-9

#: The caps of an exchange whose caller gives none: L{loopd.http}'s defaults.
_DEFAULT_CAPS = http.HttpCaps()

#: Accept-rate refusals one exchange takes before it gives up, within its wait bound.
MAX_RATE_REFUSALS = 3


@dataclass
class PacingStats:
    """
    What one pacer has done since it was made; read by the gateway's metrics.

    @ivar connections: connections let through.
    @ivar waits: of those, how many had to wait.
    @ivar waited_seconds: the time they waited, in all.
    @ivar busy: connections that failed with L{Busy}, past the wait bound.
    @ivar refusals: refusals the inferproxy still gave, by limit.
    """

    connections: int = 0
    waits: int = 0
    waited_seconds: float = 0.0
    busy: int = 0
    refusals: dict[str, int] = field(default_factory=dict)


class Ticket:
    """
    One connection's place under the pacer's cap, held until L{release}.
    """

    def __init__(self, pacer: Pacer) -> None:
        """
        @param pacer: the pacer the place belongs to.
        """
        self._pacer = pacer
        self._released = False

    def release(self) -> None:
        """
        The connection is gone: give its place back. Calling it again does nothing.
        """
        if self._released:
            return
        self._released = True
        self._pacer._released()


@dataclass(eq=False)
class _Waiter:
    """A connection waiting for the pacer: since when, and its deadline's timer."""

    deferred: Deferred[Ticket]
    since: float
    deadline: IDelayedCall | None = None


class Pacer:
    """
    A token bucket and a connection cap, mirroring one inferproxy's limits, with a queue of
    connections that wait for both (see the module docstring).

    @ivar name: the endpoint's name, for messages.
    @ivar stats: the counts (L{PacingStats}).
    """

    def __init__(
        self,
        clock: IReactorTime,
        *,
        name: str,
        max_connections: int,
        burst: int,
        refill_per_second: float,
        wait_ms: int,
    ) -> None:
        """
        The bucket starts full.

        @param clock: the time source and the timers.
        @param name: the endpoint's name, for messages.
        @param max_connections: loopd's connections to the endpoint open at a time (> 0).
        @param burst: the bucket's size (> 0).
        @param refill_per_second: the bucket's refill (> 0).
        @param wait_ms: how long a connection may wait (>= 0).
        @raise ValueError: for a limit out of range.
        """
        if max_connections < 1 or burst < 1 or not refill_per_second > 0 or wait_ms < 0:
            raise ValueError("pacing limits out of range")
        self._clock = clock
        self.name = name
        self._cap = max_connections
        self._burst = float(burst)
        self._rate = refill_per_second
        self._wait = wait_ms / 1000.0
        self._tokens = float(burst)
        self._stamp = clock.seconds()
        self._open = 0
        self._waiters: deque[_Waiter] = deque()
        self._timer: IDelayedCall | None = None
        self.stats = PacingStats()

    @classmethod
    def for_endpoint(cls, clock: IReactorTime, endpoint: Endpoint) -> Pacer:
        """
        The pacer of C{endpoint}, from its C{proxy_*} and C{pacing_wait_ms} fields.
        """
        return cls(
            clock,
            name=endpoint.name,
            max_connections=endpoint.proxy_max_connections,
            burst=endpoint.proxy_burst,
            refill_per_second=endpoint.proxy_refill_per_second,
            wait_ms=endpoint.pacing_wait_ms,
        )

    @property
    def clock(self) -> IReactorTime:
        """The pacer's time source."""
        return self._clock

    @property
    def wait_seconds(self) -> float:
        """How long a connection may wait, in seconds (C{pacing_wait_ms})."""
        return self._wait

    @property
    def open_connections(self) -> int:
        """How many of loopd's connections to the endpoint hold a place now."""
        return self._open

    @property
    def waiting(self) -> int:
        """How many connections wait for the pacer now."""
        return len(self._waiters)

    def acquire(self, deadline: float | None = None) -> Deferred[Ticket]:
        """
        Ask to open one connection.

        @param deadline: the clock time by which it must be let through; by default
            C{wait_ms} from now.
        @return: fires with a L{Ticket} when the connection may open (at once when a token
            and a place are free and nobody waits), or fails with L{Busy}: at once when the
            bucket's schedule shows the wait would pass the deadline, else when the deadline
            passes. Cancelling it leaves the queue (C{CancelledError}).
        """
        now = self._clock.seconds()
        self._refill(now)
        due = now + self._wait if deadline is None else deadline
        if not self._waiters and self._free():
            return succeed(self._let_through(now, now))
        if due <= now + _EPSILON:
            return fail(self._busy("nothing is free now"))
        if self._open < self._cap:
            # The tokens decide: the waiter k-th in line gets its token when the bucket,
            # which nobody else drains meanwhile, has refilled to k.
            ready = now + max(0.0, len(self._waiters) + 1 - self._tokens) / self._rate
            if ready > due + _EPSILON:
                return fail(self._busy(f"its turn would come in {ready - now:.1f} s"))
        waiter = _Waiter(Deferred(lambda d: self._withdraw(waiter)), now)
        waiter.deadline = self._clock.callLater(due - now, self._expire, waiter)
        self._waiters.append(waiter)
        self._schedule()
        return waiter.deferred

    def drain(self) -> None:
        """
        Empty the bucket: the inferproxy refused on its accept rate, so its bucket is empty
        whatever this one says. Refilling starts from now.
        """
        self._refill(self._clock.seconds())
        self._tokens = 0.0
        self._schedule()

    def refused(self, limit: str) -> None:
        """
        Count a refusal the inferproxy still gave, by limit.
        """
        self.stats.refusals[limit] = self.stats.refusals.get(limit, 0) + 1

    # -- inside --------------------------------------------------------------------------

    def _refill(self, now: float) -> None:
        """Add the tokens earned since the last look, up to the burst."""
        elapsed = max(0.0, now - self._stamp)
        self._tokens = min(self._burst, self._tokens + elapsed * self._rate)
        self._stamp = now

    def _free(self) -> bool:
        """Whether a token and a place are both free now."""
        return self._tokens >= 1.0 - _EPSILON and self._open < self._cap

    def _let_through(self, now: float, since: float) -> Ticket:
        """Spend a token and a place for a connection that asked at C{since}."""
        self._tokens = max(0.0, self._tokens - 1.0)
        self._open += 1
        self.stats.connections += 1
        if now > since:
            self.stats.waits += 1
            self.stats.waited_seconds += now - since
        return Ticket(self)

    def _busy(self, why: str) -> Busy:
        """Count and make the L{Busy} of a connection that cannot go within its bound."""
        self.stats.busy += 1
        return Busy(
            f"endpoint {self.name}: {len(self._waiters)} connections already wait for the"
            f" pacing under its inferproxy's limits ({self._rate:g} connections a second,"
            f" {self._cap} open); {why}, past pacing_wait_ms"
        )

    def _pump(self) -> None:
        """Let waiters through, oldest first, while a token and a place are free."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        now = self._clock.seconds()
        self._refill(now)
        while self._waiters and self._free():
            waiter = self._waiters.popleft()
            if waiter.deadline is not None and waiter.deadline.active():
                waiter.deadline.cancel()
            # Fire only once the state is whole: its callbacks may ask the pacer again.
            waiter.deferred.callback(self._let_through(now, waiter.since))
        self._schedule()

    def _schedule(self) -> None:
        """
        Set the one timer to the moment the next token is due, when someone waits for a
        token; a full cap waits for a release instead.
        """
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if not self._waiters or self._open >= self._cap:
            return
        if self._free():
            self._timer = self._clock.callLater(0, self._pump)
            return
        self._refill(self._clock.seconds())
        self._timer = self._clock.callLater((1.0 - self._tokens) / self._rate, self._pump)

    def _released(self) -> None:
        """A ticket was released: its place is free, a waiter may go."""
        self._open -= 1
        if self._waiters:
            self._pump()

    def _withdraw(self, waiter: _Waiter) -> None:
        """The canceller of a waiter: leave the queue; C{Deferred.cancel} fails it."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        if waiter.deadline is not None and waiter.deadline.active():
            waiter.deadline.cancel()
        self._schedule()

    def _expire(self, waiter: _Waiter) -> None:
        """A waiter's deadline passed: it fails with L{Busy}."""
        if waiter not in self._waiters:
            return
        self._waiters.remove(waiter)
        waited = self._clock.seconds() - waiter.since
        waiter.deferred.errback(Failure(self._busy(f"it waited {waited:.1f} s")))
        self._schedule()


class PacedOpener:
    """
    The L{loopd.http.Opener} of one endpoint, through its L{Pacer} (see the module
    docstring).

    @ivar pacer: the endpoint's pacer.
    """

    def __init__(self, reactor: IUnixReactor, endpoint: Endpoint, pacer: Pacer) -> None:
        """
        @param reactor: provides IReactorTime and IReactorUNIX.
        @param endpoint: the endpoint whose socket is opened.
        @param pacer: the endpoint's pacer.
        """
        self._reactor = reactor
        self._endpoint = endpoint
        self.pacer = pacer

    def __call__(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        caps: http.HttpCaps = _DEFAULT_CAPS,
        connect_timeout: float = 5.0,
        on_connected: Callable[[], None] | None = None,
    ) -> Deferred[http.HttpResponse]:
        """
        One exchange as L{loopd.http.request} makes it, once the pacer lets it through.

        @return: fires with the response once its headers are in; fails as
            L{loopd.http.request} does, with L{Busy} past the wait bound, with
            L{ProxyRefused} and L{Connect} named for the endpoint, or with
            C{CancelledError} when cancelled (a waiting connection then leaves the queue).
        """

        def send(ticket: Ticket) -> Deferred[http.HttpResponse]:
            """Open the connection; its place is given back when it closes."""
            return http.request(
                self._reactor,
                self._endpoint.socket,
                method,
                path,
                body,
                headers,
                caps=caps,
                connect_timeout=connect_timeout,
                on_connected=on_connected,
                on_closed=ticket.release,
            )

        return _PacedExchange(self, send).start()

    def _connect_failed(self, error: Connect) -> Connect:
        """Log a connect failure with the socket's path; the error names the endpoint."""
        _log.warn(
            "endpoint {endpoint}: cannot connect to {path}: {reason}",
            endpoint=self._endpoint.name,
            path=error.path or self._endpoint.socket,
            reason=error.reason,
        )
        return Connect(error.reason, path=error.path, endpoint=self._endpoint.name)

    def _refused(self, error: ProxyRefused) -> ProxyRefused:
        """Count and log a refusal by the inferproxy; the error names the endpoint."""
        self.pacer.refused(error.limit)
        _log.warn(
            "endpoint {endpoint}: its inferproxy refused a connection ({limit} limit)",
            endpoint=self._endpoint.name,
            limit=error.limit,
        )
        return ProxyRefused(error.limit, error.retry_after, endpoint=self._endpoint.name)


class _PacedExchange:
    """One exchange of a L{PacedOpener}: waiting for the pacer, or under way."""

    def __init__(
        self, opener: PacedOpener, send: Callable[[Ticket], Deferred[http.HttpResponse]]
    ) -> None:
        """
        @param opener: the opener, its pacer and its endpoint.
        @param send: opens the connection once a ticket is given.
        """
        self._opener = opener
        self._pacer = opener.pacer
        self._send = send
        self._deadline = opener.pacer.clock.seconds() + opener.pacer.wait_seconds
        self._result: Deferred[http.HttpResponse] = Deferred(self._cancel)
        self._step: Deferred[Any] | None = None
        self._rate_refusals = 0

    def start(self) -> Deferred[http.HttpResponse]:
        """Wait for the pacer, then send."""
        self._wait()
        return self._result

    def _wait(self) -> None:
        """Ask the pacer for a place, within the exchange's one deadline."""
        waiting = self._pacer.acquire(self._deadline)
        self._step = waiting
        waiting.addCallbacks(self._go, self._failed)

    def _go(self, ticket: Ticket) -> None:
        """Let through: open the connection."""
        if self._result.called:
            ticket.release()
            return
        sending = self._send(ticket)
        self._step = sending
        sending.addCallbacks(self._answered, self._failed)

    def _answered(self, response: http.HttpResponse) -> None:
        """The headers are in."""
        self._step = None
        if self._result.called:
            response.abort()
            return
        self._result.callback(response)

    def _failed(self, reason: Failure) -> None:
        """
        A failure of the wait or of the exchange: an accept-rate refusal waits again (see
        the module docstring), a refusal or a connect failure is named for the endpoint,
        anything else passes as it is.
        """
        self._step = None
        if self._result.called:
            return
        error = reason.value
        if isinstance(error, ProxyRefused):
            named = self._opener._refused(error)
            if error.limit == ProxyRefused.ACCEPT_RATE:
                self._pacer.drain()
                self._rate_refusals += 1
                if self._rate_refusals < MAX_RATE_REFUSALS:
                    self._wait()
                    return
            self._result.errback(Failure(named))
        elif isinstance(error, Connect):
            self._result.errback(Failure(self._opener._connect_failed(error)))
        else:
            self._result.errback(reason)

    def _cancel(self, result: Deferred[http.HttpResponse]) -> None:
        """
        The canceller of the result: leave the pacer's queue, or cancel the exchange.
        """
        step, self._step = self._step, None
        if step is not None:
            step.cancel()
