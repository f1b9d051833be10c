"""
Tests for L{loopd.moa.turn}: tool-call ingest, turn classification and the derived values
(reference C{mesh-moa.md} §1.3), and v2's tool-loop detection (§6).
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.moa.turn import (
    ToolCall,
    ToolLoop,
    TurnKind,
    classify,
    detect_tool_loop,
    ingest_tool_calls,
    json_equal,
    last_user_text,
    read_turn,
    system_prompt,
)


def user(text: Any) -> dict[str, Any]:
    """A user message."""
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    """A plain assistant message."""
    return {"role": "assistant", "content": text}


def calling(*calls: tuple[str, str, Any]) -> dict[str, Any]:
    """An assistant message calling tools, each (id, name, arguments)."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in calls
        ],
    }


def result(call_id: str, content: Any) -> dict[str, Any]:
    """A tool result message."""
    return {"role": "tool", "tool_call_id": call_id, "content": content}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)

message_like = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool", "system", "", 3])},
        optional={
            "content": json_values,
            "tool_calls": st.lists(json_values, max_size=3) | json_values,
            "tool_call_id": st.sampled_from(["a", "b", ""]) | json_values,
        },
    ),
)


class IngestTests(SynchronousTestCase):
    """C{ingest_tool_calls}: the history's tool calls and their results."""

    def test_calls_with_raw_arguments(self) -> None:
        """Each tool_calls entry is a call {id, function.name, arguments as sent}."""
        calls = ingest_tool_calls([calling(("c1", "read", '{"p":1}'), ("c2", "ls", {"d": 1}))])
        self.assertEqual(calls, (ToolCall("c1", "read", '{"p":1}'), ToolCall("c2", "ls", {"d": 1})))

    def test_missing_arguments_null(self) -> None:
        """Missing arguments are null (None)."""
        message = {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}
        self.assertEqual(ingest_tool_calls([message]), (ToolCall("c", "f", None),))

    def test_malformed_calls_dropped(self) -> None:
        """A call whose id or function.name is missing or empty is dropped."""
        message = {
            "role": "assistant",
            "tool_calls": [
                {"function": {"name": "f"}},
                {"id": "", "function": {"name": "f"}},
                {"id": "x", "function": {}},
                {"id": "y", "function": {"name": ""}},
                {"id": 7, "function": {"name": "f"}},
                {"id": "z", "function": "f"},
                "junk",
                {"id": "ok", "function": {"name": "g"}},
            ],
        }
        self.assertEqual(ingest_tool_calls([message]), (ToolCall("ok", "g", None),))

    def test_result_attached(self) -> None:
        """A tool message attaches its content to the call with the same id."""
        calls = ingest_tool_calls(
            [calling(("c1", "a", "{}"), ("c2", "b", "{}")), result("c2", "42")]
        )
        self.assertEqual([c.result for c in calls], [None, "42"])

    def test_non_string_result(self) -> None:
        """A tool message whose content is not a string gives the result ""."""
        calls = ingest_tool_calls([calling(("c", "a", "{}")), result("c", [{"type": "text"}])])
        self.assertEqual(calls[0].result, "")

    def test_result_without_id_ignored(self) -> None:
        """A tool message with a missing or empty tool_call_id is ignored."""
        history = [
            calling(("c", "a", "{}")),
            {"role": "tool", "content": "x"},
            result("", "y"),
            result("other", "z"),
        ]
        self.assertIsNone(ingest_tool_calls(history)[0].result)

    def test_first_pending_call(self) -> None:
        """Repeated ids: each result goes to the first call with that id still pending."""
        history = [
            calling(("c", "a", "1")),
            result("c", "r1"),
            calling(("c", "a", "2")),
            result("c", "r2"),
        ]
        self.assertEqual([c.result for c in ingest_tool_calls(history)], ["r1", "r2"])

    def test_tool_calls_not_array(self) -> None:
        """An assistant message whose tool_calls is not an array adds nothing."""
        message = {"role": "assistant", "tool_calls": {"id": "c"}}
        self.assertEqual(ingest_tool_calls([message]), ())


class ClassifyTests(SynchronousTestCase):
    """C{classify}: scan back to the first tool or assistant message."""

    def test_table(self) -> None:
        """Fresh and tool-result turns of the reference."""
        call = calling(("c", "f", "{}"))
        cases = [
            ([], TurnKind.FRESH),
            ([user("hi")], TurnKind.FRESH),
            ([user("q"), call, result("c", "r")], TurnKind.TOOL_RESULT),
            ([user("q"), call, result("c", "r"), user("Go on.")], TurnKind.TOOL_RESULT),
            ([user("q"), call, result("c", "r"), assistant("done")], TurnKind.FRESH),
            ([user("q"), call, result("c", "r"), assistant("a"), user("more")], TurnKind.FRESH),
            ([{"role": "system", "content": "s"}, user("q")], TurnKind.FRESH),
        ]
        for messages, kind in cases:
            self.assertEqual(classify(messages), kind, messages)

    def test_other_roles_skipped(self) -> None:
        """System messages, missing roles and non-objects are skipped by the scan."""
        history = [result("c", "r"), {"role": "system"}, {"content": "x"}, "junk", user("u")]
        self.assertEqual(classify(history), TurnKind.TOOL_RESULT)

    def test_orphan_tool(self) -> None:
        """Classification does not check that the tool message answers a known call."""
        self.assertEqual(classify([user("q"), result("nobody", "r")]), TurnKind.TOOL_RESULT)

    def test_assistant_stops(self) -> None:
        """An assistant message stops the scan even with a tool result before it."""
        self.assertEqual(classify([result("c", "r"), assistant("x")]), TurnKind.FRESH)


class DerivedTests(SynchronousTestCase):
    """has_tools, allowed_tools, last_user_text and system_prompt."""

    def test_has_tools(self) -> None:
        """has_tools is true only for a non-empty tools array."""
        tool = {"type": "function", "function": {"name": "f"}}
        self.assertTrue(read_turn({"tools": [tool]}).has_tools)
        self.assertFalse(read_turn({"tools": []}).has_tools)
        self.assertFalse(read_turn({}).has_tools)
        self.assertFalse(read_turn({"tools": {"0": tool}}).has_tools)

    def test_allowed_tools(self) -> None:
        """allowed_tools is tools[*].function.name, entries without a string name skipped."""
        tools = [
            {"function": {"name": "a"}},
            {"function": {}},
            {"name": "top-level"},
            "junk",
            {"function": {"name": 5}},
            {"function": {"name": "b"}},
        ]
        self.assertEqual(read_turn({"tools": tools}).allowed_tools, ("a", "b"))

    def test_last_user_string(self) -> None:
        """The last user message's string content, not an earlier one."""
        self.assertEqual(last_user_text([user("first"), assistant("x"), user("second")]), "second")

    def test_last_user_multipart(self) -> None:
        """A content array contributes its text parts joined with a newline."""
        content = [
            {"type": "text", "text": "a"},
            {"type": "image_url", "image_url": {"url": "x"}},
            {"type": "text", "text": "b"},
            {"type": "text", "text": 3},
        ]
        self.assertEqual(last_user_text([user(content)]), "a\nb")

    def test_last_user_otherwise_empty(self) -> None:
        """No user message, no text parts, or another content: ""."""
        self.assertEqual(last_user_text([]), "")
        self.assertEqual(last_user_text([user([{"type": "image_url"}])]), "")
        self.assertEqual(last_user_text([user(None)]), "")
        self.assertEqual(last_user_text([user("x"), user(42)]), "")

    def test_system_prompt(self) -> None:
        """The first system message's content if it is a string, else None."""
        s1 = {"role": "system", "content": "one"}
        s2 = {"role": "system", "content": "two"}
        self.assertEqual(system_prompt([user("u"), s1, s2]), "one")
        self.assertIsNone(system_prompt([{"role": "system", "content": [1]}, s2]))
        self.assertIsNone(system_prompt([user("u")]))

    def test_read_turn(self) -> None:
        """read_turn gathers the kind, messages, tools, calls and texts."""
        tools = [{"type": "function", "function": {"name": "f"}}]
        messages = [
            {"role": "system", "content": "sys"},
            user("q"),
            calling(("c", "f", "{}")),
            result("c", "r"),
        ]
        turn = read_turn({"model": "mesh", "messages": messages, "tools": tools})
        self.assertEqual(turn.kind, TurnKind.TOOL_RESULT)
        self.assertEqual(turn.messages, tuple(messages))
        self.assertEqual(turn.tools, tuple(tools))
        self.assertEqual(turn.tool_calls, (ToolCall("c", "f", "{}", "r"),))
        self.assertEqual(turn.last_user_text, "q")
        self.assertEqual(turn.system_prompt, "sys")

    def test_empty_messages_fresh(self) -> None:
        """Missing, non-array or empty messages make a Fresh turn with empty user text."""
        bodies: list[Any] = [{}, {"messages": "hi"}, {"messages": []}, [], None, "x"]
        for body in bodies:
            turn = read_turn(body)
            self.assertEqual(
                (turn.kind, turn.messages, turn.last_user_text), (TurnKind.FRESH, (), "")
            )

    @given(
        st.fixed_dictionaries(
            {},
            optional={
                "messages": st.lists(message_like, max_size=8) | json_values,
                "tools": json_values,
            },
        )
    )
    def test_never_raises(self, body: dict[str, Any]) -> None:
        """Any JSON body reads into a turn whose values have their declared types."""
        turn = read_turn(body)
        self.assertIsInstance(turn.kind, TurnKind)
        self.assertIsInstance(turn.last_user_text, str)
        self.assertTrue(all(isinstance(n, str) for n in turn.allowed_tools))
        for call in turn.tool_calls:
            self.assertTrue(call.call_id and call.name)
        self.assertIsNone(detect_tool_loop(turn.tool_calls, threshold=100))


class ToolLoopTests(SynchronousTestCase):
    """C{detect_tool_loop}: three identical completed calls in a row (v2)."""

    def history(self, *calls: tuple[str, Any], pending: bool = False) -> list[dict[str, Any]]:
        """A history of completed calls (name, arguments), the last one pending if asked."""
        messages: list[dict[str, Any]] = [user("go")]
        for i, (name, arguments) in enumerate(calls):
            messages.append(calling((f"c{i}", name, arguments)))
            if not (pending and i == len(calls) - 1):
                messages.append(result(f"c{i}", "out"))
        return messages

    def loop(self, *calls: tuple[str, Any], pending: bool = False) -> ToolLoop | None:
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

    def test_object_arguments(self) -> None:
        """Arguments sent as objects compare as JSON, key order aside."""
        calls = [("ls", {"a": 1, "b": [True]}), ("ls", {"b": [True], "a": 1.0})] * 2
        self.assertEqual(self.loop(*calls), ToolLoop("ls", 4))

    def test_pending_call_not_counted(self) -> None:
        """Only completed calls count: a pending fourth call does not break the run."""
        calls = [("ls", "{}")] * 3 + [("cat", "{}")]
        self.assertEqual(self.loop(*calls, pending=True), ToolLoop("ls", 3))

    def test_json_equal(self) -> None:
        """JSON equality: true is not 1, 1 is 1.0, objects ignore key order, arrays do not."""
        self.assertFalse(json_equal(True, 1))
        self.assertFalse(json_equal(0, False))
        self.assertTrue(json_equal(1, 1.0))
        self.assertTrue(json_equal({"a": 1, "b": 2}, {"b": 2, "a": 1}))
        self.assertFalse(json_equal([1, 2], [2, 1]))
        self.assertFalse(json_equal("1", 1))
        self.assertTrue(json_equal(None, None))

    @given(json_values)
    def test_json_equal_reflexive(self, value: Any) -> None:
        """Every JSON value (no NaN) equals itself."""
        self.assertTrue(json_equal(value, value))
