"""
Tests for L{loopd.moa.tool_guard}: v2's loop guard (reference C{mesh-moa.md} §6, DESIGN
decision 32) and the rule that tool calls go out only for declared tools (§1.12, §7 quirk 3).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.chat_read import parse_request
from loopd.llama.types import System, ToolSchema
from loopd.moa.outcome import Kind, Outcome
from loopd.moa.tool_guard import (
    emits_tool_call,
    enforce_declared_tools,
    loop_guard,
    pack_tool_result_reducer,
    reducer_allowed_tools,
)
from loopd.moa.turn import ToolLoop, Turn, read_turn

GUARD = (
    "Tool loop guard: the last 3 completed tool calls all used `read_file`. Answer now from "
    "the gathered tool results. Do not call another tool. If the evidence is incomplete, say "
    "what can be determined and what is missing."
)

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "web_search"}},
]


def calling(call_id: str, name: str = "read_file", arguments: str = '{"path":"a"}') -> Any:
    """An assistant message calling one tool."""
    function = {"name": name, "arguments": arguments}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def result(call_id: str) -> Any:
    """The tool message answering C{call_id}."""
    return {"role": "tool", "tool_call_id": call_id, "content": "out"}


def rounds(*calls: tuple[str, str]) -> list[Any]:
    """A history: a user question, then one completed round per (name, arguments)."""
    messages: list[Any] = [{"role": "system", "content": "Be kind."}]
    messages.append({"role": "user", "content": "read it"})
    for number, (name, arguments) in enumerate(calls):
        messages += [calling(f"c{number}", name, arguments), result(f"c{number}")]
    return messages


def turn_of(messages: list[Any], tools: list[Any] | None = TOOLS) -> Turn:
    """The turn of a request with these messages and tools, as the front door reads it."""
    body: dict[str, Any] = {"model": "mesh", "messages": messages}
    if tools is not None:
        body["tools"] = tools
    request = parse_request(json.dumps(body).encode())
    return read_turn(request.messages, request.tools)


#: L{TOOLS} as the front door reads them.
SCHEMAS = (ToolSchema("read_file", "", {"type": "object"}), ToolSchema("web_search", ""))


SAME = ("read_file", '{"path":"a"}')
PROPOSAL = Outcome(Kind.TOOL_PROPOSAL, "reading", 0.9, tool_name="read_file", tool_arguments={})


class LoopGuardTests(SynchronousTestCase):
    """'When the last 3 consecutive completed tool calls have the same name and identical
    raw arguments, tools are disabled for the reducer' (§6)."""

    def test_three_identical(self) -> None:
        """Three identical completed calls guard the reducer."""
        self.assertEqual(loop_guard(turn_of(rounds(SAME, SAME, SAME))), ToolLoop("read_file", 3))

    def test_counts_the_whole_run(self) -> None:
        """The count is the whole identical run at the end."""
        turn = turn_of(rounds(("web_search", "{}"), SAME, SAME, SAME, SAME))
        self.assertEqual(loop_guard(turn), ToolLoop("read_file", 4))

    def test_two_is_not_a_loop(self) -> None:
        """Two identical calls are not yet a loop."""
        self.assertIsNone(loop_guard(turn_of(rounds(SAME, SAME))))

    def test_different_arguments(self) -> None:
        """The same tool with other arguments is progress, not a loop."""
        turn = turn_of(rounds(SAME, ("read_file", '{"path":"b"}'), SAME))
        self.assertIsNone(loop_guard(turn))

    def test_different_name(self) -> None:
        """A different tool in the last three breaks the run."""
        self.assertIsNone(loop_guard(turn_of(rounds(SAME, SAME, ("web_search", '{"path":"a"}')))))

    def test_pending_call_not_counted(self) -> None:
        """Only completed calls count: a call without a result is skipped."""
        messages = rounds(SAME, SAME)
        messages += [calling("p"), calling("c9"), result("c9")]
        self.assertEqual(loop_guard(turn_of(messages)), ToolLoop("read_file", 3))

    def test_only_tool_result_turns(self) -> None:
        """A fresh turn (the assistant answered since) is not guarded."""
        messages = rounds(SAME, SAME, SAME)
        messages += [{"role": "assistant", "content": "done"}, {"role": "user", "content": "ok"}]
        self.assertIsNone(loop_guard(turn_of(messages)))

    def test_user_nudge_still_guarded(self) -> None:
        """A user nudge after the tool result is still a tool-result turn, still guarded."""
        messages = rounds(SAME, SAME, SAME) + [{"role": "user", "content": "go on"}]
        self.assertEqual(loop_guard(turn_of(messages)), ToolLoop("read_file", 3))


class PackTests(SynchronousTestCase):
    """DESIGN 32: the guarded reducer gets no tools and the §6 instruction in its system prompt."""

    def test_guarded(self) -> None:
        """Under a loop: tools None, the exact guard text ends the system prompt."""
        packed = pack_tool_result_reducer(turn_of(rounds(SAME, SAME, SAME)))
        self.assertIsNone(packed.tools)
        system = packed.messages[0]
        assert isinstance(system, System)
        self.assertTrue(system.content.endswith("Be kind.\n\n" + GUARD))
        self.assertEqual(packed.max_tokens, 2048)

    def test_unguarded(self) -> None:
        """Without a loop: the native tools and no guard text."""
        packed = pack_tool_result_reducer(turn_of(rounds(SAME, SAME)))
        self.assertEqual(packed.tools, SCHEMAS)
        self.assertNotIn("Tool loop guard", str(packed.messages[0]))

    def test_allowed_tools(self) -> None:
        """The reducer may call the declared tools, none under the guard."""
        turn = turn_of(rounds(SAME))
        self.assertEqual(reducer_allowed_tools(turn), ("read_file", "web_search"))
        self.assertEqual(reducer_allowed_tools(turn, ToolLoop("read_file", 3)), ())


class DeclaredToolTests(SynchronousTestCase):
    """§1.12: tool calls only for tools the request declared (v1 quirk 3 fixed)."""

    def test_declared_kept(self) -> None:
        """A proposal of a declared tool is unchanged and is emitted."""
        self.assertIs(enforce_declared_tools(PROPOSAL, ("read_file",)), PROPOSAL)
        self.assertTrue(emits_tool_call(PROPOSAL, ("read_file",)))

    def test_undeclared_demoted(self) -> None:
        """An undeclared tool becomes an uncertainty with confidence 0, payload kept."""
        outcome = enforce_declared_tools(PROPOSAL, ("web_search",))
        self.assertEqual(outcome.kind, Kind.UNCERTAINTY)
        self.assertEqual(outcome.confidence, 0.0)
        self.assertEqual(outcome.text, "reading")
        self.assertEqual(outcome.demoted_tool, "read_file")
        self.assertIsNone(outcome.tool_name)
        self.assertFalse(emits_tool_call(outcome, ("web_search",)))

    def test_no_tools_declared(self) -> None:
        """Quirk 3 fixed: with no tools declared a named proposal is demoted, never emitted."""
        outcome = enforce_declared_tools(PROPOSAL, ())
        self.assertEqual(
            outcome,
            Outcome(Kind.UNCERTAINTY, "reading", 0.0, demoted_tool="read_file"),
        )
        self.assertFalse(emits_tool_call(PROPOSAL, ()))

    def test_others_unchanged(self) -> None:
        """Answers and nameless proposals pass unchanged; they are never tool calls."""
        nameless = Outcome(Kind.TOOL_PROPOSAL, "use a tool", 0.7)
        answer = Outcome(Kind.ANSWER, "42")
        for outcome in (nameless, answer):
            for allowed in ((), ("read_file",)):
                self.assertIs(enforce_declared_tools(outcome, allowed), outcome)
                self.assertFalse(emits_tool_call(outcome, allowed))

    @given(
        st.text(min_size=1, max_size=10),
        st.lists(st.text(min_size=1, max_size=10), max_size=4),
        st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    )
    def test_only_declared_emitted(self, name: str, allowed: list[str], args: Any) -> None:
        """After enforcement a tool call is emitted exactly when its tool was declared."""
        proposal = Outcome(Kind.TOOL_PROPOSAL, "t", 0.8, tool_name=name, tool_arguments=args)
        outcome = enforce_declared_tools(proposal, allowed)
        self.assertEqual(emits_tool_call(outcome, allowed), name in allowed)
        self.assertEqual(outcome.kind is Kind.TOOL_PROPOSAL, name in allowed)
