"""
Tests for L{loopd.moa.engine}: one mesh turn driven over time, the fan-out and its decisions
(reference C{mesh-moa.md} §1.7 dispatch, grace and gather, §1.10 resolution, §6 strong
patience, §7 quirk 11; DESIGN decisions 28-31 and 33), the hedged reducer ladder as the
turn drives it, and the tool-result turn (§1.10 (a) and (b), §1.11, §6 loop guard and
C{no_usable_answer}, §7 quirks 5, 6 and 10; decision 32).

Every test runs the turn on a L{Clock} with a fake upstream C{call} whose Deferreds the test
fires by hand with completions, or fails. Each call's request is also rendered as the body
the llama client would send an C{openai}-kind endpoint (C{Call.body}), so the tests read
the wire form of decision 28. The request a test describes is read by the front door.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.chat_read import parse_request
from loopd.llama.request import chat_body
from loopd.llama.types import ChatRequest, Completion, FinishReason, Timings, ToolCall
from loopd.moa.context import loop_guard_text
from loopd.moa.engine import ALL_WORKERS_FAILED_MESSAGE, MeshTimings, MeshTurn, TurnResult
from loopd.moa.fanout import RateLimited
from loopd.moa.report import TurnLabel, TurnReport
from loopd.moa.roles import Worker
from loopd.moa.turn import ToolLoop, Turn, read_turn
from loopd.settings import Config, Endpoint

#: The endpoint every call's wire body is rendered for: an OpenAI-compatible server.
WIRE = Endpoint(name="wire", socket="/tmp/ld/wire.sock", kind="openai")
WIRE_CONFIG = Config(endpoints=(WIRE,))


class Boom(Exception):  # noqa: N818 (a test stand-in)
    """An upstream failure that is not a 429."""


def completion(
    text: str | None, finish_reason: str = "stop", reasoning: str | None = None
) -> Completion:
    """A completion answering C{text}."""
    return Completion("c", text, reasoning, (), FinishReason(finish_reason), Timings())


def tool_completion(name: str, arguments: Mapping[str, Any]) -> Completion:
    """A completion with one native tool call."""
    call = ToolCall("c1", name, json.dumps(arguments))
    return Completion("c", None, None, (call,), FinishReason.TOOL_CALLS, Timings())


def turn_of(document: Mapping[str, Any]) -> Turn:
    """The turn of a request C{document}, read by the front door."""
    request = parse_request(json.dumps(document).encode())
    return read_turn(request.messages, request.tools)


@dataclass(eq=False)
class Call:
    """One upstream call: who, what, when, and its Deferred (cancellation recorded)."""

    name: str
    request: ChatRequest
    at: float
    cancelled: bool = False
    deferred: Deferred[Completion] = field(init=False)
    body: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        """Make the call's Deferred, whose canceller records the cancellation."""
        self.deferred = Deferred(self._cancel)
        self.body = chat_body(self.request, WIRE_CONFIG, WIRE)

    def _cancel(self, d: Deferred[Any]) -> None:
        """The canceller: note it (the Deferred then fails with CancelledError)."""
        self.cancelled = True

    def answer(self, text: str, finish_reason: str = "stop") -> None:
        """Reply with C{text}."""
        self.deferred.callback(completion(text, finish_reason))

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> None:
        """Reply with a native tool call."""
        self.deferred.callback(tool_completion(name, arguments))

    def reply(self, completion: Completion) -> None:
        """Reply with any completion."""
        self.deferred.callback(completion)

    def fail(self, error: Exception) -> None:
        """Fail the call."""
        self.deferred.errback(error)


class Upstream:
    """
    The fake C{call(name, request)}: records every call with the clock's time. C{auto}, when
    set, settles each call before it is returned (an upstream that answers synchronously).
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.calls: list[Call] = []
        self.auto: Callable[[Call], None] | None = None

    def __call__(self, name: str, request: ChatRequest) -> Deferred[Completion]:
        call = Call(name, request, self.clock.seconds())
        self.calls.append(call)
        if self.auto is not None:
            self.auto(call)
        return call.deferred

    def named(self, name: str) -> list[Call]:
        """The calls to C{name}, in order."""
        return [call for call in self.calls if call.name == name]

    def last(self, name: str) -> Call:
        """The latest call to C{name}."""
        return self.named(name)[-1]

    def names(self) -> list[str]:
        """Every call's name, in call order."""
        return [call.name for call in self.calls]


GREP_TOOL = {
    "type": "function",
    "function": {"name": "grep", "description": "Search files", "parameters": {}},
}
QUESTION = {"role": "user", "content": "What is the capital of France?"}
FRESH: dict[str, Any] = {"messages": [QUESTION]}
FRESH_TOOLS: dict[str, Any] = {"messages": [QUESTION], "tools": [GREP_TOOL]}

SMALL2 = (Worker("qwen3-8b"), Worker("mistral-7b"))
"""Two small-tier workers: Fast qwen3-8b, Strong mistral-7b (no patience applies)."""
SMALL3 = (Worker("qwen3-8b"), Worker("mistral-7b"), Worker("gemma-2b"))
"""Three small-tier workers: Fast, Specialist, Strong in this order."""
MIXED3 = (Worker("qwen3-8b"), Worker("mistral-7b"), Worker("llama-70b"))
"""Fast and Specialist small tier, Strong llama-70b big tier (strong patience applies)."""


class EngineCase(SynchronousTestCase):
    """Helpers: a clock, the fake upstream, the progress events; no tests of its own."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.upstream = Upstream(self.clock)
        self.events: list[dict[str, Any]] = []

    def run_turn(
        self, document: Mapping[str, Any], pool: Sequence[Worker], **kwargs: Any
    ) -> Deferred[TurnResult]:
        """Start a turn over C{document} with C{pool}; return run()'s Deferred."""
        turn = MeshTurn(
            self.clock,
            turn_of(document),
            pool,
            self.upstream,
            progress=lambda event: self.events.append(dict(event)),
            **kwargs,
        )
        return turn.run()

    def at(self, when: float) -> None:
        """
        Move the clock to C{when} seconds, stopping at every timer on the way, so that a
        timer armed by another fires at its own time (one big L{Clock.advance} would not).
        """
        while True:
            due = [call.getTime() for call in self.clock.getDelayedCalls()]
            due = [time for time in due if time <= when]
            if not due:
                break
            self.clock.advance(min(due) - self.clock.seconds())
        self.clock.advance(when - self.clock.seconds())

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        """The progress events of one kind, in order."""
        return [event for event in self.events if event["event"] == kind]

    def assert_report(
        self,
        report: TurnReport,
        turn: TurnLabel,
        workers: int,
        ok: int,
        reducer: bool = False,
        attempts: int = 0,
    ) -> None:
        """The report's label and counts (the elapsed time aside)."""
        self.assertEqual(
            (report.turn, report.workers, report.workers_ok),
            (turn, workers, ok),
        )
        self.assertEqual((report.reducer_used, report.reducer_attempts), (reducer, attempts))

    def assert_quiet(self) -> None:
        """No timer pending, and every call the test did not fire was cancelled."""
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertEqual([c.name for c in self.upstream.calls if not c.deferred.called], [])


class DispatchTests(EngineCase):
    """What each worker is sent (§1.5-§1.7, DESIGN decision 28)."""

    def test_every_worker_called_at_once_with_its_role_body(self) -> None:
        """All workers called at dispatch: the role's max_tokens, worker sampling, no thinking."""
        self.run_turn(FRESH, MIXED3)
        self.assertEqual(self.upstream.names(), ["qwen3-8b", "mistral-7b", "llama-70b"])
        self.assertEqual({call.at for call in self.upstream.calls}, {0.0})
        budgets = {call.name: call.body["max_tokens"] for call in self.upstream.calls}
        self.assertEqual(budgets, {"qwen3-8b": 256, "mistral-7b": 512, "llama-70b": 1024})
        for call in self.upstream.calls:
            body = call.body
            self.assertEqual((body["temperature"], body["top_p"]), (0.8, 0.95))
            self.assertEqual(body["chat_template_kwargs"], {"enable_thinking": False})
            self.assertEqual(body["reasoning_effort"], "none")
            self.assertEqual(body["messages"][-1], QUESTION)

    def test_thinking_on_reaches_every_worker(self) -> None:
        """enable_thinking=True: enable_thinking true in every body and no reasoning_effort."""
        self.run_turn(FRESH, MIXED3, enable_thinking=True)
        self.assertEqual(len(self.upstream.calls), 3)
        for call in self.upstream.calls:
            self.assertEqual(call.body["chat_template_kwargs"], {"enable_thinking": True})
            self.assertNotIn("reasoning_effort", call.body)

    def test_native_tools_by_role(self) -> None:
        """With tools declared, Fast gets no native tools, Specialist and Strong get them."""
        self.run_turn(FRESH_TOOLS, MIXED3)
        tools = {call.name: call.body.get("tools") for call in self.upstream.calls}
        self.assertEqual(
            tools, {"qwen3-8b": None, "mistral-7b": [GREP_TOOL], "llama-70b": [GREP_TOOL]}
        )

    def test_same_name_twice(self) -> None:
        """Two workers of one name each get their own role's body (Fast 256, Strong 1024)."""
        self.run_turn(FRESH, (Worker("qwen3-8b"), Worker("qwen3-8b")))
        self.assertEqual([call.body["max_tokens"] for call in self.upstream.calls], [256, 1024])

    def test_run_twice(self) -> None:
        """A turn runs once: a second run() is a RuntimeError."""
        turn = MeshTurn(self.clock, turn_of(FRESH), SMALL2, self.upstream)
        turn.run()
        self.assertRaises(RuntimeError, turn.run)


class DecisionTests(EngineCase):
    """When the fan-out ships, fails or waits (§1.7, §1.10, DESIGN decisions 30, 33)."""

    def test_consensus_early_exit(self) -> None:
        """Two agreeing answers of three ship at once; the third is cancelled; early-exit."""
        d = self.run_turn(FRESH, SMALL3)
        self.at(0.1)
        self.upstream.last("qwen3-8b").answer("Paris")
        self.assertNoResult(d)
        self.at(0.2)
        self.upstream.last("mistral-7b").answer("The capital of France is Paris.")
        result = self.successResultOf(d)
        self.assertEqual(
            result.outcome.text if result.outcome else None, "The capital of France is Paris."
        )
        self.assertIsNone(result.error_code)
        self.assertTrue(self.upstream.last("gemma-2b").cancelled)
        self.assert_report(result.report, TurnLabel.EARLY_EXIT, workers=3, ok=2)
        self.assertEqual(result.report.elapsed_ms, 200)
        self.assert_quiet()

    def test_all_finish_then_ship(self) -> None:
        """A decision taken when no worker runs any more is labelled fanout."""
        d = self.run_turn(FRESH, SMALL2)
        self.upstream.last("qwen3-8b").answer("Paris")
        self.assertNoResult(d)
        self.upstream.last("mistral-7b").answer("Paris")
        result = self.successResultOf(d)
        assert result.outcome is not None
        self.assertEqual(result.outcome.text, "Paris")
        self.assertFalse(result.tool_call)
        self.assert_report(result.report, TurnLabel.FANOUT, workers=2, ok=2)
        self.assert_quiet()

    def test_all_workers_fail(self) -> None:
        """Every worker failed: all_workers_failed, label failed, and no reducer call."""
        d = self.run_turn(FRESH, SMALL3)
        for call in list(self.upstream.calls):
            self.assertNoResult(d)
            call.fail(Boom("connection refused"))
        result = self.successResultOf(d)
        self.assertIsNone(result.outcome)
        self.assertEqual(result.error_code, "all_workers_failed")
        self.assertEqual(result.error_message, ALL_WORKERS_FAILED_MESSAGE)
        self.assertEqual(len(self.upstream.calls), 3)
        self.assert_report(result.report, TurnLabel.FAILED, workers=3, ok=0)
        self.assert_quiet()

    def test_grace_ships_at_three_seconds(self) -> None:
        """No tools: one qualifying answer and a worker still running ship at 3 s, not before."""
        d = self.run_turn(FRESH, SMALL2)
        self.at(0.5)
        self.upstream.last("qwen3-8b").answer("Paris")
        self.at(2.999)
        self.assertNoResult(d)
        self.at(3.0)
        result = self.successResultOf(d)
        assert result.outcome is not None
        self.assertEqual(result.outcome.text, "Paris")
        self.assertTrue(self.upstream.last("mistral-7b").cancelled)
        self.assert_report(result.report, TurnLabel.EARLY_EXIT, workers=2, ok=1)
        self.assertEqual(self.events_of("mesh_decision")[0]["reason"], "grace")
        self.assert_quiet()

    def test_no_grace_with_tools(self) -> None:
        """With tools declared there is no grace exit: the answer waits for the other worker."""
        d = self.run_turn(FRESH_TOOLS, SMALL2)
        self.at(0.5)
        self.upstream.last("qwen3-8b").answer("Paris")
        self.at(30.0)
        self.assertNoResult(d)
        self.assertFalse(self.upstream.last("mistral-7b").cancelled)
        self.upstream.last("mistral-7b").answer("Paris")
        result = self.successResultOf(d)
        self.assert_report(result.report, TurnLabel.FANOUT, workers=2, ok=2)
        self.assert_quiet()

    def test_dead_worker_of_two_does_not_wait(self) -> None:
        """Quirk 11 fixed: one of two answered, the other failed: it ships at the failure."""
        d = self.run_turn(FRESH_TOOLS, SMALL2)
        self.at(0.1)
        self.upstream.last("qwen3-8b").answer("Paris")
        self.assertNoResult(d)
        self.at(0.2)
        self.upstream.last("mistral-7b").fail(Boom("connection refused"))
        result = self.successResultOf(d)
        assert result.outcome is not None
        self.assertEqual(result.outcome.text, "Paris")
        self.assertEqual(result.report.elapsed_ms, 200)
        self.assert_report(result.report, TurnLabel.FANOUT, workers=2, ok=1)
        self.assert_quiet()

    def test_worker_timeout(self) -> None:
        """A silent worker is cancelled at the 60 s worker timeout and the turn decides then."""
        d = self.run_turn(FRESH_TOOLS, SMALL2)
        self.at(1.0)
        self.upstream.last("qwen3-8b").answer("Paris")
        silent = self.upstream.last("mistral-7b")
        self.at(59.999)
        self.assertNoResult(d)
        self.assertFalse(silent.cancelled)
        self.at(60.0)
        self.assertTrue(silent.cancelled)
        result = self.successResultOf(d)
        assert result.outcome is not None
        self.assertEqual(result.outcome.text, "Paris")
        self.assert_report(result.report, TurnLabel.FANOUT, workers=2, ok=1)
        failed = self.events_of("mesh_worker")[1]
        self.assertEqual((failed["worker"], failed["ok"]), ("mistral-7b", False))
        self.assertIn("timed out", failed["error"])
        self.assert_quiet()

    def test_rate_limited_worker_retried_once(self) -> None:
        """A 429 is retried once, with the same body, after its Retry-After on the clock."""
        d = self.run_turn(FRESH, SMALL2)
        first = self.upstream.last("qwen3-8b")
        first.fail(RateLimited(2))
        self.at(1.999)
        self.assertEqual(len(self.upstream.named("qwen3-8b")), 1)
        self.at(2.0)
        self.assertEqual(len(self.upstream.named("qwen3-8b")), 2)
        retry = self.upstream.last("qwen3-8b")
        self.assertEqual(retry.request, first.request)
        self.assertEqual(self.events_of("mesh_worker"), [])
        retry.answer("Paris")
        self.upstream.last("mistral-7b").answer("Paris")
        result = self.successResultOf(d)
        self.assert_report(result.report, TurnLabel.FANOUT, workers=2, ok=2)
        self.assert_quiet()

    def test_tool_consensus_ships_proposal_with_arguments(self) -> None:
        """Two workers propose one declared tool: the one with arguments ships as a tool call."""
        d = self.run_turn(FRESH_TOOLS, SMALL2)
        self.upstream.last("qwen3-8b").call_tool("grep", {})
        self.assertNoResult(d)
        self.upstream.last("mistral-7b").call_tool("grep", {"q": "x"})
        result = self.successResultOf(d)
        assert result.outcome is not None
        self.assertTrue(result.tool_call)
        self.assertEqual(result.outcome.tool_name, "grep")
        self.assertEqual(result.outcome.tool_arguments, {"q": "x"})
        self.assertEqual(result.outcome.worker, "mistral-7b")
        self.assert_report(result.report, TurnLabel.FANOUT, workers=2, ok=2)
        self.assert_quiet()

    def test_empty_pool_fails_at_once(self) -> None:
        """No worker at all: all_workers_failed at once, no call and no timer."""
        d = self.run_turn(FRESH, ())
        result = self.successResultOf(d)
        self.assertEqual(result.error_code, "all_workers_failed")
        self.assertEqual(self.upstream.calls, [])
        self.assert_report(result.report, TurnLabel.FAILED, workers=0, ok=0)
        self.assert_quiet()


class StrongPatienceTests(EngineCase):
    """DESIGN decision 31: a small-tier consensus waits for a running big-tier Strong worker."""

    def small_consensus(self) -> Deferred[TurnResult]:
        """Run MIXED3 with the two small workers agreeing at 1 s; Strong still running."""
        d = self.run_turn(FRESH, MIXED3, timings=MeshTimings(strong_patience=20.0))
        self.at(1.0)
        self.upstream.last("qwen3-8b").answer("Paris")
        self.upstream.last("mistral-7b").answer("Paris")
        return d

    def test_waits_through_grace_until_patience(self) -> None:
        """No ship at the 3 s grace nor before patience; at patience the consensus ships."""
        d = self.small_consensus()
        self.at(3.0)
        self.assertNoResult(d)
        self.at(19.999)
        self.assertNoResult(d)
        self.at(20.0)
        result = self.successResultOf(d)
        assert result.outcome is not None
        self.assertEqual(result.outcome.text, "Paris")
        self.assertTrue(self.upstream.last("llama-70b").cancelled)
        self.assert_report(result.report, TurnLabel.EARLY_EXIT, workers=3, ok=2)
        self.assert_quiet()

    def test_patience_is_the_configured_time(self) -> None:
        """The patience time is timings.strong_patience."""
        d = self.run_turn(FRESH, MIXED3, timings=MeshTimings(strong_patience=8.0))
        self.upstream.last("qwen3-8b").answer("Paris")
        self.upstream.last("mistral-7b").answer("Paris")
        self.at(7.999)
        self.assertNoResult(d)
        self.at(8.0)
        self.assertIsNone(self.successResultOf(d).error_code)
        self.assert_quiet()

    def test_strong_agrees(self) -> None:
        """Strong lands agreeing before patience: the answer ships at once."""
        d = self.small_consensus()
        self.at(5.0)
        self.assertNoResult(d)
        self.upstream.last("llama-70b").answer("Paris is the capital of France.")
        result = self.successResultOf(d)
        assert result.outcome is not None
        self.assertIn("Paris", result.outcome.text)
        self.assert_report(result.report, TurnLabel.FANOUT, workers=3, ok=3)
        self.assertEqual(result.report.elapsed_ms, 5000)
        self.assert_quiet()

    def test_strong_dissent_goes_to_reducer(self) -> None:
        """Strong lands disagreeing with the small consensus: the drafts go to the reducer."""
        d = self.small_consensus()
        self.at(5.0)
        self.upstream.last("llama-70b").answer("Lyon")
        self.assertNoResult(d)
        self.assertEqual(len(self.upstream.calls), 4)
        reducer = self.upstream.calls[3]
        self.assertEqual(reducer.body["max_tokens"], 2048)
        self.assertEqual(self.events_of("mesh_decision")[0]["decision"], "reduce")
        reducer.answer("Paris")
        result = self.successResultOf(d)
        self.assert_report(
            result.report, TurnLabel.FANOUT, workers=3, ok=3, reducer=True, attempts=1
        )
        self.assert_quiet()


class CancelTests(EngineCase):
    """Cancelling a turn (DESIGN decision 29: a cancelled call closes its connection)."""

    def test_cancel_during_fanout(self) -> None:
        """Cancelling run()'s Deferred cancels every worker call and leaves no timer."""
        d = self.run_turn(FRESH, MIXED3)
        self.at(1.0)
        self.upstream.last("qwen3-8b").answer("Paris")
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual([c.cancelled for c in self.upstream.calls], [False, True, True])
        self.assert_quiet()
        self.at(100.0)
        self.assertEqual(len(self.upstream.calls), 3)

    def test_cancel_during_reducer(self) -> None:
        """Cancelling while hedged reducers run cancels both, and no hedge timer is left."""
        d = self.run_turn(FRESH, SMALL2)
        self.upstream.last("qwen3-8b").answer("Paris")
        self.upstream.last("mistral-7b").answer("Berlin")
        self.at(5.0)
        self.assertEqual(len(self.upstream.calls), 4)
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual([c.cancelled for c in self.upstream.calls[2:]], [True, True])
        self.assert_quiet()
        self.at(100.0)
        self.assertEqual(len(self.upstream.calls), 4)

    def test_cancel_while_rate_limited(self) -> None:
        """Cancelling while a worker waits for its 429 retry drops the retry timer too."""
        d = self.run_turn(FRESH, SMALL2)
        self.upstream.last("qwen3-8b").fail(RateLimited(2))
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assert_quiet()
        self.at(10.0)
        self.assertEqual(len(self.upstream.named("qwen3-8b")), 1)


def tool_round(call_id: str) -> list[dict[str, Any]]:
    """One completed C{grep {"q":"x"}} round: the assistant's call and the tool's result."""
    function = {"name": "grep", "arguments": '{"q":"x"}'}
    call = {"id": call_id, "type": "function", "function": function}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "x is in a.py"},
    ]


TOOL_RESULT: dict[str, Any] = {"messages": [QUESTION, *tool_round("c1")], "tools": [GREP_TOOL]}
LOOPING: dict[str, Any] = {
    "messages": [QUESTION, *tool_round("c1"), *tool_round("c2"), *tool_round("c3")],
    "tools": [GREP_TOOL],
}

REASONING_ONLY = completion("", reasoning="Hmm.")


class LadderTests(EngineCase):
    """The hedged reducer ladder after the workers disagreed (§1.10 a, §1.11, v2 §6)."""

    def disagree(self, document: dict[str, Any] = FRESH, **kwargs: Any) -> Deferred[TurnResult]:
        """Run MIXED3 with three disagreeing answers at 0 s: the reducer ladder starts."""
        d = self.run_turn(document, MIXED3, **kwargs)
        for call, text in zip(list(self.upstream.calls), ("Paris", "Berlin", "Rome"), strict=True):
            call.answer(text)
        self.assertNoResult(d)
        return d

    def reducers(self) -> list[Call]:
        """The reducer calls, in call order (after MIXED3's three worker calls)."""
        return self.upstream.calls[len(MIXED3) :]

    def test_reducer_body(self) -> None:
        """The reducer body: max_tokens 2048, temperature 0.3, top_p 0.9, thinking off."""
        self.disagree()
        (reducer,) = self.reducers()
        body = reducer.body
        self.assertEqual((body["max_tokens"], body["temperature"], body["top_p"]), (2048, 0.3, 0.9))
        self.assertEqual(body["chat_template_kwargs"], {"enable_thinking": False})
        self.assertEqual(body["reasoning_effort"], "none")
        self.assertNotIn("tools", body)
        system = body["messages"][0]["content"]
        self.assertIn("3 disagreeing answers to synthesize", system)
        for draft in ("Paris", "Berlin", "Rome"):
            self.assertIn(draft, system)
        self.assertEqual(body["messages"][-1], QUESTION)

    def test_reducer_body_thinking_on(self) -> None:
        """enable_thinking=True reaches the reducer: true, and no reasoning_effort."""
        self.disagree(enable_thinking=True)
        (reducer,) = self.reducers()
        self.assertEqual(reducer.body["chat_template_kwargs"], {"enable_thinking": True})
        self.assertNotIn("reasoning_effort", reducer.body)

    def test_candidate_order_big_tier_first(self) -> None:
        """Candidates: the big tier first, then the small tier in pool order."""
        self.disagree()
        self.at(10.0)
        self.assertEqual(
            [call.name for call in self.reducers()], ["llama-70b", "qwen3-8b", "mistral-7b"]
        )
        self.assertEqual([call.at for call in self.reducers()], [0.0, 5.0, 10.0])

    def test_hedge_after_five_seconds(self) -> None:
        """No result in 5 s: the second candidate starts alongside the first."""
        d = self.disagree()
        self.at(4.999)
        self.assertEqual(len(self.reducers()), 1)
        self.at(5.0)
        first, second = self.reducers()
        self.assertEqual(second.name, "qwen3-8b")
        self.assertFalse(first.cancelled)
        self.assertNoResult(d)

    def test_first_success_wins(self) -> None:
        """The first success wins and the other call is cancelled; nothing more starts."""
        d = self.disagree()
        self.at(6.0)
        first, second = self.reducers()
        second.answer("Paris")
        result = self.successResultOf(d)
        assert result.outcome is not None
        self.assertEqual(result.outcome.text, "Paris")
        self.assertEqual(result.outcome.worker, "qwen3-8b")
        self.assertTrue(first.cancelled)
        self.assert_report(result.report, TurnLabel.FANOUT, 3, 3, reducer=True, attempts=2)
        self.assert_quiet()
        self.at(100.0)
        self.assertEqual(len(self.reducers()), 2)

    def test_failure_launches_next_at_once(self) -> None:
        """A failed reducer call starts the next candidate at once, not at the hedge."""
        d = self.disagree()
        self.at(1.0)
        self.reducers()[0].fail(Boom("HTTP 500"))
        self.assertEqual([(c.name, c.at) for c in self.reducers()[1:]], [("qwen3-8b", 1.0)])
        self.assertNoResult(d)

    def test_all_reducers_fail(self) -> None:
        """All failed: all_reducers_failed, fanout, reducer used, 3 attempts (quirks 5, 6)."""
        d = self.disagree()
        for attempt in range(3):
            self.reducers()[attempt].fail(Boom(f"HTTP 50{attempt}"))
        result = self.successResultOf(d)
        self.assertIsNone(result.outcome)
        self.assertEqual(result.error_code, "all_reducers_failed")
        self.assertEqual(result.error_message, "Reducer failed (tried 3): HTTP 502")
        self.assert_report(result.report, TurnLabel.FANOUT, 3, 3, reducer=True, attempts=3)
        self.assert_quiet()

    def test_reducer_timeout(self) -> None:
        """Each reducer call has its own 60 s timeout; the last timing out fails the ladder."""
        d = self.disagree()
        self.at(10.0)
        self.assertEqual(len(self.reducers()), 3)
        self.at(69.999)
        self.assertNoResult(d)
        self.assertEqual([c.cancelled for c in self.reducers()], [True, True, False])
        self.at(70.0)
        result = self.successResultOf(d)
        self.assertEqual(result.error_code, "all_reducers_failed")
        self.assertIn("timed out", result.error_message)
        self.assert_quiet()

    def test_rate_limited_reducer_retried(self) -> None:
        """A 429 on a reducer call is retried after Retry-After; the ladder does not move on."""
        d = self.disagree()
        self.reducers()[0].fail(RateLimited(1))
        self.assertEqual(len(self.reducers()), 1)
        self.at(1.0)
        self.assertEqual([c.name for c in self.reducers()], ["llama-70b", "llama-70b"])
        self.reducers()[1].answer("Paris")
        result = self.successResultOf(d)
        self.assert_report(result.report, TurnLabel.FANOUT, 3, 3, reducer=True, attempts=1)
        self.assert_quiet()

    def test_uncertain_reply_is_no_usable_answer(self) -> None:
        """A reducer reply that is an uncertainty ends the turn with no_usable_answer (v2)."""
        d = self.disagree()
        self.reducers()[0].answer("I'm not sure, it depends.")
        result = self.successResultOf(d)
        self.assertEqual(result.error_code, "no_usable_answer")
        self.assertIsNone(result.outcome)
        self.assert_report(result.report, TurnLabel.FANOUT, 3, 3, reducer=True, attempts=1)
        self.assert_quiet()

    def test_undeclared_tool_without_tools_is_no_usable_answer(self) -> None:
        """A tool call from the reducer when the request declared no tools: no_usable_answer."""
        d = self.disagree()
        self.reducers()[0].call_tool("grep", {"q": "x"})
        result = self.successResultOf(d)
        self.assertEqual(result.error_code, "no_usable_answer")
        self.assertFalse(result.tool_call)
        self.assert_quiet()

    def test_undeclared_tool_with_tools_is_no_usable_answer(self) -> None:
        """A reducer tool call naming a tool the request did not declare: no_usable_answer."""
        d = self.disagree(FRESH_TOOLS)
        self.assertEqual(self.reducers()[0].body["tools"], [GREP_TOOL])
        self.reducers()[0].call_tool("rm", {"path": "/"})
        result = self.successResultOf(d)
        self.assertEqual(result.error_code, "no_usable_answer")
        self.assert_quiet()

    def test_declared_tool_ships_as_tool_call(self) -> None:
        """A reducer tool call of a declared tool ships as a tool call."""
        d = self.disagree(FRESH_TOOLS)
        self.reducers()[0].call_tool("grep", {"q": "x"})
        result = self.successResultOf(d)
        assert result.outcome is not None
        self.assertTrue(result.tool_call)
        self.assertEqual(
            (result.outcome.tool_name, result.outcome.tool_arguments), ("grep", {"q": "x"})
        )
        self.assert_quiet()

    def test_reasoning_only_reply_is_a_failure(self) -> None:
        """A reasoning-only reducer reply is a failed call: the next candidate starts at once."""
        d = self.disagree()
        self.at(1.0)
        self.reducers()[0].reply(REASONING_ONLY)
        self.assertEqual([(c.name, c.at) for c in self.reducers()[1:]], [("qwen3-8b", 1.0)])
        self.assertEqual(self.events_of("mesh_reducer_failed")[0]["model"], "llama-70b")
        self.assertNoResult(d)


class ProgressTests(EngineCase):
    """The progress events of a turn, meant for a stream's C{: loopd} comments (issue 6)."""

    def test_progress_events_in_order(self) -> None:
        """mesh_worker (ok, failed), mesh_decision, mesh_reducer (hedged), mesh_reducer_failed."""
        d = self.run_turn(FRESH, SMALL3)
        self.at(0.1)
        self.upstream.last("qwen3-8b").answer("Paris")
        self.upstream.last("mistral-7b").answer("Berlin")
        self.upstream.last("gemma-2b").fail(Boom("connection refused"))
        self.at(5.1)
        self.upstream.calls[3].fail(Boom("HTTP 500"))
        self.upstream.calls[4].answer("Paris")
        self.successResultOf(d)
        self.assertEqual(
            [(e["event"], e.get("worker") or e.get("model")) for e in self.events],
            [
                ("mesh_worker", "qwen3-8b"),
                ("mesh_worker", "mistral-7b"),
                ("mesh_worker", "gemma-2b"),
                ("mesh_decision", None),
                ("mesh_reducer", "qwen3-8b"),
                ("mesh_reducer", "mistral-7b"),
                ("mesh_reducer_failed", "qwen3-8b"),
                ("mesh_reducer", "gemma-2b"),
            ],
        )
        workers = self.events_of("mesh_worker")
        self.assertEqual([e["ok"] for e in workers], [True, True, False])
        self.assertEqual(workers[2]["error"], "connection refused")
        self.assertEqual(workers[0]["elapsed_ms"], 100)
        decision = self.events_of("mesh_decision")[0]
        self.assertEqual((decision["decision"], decision["early"]), ("reduce", False))
        reducers = self.events_of("mesh_reducer")
        self.assertEqual([e["attempt"] for e in reducers], [1, 2, 3])
        self.assertEqual([e["hedged"] for e in reducers], [False, True, True])
        self.assertEqual(self.events_of("mesh_reducer_failed")[0]["error"], "HTTP 500")
        self.assert_quiet()


class ToolResultTests(EngineCase):
    """A tool-result turn: the reducer alone (§1.10 b, v2 §6 loop guard, DESIGN 32, 33)."""

    def test_reducer_alone_with_native_tools(self) -> None:
        """No workers: one reducer call with the native tools; tool-result, 1 worker."""
        d = self.run_turn(TOOL_RESULT, MIXED3)
        (call,) = self.upstream.calls
        self.assertEqual(call.name, "llama-70b")
        self.assertEqual(call.body["tools"], [GREP_TOOL])
        self.assertEqual((call.body["max_tokens"], call.body["temperature"]), (2048, 0.3))
        self.assertEqual(call.body["messages"][1:], TOOL_RESULT["messages"])
        call.answer("x is in a.py.")
        result = self.successResultOf(d)
        assert result.outcome is not None
        self.assertEqual(result.outcome.text, "x is in a.py.")
        self.assert_report(result.report, TurnLabel.TOOL_RESULT, 1, 1, reducer=True, attempts=1)
        self.assertEqual(self.events_of("mesh_worker"), [])
        self.assert_quiet()

    def test_tool_call_ships(self) -> None:
        """The reducer's call of a declared tool ships as a tool call."""
        d = self.run_turn(TOOL_RESULT, MIXED3)
        self.upstream.calls[0].call_tool("grep", {"q": "y"})
        result = self.successResultOf(d)
        self.assertTrue(result.tool_call)
        self.assert_quiet()

    def test_all_reducers_fail(self) -> None:
        """Every candidate failed: all_reducers_failed, still 1 worker, 0 ok (decision 33)."""
        d = self.run_turn(TOOL_RESULT, (Worker("qwen3-8b"), Worker("llama-70b")))
        self.upstream.calls[0].fail(Boom("refused"))
        self.upstream.calls[1].fail(Boom("refused again"))
        result = self.successResultOf(d)
        self.assertEqual(result.error_code, "all_reducers_failed")
        self.assertEqual(result.error_message, "Reducer failed (tried 2): refused again")
        self.assert_report(result.report, TurnLabel.TOOL_RESULT, 1, 0, reducer=True, attempts=2)
        self.assert_quiet()

    def test_loop_guard(self) -> None:
        """3 identical completed calls: no tools, the guard text, and a tool call is unusable."""
        d = self.run_turn(LOOPING, MIXED3)
        (call,) = self.upstream.calls
        self.assertNotIn("tools", call.body)
        guard = loop_guard_text(ToolLoop("grep", 3))
        self.assertTrue(call.body["messages"][0]["content"].endswith("\n\n" + guard))
        self.assertEqual(self.events[0], {"event": "mesh_loop_guard", "tool": "grep", "count": 3})
        call.call_tool("grep", {"q": "x"})
        result = self.successResultOf(d)
        self.assertEqual(result.error_code, "no_usable_answer")
        self.assertFalse(result.tool_call)
        self.assert_report(result.report, TurnLabel.TOOL_RESULT, 1, 0, reducer=True, attempts=1)
        self.assert_quiet()

    def test_loop_guard_answer_ships(self) -> None:
        """Under the loop guard a text answer ships as usual."""
        d = self.run_turn(LOOPING, MIXED3)
        self.upstream.calls[0].answer("x is in a.py.")
        result = self.successResultOf(d)
        self.assertIsNone(result.error_code)
        self.assertFalse(result.tool_call)
        self.assert_quiet()

    def test_no_loop_guard_for_two_repeats(self) -> None:
        """Two identical completed calls are no loop: the tools are sent."""
        document = {
            "messages": [QUESTION, *tool_round("c1"), *tool_round("c2")],
            "tools": [GREP_TOOL],
        }
        self.run_turn(document, MIXED3)
        self.assertEqual(self.upstream.calls[0].body["tools"], [GREP_TOOL])
        self.assertEqual(self.events_of("mesh_loop_guard"), [])


class SynchronousCallTests(EngineCase):
    """Calls whose Deferreds have already fired when C{call} returns."""

    def test_decision_during_dispatch(self) -> None:
        """A consensus during dispatch ships at once; a worker not yet called never is."""
        self.upstream.auto = lambda call: call.answer("Paris")
        result = self.successResultOf(self.run_turn(FRESH, SMALL3))
        self.assertEqual(self.upstream.names(), ["qwen3-8b", "mistral-7b"])
        self.assert_report(result.report, TurnLabel.EARLY_EXIT, 3, 2)
        self.assert_quiet()

    def test_all_fail_during_dispatch(self) -> None:
        """Every worker failing synchronously: all_workers_failed at once, no timer left."""
        self.upstream.auto = lambda call: call.fail(Boom("refused"))
        result = self.successResultOf(self.run_turn(FRESH, SMALL3))
        self.assertEqual(result.error_code, "all_workers_failed")
        self.assert_quiet()

    def test_ladder_failing_synchronously(self) -> None:
        """Reducers failing synchronously climb the whole ladder at once: all_reducers_failed."""

        def settle(call: Call) -> None:
            if call.body["max_tokens"] == 2048:
                call.fail(Boom(f"{call.name} refused"))
            else:
                call.answer({"qwen3-8b": "Paris", "mistral-7b": "Berlin"}.get(call.name, "Rome"))

        self.upstream.auto = settle
        result = self.successResultOf(self.run_turn(FRESH, MIXED3))
        self.assertEqual(len(self.upstream.calls), 6)
        self.assertEqual(result.error_message, "Reducer failed (tried 3): mistral-7b refused")
        self.assert_report(result.report, TurnLabel.FANOUT, 3, 3, reducer=True, attempts=3)
        self.assert_quiet()

    def test_tool_result_answered_synchronously(self) -> None:
        """A tool-result reducer answering synchronously: the result, and no hedge timer left."""
        self.upstream.auto = lambda call: call.answer("x is in a.py.")
        result = self.successResultOf(self.run_turn(TOOL_RESULT, MIXED3))
        self.assert_report(result.report, TurnLabel.TOOL_RESULT, 1, 1, reducer=True, attempts=1)
        self.assert_quiet()
