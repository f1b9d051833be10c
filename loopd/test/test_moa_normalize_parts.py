"""
Tests for the parts of the mesh normalizer (L{loopd.moa.normalize_think},
L{loopd.moa.normalize_reply}, L{loopd.moa.normalize_rescue}) and its value,
L{loopd.moa.outcome.Outcome}: reference/mesh-moa.md §1.8 and §1.9 step 0 and step 3.1.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from loopd.moa.normalize import (
    ERROR_EMPTY,
    ERROR_MALFORMED,
    ERROR_REASONING_ONLY,
    normalize_reply,
    normalize_text,
)
from loopd.moa.normalize_json import balanced_spans
from loopd.moa.normalize_rescue import SCAN_LIMIT, rescue_tool_call
from loopd.moa.normalize_think import extract_thinking, strip_thinking
from loopd.moa.outcome import Kind, Outcome, Rule
from loopd.test.test_moa_normalize import Checks, native, reply

A, T, C, U, E = Kind.ANSWER, Kind.TOOL_PROPOSAL, Kind.CRITIQUE, Kind.UNCERTAINTY, Kind.EMPTY


class ThinkingTests(SynchronousTestCase):
    """§1.8 strip_thinking and §1.9 step 0: think tags go, in both styles."""

    def test_strip_table(self) -> None:
        """Blocks go, an unclosed opener drops the rest, orphan closers go, the rest is trimmed."""
        cases = [
            ("<think>plan</think> Paris", "Paris"),
            ("a<think>1</think>b<think>2</think>c", "abc"),
            ("Paris <think>and then", "Paris"),
            ("stray</think> Paris", "stray Paris"),
            ("[THINK]plan[/THINK]Paris", "Paris"),
            ("Paris [THINK]unclosed", "Paris"),
            ("<think>mixed[/THINK] still thinking", ""),
            ("  plain  ", "plain"),
        ]
        for text, expected in cases:
            self.assertEqual(strip_thinking(text), expected, text)

    def test_extract(self) -> None:
        """The thinking is the text inside the blocks, an unclosed one to the end."""
        self.assertEqual(extract_thinking("<think> a </think>x"), "a")
        self.assertEqual(extract_thinking("x<think>rest"), "rest")
        self.assertEqual(extract_thinking("none"), "")

    def test_text_all_thinking_is_reasoning_only(self) -> None:
        """v2: a text with nothing but thinking is a failed reasoning-only reply, unclassified."""
        outcome = normalize_text("<think>I'm not sure, I'll use read_file</think>")
        self.assertEqual((outcome.kind, outcome.text, outcome.error), (E, "", ERROR_REASONING_ONLY))
        self.assertTrue(outcome.reasoning_only and outcome.failed)

    def test_stripped_before_parsing(self) -> None:
        """The pre-clean runs before the JSON step: thinking does not hide an envelope."""
        outcome = normalize_text('<think>{"x":1}</think>{"kind":"critique","payload":"no"}')
        self.assertEqual((outcome.kind, outcome.text), (C, "no"))


class ReplyExtractionTests(SynchronousTestCase):
    """§1.8 text extraction from a backend reply, with v2's reasoning-only rule."""

    def test_missing_message(self) -> None:
        """No choices[0].message (also choices: [] and any non-object) is a malformed reply."""
        for body in [
            {},
            {"choices": []},
            {"choices": [{}]},
            {"choices": [{"message": "x"}]},
            [],
            3,
        ]:
            outcome = normalize_reply(body)
            self.assertEqual((outcome.kind, outcome.error), (E, ERROR_MALFORMED), body)
            self.assertTrue(outcome.failed)

    def test_native_tool_call(self) -> None:
        """The first native call is a tool proposal, confidence 0.9, payload "calling NAME"."""
        body = reply(tool_calls=[native("read_file", '{"path":"a"}'), native("x", "{}")])
        outcome = normalize_reply(body, worker="w1", role="fast", elapsed_ms=12.0)
        self.assertEqual(
            (outcome.kind, outcome.tool_name, outcome.tool_arguments, outcome.confidence),
            (T, "read_file", {"path": "a"}, 0.9),
        )
        self.assertEqual((outcome.text, outcome.rule), ("calling read_file", Rule.NATIVE_TOOL_CALL))
        self.assertEqual((outcome.worker, outcome.role, outcome.elapsed_ms), ("w1", "fast", 12.0))

    def test_native_tool_call_defaults(self) -> None:
        """A call without a name is "unknown"; arguments that are not an object are {}."""
        cases = [
            (native(None, '{"a":1}'), "unknown", {"a": 1}),
            ({"id": "c"}, "unknown", {}),
            (native("f", 7), "f", {}),
            (native("f", "not json"), "f", {}),
            (native("f", "[1]"), "f", {}),
        ]
        for call, name, arguments in cases:
            outcome = normalize_reply(reply(tool_calls=[call]))
            self.assertEqual((outcome.tool_name, outcome.tool_arguments), (name, arguments), call)

    def test_native_arguments_kept_whole(self) -> None:
        """Arguments spanning lines, or given as an object, survive (v1's line text lost them)."""
        for arguments in ['{\n  "path": "a"\n}', {"path": "a"}]:
            outcome = normalize_reply(reply(tool_calls=[native("read_file", arguments)]))
            self.assertEqual(outcome.tool_arguments, {"path": "a"})

    def test_tool_call_beats_content(self) -> None:
        """With native tool calls the content is not read."""
        outcome = normalize_reply(reply("The answer is 4", tool_calls=[native("f", "{}")]))
        self.assertEqual(outcome.kind, T)

    def test_content(self) -> None:
        """The content, thinking stripped, is normalized; an empty tool_calls list is no call."""
        outcome = normalize_reply(reply("<think>hm</think>Paris", tool_calls=[]))
        self.assertEqual((outcome.kind, outcome.text), (A, "Paris"))

    def test_content_parts(self) -> None:
        """Content given as text parts is joined."""
        parts = [
            {"type": "text", "text": "Par"},
            {"type": "image_url"},
            {"type": "text", "text": "is"},
        ]
        self.assertEqual(normalize_reply(reply(parts)).text, "Paris")

    def test_reasoning_only(self) -> None:
        """v2: reasoning in think tags, reasoning_content or reasoning alone is a failed reply."""
        for body in [
            reply("<think>Paris, probably</think>"),
            reply("", reasoning_content="Paris, probably"),
            reply(None, reasoning="Paris, probably"),
        ]:
            outcome = normalize_reply(body)
            self.assertEqual(
                (outcome.kind, outcome.text, outcome.error), (E, "", ERROR_REASONING_ONLY)
            )
            self.assertTrue(outcome.reasoning_only and outcome.failed and not outcome.verbatim_ok)

    def test_empty(self) -> None:
        """No content, no tool call and no reasoning is an empty reply."""
        for body in [reply(None), reply("   "), reply("<think></think>")]:
            outcome = normalize_reply(body)
            self.assertEqual(
                (outcome.kind, outcome.error, outcome.reasoning_only), (E, ERROR_EMPTY, False)
            )

    def test_truncated(self) -> None:
        """v2: finish_reason "length" is flagged: classified, but not shippable verbatim."""
        outcome = normalize_reply(reply("Paris is", finish="length"))
        self.assertEqual((outcome.kind, outcome.finish_reason), (A, "length"))
        self.assertTrue(outcome.truncated)
        self.assertFalse(outcome.failed or outcome.verbatim_ok)
        self.assertTrue(normalize_reply(reply("Paris")).verbatim_ok)

    def test_truncated_reasoning(self) -> None:
        """A budget spent thinking is both truncated and reasoning-only."""
        outcome = normalize_reply(reply("<think>long", finish="length"))
        self.assertTrue(outcome.truncated and outcome.reasoning_only)


class RescueTests(SynchronousTestCase, Checks):
    """§1.9 step 3.1: the guardrail rescue of tool calls written in text."""

    def test_shapes(self) -> None:
        """JSON (array, tool_calls, one call), [ARGS], name(...), Qwen XML and Granite calls."""
        cases = [
            ('[{"name":"f","arguments":{"a":1}}, {"name":"g","arguments":{}}]', "f", {"a": 1}),
            ('{"tool_calls":[{"function":{"name":"f","arguments":"{\\"a\\":1}"}}]}', "f", {"a": 1}),
            ('```\n{"name":"f","arguments":{"a":1}}\n```', "f", {"a": 1}),
            ('text {"x": "}"} {"name":"f","arguments":{"a":1}}', "f", {"a": 1}),
            ('[TOOL_CALLS]f[ARGS]{"a": 1}', "f", {"a": 1}),
            ('I call f({"a": 1}) now', "f", {"a": 1}),
            (
                "<function=f>\n<parameter=a>\n1\n</parameter>\n"
                "<parameter=b>\nx y\n</parameter>\n</function>",
                "f",
                {"a": 1, "b": "x y"},
            ),
            ('<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>', "f", {"a": 1}),
        ]
        for text, name, arguments in cases:
            self.assertEqual(rescue_tool_call(text), (name, arguments), text)

    def test_argument_rules(self) -> None:
        """String arguments must hold an object, null is invalid, other primitives become {}."""
        call = '{{"name":"f","arguments":{}}}'
        self.assertIsNone(rescue_tool_call(call.format('"[1]"')))
        self.assertIsNone(rescue_tool_call(call.format("null")))
        self.assertIsNone(rescue_tool_call('{"name":"f"}'))
        self.assertEqual(rescue_tool_call(call.format("3")), ("f", {}))

    def test_classified(self) -> None:
        """A rescued call is a tool proposal, confidence 0.7, payload stripped of key lines."""
        text = 'confidence: 0.2\n{"tool_calls":[{"function":{"name":"f","arguments":"{}"}}]}'
        payload = '{"tool_calls":[{"function":{"name":"f","arguments":"{}"}}]}'
        self.assertOutcome(text, T, payload, tool_name="f", confidence=0.7, rule=Rule.RESCUE)

    def test_scan_limit(self) -> None:
        """Only the first 64 KiB are scanned."""
        call = '[TOOL_CALLS]lookup[ARGS]{"q": 1}'
        self.assertEqual(rescue_tool_call("x " * 10 + call), ("lookup", {"q": 1}))
        self.assertIsNone(rescue_tool_call("x" * SCAN_LIMIT + call))

    def test_candidate_cap(self) -> None:
        """At most 32 JSON candidates (the whole text counts) are tried."""
        call = '{"tool_calls":[{"function":{"name":"lookup","arguments":"{}"}}]}'
        fillers = " ".join(f"[{i}]" for i in range(31))
        self.assertEqual(rescue_tool_call(fillers[:-5] + " " + call), ("lookup", {}))
        self.assertIsNone(rescue_tool_call(fillers + " " + call))

    def test_balanced_spans(self) -> None:
        """Spans are string-aware; a wrong closer fails the spans open around it."""
        self.assertEqual(balanced_spans('a {"b": "}"} [1, [2]] c', 32), ['{"b": "}"}', "[1, [2]]"])
        self.assertEqual(balanced_spans("{ [ } {x}", 32), ["{x}"])
        self.assertEqual(balanced_spans("[0] [1] [2]", 2), ["[0]", "[1]"])


class OutcomeTests(SynchronousTestCase):
    """The normalized value itself."""

    def test_tool_fields_only_on_proposals(self) -> None:
        """Only a tool proposal carries a tool, and its arguments are an object."""
        self.assertRaises(ValueError, Outcome, A, "x", tool_name="f")
        self.assertRaises(ValueError, Outcome, C, "x", tool_arguments={})
        self.assertRaises(ValueError, Outcome, T, "x", tool_arguments=[1])

    def test_arguments(self) -> None:
        """has_arguments means non-empty; arguments_json is compact JSON, {} for none."""
        with_args = Outcome(T, "p", tool_name="f", tool_arguments={"path": "é"})
        self.assertTrue(with_args.has_arguments)
        self.assertEqual(with_args.arguments_json(), '{"path":"é"}')
        arguments: dict[str, object] | None
        for arguments in [None, {}]:
            bare = Outcome(T, "p", tool_name="f", tool_arguments=arguments)
            self.assertFalse(bare.has_arguments)
            self.assertEqual(bare.arguments_json(), "{}")

    def test_hashable(self) -> None:
        """An outcome with arguments is hashable and compares by value."""
        first = Outcome(T, "p", tool_name="f", tool_arguments={"a": 1})
        self.assertEqual({first, Outcome(T, "p", tool_name="f", tool_arguments={"a": 1})}, {first})
