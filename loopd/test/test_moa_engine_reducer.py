"""
Tests for L{loopd.moa.engine}: the hedged reducer ladder as the turn drives it, and the
tool-result turn (reference C{mesh-moa.md} §1.10 (a) and (b), §1.11, §6 loop guard and
C{no_usable_answer}, §7 quirks 5, 6 and 10; DESIGN decisions 28, 32, 33).

The fakes are L{loopd.test.test_moa_engine}'s: a L{Clock} and an upstream whose calls the
tests fire by hand.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred

from loopd.moa.context import loop_guard_text
from loopd.moa.engine import TurnResult
from loopd.moa.fanout import RateLimited
from loopd.moa.response import TurnLabel
from loopd.moa.roles import Worker
from loopd.moa.turn import ToolLoop
from loopd.test.test_moa_engine import (
    FRESH,
    FRESH_TOOLS,
    GREP_TOOL,
    MIXED3,
    QUESTION,
    SMALL3,
    Boom,
    Call,
    EngineCase,
)


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

REASONING_ONLY = {
    "choices": [
        {
            "message": {"role": "assistant", "content": "", "reasoning_content": "Hmm."},
            "finish_reason": "stop",
        }
    ]
}


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
