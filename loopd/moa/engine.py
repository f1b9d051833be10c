# -*- test-case-name: loopd.test.test_moa_engine -*-
"""
One mesh turn, driven over time (reference C{mesh-moa.md} §1.7 dispatch and gather, §1.10
resolution, §1.11 the ladder; DESIGN §3 decisions 28-33).

L{MeshTurn} joins the pure pieces: the roles (L{assign_roles}), the packing per role and the
knobs (L{upstream_request}), the fan-out (L{Fanout}: timeouts, one 429 retry), the normalizer,
the arbiter (L{decide}, re-asked after every worker and every timer) and the hedged reducer
ladder (L{HedgedLadder}, carried out with reactor timers). It does no I/O of its own: each
upstream call is the caller's C{call(name, request)}, whose Deferred fires with the reply's
L{Completion} (or fails; L{RateLimited} for an HTTP 429) and whose cancellation abandons
the request. Every timer is the injected reactor's.

Choices made here, where the reference leaves room or v1 misbehaves:

  - The grace and strong-patience timers are armed at dispatch and only mark their time as
    passed; the arbiter is asked again then, and after every later worker. That is v1's
    "sleep for grace minus elapsed, armed while eligible" with the same outcome.
  - A turn's label (C{x-moa-turn}): C{failed} when no worker produced an output; otherwise
    C{early-exit} when the decision came while workers still ran, else C{fanout}; the
    reducer's ladder, once started, makes it C{fanout} whatever its end (quirk 5 of §7:
    v1 called an escalation whose reducers all failed "early-exit"). A tool-result turn is
    C{tool-result}.
  - When every reducer fails on the fan-out path the turn fails with C{all_reducers_failed}
    (v1 shipped the best worker answer with a 200, quirk 6): the reducer ran because the
    drafts could not be shipped as they were, so one of them is not the answer.
  - C{x-moa-reducer} is true whenever a reducer was called, also when it failed; the
    attempts are the candidates launched.
  - A reducer reply that names a tool the request did not declare (or any tool under the
    loop guard) is demoted before the ladder sees it, so it ends as C{no_usable_answer}.
  - Every worker and reducer call is upstream without streaming from the engine's view; the
    caller may stream (DESIGN decision 28 leaves it to loopd).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from loopd.llama.types import ChatRequest, Completion
from loopd.moa.arbiter import (
    ArbiterState,
    Fail,
    Landed,
    Reduce,
    Running,
    Ship,
    Wait,
    decide,
)
from loopd.moa.context import Packed, pack_for_reducer, pack_for_role
from loopd.moa.fanout import WORKER_TIMEOUT, Fanout
from loopd.moa.knobs import REDUCER_SAMPLING, sampling_for, upstream_request
from loopd.moa.normalize import ERROR_REASONING_ONLY, normalize_completion
from loopd.moa.outcome import Kind, Outcome, Rule
from loopd.moa.reducer import (
    HEDGE_DELAY_S,
    REDUCER_TIMEOUT_S,
    Action,
    ArmHedge,
    Cancel,
    Finish,
    HedgedLadder,
    Launch,
    StopHedge,
    reducer_candidates,
)
from loopd.moa.reducer import Fail as LadderFail
from loopd.moa.report import TurnLabel, TurnReport
from loopd.moa.roles import Assignment, Role, Worker, assign_roles
from loopd.moa.tool_guard import (
    emits_tool_call,
    enforce_declared_tools,
    loop_guard,
    pack_tool_result_reducer,
    reducer_allowed_tools,
)
from loopd.moa.turn import Turn, TurnKind

__all__ = [
    "ALL_WORKERS_FAILED_MESSAGE",
    "GRACE_S",
    "MeshTimings",
    "MeshTurn",
    "TurnResult",
    "UpstreamCall",
]

GRACE_S: Final = 3.0
"""Seconds after dispatch from which a qualifying answer may ship (§2 C{grace}, tool-less turns)."""

ALL_WORKERS_FAILED_MESSAGE: Final = "All MoA workers failed"
"""The error message when no worker produced an output (§1.7)."""

UpstreamCall = Callable[[str, ChatRequest], Deferred[Completion]]
"""C{call(endpoint name, request)}: the reply's completion, or a failure."""


@dataclass(frozen=True)
class MeshTimings:
    """The times of a mesh turn, in seconds (§2, v2 §6, DESIGN decision 31)."""

    grace: float = GRACE_S
    """After dispatch, a qualifying answer may ship on a turn without tools."""
    strong_patience: float = 20.0
    """How long a small-tier consensus waits for a still-running big-tier Strong worker."""
    hedge_delay: float = HEDGE_DELAY_S
    """Seconds without a reducer result before the next candidate starts alongside."""
    worker_timeout: float = WORKER_TIMEOUT
    """What one worker may take, its 429 retry included."""
    reducer_timeout: float = REDUCER_TIMEOUT_S
    """What one reducer call may take, its 429 retry included."""


@dataclass(frozen=True)
class TurnResult:
    """
    How a turn ended: an answer, a tool call, or an error, with its report.

    Exactly one of C{outcome} (shipped) and C{error_code} is set.
    """

    report: TurnReport
    """What the C{x-moa-*} headers say."""
    outcome: Outcome | None = None
    """The shipped outcome: its text, or its tool call when C{tool_call}."""
    tool_call: bool = False
    """Answer with C{tool_calls} (the outcome's tool name and arguments)."""
    error_code: str | None = None
    """C{all_workers_failed}, C{all_reducers_failed} or C{no_usable_answer}."""
    error_message: str = ""
    """The error's human-readable message."""


def _failed_outcome(worker: str, role: str, reason: str) -> Outcome:
    """A worker or reducer call that failed, as the outcome the arbiter counts as failed."""
    return Outcome(Kind.EMPTY, "", rule=Rule.NO_TEXT, worker=worker, role=role, error=reason)


class MeshTurn:
    """
    Serve one mesh turn: fan out to the pool and arbitrate, or (a tool-result turn) run
    the reducer alone.

    L{run} returns a Deferred that fires with a L{TurnResult}, never fails, and when
    cancelled cancels every call and timer of the turn. C{progress} receives the turn's
    events as dicts with an C{event} key (C{mesh_worker}, C{mesh_decision},
    C{mesh_reducer}), meant for a stream's C{: loopd} comments.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        turn: Turn,
        pool: Sequence[Worker],
        call: UpstreamCall,
        *,
        enable_thinking: bool = False,
        timings: MeshTimings = MeshTimings(),
        progress: Callable[[Mapping[str, Any]], None] = lambda event: None,
    ) -> None:
        """
        @param reactor: every timer's clock.
        @param turn: the request, read (L{loopd.moa.turn.read_turn}).
        @param pool: the workers (L{loopd.moa.roles.build_pool}); the reducer candidates
            come from it too.
        @param call: does one upstream request, see L{UpstreamCall}.
        @param enable_thinking: the thinking choice sent with every call (§1.6).
        @param timings: the turn's times.
        @param progress: receives each progress event.
        """
        self._reactor = reactor
        self._turn = turn
        self._pool = tuple(pool)
        self._call = call
        self._thinking = enable_thinking
        self._timings = timings
        self._progress = progress
        self._started_at = 0.0
        self._result: Deferred[TurnResult] | None = None
        self._done = False
        self._assignments: tuple[Assignment, ...] = ()
        self._landed: list[Landed] = []
        self._fanout: Fanout[Assignment] | None = None
        self._grace_elapsed = False
        self._patience_elapsed = False
        self._timers: list[IDelayedCall] = []
        self._ladder: HedgedLadder | None = None
        self._reducer_calls: dict[int, Fanout[int]] = {}
        self._hedge: IDelayedCall | None = None
        self._label = TurnLabel.FANOUT

    def run(self) -> Deferred[TurnResult]:
        """Start the turn; see the class docstring. A turn runs once (C{RuntimeError})."""
        if self._result is not None:
            raise RuntimeError("this turn has already run")
        self._result = Deferred(lambda d: self._abort())
        self._started_at = self._reactor.seconds()
        if self._turn.kind is TurnKind.TOOL_RESULT:
            self._answer_tool_result()
        else:
            self._fan_out()
        return self._result

    # -- fan-out -------------------------------------------------------------------------

    def _fan_out(self) -> None:
        """Dispatch every worker with its packing and arm the grace and patience timers."""
        self._assignments = assign_roles(self._pool)
        requests = {
            a: upstream_request(
                pack_for_role(self._turn, a.role),
                sampling=sampling_for(a.role),
                enable_thinking=self._thinking,
            )
            for a in self._assignments
        }

        def call(a: Assignment) -> Deferred[Outcome]:
            """
            Send worker C{a} its request; its reply is normalized into an L{Outcome} (the
            request's declared tools allowed, the call's own time recorded).
            """
            began = self._reactor.seconds()
            d = self._call(a.name, requests[a])
            return d.addCallback(
                lambda completion: normalize_completion(
                    completion,
                    allowed_tools=self._turn.allowed_tools,
                    worker=a.name,
                    role=a.role.value,
                    elapsed_ms=(self._reactor.seconds() - began) * 1000.0,
                )
            )

        timeout = self._timings.worker_timeout
        self._fanout = Fanout(self._reactor, self._assignments, call, self._worker_landed, timeout)
        if not self._turn.has_tools:
            self._timers.append(self._reactor.callLater(self._timings.grace, self._grace_passed))
        patience = self._reactor.callLater(self._timings.strong_patience, self._patience_passed)
        self._timers.append(patience)
        self._fanout.start()
        if not self._assignments:
            # No worker will ever land to ask the arbiter: it fails the turn now.
            self._arbitrate()

    def _worker_landed(
        self, a: Assignment, outcome: Outcome | None, failure: Failure | None
    ) -> None:
        """A worker finished: record it, tell the stream, ask the arbiter."""
        if outcome is None:
            reason = failure.getErrorMessage() if failure is not None else "failed"
            outcome = _failed_outcome(a.name, a.role.value, reason)
        self._landed.append(Landed(outcome, a.role, a.tier))
        event: dict[str, Any] = {
            "event": "mesh_worker",
            "worker": a.name,
            "role": a.role.value,
            "ok": not outcome.failed,
            "kind": outcome.kind.value,
            "elapsed_ms": round(outcome.elapsed_ms or self._elapsed_ms()),
        }
        if outcome.failed:
            event["error"] = outcome.error or ""
        self._progress(event)
        self._arbitrate()

    def _grace_passed(self) -> None:
        """
        The grace has passed since dispatch: a qualifying answer may ship now; ask the arbiter.
        """
        self._grace_elapsed = True
        self._arbitrate()

    def _patience_passed(self) -> None:
        """
        The strong patience has passed: a small-tier consensus need not wait for a running
        big-tier Strong worker any more; ask the arbiter.
        """
        self._patience_elapsed = True
        self._arbitrate()

    def _arbitrate(self) -> None:
        """Ask the arbiter what to do now, and do it."""
        if self._done or self._ladder is not None or self._fanout is None:
            return
        running = self._fanout.running()
        state = ArbiterState(
            landed=tuple(self._landed),
            running=tuple(Running(a.name, a.role, a.tier) for a in running),
            has_tools=self._turn.has_tools,
            grace_elapsed=self._grace_elapsed,
            patience_elapsed=self._patience_elapsed,
        )
        decision = decide(state)
        if isinstance(decision, Wait):
            return
        self._stop_timers()
        self._fanout.cancel_all()
        early = bool(running)
        self._label = TurnLabel.EARLY_EXIT if early else TurnLabel.FANOUT
        if isinstance(decision, Ship):
            self._progress(
                {"event": "mesh_decision", "decision": "ship", "reason": decision.reason}
                | {"early": early, "cancelled": [a.name for a in running]}
            )
            self._finish(decision.outcome, decision.tool_call)
        elif isinstance(decision, Reduce):
            self._progress(
                {"event": "mesh_decision", "decision": "reduce", "reason": decision.reason}
                | {"early": early, "cancelled": [a.name for a in running]}
            )
            self._label = TurnLabel.FANOUT
            packed = pack_for_reducer(self._turn, decision.outcomes, decision.reason)
            self._start_ladder(_reducer_request(packed, self._thinking), self._turn.allowed_tools)
        else:
            assert isinstance(decision, Fail)
            self._label = TurnLabel.FAILED
            self._progress({"event": "mesh_decision", "decision": "fail", "reason": decision.code})
            self._fail(decision.code, ALL_WORKERS_FAILED_MESSAGE)

    # -- the reducer ---------------------------------------------------------------------

    def _answer_tool_result(self) -> None:
        """A tool-result turn: the reducer alone, under the loop guard when it applies."""
        self._label = TurnLabel.TOOL_RESULT
        loop = loop_guard(self._turn)
        if loop is not None:
            self._progress({"event": "mesh_loop_guard", "tool": loop.tool, "count": loop.count})
        packed = pack_tool_result_reducer(self._turn)
        allowed = reducer_allowed_tools(self._turn, loop)
        self._start_ladder(_reducer_request(packed, self._thinking), allowed)

    def _start_ladder(self, request: ChatRequest, allowed: tuple[str, ...]) -> None:
        """Run the hedged ladder over the pool's reducer candidates with C{request}."""
        self._allowed = allowed
        self._reducer_request = request
        self._ladder = HedgedLadder(reducer_candidates(self._pool), self._timings.hedge_delay)
        self._apply(self._ladder.start())

    def _apply(self, actions: Sequence[Action]) -> None:
        """Carry out the ladder's actions, in order."""
        for action in actions:
            if isinstance(action, Launch):
                self._launch(action)
            elif isinstance(action, Cancel):
                for index in action.indices:
                    self._reducer_calls.pop(index).cancel_all()
            elif isinstance(action, ArmHedge):
                self._stop_hedge()
                if not self._done:
                    self._hedge = self._reactor.callLater(action.delay, self._hedge_fired)
            elif isinstance(action, StopHedge):
                self._stop_hedge()
            elif isinstance(action, Finish):
                self._finish(action.outcome, emits_tool_call(action.outcome, self._allowed))
            else:
                assert isinstance(action, LadderFail)
                self._fail(action.code, action.message)

    def _hedge_fired(self) -> None:
        """
        No reducer result within the hedge delay: let the ladder start the next candidate
        alongside.
        """
        self._hedge = None
        if self._ladder is not None:
            self._apply(self._ladder.on_hedge_timer())

    def _launch(self, launch: Launch) -> None:
        """Call reducer candidate C{launch.index} with its own timeout and 429 retry."""
        ladder = self._ladder
        assert ladder is not None
        hedged = len(ladder.in_flight) > 1
        self._progress(
            {"event": "mesh_reducer", "model": launch.name, "attempt": launch.index + 1}
            | {"hedged": hedged}
        )

        def call(index: int) -> Deferred[Outcome]:
            """
            Send the reducer request to the candidate; its reply is normalized, and a tool call the
            reducer may not make is demoted (L{enforce_declared_tools}) before the ladder sees it.
            """
            d = self._call(launch.name, self._reducer_request)
            return d.addCallback(
                lambda completion: enforce_declared_tools(
                    normalize_completion(
                        completion,
                        allowed_tools=self._allowed,
                        worker=launch.name,
                        role=Role.REDUCER.value,
                    ),
                    self._allowed,
                )
            )

        def landed(index: int, outcome: Outcome | None, failure: Failure | None) -> None:
            """
            The candidate's call ended: a reply with an outcome goes to the ladder as a success
            (the ladder judges whether it is usable). A failed call, a timeout, or an empty or
            reasoning-only reply is reported as C{mesh_reducer_failed} and goes to the ladder
            as a failure.
            """
            self._reducer_calls.pop(index, None)
            if outcome is not None and not outcome.failed:
                self._apply(ladder.on_success(index, outcome))
                return
            if outcome is not None:
                # An empty or reasoning-only reply is a failed call (v2), reported as one.
                reason = outcome.error or ERROR_REASONING_ONLY
            else:
                reason = failure.getErrorMessage() if failure is not None else "failed"
            self._progress({"event": "mesh_reducer_failed", "model": launch.name, "error": reason})
            self._apply(ladder.on_failure(index, reason))

        fanout = Fanout(self._reactor, [launch.index], call, landed, self._timings.reducer_timeout)
        self._reducer_calls[launch.index] = fanout
        fanout.start()

    # -- endings -------------------------------------------------------------------------

    def _report(self, succeeded: bool) -> TurnReport:
        """The turn's report now, for an ending that C{succeeded} or not."""
        ladder = self._ladder
        attempts = ladder.attempts if ladder is not None else 0
        if self._label is TurnLabel.TOOL_RESULT:
            workers, ok = 1, int(succeeded)
        else:
            workers = len(self._assignments)
            ok = sum(1 for landed in self._landed if not landed.outcome.failed)
        return TurnReport(
            elapsed_ms=round(self._elapsed_ms()),
            turn=self._label,
            workers=workers,
            workers_ok=ok,
            reducer_used=attempts > 0,
            reducer_attempts=attempts,
        )

    def _finish(self, outcome: Outcome, tool_call: bool) -> None:
        """End the turn with C{outcome} shipped, as a tool call if C{tool_call}."""
        self._end(TurnResult(self._report(True), outcome=outcome, tool_call=tool_call))

    def _fail(self, code: str, message: str) -> None:
        """End the turn with the error C{code} and its C{message}."""
        self._end(TurnResult(self._report(False), error_code=code, error_message=message))

    def _end(self, result: TurnResult) -> None:
        """
        End the turn once: stop every call and timer, then fire the result. Later endings (a
        call landing as the turn ends) do nothing.
        """
        if self._done:
            return
        self._abort()
        assert self._result is not None
        self._result.callback(result)

    def _abort(self) -> None:
        """Stop everything of the turn: workers, reducer calls, timers."""
        self._done = True
        self._stop_timers()
        self._stop_hedge()
        if self._fanout is not None:
            self._fanout.cancel_all()
        calls, self._reducer_calls = self._reducer_calls, {}
        for fanout in calls.values():
            fanout.cancel_all()

    def _stop_timers(self) -> None:
        """Cancel the grace and patience timers still pending."""
        timers, self._timers = self._timers, []
        for timer in timers:
            if timer.active():
                timer.cancel()

    def _stop_hedge(self) -> None:
        """Cancel the hedge timer, if it is pending."""
        hedge, self._hedge = self._hedge, None
        if hedge is not None and hedge.active():
            hedge.cancel()

    def _elapsed_ms(self) -> float:
        """Milliseconds since L{run} started the turn."""
        return (self._reactor.seconds() - self._started_at) * 1000.0


def _reducer_request(packed: Packed, enable_thinking: bool) -> ChatRequest:
    """The reducer's upstream request for C{packed}: reducer sampling, the thinking choice."""
    return upstream_request(packed, sampling=REDUCER_SAMPLING, enable_thinking=enable_thinking)
