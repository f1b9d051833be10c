# -*- test-case-name: loopd.test.test_gateway_swap_gate -*-
"""
The gate in front of each router's models (DESIGN decision 46): a request for a model of a
router waits here until its router's L{SwapBoard} lets it go, so that loopd, not the
router's own least-recently-used rule, decides when a model is swapped out.

Before a request whose load evicts a model goes, the sessions of that model keep their
caches: L{ModelSwaps}' C{before_evict} (the gateway saves their slots to files, decision
39, and forgets what those slots held) runs first. While it waits, the request's client
hears L{Queued} with the requests ahead of it. The price of a swap is the router's measured
load time (learned from the requests that loaded a model: their time to the answer less the
server's own prompt and generation time; L{PRIOR_LOAD_SECONDS} before any) plus the
victim's re-prefill (C{reprefill}, from the gateway's sessions).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Final

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from loopd.gateway.swaps import Go, SwapBoard
from loopd.llama.types import ChatEvent, Queued, Timings
from loopd.settings import Endpoint

__all__ = ["PRIOR_LOAD_SECONDS", "ModelSwaps", "RouterStart", "router_starts"]

_log: Final = Logger(namespace="loopd.gateway.swaps")

#: The load time assumed before a router's first measured load (seconds).
PRIOR_LOAD_SECONDS: Final = 5.0
#: The weight of a new load time in the router's average.
_LOAD_WEIGHT: Final = 0.5


@dataclass(frozen=True)
class RouterStart:
    """
    What loopd knows of a router when it starts.

    @ivar capacity: how many models it keeps loaded (its C{models_max}).
    @ivar loaded: its loaded models, as its C{/v1/models} said.
    @ivar bound_ms: the longest a request waits for a swap (the router's C{swap_wait_ms}).
    """

    capacity: int
    loaded: tuple[str, ...] = ()
    bound_ms: int = 30_000


class ModelSwaps:
    """The swap gates of one gateway's routers."""

    def __init__(
        self,
        reactor: IReactorTime,
        routers: Mapping[str, RouterStart],
        grace_ms: int,
        reprefill: Callable[[str], float],
        before_evict: Callable[[str], Deferred[None]],
    ) -> None:
        """
        @param routers: each router's start, by the router's name.
        @param grace_ms: how long after its last request a model counts as mid-task (the
            lease grace).
        @param reprefill: the seconds the sessions of a model (by endpoint name) would take
            to evaluate their prompts again if it were unloaded now.
        @param before_evict: what to do before a model (by endpoint name) is evicted; the
            evicting request goes when it fires (a failure is logged and passed over).
        """
        self._reactor = reactor
        self._reprefill = reprefill
        self._before_evict = before_evict
        self._boards = {
            name: SwapBoard(
                start.capacity, start.bound_ms / 1000.0, grace_ms / 1000.0, start.loaded
            )
            for name, start in routers.items()
        }
        self._waiters: dict[Hashable, Deferred[Hashable]] = {}
        # Per router, the evicted models' saves still running, and the requests the board
        # let go meanwhile (key, model), held until they end: the router would swap for
        # any of them before a save reached it.
        self._saving: dict[str, int] = {}
        self._held: dict[str, list[tuple[Hashable, str]]] = {}
        self._timers: dict[str, IDelayedCall] = {}
        self._stopped = False
        self._keys = count()
        # A request that loaded its model: when it went, for the load time it shows.
        self._loading: dict[Hashable, float] = {}
        self.load_seconds: dict[str, float] = dict.fromkeys(routers, PRIOR_LOAD_SECONDS)
        self._load_samples: dict[str, int] = dict.fromkeys(routers, 0)

    def stop(self) -> None:
        """
        The gateway stops: cancel every decision timer and every wait (its request ends
        with C{CancelledError}); nothing is scheduled after this.
        """
        self._stopped = True
        for timer in self._timers.values():
            if timer.active():
                timer.cancel()
        self._timers.clear()
        for waiter in list(self._waiters.values()):
            if not waiter.called:
                waiter.cancel()

    def routers(self) -> list[str]:
        """The routers' names."""
        return sorted(self._boards)

    def board(self, router: str) -> SwapBoard:
        """Router C{router}'s board."""
        return self._boards[router]

    def admit(
        self, endpoint: Endpoint, on_event: Callable[[ChatEvent], None]
    ) -> Deferred[Hashable]:
        """
        Wait until a request for C{endpoint} may go (at once for an endpoint that is no
        router's model). Fires with the request's key, which L{done} takes back; cancelling
        it withdraws the request.
        """
        router = endpoint.router
        if router is None or router not in self._boards:
            return succeed(None)
        key = ("swap", next(self._keys))
        board = self._boards[router]
        waiting: Deferred[Hashable] = Deferred(lambda d: self._withdraw(router, key))
        self._waiters[key] = waiting
        board.ask(key, endpoint.name, self._reactor.seconds())
        self._decide(router)
        ahead = board.waiting()
        if key in ahead:
            on_event(Queued(ahead=ahead.index(key)))
        return waiting

    def done(self, endpoint: Endpoint, key: Hashable, timings: Timings | None) -> None:
        """
        The request L{admit} let go as C{key} ended (with C{timings} when it was answered):
        its model may be a victim again, and a request that loaded it teaches the load time.
        """
        router = endpoint.router
        if router is None or router not in self._boards:
            return
        now = self._reactor.seconds()
        went = self._loading.pop(key, None)
        if went is not None and timings is not None:
            self._learn_load(router, now - went - _server_seconds(timings))
        self._boards[router].ended(endpoint.name, now)
        self._decide(router)

    def price(self, router: str) -> Callable[[str, str], float]:
        """The price of a swap on C{router}: its load time plus the victim's re-prefill."""

        def priced(victim: str, wanted: str) -> float:
            return self.load_seconds[router] + self._reprefill(victim)

        return priced

    def _withdraw(self, router: str, key: Hashable) -> None:
        """
        A waiting request was cancelled: it waits no more; one the board had let go (held
        while saves ran) ends.
        """
        self._waiters.pop(key, None)
        board = self._boards[router]
        let_go = [model for held, model in self._held.get(router, []) if held == key]
        if let_go:
            self._held[router] = [h for h in self._held[router] if h[0] != key]
            self._loading.pop(key, None)
            board.ended(let_go[0], self._reactor.seconds())
        board.withdraw(key)
        self._decide(router)

    def _decide(self, router: str) -> None:
        """Let go whom the board lets go now, then set the timer of its next decision."""
        board = self._boards[router]
        price = self.price(router)
        now = self._reactor.seconds()
        loaded = set(board.loaded)
        for go in board.decide(now, price):
            if go.model not in loaded:
                self._loading[go.key] = now
            self._release(router, go)
        timer = self._timers.pop(router, None)
        if timer is not None and timer.active():
            timer.cancel()
        at = board.next_decision(now, price)
        if at is not None and not self._stopped:
            self._timers[router] = self._reactor.callLater(at - now, self._decide, router)

    def _release(self, router: str, go: Go) -> None:
        """
        Fire C{go}'s waiter, after the evicted model's sessions are saved; while any save on
        its router runs, every request let go waits for the saves to end (one sent sooner
        could make the router swap before a save reached it).
        """
        if go.key in self._waiters:
            self._held.setdefault(router, []).append((go.key, go.model))
        if go.evict is None:
            if not self._saving.get(router):
                self._let_go(router)
            return
        _log.info(
            "router {router}: {model} evicts {evict}",
            router=router,
            model=go.model,
            evict=go.evict,
        )
        self._saving[router] = self._saving.get(router, 0) + 1
        saving = self._before_evict(go.evict)

        def failed(reason: object) -> None:
            _log.warn(
                "router {router}: saving {evict} failed: {why}",
                router=router,
                evict=go.evict,
                why=reason,
            )

        def saved(ignored: object) -> None:
            self._saving[router] -= 1
            if not self._saving[router]:
                del self._saving[router]
                self._let_go(router)

        saving.addErrback(failed).addCallback(saved)

    def _let_go(self, router: str) -> None:
        """Fire the waiters of the requests held on C{router}."""
        for key, _model in self._held.pop(router, []):
            waiter = self._waiters.pop(key, None)
            if waiter is not None and not waiter.called:
                waiter.callback(key)

    def _learn_load(self, router: str, seconds: float) -> None:
        """A load took C{seconds} on C{router}: fold it into the router's average."""
        seconds = max(0.0, seconds)
        if self._load_samples[router] == 0:
            self.load_seconds[router] = seconds
        else:
            old = self.load_seconds[router]
            self.load_seconds[router] = old + _LOAD_WEIGHT * (seconds - old)
        self._load_samples[router] += 1


def _server_seconds(timings: Timings) -> float:
    """The seconds the server said it spent on the prompt and the generation."""
    total = 0.0
    if timings.prompt_per_second:
        total += timings.prompt_n / timings.prompt_per_second
    if timings.predicted_per_second:
        total += timings.predicted_n / timings.predicted_per_second
    return total


def router_starts(
    endpoints: Sequence[Endpoint],
    capacities: Mapping[str, int],
    loaded: Mapping[str, Sequence[str]],
) -> dict[str, RouterStart]:
    """
    The start of every router that C{endpoints} (the expanded config's) hold models of,
    its bound the C{swap_wait_ms} its models inherited.

    @param capacities: each router's C{models_max}, as configured or as its C{/props} said.
    @param loaded: each router's loaded models.
    """
    bounds = {e.router: e.swap_wait_ms for e in endpoints if e.router is not None}
    return {
        name: RouterStart(capacities.get(name, 1), tuple(loaded.get(name, ())), bound)
        for name, bound in bounds.items()
    }
