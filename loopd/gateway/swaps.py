# -*- test-case-name: loopd.test.test_gateway_swaps -*-
"""
Model swaps on one router (DESIGN decision 46): which of its models are loaded, which
requests wait for a model that is not, and when one may go although it evicts another.

A router keeps at most its C{models_max} models loaded; a request for another one makes it
unload the least recently used and load that one: a swap, whose price is the load and the
re-prefill of every session of the evicted model that was mid-task (its KV cache is gone
with the model's process). A L{SwapBoard} holds each request for an unloaded model while
that is worth it, so that turns of the loaded model are grouped and swaps are few:

 1. A request for a loaded model goes, and so does one for an unloaded model while the
    router has room (fewer than C{capacity} loaded).
 2. Otherwise the I{victim} is the least recently used loaded model with no request in
    flight (none: the request waits; the router would queue it anyway). While the victim
    is I{mid-task} (a request of it ended less than C{grace} ago: its session is likely to
    send its next turn), the request waits as long as its wait is below the swap's price
    (L{SwapBoard.decide}'s C{price}: the load plus the victim's re-prefill, as decision
    37 prices a grace), and never longer than C{bound}. Then it goes, evicting the victim.
 3. B{Never starved.} A request that has waited C{bound} is I{overdue}: from then on no
    request that comes after it starts (not even one for a loaded model), so the models in
    flight drain and it goes. Waiting requests are taken in their order of arrival.

Pure: no reactor, no I/O; time comes in as seconds from the caller's clock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

__all__ = ["Go", "SwapBoard"]


@dataclass(frozen=True)
class Go:
    """
    A waiting request may go now.

    @ivar key: the request, as it was asked (L{SwapBoard.ask}).
    @ivar model: the model it asked for.
    @ivar evict: the model its load evicts, or C{None} when nothing is evicted.
    """

    key: Hashable
    model: str
    evict: str | None = None


@dataclass
class _Waiter:
    """A request waiting for its model: when it asked."""

    key: Hashable
    model: str
    since: float


class SwapBoard:
    """The loaded models of one router and the requests waiting to load one."""

    def __init__(
        self, capacity: int, bound: float, grace: float, loaded: Iterable[str] = ()
    ) -> None:
        """
        @param capacity: how many models the router keeps loaded (its C{--models-max}).
        @param bound: the longest a request waits before it is overdue (seconds).
        @param grace: how long after its last request ended a model counts as mid-task.
        @param loaded: the models loaded now, least recently used first.
        @raise ValueError: C{capacity} below 1, or C{bound} or C{grace} negative.
        """
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if bound < 0 or grace < 0:
            raise ValueError(f"bound and grace must be >= 0, got {bound} and {grace}")
        self.capacity = capacity
        self.bound = bound
        self.grace = grace
        # Loaded models, least recently used first: the time each was last used.
        self._loaded: dict[str, float] = dict.fromkeys(loaded, float("-inf"))
        self._in_flight: dict[str, int] = {}
        self._waiting: list[_Waiter] = []
        #: How many swaps the board has let happen (a load that evicted a model).
        self.swaps = 0

    @property
    def loaded(self) -> tuple[str, ...]:
        """The loaded models, least recently used first."""
        return tuple(self._loaded)

    def in_flight(self, model: str) -> int:
        """How many requests for C{model} run now."""
        return self._in_flight.get(model, 0)

    def waiting(self) -> tuple[Hashable, ...]:
        """The waiting requests, in their order of arrival."""
        return tuple(w.key for w in self._waiting)

    def ask(self, key: Hashable, model: str, now: float) -> None:
        """
        C{key} wants to send a request for C{model}: it waits until L{decide} lets it go.

        @raise ValueError: C{key} is already waiting.
        """
        if any(w.key == key for w in self._waiting):
            raise ValueError(f"{key!r} is already waiting")
        self._waiting.append(_Waiter(key, model, now))

    def withdraw(self, key: Hashable) -> None:
        """C{key} waits no more (its client left); unknown keys are ignored."""
        self._waiting = [w for w in self._waiting if w.key != key]

    def ended(self, model: str, now: float) -> None:
        """A request L{decide} let go for C{model} ended (answered or not) at C{now}."""
        count = self._in_flight.get(model, 0) - 1
        if count > 0:
            self._in_flight[model] = count
        else:
            self._in_flight.pop(model, None)
        if model in self._loaded:
            self._touch(model, now)

    def unloaded(self, model: str) -> None:
        """The router unloaded C{model} on its own (found by asking it)."""
        self._loaded.pop(model, None)

    def decide(self, now: float, price: Callable[[str, str], float]) -> list[Go]:
        """
        The waiting requests that may go now (module docstring), in their order; each is
        no longer waiting and counts as in flight (the caller reports its L{ended}, sent
        or not), the model it loads counts as loaded (and the one it evicts as not).

        @param price: the seconds a swap costs: C{price(victim, wanted)}.
        """
        going: list[Go] = []
        remaining: list[_Waiter] = []
        blocked = False
        for waiter in self._waiting:
            go = None if blocked else self._may_go(waiter, now, price)
            if go is None:
                remaining.append(waiter)
                # Nobody passes an overdue request (rule 3).
                blocked = blocked or now - waiter.since >= self.bound
                continue
            going.append(go)
            self._in_flight[go.model] = self._in_flight.get(go.model, 0) + 1
            self._touch(go.model, now)
        self._waiting = remaining
        return going

    def next_decision(self, now: float, price: Callable[[str, str], float]) -> float | None:
        """
        When L{decide} may say something new without any other event: the first moment a
        waiting request's allowed wait or bound is over, or a victim stops being mid-task;
        C{None} when no such moment is ahead.
        """
        moments: list[float] = []
        victim = self._victim()
        for waiter in self._waiting:
            moments.append(waiter.since + self.bound)
            if victim is not None:
                moments.append(waiter.since + min(self.bound, price(victim, waiter.model)))
        if victim is not None and self._waiting:
            moments.append(self._loaded[victim] + self.grace)
        ahead = [m for m in moments if m > now]
        return min(ahead) if ahead else None

    def _may_go(self, waiter: _Waiter, now: float, price: Callable[[str, str], float]) -> Go | None:
        """Whether C{waiter} goes now; if it does, the loaded models change accordingly."""
        model = waiter.model
        if model in self._loaded or len(self._loaded) < self.capacity:
            return Go(waiter.key, model)
        victim = self._victim()
        if victim is None:
            return None
        waited = now - waiter.since
        mid_task = now - self._loaded[victim] < self.grace
        if mid_task and waited < min(self.bound, price(victim, model)):
            return None
        del self._loaded[victim]
        self.swaps += 1
        return Go(waiter.key, model, victim)

    def _victim(self) -> str | None:
        """The least recently used loaded model with no request in flight, if any."""
        for model in self._loaded:
            if not self._in_flight.get(model):
                return model
        return None

    def _touch(self, model: str, now: float) -> None:
        """C{model} is loaded and was used at C{now}: it becomes the most recently used."""
        self._loaded.pop(model, None)
        self._loaded[model] = now
