"""
Tests for L{loopd.moa.normalize}: the mesh normalizer of reference/mesh-moa.md §1.9 (the JSON
and line envelopes, the heuristics, the tool guard and the sanitizer) and the properties that
it never raises and always returns a valid outcome. The parts (thinking, reply extraction,
rescue, the outcome value) are tested in L{loopd.test.test_moa_normalize_parts}.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.moa.normalize import (
    ERROR_EMPTY,
    enforce_allowed_tools,
    normalize_reply,
    normalize_text,
)
from loopd.moa.normalize_heuristics import ACTION_PHRASES, CRITIQUE_MARKERS, KNOWN_TOOLS
from loopd.moa.normalize_json import extract_json_object
from loopd.moa.normalize_kv import strip_kv_envelope
from loopd.moa.normalize_think import strip_thinking
from loopd.moa.outcome import Kind, Outcome, Rule

A, T, C, U, E = Kind.ANSWER, Kind.TOOL_PROPOSAL, Kind.CRITIQUE, Kind.UNCERTAINTY, Kind.EMPTY


def reply(content: Any = None, finish: str | None = "stop", **message: Any) -> dict[str, Any]:
    """A chat completion body with one choice."""
    return {"choices": [{"message": {"content": content, **message}, "finish_reason": finish}]}


def native(name: Any, arguments: Any) -> dict[str, Any]:
    """A native tool_calls entry."""
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


class Checks:
    """Table helpers shared by the test cases."""

    def assertOutcome(  # noqa: N802 (an assertion helper, named as trial's are)
        self: Any, text: str, kind: Kind, payload: str | None = None, **fields: Any
    ) -> Outcome:
        """Assert that C{text} normalizes to C{kind}, C{payload} and C{fields}."""
        outcome = normalize_text(text)
        self.assertEqual(outcome.kind, kind, text)
        if payload is not None:
            self.assertEqual(outcome.text, payload, text)
        for name, value in fields.items():
            self.assertEqual(getattr(outcome, name), value, f"{name} of {text!r}")
        return outcome


class JsonEnvelopeTests(SynchronousTestCase, Checks):
    """§1.9 step 1: the JSON object in the text."""

    def test_where_found(self) -> None:
        """The whole text, a fenced block (json label stripped), or a balanced span in prose."""
        for text in [
            ' {"kind":"answer","payload":"Paris"} ',
            'Here:\n```json\n{"kind":"answer","payload":"Paris"}\n```',
            'Sure. {"kind":"answer","payload":"Paris"} Done.',
            'see {this} then {"kind":"answer","payload":"Paris"}',
        ]:
            self.assertOutcome(text, A, "Paris", rule=Rule.JSON_ENVELOPE)

    def test_brace_counter_ignores_strings(self) -> None:
        """Step 1c counts braces inside strings, so such an object in prose is not found."""
        self.assertIsNone(extract_json_object('note {"payload":"a}b"}'))
        self.assertEqual(extract_json_object('{"payload":"a}b"}'), {"payload": "a}b"})

    def test_strict_json(self) -> None:
        """NaN and Infinity are not JSON."""
        self.assertIsNone(extract_json_object('{"kind":"answer","confidence":NaN}'))

    def test_inline_tool_json(self) -> None:
        """No kind, a name and arguments: a tool proposal, confidence 0.75, the text as payload."""
        for text in [
            '{"function":{"name":"read_file","arguments":"{\\"path\\":\\"a\\"}"}}',
            '{"name":"read_file","arguments":{"path":"a"}}',
            '{"function":"read_file","arguments":{"path":"a"}}',
            '{"tool":"read_file","arguments":{"path":"a"}}',
            '{"function":{"name":"read_file"},"arguments":{"path":"a"}}',
        ]:
            self.assertOutcome(
                text,
                T,
                text,
                tool_name="read_file",
                tool_arguments={"path": "a"},
                confidence=0.75,
                rule=Rule.INLINE_TOOL_JSON,
            )

    def test_inline_tool_needs_arguments(self) -> None:
        """Without an arguments key the object is no inline tool call."""
        self.assertOutcome('{"name":"lookup"}', A, '{"name":"lookup"}', rule=Rule.PLAIN)

    def test_envelope_kinds(self) -> None:
        """kind answer, tool_proposal, critique, uncertainty; any other value is no envelope."""
        for value, kind in [
            ("answer", A),
            ("tool_proposal", T),
            ("critique", C),
            ("uncertainty", U),
        ]:
            self.assertOutcome(f'{{"kind":"{value}","payload":"p"}}', kind, "p")
        self.assertOutcome('{"kind":"chat","payload":"p"}', A, '{"kind":"chat","payload":"p"}')

    def test_envelope_fields(self) -> None:
        """confidence (default 0.5), tool, arguments normalized, payload (else the text)."""
        self.assertOutcome(
            '{"kind":"tool_proposal","tool":"f","arguments":"{\\"a\\":1}","confidence":0.8}',
            T,
            tool_name="f",
            tool_arguments={"a": 1},
            confidence=0.8,
        )
        self.assertOutcome('{"kind":"answer","confidence":"high"}', A, confidence=0.5)
        text = '{"kind":"answer"}'
        self.assertOutcome(text, A, text)

    def test_envelope_arguments(self) -> None:
        """Arguments: null and non-objects become {}, none given stays None."""
        for raw, expected in [("null", {}), ("[1]", {}), ('"x"', {}), ('{"a":1}', {"a": 1})]:
            text = f'{{"kind":"tool_proposal","tool":"f","arguments":{raw}}}'
            self.assertOutcome(text, T, tool_arguments=expected)
        self.assertOutcome('{"kind":"tool_proposal","tool":"f"}', T, tool_arguments=None)

    def test_only_proposals_carry_tools(self) -> None:
        """An answer envelope naming a tool stays an answer, without the tool."""
        self.assertOutcome('{"kind":"answer","tool":"f","payload":"p"}', A, "p", tool_name=None)


class KvEnvelopeTests(SynchronousTestCase, Checks):
    """§1.9 step 2: the kind: line envelope."""

    def test_kinds(self) -> None:
        """kind: values, quotes trimmed; an unknown value is an answer."""
        for value, kind in [
            ("answer", A),
            ('"tool_proposal"', T),
            ("'critique'", C),
            ("uncertainty", U),
            ("Answer!", A),
        ]:
            self.assertOutcome(f"kind: {value}\npayload: p", kind, "p", rule=Rule.KV_ENVELOPE)

    def test_confidence(self) -> None:
        """confidence: is a float; NaN and infinities are clamped to 0.5; missing is 0.5."""
        cases = [("0.8", 0.8), ("1e-1", 0.1), ("NaN", 0.5), ("inf", 0.5), ("-Infinity", 0.5)]
        for value, expected in cases + [("high", 0.5), ("1_0", 0.5)]:
            self.assertOutcome(
                f"kind: answer\nconfidence: {value}\npayload: p", A, confidence=expected
            )
        self.assertOutcome("kind: answer\npayload: p", A, confidence=0.5)

    def test_tool(self) -> None:
        """tool: names a tool (not empty, null, none); a named tool makes an answer a proposal."""
        self.assertOutcome(
            "kind: answer\ntool: read_file\npayload: p", T, "p", tool_name="read_file"
        )
        for value in ["", "null", "none", "None"]:
            self.assertOutcome(f"kind: answer\ntool: {value}\npayload: p", A, "p")
        self.assertOutcome("kind: tool_proposal\ntool: none\npayload: p", T, tool_name=None)

    def test_arguments(self) -> None:
        """arguments: is JSON; an object stays, another value is {}, non-JSON text is none."""
        for value, expected in [('{"path": "a"}', {"path": "a"}), ("[1, 2]", {}), ("{path", None)]:
            text = f"kind: tool_proposal\ntool: f\narguments: {value}\npayload: p"
            self.assertOutcome(text, T, tool_arguments=expected)

    def test_payload_takes_following_lines(self) -> None:
        """payload: is the rest of its line plus every following line, verbatim (keys included)."""
        text = "kind: answer\npayload: first\n  second\nkind: critique"
        self.assertOutcome(text, A, "first\n  second\nkind: critique")

    def test_kind_required(self) -> None:
        """Without a kind: line there is no envelope."""
        self.assertOutcome(
            "confidence: 0.9\npayload: Paris", A, "Paris", confidence=0.5, rule=Rule.PLAIN
        )

    def test_keys_exact_at_line_start(self) -> None:
        """Keys are case-sensitive and must start a trimmed line."""
        self.assertOutcome("Kind: answer\nPayload: p", A, rule=Rule.PLAIN)
        self.assertOutcome("my kind: answer", A, rule=Rule.PLAIN)
        self.assertOutcome("   kind: critique\n   payload: p", C, "p")

    def test_fallback_payload(self) -> None:
        """No payload: the last non-empty line before the first key line."""
        self.assertOutcome("Intro.\nParis.\n\nkind: answer\nconfidence: 0.9", A, "Paris.")

    def test_fallback_without_key_lines(self) -> None:
        """No payload and nothing before the keys: the text without its key lines (not verbatim)."""
        self.assertOutcome("kind: answer\nconfidence: 0.9\nParis", A, "Paris", confidence=0.9)

    def test_order(self) -> None:
        """A JSON envelope beats the line envelope, which beats the heuristics."""
        self.assertOutcome('kind: answer\n{"kind":"critique","payload":"x"}', C, "x")
        self.assertOutcome("kind: answer\npayload: I'm not sure", A, "I'm not sure")


class HeuristicTests(SynchronousTestCase, Checks):
    """§1.9 step 3.2-3.5: prose tool proposals, critique, uncertainty, plain answer."""

    def test_structured_markers(self) -> None:
        """tool_call, function_call, i would call, i propose calling, tool_proposal: 0.6."""
        for text in [
            "Emit a TOOL_CALL here",
            "a function_call is needed",
            "I would call the lookup",
            "I propose calling lookup",
            "this is a tool_proposal",
        ]:
            self.assertOutcome(
                text, T, text, confidence=0.6, rule=Rule.TOOL_HEURISTIC, tool_name=None
            )

    def test_would_not(self) -> None:
        """A structured marker does not count when the text says "i would not"."""
        self.assertOutcome("I would not make a tool_call.", A)

    def test_known_tool_and_action(self) -> None:
        """A known tool plus an action phrase is a proposal; either alone is not."""
        self.assertOutcome(
            "I'll use read_file on it", T, tool_name="read_file", tool_arguments=None
        )
        for tool in KNOWN_TOOLS:
            self.assertOutcome(f"I will use {tool}", T, tool_name=tool)
        for phrase in ACTION_PHRASES:
            self.assertOutcome(f"{phrase} run_command", T, tool_name="run_command")
        self.assertOutcome("Let me use get_weather, then list_files", T, tool_name="get_weather")
        self.assertOutcome("read_file reads files", A)
        self.assertOutcome("I'll use my judgement", A)

    def test_proposal_parts(self) -> None:
        """Name and arguments: a JSON tool shape, else a known tool with the first object."""
        self.assertOutcome(
            'I propose calling {"name": "lookup"}', T, tool_name="lookup", tool_arguments=None
        )
        self.assertOutcome(
            'Calling read_file with {"path": "a"}',
            T,
            tool_name="read_file",
            tool_arguments={"path": "a"},
        )

    def test_critique(self) -> None:
        """Two critique markers are a critique at 0.5; "But actually," alone is two."""
        self.assertOutcome("However, that's incorrect: 5.", C, confidence=0.5, rule=Rule.CRITIQUE)
        self.assertOutcome("But actually, it is 5.", C)
        self.assertOutcome("However, it is 5.", A)
        for marker in CRITIQUE_MARKERS:
            other = "correction:" if marker == "i disagree" else "I disagree"
            self.assertOutcome(f"{marker} {other}", C)

    def test_uncertainty(self) -> None:
        """Any uncertainty marker (ASCII apostrophes) is an uncertainty at 0.3."""
        for text in [
            "I'm not sure.",
            "I don't know",
            "Uncertain",
            "hard to say",
            "It depends.",
            "I cannot determine that",
            "insufficient information",
        ]:
            self.assertOutcome(text, U, confidence=0.3, rule=Rule.UNCERTAINTY)
        self.assertOutcome("I\u2019m not sure", A)

    def test_order(self) -> None:
        """The rescue beats the prose checks, a tool proposal beats a critique beats uncertainty."""
        self.assertOutcome('I\'m not sure: read_file({"path": "a"})', T, rule=Rule.RESCUE)
        self.assertOutcome("However, actually, I'll use read_file", T)
        self.assertOutcome("However, actually, I'm not sure", C)

    def test_plain_answer(self) -> None:
        """Otherwise an answer at 0.5, thinking and key lines stripped."""
        self.assertOutcome(
            "<think>x</think>confidence: 0.9\nParis </think>", A, "Paris", confidence=0.5
        )

    def test_empty_answer(self) -> None:
        """An answer with no text left is empty, a failure, never an empty answer."""
        for text in ["", "   ", "</think>"]:
            outcome = self.assertOutcome(text, E, "", error=ERROR_EMPTY)
            self.assertTrue(outcome.failed)

    def test_strip_kv_envelope(self) -> None:
        """Key lines go; a non-empty payload block wins; nothing left gives the text back."""
        cases = [
            ("kind: x\nconfidence: 1\nParis\ntool: t\narguments: {}", "Paris"),
            ("Intro\npayload: Paris\nis big", "Paris\nis big"),
            ("Intro\nkind: x\npayload:", "Intro"),
            ("kind: x\ntool: t", "kind: x\ntool: t"),
        ]
        for text, expected in cases:
            self.assertEqual(strip_kv_envelope(text), expected, text)


class GuardTests(SynchronousTestCase, Checks):
    """§1.9 enforce_allowed_tools and the sanitizer."""

    def test_undeclared_tool_demoted(self) -> None:
        """A proposal of an undeclared tool: uncertainty, confidence 0.0, no tool, payload kept."""
        outcome = normalize_reply(reply(tool_calls=[native("rm_rf", "{}")]), allowed_tools=["ls"])
        self.assertEqual(
            (outcome.kind, outcome.confidence, outcome.tool_name, outcome.tool_arguments),
            (U, 0.0, None, None),
        )
        self.assertEqual((outcome.text, outcome.demoted_tool), ("calling rm_rf", "rm_rf"))

    def test_declared_tool_kept(self) -> None:
        """A declared tool passes; with no tools declared nothing is filtered."""
        text = '{"name":"ls","arguments":{}}'
        self.assertEqual(normalize_text(text, allowed_tools={"ls"}).tool_name, "ls")
        self.assertEqual(normalize_text(text.replace("ls", "rm")).tool_name, "rm")

    def test_unnamed_and_other_kinds_untouched(self) -> None:
        """Only named proposals are checked."""
        for text in ["I would call something", "Paris"]:
            self.assertEqual(normalize_text(text, allowed_tools=["ls"]), normalize_text(text))

    def test_enforce_directly(self) -> None:
        """The filter is a function of its own, for the reducer's output too."""
        outcome = Outcome(T, "p", 0.9, tool_name="f", tool_arguments={"a": 1})
        self.assertIs(enforce_allowed_tools(outcome, ()), outcome)
        self.assertEqual(enforce_allowed_tools(outcome, ["g"]).kind, U)

    def test_confidence_sanitized(self) -> None:
        """Non-finite or non-numeric confidence, or one too large for a float, is 0.5."""
        for value in [math.nan, math.inf, -math.inf, 10**400, True, "0.9", None]:
            self.assertEqual(Outcome(A, "x", value).confidence, 0.5, value)  # type: ignore[arg-type]
        self.assertEqual(Outcome(A, "x", 3).confidence, 3.0)
        self.assertOutcome(
            '{"kind":"answer","payload":"p","confidence":1' + "0" * 400 + "}", A, confidence=0.5
        )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "choices",
                    "message",
                    "content",
                    "tool_calls",
                    "function",
                    "name",
                    "arguments",
                    "reasoning",
                    "reasoning_content",
                    "finish_reason",
                    "type",
                    "text",
                    "kind",
                    "payload",
                ]
            )
            | st.text(max_size=5),
            inner,
            max_size=5,
        )
    ),
    max_leaves=20,
)

# Pieces of every shape the normalizer knows, so generated texts reach every rule.
fragments = st.sampled_from(
    """kind: |answer|tool_proposal|critique|uncertainty|\n|tool: |arguments: |payload: |
    confidence: |NaN|0.7|{|}|[|]|"|\\|:|,|```|json|"name"|"arguments"|"kind"|
    "tool_calls"|"function"|null|<think>|</think>|[THINK]|[/THINK]|[ARGS]|(|)|<function=|
    <parameter=|</parameter>|</function>|
    <tool_call>|</tool_call>|read_file|I'll use|however,|actually,|I'm not sure|
    {"kind":"answer","payload":"p"}|{"kind":"tool_proposal","tool":"f","arguments":{"a":1}}|
    {"name":"f","arguments":{"a":1}}|{"tool_calls":[{"function":{"name":"f","arguments":"{}"}}]}|
    f[ARGS]{"a":1}|f({"a":1})|<function=f><parameter=a>1</parameter></function>""".replace(
        "\n    ", ""
    ).split("|")
)
texts = st.text() | st.lists(fragments | st.text(max_size=4), max_size=30).map("".join)


class PropertyTests(SynchronousTestCase):
    """normalize never raises and always returns a valid outcome."""

    def check(self, outcome: Outcome, allowed: list[str]) -> None:
        """Assert the invariants of a normalized outcome."""
        self.assertIsInstance(outcome.kind, Kind)
        self.assertIsInstance(outcome.text, str)
        self.assertTrue(math.isfinite(outcome.confidence))
        json.loads(outcome.arguments_json())
        if outcome.kind is not T:
            self.assertIsNone(outcome.tool_name)
            self.assertIsNone(outcome.tool_arguments)
        elif allowed and outcome.tool_name is not None:
            self.assertIn(outcome.tool_name, allowed)
        self.assertEqual(outcome.failed, outcome.kind is E or outcome.reasoning_only)
        if outcome.kind is E:
            self.assertEqual(outcome.text, "")
            self.assertIsNotNone(outcome.error)
        if outcome.kind is A:
            self.assertTrue(outcome.text.strip())
        if outcome.demoted_tool is not None:
            self.assertEqual((outcome.kind, outcome.confidence), (U, 0.0))

    @given(texts, st.lists(st.sampled_from(["read_file", "f", "lookup"]), max_size=2))
    def test_any_text(self, text: str, allowed: list[str]) -> None:
        """Any text normalizes to a valid outcome."""
        self.check(normalize_text(text, allowed_tools=allowed), allowed)

    @given(json_values)
    def test_any_json(self, body: object) -> None:
        """Any JSON value as a reply body normalizes to a valid outcome."""
        self.check(normalize_reply(body), [])

    @given(json_values | texts, json_values, st.sampled_from([None, "stop", "length", 3]))
    def test_reply_shaped(self, content: object, calls: object, finish: object) -> None:
        """Reply-shaped bodies with any content, tool calls and finish reason are valid."""
        body = {
            "choices": [
                {"message": {"content": content, "tool_calls": calls}, "finish_reason": finish}
            ]
        }
        outcome = normalize_reply(body, allowed_tools=["read_file"])
        self.check(outcome, ["read_file"])
        self.assertEqual(outcome.truncated, finish == "length")

    @given(st.text().filter(lambda t: "think>" not in t and "THINK]" not in t))
    def test_strip_without_tags(self, text: str) -> None:
        """Text without think tags is only trimmed."""
        self.assertEqual(strip_thinking(text), text.strip())
