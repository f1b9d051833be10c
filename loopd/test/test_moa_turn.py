"""
Tests for L{loopd.moa.turn}: tool-call ingest, turn classification and the derived values
(reference C{mesh-moa.md} §1.3), and v2's tool-loop detection (§6), over the checked
request's messages (what v1 skipped as malformed, the front door refuses).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.llama.types import (
    Assistant,
    ChatMessage,
    System,
    Tool,
    ToolCall,
    ToolSchema,
    User,
)
from loopd.moa.turn import (
    HistoryCall,
    ToolLoop,
    TurnKind,
    classify,
    detect_tool_loop,
    ingest_tool_calls,
    last_user_text,
    read_turn,
    system_prompt,
)


def calling(*calls: tuple[str, str, str]) -> Assistant:
    """An assistant message calling tools, each (id, name, arguments)."""
    return Assistant(None, None, tuple(ToolCall(i, n, a) for i, n, a in calls))


_text = st.text(max_size=4)
messages = st.lists(
    st.one_of(
        st.builds(System, _text),
        st.builds(User, _text),
        st.builds(Tool, st.sampled_from(["a", "b", ""]), _text),
        st.builds(
            Assistant,
            st.none() | _text,
            st.none() | _text,
            st.lists(
                st.builds(
                    ToolCall, st.sampled_from(["a", "b", ""]), st.sampled_from(["f", ""]), _text
                ),
                max_size=2,
            ).map(tuple),
        ),
    ),
    max_size=8,
)


class IngestTests(SynchronousTestCase):
    """C{ingest_tool_calls}: the history's tool calls and their results."""

    def test_calls_with_raw_arguments(self) -> None:
        """Each tool call is a call {id, name, arguments as sent}."""
        calls = ingest_tool_calls([calling(("c1", "read", '{"p":1}'), ("c2", "ls", "{}"))])
        self.assertEqual(
            calls, (HistoryCall("c1", "read", '{"p":1}'), HistoryCall("c2", "ls", "{}"))
        )

    def test_empty_names_dropped(self) -> None:
        """A call whose id or name is empty is dropped."""
        message = calling(("", "f", "{}"), ("y", "", "{}"), ("ok", "g", "{}"))
        self.assertEqual(ingest_tool_calls([message]), (HistoryCall("ok", "g", "{}"),))

    def test_result_attached(self) -> None:
        """A tool message attaches its content to the call with the same id."""
        calls = ingest_tool_calls([calling(("c1", "a", "{}"), ("c2", "b", "{}")), Tool("c2", "42")])
        self.assertEqual([c.result for c in calls], [None, "42"])

    def test_result_without_id_ignored(self) -> None:
        """A tool message with an empty or unknown tool_call_id is ignored."""
        history = [calling(("c", "a", "{}")), Tool("", "y"), Tool("other", "z")]
        self.assertIsNone(ingest_tool_calls(history)[0].result)

    def test_first_pending_call(self) -> None:
        """Repeated ids: each result goes to the first call with that id still pending."""
        history: list[ChatMessage] = [
            calling(("c", "a", "1")),
            Tool("c", "r1"),
            calling(("c", "a", "2")),
            Tool("c", "r2"),
        ]
        self.assertEqual([c.result for c in ingest_tool_calls(history)], ["r1", "r2"])


class ClassifyTests(SynchronousTestCase):
    """C{classify}: scan back to the first tool or assistant message."""

    def test_table(self) -> None:
        """Fresh and tool-result turns of the reference."""
        call = calling(("c", "f", "{}"))
        done = Tool("c", "r")
        cases: list[tuple[list[ChatMessage], TurnKind]] = [
            ([], TurnKind.FRESH),
            ([User("hi")], TurnKind.FRESH),
            ([User("q"), call, done], TurnKind.TOOL_RESULT),
            ([User("q"), call, done, User("Go on.")], TurnKind.TOOL_RESULT),
            ([User("q"), call, done, Assistant("done")], TurnKind.FRESH),
            ([User("q"), call, done, Assistant("a"), User("more")], TurnKind.FRESH),
            ([System("s"), User("q")], TurnKind.FRESH),
        ]
        for history, kind in cases:
            self.assertEqual(classify(history), kind, history)

    def test_system_skipped(self) -> None:
        """System and user messages are skipped by the scan."""
        self.assertEqual(classify([Tool("c", "r"), System("s"), User("u")]), TurnKind.TOOL_RESULT)

    def test_orphan_tool(self) -> None:
        """Classification does not check that the tool message answers a known call."""
        self.assertEqual(classify([User("q"), Tool("nobody", "r")]), TurnKind.TOOL_RESULT)

    def test_assistant_stops(self) -> None:
        """An assistant message stops the scan even with a tool result before it."""
        self.assertEqual(classify([Tool("c", "r"), Assistant("x")]), TurnKind.FRESH)


class DerivedTests(SynchronousTestCase):
    """has_tools, allowed_tools, last_user_text and system_prompt."""

    def test_tools(self) -> None:
        """has_tools for any tool; allowed_tools are their names in order."""
        tools = (ToolSchema("a", ""), ToolSchema("b", "B."))
        self.assertEqual(read_turn([], tools).allowed_tools, ("a", "b"))
        self.assertTrue(read_turn([], tools).has_tools)
        self.assertFalse(read_turn([]).has_tools)

    def test_last_user(self) -> None:
        """The last user message's text, not an earlier one; none: ""."""
        history = [User("first"), Assistant("x"), User("second")]
        self.assertEqual(last_user_text(history), "second")
        self.assertEqual(last_user_text([Assistant("x")]), "")

    def test_last_user_with_media(self) -> None:
        """A user turn with media contributes its text (the text parts joined)."""
        parts = ({"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}})
        self.assertEqual(last_user_text([User("a", parts)]), "a")

    def test_system_prompt(self) -> None:
        """The first system message's content, else None."""
        self.assertEqual(system_prompt([User("u"), System("one"), System("two")]), "one")
        self.assertIsNone(system_prompt([User("u")]))

    def test_read_turn(self) -> None:
        """read_turn gathers the kind, messages, tools, calls and texts."""
        tools = (ToolSchema("f", ""),)
        history = (System("sys"), User("q"), calling(("c", "f", "{}")), Tool("c", "r"))
        turn = read_turn(history, tools)
        self.assertEqual(turn.kind, TurnKind.TOOL_RESULT)
        self.assertEqual(turn.messages, history)
        self.assertEqual(turn.tools, tools)
        self.assertEqual(turn.tool_calls, (HistoryCall("c", "f", "{}", "r"),))
        self.assertEqual(turn.last_user_text, "q")
        self.assertEqual(turn.system_prompt, "sys")

    def test_empty_messages_fresh(self) -> None:
        """No messages make a Fresh turn with empty user text."""
        turn = read_turn([])
        self.assertEqual((turn.kind, turn.messages, turn.last_user_text), (TurnKind.FRESH, (), ""))

    @given(messages)
    def test_any_history(self, history: list[ChatMessage]) -> None:
        """Any history reads into a turn whose calls have ids and names."""
        turn = read_turn(history)
        self.assertIsInstance(turn.kind, TurnKind)
        for call in turn.tool_calls:
            self.assertTrue(call.call_id and call.name)
        self.assertIsNone(detect_tool_loop(turn.tool_calls, threshold=100))


class ToolLoopTests(SynchronousTestCase):
    """C{detect_tool_loop}: three identical completed calls in a row (v2)."""

    def history(self, *calls: tuple[str, str], pending: bool = False) -> list[ChatMessage]:
        """A history of completed calls (name, arguments), the last one pending if asked."""
        history: list[ChatMessage] = [User("go")]
        for i, (name, arguments) in enumerate(calls):
            history.append(calling((f"c{i}", name, arguments)))
            if not (pending and i == len(calls) - 1):
                history.append(Tool(f"c{i}", "out"))
        return history

    def loop(self, *calls: tuple[str, str], pending: bool = False) -> ToolLoop | None:
        """The loop detected in such a history."""
        return detect_tool_loop(ingest_tool_calls(self.history(*calls, pending=pending)))

    def test_three_identical(self) -> None:
        """The last 3 completed calls with the same name and arguments are a loop."""
        self.assertEqual(self.loop(*[("ls", '{"d":"."}')] * 3), ToolLoop("ls", 3))

    def test_counts_the_run(self) -> None:
        """The count is the whole identical run at the end of the history."""
        calls = [("cat", "{}")] + [("ls", "{}")] * 4
        self.assertEqual(self.loop(*calls), ToolLoop("ls", 4))

    def test_two_is_no_loop(self) -> None:
        """Two identical calls, or three broken by another one, are no loop."""
        self.assertIsNone(self.loop(("ls", "{}"), ("ls", "{}")))
        self.assertIsNone(self.loop(("ls", "{}"), ("ls", "{}"), ("cat", "{}"), ("ls", "{}")))

    def test_arguments_must_match(self) -> None:
        """Same name with different raw arguments is no loop; different names neither."""
        self.assertIsNone(self.loop(("ls", '{"d":1}'), ("ls", '{"d":1}'), ("ls", '{"d":2}')))
        self.assertIsNone(self.loop(("a", "{}"), ("b", "{}"), ("a", "{}")))

    def test_raw_arguments_compared(self) -> None:
        """Raw argument strings compare as text: a re-spaced JSON string differs."""
        self.assertIsNone(self.loop(("ls", '{"d":1}'), ("ls", '{"d":1}'), ("ls", '{"d": 1}')))

    def test_pending_call_not_counted(self) -> None:
        """Only completed calls count: a pending fourth call does not break the run."""
        calls = [("ls", "{}")] * 3 + [("cat", "{}")]
        self.assertEqual(self.loop(*calls, pending=True), ToolLoop("ls", 3))
