# -*- test-case-name: loopd.test.test_moa_reducer -*-
"""
The reducer candidate order and the hedged reducer ladder (reference C{mesh-moa.md} §1.11),
with the v2 changes issue 6 adopts (§6).

L{reducer_candidates} orders the configured models for the ladder. L{HedgedLadder} is the
ladder as a pure state machine: the caller feeds it events (L{HedgedLadder.start},
L{HedgedLadder.on_success}, L{HedgedLadder.on_failure}, L{HedgedLadder.on_hedge_timer}) and
carries out the actions it returns (L{Launch}, L{Cancel}, L{ArmHedge}, L{StopHedge},
L{Finish}, L{Fail}). It holds no timer and does no I/O; the turn module drives it with
reactor timers. A call that times out (C{reducer_timeout}, 60 s) is a failure the caller
reports.

Differences from v1, each decided by issue 6 (v2 behaviour):

  - A reasoning-only or empty reply (L{Outcome.failed}) is a failed call: the next
    candidate starts at once, as for a transport error.
  - A reply that arrives but is not usable (L{is_usable}: an uncertainty, including a
    demoted hallucinated tool, or a truncated reply, which is never shipped verbatim) ends
    the ladder with L{NO_USABLE_ANSWER}.
  - After the last candidate has started no hedge timer runs: v1 re-armed one whose firing
    could only note that the list was exhausted, which changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias

from loopd.moa.normalize import ERROR_REASONING_ONLY
from loopd.moa.outcome import Kind, Outcome
from loopd.moa.roles import Tier, Worker, tier_of

__all__ = [
    "ALL_REDUCERS_FAILED",
    "HEDGE_DELAY_S",
    "NO_USABLE_ANSWER",
    "REDUCER_TIMEOUT_S",
    "Action",
    "ArmHedge",
    "Cancel",
    "Fail",
    "Finish",
    "HedgedLadder",
    "Launch",
    "StopHedge",
    "is_usable",
    "reducer_candidates",
]

HEDGE_DELAY_S: Final = 5.0
"""Seconds without a result before the next candidate starts alongside (§2 C{hedge_delay})."""

REDUCER_TIMEOUT_S: Final = 60.0
"""Seconds one reducer call may take before the caller reports it failed (§2)."""

ALL_REDUCERS_FAILED: Final = "all_reducers_failed"
"""The error code when every candidate failed, or there was none."""

NO_USABLE_ANSWER: Final = "no_usable_answer"
"""The error code when the winning reply has no usable answer (v2, §6)."""

NO_CANDIDATES_MESSAGE: Final = "no reducer candidates"
"""The error message of a ladder with nothing to try (§1.10 b)."""

NO_USABLE_ANSWER_MESSAGE: Final = "MoA reducer returned no usable answer"
"""The error message of L{NO_USABLE_ANSWER} (v2, §6)."""

DEFAULT_FAILURE: Final = "all reducer candidates failed"
"""The last error reported when no failure gave a reason (§1.11 step 4)."""


def reducer_candidates(models: Sequence[Worker]) -> tuple[str, ...]:
    """
    The reducer ladder's candidate names (§1.11): every configured model, the workers that
    failed included, big tier first, then small tier, each tier in the given (config)
    order. The tier is L{loopd.moa.roles.tier_of} (a configured C{size_b} wins over the
    name rule). The same name given twice is kept once, at its first place. May be empty.
    """
    seen: dict[str, Tier] = {}
    for model in models:
        if model.name not in seen:
            seen[model.name] = tier_of(model.name, model.size_b)
    big = [name for name, tier in seen.items() if tier is Tier.BIG]
    small = [name for name, tier in seen.items() if tier is Tier.SMALL]
    return tuple(big + small)


def is_usable(outcome: Outcome) -> bool:
    """
    Whether a reducer reply that did not fail can be shipped: not an uncertainty (which
    is also what a demoted, undeclared tool proposal becomes) and not truncated (v2 never
    ships a C{finish_reason: "length"} reply verbatim).
    """
    return outcome.verbatim_ok and outcome.kind is not Kind.UNCERTAINTY


@dataclass(frozen=True)
class Launch:
    """Start the reducer call of candidate C{index}."""

    index: int
    """The candidate's position in the ladder (also the attempt number minus one)."""
    name: str
    """The candidate's model name."""


@dataclass(frozen=True)
class Cancel:
    """Cancel the calls still in flight: their results no longer matter."""

    indices: tuple[int, ...]
    """The candidates to cancel, in launch order; never empty."""


@dataclass(frozen=True)
class ArmHedge:
    """(Re)start the hedge timer: drop any pending one, call C{on_hedge_timer} in C{delay} s."""

    delay: float
    """Seconds from now."""


@dataclass(frozen=True)
class StopHedge:
    """Drop the pending hedge timer, if any: no further candidate will be hedged."""


@dataclass(frozen=True)
class Finish:
    """The ladder is won: ship this candidate's reply."""

    index: int
    """The winning candidate."""
    name: str
    """The winning model."""
    outcome: Outcome
    """Its normalized reply (usable: L{is_usable})."""


@dataclass(frozen=True)
class Fail:
    """The ladder is lost: answer with this error (HTTP 502 on the paths that report it)."""

    code: str
    """L{ALL_REDUCERS_FAILED} or L{NO_USABLE_ANSWER}."""
    message: str
    """The human-readable error message."""
    index: int | None = None
    """The candidate whose unusable reply ended the ladder (L{NO_USABLE_ANSWER} only)."""


Action: TypeAlias = Launch | Cancel | ArmHedge | StopHedge | Finish | Fail
"""Something the driver of a L{HedgedLadder} must do, in the order given."""


class HedgedLadder:
    """
    The hedged reducer ladder (§1.11) as a state machine over events.

    Every event method returns the actions to carry out, in order. Once a L{Finish} or
    L{Fail} has been returned the ladder is over: every later event returns nothing. A
    result for a candidate that is no longer in flight (cancelled, or already reported)
    is ignored; a result for a candidate never launched is a C{ValueError}.

    Rules: L{start} launches candidate 0. A hedge timer that fires, or a failed call,
    launches the next candidate alongside the ones still running (so concurrency can grow
    to every candidate, quirk 10 of §7); the timer is re-armed after every launch. The
    first call that returns wins and the rest are cancelled: a usable reply is a
    L{Finish}, any other reply that did not fail is a L{Fail} with L{NO_USABLE_ANSWER}. A
    reply that L{Outcome.failed} is a failed call. When the last call in flight fails and
    no candidate is left, the ladder fails with L{ALL_REDUCERS_FAILED}.
    """

    def __init__(self, candidates: Sequence[str], hedge_delay: float = HEDGE_DELAY_S) -> None:
        """
        @param candidates: the model names to try, in order (L{reducer_candidates}).
        @param hedge_delay: seconds without a result before the next candidate starts.
        """
        self._candidates = tuple(candidates)
        self._hedge_delay = hedge_delay
        self._started = False
        self._done = False
        self._in_flight: list[int] = []
        self._launched = 0
        self._last_error: str | None = None
        self._winner: int | None = None

    @property
    def candidates(self) -> tuple[str, ...]:
        """The candidate names, in ladder order."""
        return self._candidates

    @property
    def attempts(self) -> int:
        """How many candidates have been launched (the C{x-moa-reducer-attempts} value)."""
        return self._launched

    @property
    def in_flight(self) -> tuple[int, ...]:
        """The candidates whose calls are running, in launch order."""
        return tuple(self._in_flight)

    @property
    def done(self) -> bool:
        """Whether the ladder has finished or failed."""
        return self._done

    @property
    def winner(self) -> str | None:
        """The model whose reply ended the ladder (usable or not), or None."""
        return None if self._winner is None else self._candidates[self._winner]

    @property
    def last_error(self) -> str | None:
        """The reason given by the latest failed call, if any."""
        return self._last_error

    def start(self) -> tuple[Action, ...]:
        """
        Begin: launch candidate 0 and arm the hedge timer, or fail at once with
        L{ALL_REDUCERS_FAILED} ("no reducer candidates") when there is none. A second call
        is a C{ValueError}.
        """
        if self._started:
            raise ValueError("the ladder has already started")
        self._started = True
        if not self._candidates:
            self._done = True
            return (Fail(ALL_REDUCERS_FAILED, NO_CANDIDATES_MESSAGE),)
        return self._launch_next()

    def on_success(self, index: int, outcome: Outcome) -> tuple[Action, ...]:
        """
        Candidate C{index}'s call returned C{outcome}. A failed reply (L{Outcome.failed})
        is handled as L{on_failure}; otherwise the ladder ends: the other calls are
        cancelled and the hedge timer stopped, then L{Finish} when the reply is usable
        (L{is_usable}), else L{Fail} with L{NO_USABLE_ANSWER}.
        """
        if not self._accepts(index):
            return ()
        if outcome.failed:
            return self.on_failure(index, outcome.error or ERROR_REASONING_ONLY)
        self._in_flight.remove(index)
        self._done = True
        self._winner = index
        actions: list[Action] = [StopHedge()]
        if self._in_flight:
            actions.append(Cancel(tuple(self._in_flight)))
            self._in_flight.clear()
        name = self._candidates[index]
        if is_usable(outcome):
            actions.append(Finish(index, name, outcome))
        else:
            actions.append(Fail(NO_USABLE_ANSWER, NO_USABLE_ANSWER_MESSAGE, index))
        return tuple(actions)

    def on_failure(self, index: int, error: str = "") -> tuple[Action, ...]:
        """
        Candidate C{index}'s call failed (transport error, HTTP error, timeout, or a reply
        that L{Outcome.failed}), for the reason C{error}. The next candidate starts at
        once; with none left, and nothing else in flight, the ladder fails with
        L{ALL_REDUCERS_FAILED} and the message C{"Reducer failed (tried N): ERROR"}.
        """
        if not self._accepts(index):
            return ()
        self._in_flight.remove(index)
        if error:
            self._last_error = error
        if self._launched < len(self._candidates):
            return self._launch_next()
        if self._in_flight:
            return ()
        self._done = True
        reason = self._last_error or DEFAULT_FAILURE
        message = f"Reducer failed (tried {self._launched}): {reason}"
        return (StopHedge(), Fail(ALL_REDUCERS_FAILED, message))

    def on_hedge_timer(self) -> tuple[Action, ...]:
        """
        The hedge timer fired with no result: launch the next candidate alongside the
        running ones and re-arm the timer. Nothing when no candidate is left or the ladder
        is over (a late timer is harmless).
        """
        if not self._started or self._done or self._launched >= len(self._candidates):
            return ()
        return self._launch_next()

    def _accepts(self, index: int) -> bool:
        """
        Whether a result for C{index} counts: the ladder runs and the call is in flight.
        A candidate never launched is the caller's bug (C{ValueError}).
        """
        if not 0 <= index < self._launched:
            raise ValueError(f"candidate {index} was never launched")
        return not self._done and index in self._in_flight

    def _launch_next(self) -> tuple[Action, ...]:
        """Launch the next candidate; arm the timer if another remains, else stop it."""
        index = self._launched
        self._launched += 1
        self._in_flight.append(index)
        launch = Launch(index, self._candidates[index])
        if self._launched < len(self._candidates):
            return (launch, ArmHedge(self._hedge_delay))
        return (launch, StopHedge())
