# -*- test-case-name: loopd.test.test_gateway_health -*-
"""
Endpoint health (DESIGN §3 decision 38): each endpoint is C{up}, C{down} or C{probing}, fed
by the outcomes of the requests loopd sends it and by a background probe of its C{/health}
(L{loopd.gateway.probe} runs the probe; this module only decides).

B{The states.}
  - C{probing}: loopd does not know yet, or the endpoint was down and its probe answered
    once since. It takes requests; the next successful probe or answered request makes it
    C{up}, the next failure C{down}. Every endpoint starts here, with a probe due at once.
  - C{up}: it answers. It takes requests and is probed once C{up_interval_ms} has passed
    since its last probe or its last answered request.
  - C{down}: a request or a probe failed in a way that says nothing serves it. C{auto} and
    C{mesh} leave it out; a request naming it is answered 503 C{endpoint_unavailable} at
    once, with C{Retry-After} the seconds until its next probe (at least 1). It is probed
    every C{down_interval_ms}, and only a successful probe takes it out of C{down} (to
    C{probing}): an endpoint nobody sends requests to must still come back. Once a probe
    has failed too, it is I{confirmed} down (L{HealthBoard.confirmed_down}): a request
    waiting in a retry's backoff to try it again gives up then.

B{What counts as down} (L{means_down}): no connection (L{Connect}); the connection closed
before the response's headers (L{StreamClosedEarly} C{before_headers}: an inferproxy whose
server is dead accepts and closes); an upstream 502 or 503 that is not llama-server saying
it is loading its model. A refusal by the inferproxy at its limits (L{ProxyRefused}) is a
busy endpoint, not a dead one; so is a probe that it refuses. Anything else (a 4xx, a stall,
an answer cut short) says the server is there.

Pure: no reactor, no I/O; time comes in as seconds from the caller's clock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from loopd.errors import Connect, Http, StreamClosedEarly
from loopd.gateway.errors import GatewayError
from loopd.settings import HealthProbe

__all__ = [
    "EndpointUnavailableError",
    "HealthBoard",
    "ProbeOutcome",
    "ProbePace",
    "State",
    "describe",
    "means_down",
]

#: What llama-server's 503 says while it loads its model: busy starting, not down.
LOADING_MARKER: Final = "Loading model"


class State(enum.Enum):
    """An endpoint's health."""

    UP = "up"
    DOWN = "down"
    PROBING = "probing"


class ProbeOutcome(enum.Enum):
    """What one C{/health} probe found."""

    OK = "the server answered that it is fit to take requests"
    FAILED = "no connection, no answer in time, or an answer saying it is not ready"
    BUSY = "the endpoint's inferproxy refused the probe at a limit: it tells nothing"


@dataclass(frozen=True)
class ProbePace:
    """
    How often an endpoint is probed, in seconds.

    @ivar up: between probes of an endpoint that is up.
    @ivar down: between probes of an endpoint that is down or probing.
    """

    up: float
    down: float

    @classmethod
    def from_settings(cls, settings: HealthProbe) -> ProbePace:
        """The pace of C{[health]}."""
        return cls(settings.up_interval_ms / 1000.0, settings.down_interval_ms / 1000.0)


class EndpointUnavailableError(GatewayError):
    """
    503 C{endpoint_unavailable}: the endpoint a request names is down (or every candidate of
    an C{auto} or C{mesh} request is).

    @ivar retry_after: whole seconds until the next probe could bring it back (at least 1),
        for the C{Retry-After} header.
    """

    def __init__(self, why: Mapping[str, str], retry_after: int) -> None:
        """
        @param why: each endpoint that is down, with why it was put down (naming no path).
        @param retry_after: see the class docstring.
        """
        if len(why) == 1:
            ((name, reason),) = why.items()
            what = f"endpoint {name} is down: {reason}"
        else:
            listed = "; ".join(f"{name}: {reason}" for name, reason in why.items())
            what = f"every candidate endpoint is down ({listed})"
        super().__init__(
            503,
            f"{what}; retry after {retry_after} s",
            "server_error",
            "endpoint_unavailable",
        )
        self.retry_after = retry_after


def means_down(error: BaseException) -> bool:
    """
    Whether a request that failed with C{error} says nothing serves its endpoint (module
    docstring, "What counts as down").
    """
    if isinstance(error, Connect):
        return True
    if isinstance(error, StreamClosedEarly):
        return error.before_headers
    if isinstance(error, Http):
        return error.status in (502, 503) and LOADING_MARKER not in error.body
    return False


def describe(error: BaseException) -> str:
    """Why C{error} put an endpoint down, in a few words that name no socket path."""
    if isinstance(error, Connect):
        return error.reason
    if isinstance(error, Http):
        return f"HTTP {error.status}"
    return str(error) or type(error).__name__


class _Endpoint:
    """
    One endpoint's state, why it is in it, its probe's schedule, whether a probe of it is
    in flight, and whether its probe has found it down since it went down.
    """

    def __init__(self, now: float) -> None:
        """Probing, with a probe due at C{now}."""
        self.state = State.PROBING
        self.why = "not probed yet"
        self.due = now
        self.probing = False
        self.confirmed = False


class HealthBoard:
    """
    The health of every endpoint of one gateway; see the module docstring.

    Listeners (L{watch}) hear each endpoint whose state or next probe changed, so the
    prober can move its timer.
    """

    def __init__(self, names: Iterable[str], pace: ProbePace, now: float) -> None:
        """
        @param names: the endpoints, each starting C{probing} with a probe due at C{now}.
        @param pace: how often each is probed.
        """
        self.pace = pace
        self._endpoints = {name: _Endpoint(now) for name in names}
        self._listeners: list[Callable[[str], None]] = []

    def watch(self, listener: Callable[[str], None]) -> None:
        """Call C{listener(name)} whenever endpoint C{name}'s state or next probe changes."""
        self._listeners.append(listener)

    def state(self, name: str) -> State:
        """Endpoint C{name}'s state."""
        return self._endpoints[name].state

    def states(self) -> Mapping[str, State]:
        """Every endpoint's state, in the order they were given."""
        return {name: e.state for name, e in self._endpoints.items()}

    def why(self, name: str) -> str:
        """What put endpoint C{name} in its state: the last failure or probe answer."""
        return self._endpoints[name].why

    def confirmed_down(self, name: str) -> bool:
        """
        Whether endpoint C{name} is down and its probe has found it so since it went down:
        the failure that put it down was not a passing one (a request waiting to retry on it
        gives up, L{loopd.gateway.upstream}).
        """
        endpoint = self._endpoints[name]
        return endpoint.state is State.DOWN and endpoint.confirmed

    def eligible(self, name: str) -> bool:
        """Whether endpoint C{name} takes requests (it is not down)."""
        return self._endpoints[name].state is not State.DOWN

    def due(self, name: str) -> float:
        """When endpoint C{name}'s next probe should start."""
        return self._endpoints[name].due

    def retry_after(self, name: str, now: float) -> int:
        """
        Whole seconds from C{now} until endpoint C{name}'s next probe is due, at least 1:
        the C{Retry-After} of a 503.
        """
        # Clock times are float sums: (now + 1) - now can exceed 1 by a hair.
        return max(1, math.ceil(round(self._endpoints[name].due - now, 6)))

    def unavailable(self, names: Iterable[str], now: float) -> EndpointUnavailableError:
        """The 503 for a request whose endpoints C{names} (at least one) are all down."""
        why = {name: self.why(name) for name in names}
        return EndpointUnavailableError(why, min(self.retry_after(n, now) for n in why))

    # -- request outcomes ------------------------------------------------------------------

    def request_failed(self, name: str, error: BaseException, now: float) -> bool:
        """
        A request to C{name} failed with C{error}: down when it L{means_down}.

        @return: whether the endpoint went down just now because of it.
        """
        if not means_down(error) or self._endpoints[name].state is State.DOWN:
            return False
        self._endpoints[name].why = describe(error)
        self._enter(name, State.DOWN, now)
        return True

    def request_answered(self, name: str, now: float) -> None:
        """
        A request to C{name} got its answer: a C{probing} endpoint is C{up}, and an C{up}
        one needs no probe for an up interval from now (requests that are answered say as
        much as a probe would, and each probe spends a connection of the inferproxy's).
        """
        endpoint = self._endpoints[name]
        if endpoint.state is State.PROBING:
            endpoint.why = "a request was answered"
            self._enter(name, State.UP, now)
        elif endpoint.state is State.UP and not endpoint.probing:
            endpoint.due = max(endpoint.due, now + self.pace.up)
            self._tell(name)

    # -- the probe -------------------------------------------------------------------------

    def probe_started(self, name: str) -> bool:
        """
        The prober wants to probe C{name} now.

        @return: C{False} when a probe of it is in flight already (never two at once).
        """
        endpoint = self._endpoints[name]
        if endpoint.probing:
            return False
        endpoint.probing = True
        return True

    def probe_ended(self, name: str, outcome: ProbeOutcome, now: float, detail: str = "") -> None:
        """
        The probe of C{name} ended with C{outcome} at C{now}: C{OK} takes C{down} to
        C{probing} and C{probing} to C{up}; C{FAILED} is C{down}; C{BUSY} changes nothing.
        The next probe is due one interval of the new state from C{now}.

        @param detail: what the probe found, in words (L{loopd.llama.Health.detail}).
        """
        endpoint = self._endpoints[name]
        endpoint.probing = False
        if outcome is ProbeOutcome.OK:
            after = {State.DOWN: State.PROBING, State.PROBING: State.UP, State.UP: State.UP}
            endpoint.state = after[endpoint.state]
        elif outcome is ProbeOutcome.FAILED:
            endpoint.state = State.DOWN
        endpoint.confirmed = endpoint.state is State.DOWN and (
            outcome is ProbeOutcome.FAILED or endpoint.confirmed
        )
        if outcome is not ProbeOutcome.BUSY:
            endpoint.why = f"/health: {detail}" if detail else outcome.value
        endpoint.due = now + self._interval(endpoint.state)
        self._tell(name)

    # -- inside ----------------------------------------------------------------------------

    def _interval(self, state: State) -> float:
        """Seconds between probes in C{state}."""
        return self.pace.up if state is State.UP else self.pace.down

    def _enter(self, name: str, state: State, now: float) -> None:
        """C{name} is in C{state} from C{now}, its next probe one interval away (or sooner)."""
        endpoint = self._endpoints[name]
        endpoint.state = state
        endpoint.confirmed = False
        endpoint.due = min(endpoint.due, now + self._interval(state))
        self._tell(name)

    def _tell(self, name: str) -> None:
        """Tell every listener about C{name}."""
        for listener in list(self._listeners):
            listener(name)
