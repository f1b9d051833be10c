"""
Tests for the mesh normalizer, L{loopd.moa.normalize} and its parts (L{loopd.moa.normalize_think},
L{loopd.moa.normalize_reply}, L{loopd.moa.normalize_json}, L{loopd.moa.normalize_kv},
L{loopd.moa.normalize_heuristics}, L{loopd.moa.normalize_rescue}) and its value,
L{loopd.moa.outcome.Outcome}: reference/mesh-moa.md §1.8 and §1.9 (the thinking, the reply
extraction, the JSON and line envelopes, the heuristics, the rescue, the tool guard and the
sanitizer) and the properties that it never raises and always returns a valid outcome.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.llama.types import Completion, FinishReason, Timings, ToolCall
from loopd.moa.normalize import (
    ERROR_EMPTY,
    ERROR_REASONING_ONLY,
    enforce_allowed_tools,
    normalize_completion,
    normalize_text,
)
from loopd.moa.normalize_heuristics import ACTION_PHRASES, CRITIQUE_MARKERS, KNOWN_TOOLS
from loopd.moa.normalize_json import balanced_spans, extract_json_object
from loopd.moa.normalize_kv import strip_kv_envelope
from loopd.moa.normalize_rescue import SCAN_LIMIT, rescue_tool_call
from loopd.moa.normalize_think import extract_thinking, strip_thinking
from loopd.moa.outcome import Kind, Outcome, Rule

A, T, C, U, E = Kind.ANSWER, Kind.TOOL_PROPOSAL, Kind.CRITIQUE, Kind.UNCERTAINTY, Kind.EMPTY


def reply(
    content: str | None = None,
    finish: str = "stop",
    *,
    reasoning_content: str | None = None,
    tool_calls: tuple[ToolCall, ...] = (),
) -> Completion:
    """A finished reply, as the llama client assembles it."""
    return Completion(
        "chatcmpl-1", content, reasoning_content, tool_calls, FinishReason(finish), Timings()
    )


def native(name: str, arguments: str) -> ToolCall:
    """A native tool call."""
    return ToolCall("c1", name, arguments)


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
        outcome = normalize_completion(
            reply(tool_calls=(native("rm_rf", "{}"),)), allowed_tools=["ls"]
        )
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

    def test_native_tool_call(self) -> None:
        """The first native call is a tool proposal, confidence 0.9, payload "calling NAME"."""
        body = reply(tool_calls=(native("read_file", '{"path":"a"}'), native("x", "{}")))
        outcome = normalize_completion(body, worker="w1", role="fast", elapsed_ms=12.0)
        self.assertEqual(
            (outcome.kind, outcome.tool_name, outcome.tool_arguments, outcome.confidence),
            (T, "read_file", {"path": "a"}, 0.9),
        )
        self.assertEqual((outcome.text, outcome.rule), ("calling read_file", Rule.NATIVE_TOOL_CALL))
        self.assertEqual((outcome.worker, outcome.role, outcome.elapsed_ms), ("w1", "fast", 12.0))

    def test_native_tool_call_defaults(self) -> None:
        """A call without a name is "unknown"; arguments that are not an object are {}."""
        cases = [
            (native("", '{"a":1}'), "unknown", {"a": 1}),
            (native(" ", ""), "unknown", {}),
            (native("f", "7"), "f", {}),
            (native("f", "not json"), "f", {}),
            (native("f", "[1]"), "f", {}),
        ]
        for call, name, arguments in cases:
            outcome = normalize_completion(reply(tool_calls=(call,)))
            self.assertEqual((outcome.tool_name, outcome.tool_arguments), (name, arguments), call)

    def test_native_arguments_kept_whole(self) -> None:
        """Arguments spanning lines survive (v1's line text lost them)."""
        arguments = '{\n  "path": "a"\n}'
        outcome = normalize_completion(reply(tool_calls=(native("read_file", arguments),)))
        self.assertEqual(outcome.tool_arguments, {"path": "a"})

    def test_tool_call_beats_content(self) -> None:
        """With native tool calls the content is not read."""
        outcome = normalize_completion(reply("The answer is 4", tool_calls=(native("f", "{}"),)))
        self.assertEqual(outcome.kind, T)

    def test_content(self) -> None:
        """The content, thinking stripped, is normalized."""
        outcome = normalize_completion(reply("<think>hm</think>Paris"))
        self.assertEqual((outcome.kind, outcome.text), (A, "Paris"))

    def test_reasoning_only(self) -> None:
        """v2: reasoning in think tags or reasoning_content alone is a failed reply."""
        for body in [
            reply("<think>Paris, probably</think>"),
            reply("", reasoning_content="Paris, probably"),
            reply(None, reasoning_content="Paris, probably"),
        ]:
            outcome = normalize_completion(body)
            self.assertEqual(
                (outcome.kind, outcome.text, outcome.error), (E, "", ERROR_REASONING_ONLY)
            )
            self.assertTrue(outcome.reasoning_only and outcome.failed and not outcome.verbatim_ok)

    def test_empty(self) -> None:
        """No content, no tool call and no reasoning is an empty reply."""
        for body in [reply(None), reply("   "), reply("<think></think>")]:
            outcome = normalize_completion(body)
            self.assertEqual(
                (outcome.kind, outcome.error, outcome.reasoning_only), (E, ERROR_EMPTY, False)
            )

    def test_truncated(self) -> None:
        """v2: finish_reason "length" is flagged: classified, but not shippable verbatim."""
        outcome = normalize_completion(reply("Paris is", finish="length"))
        self.assertEqual((outcome.kind, outcome.finish_reason), (A, "length"))
        self.assertTrue(outcome.truncated)
        self.assertFalse(outcome.failed or outcome.verbatim_ok)
        self.assertTrue(normalize_completion(reply("Paris")).verbatim_ok)

    def test_truncated_reasoning(self) -> None:
        """A budget spent thinking is both truncated and reasoning-only."""
        outcome = normalize_completion(reply("<think>long", finish="length"))
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

    @given(
        st.none() | texts,
        st.none() | texts,
        st.lists(st.builds(ToolCall, st.text(max_size=3), texts, texts), max_size=2),
        st.sampled_from(["stop", "length", "tool_calls"]),
    )
    def test_any_reply(
        self, content: str | None, reasoning: str | None, calls: list[ToolCall], finish: str
    ) -> None:
        """Replies with any content, reasoning, tool calls and finish reason are valid."""
        completion = reply(content, finish, reasoning_content=reasoning, tool_calls=tuple(calls))
        outcome = normalize_completion(completion, allowed_tools=["read_file"])
        self.check(outcome, ["read_file"])
        self.assertEqual(outcome.truncated, finish == "length")

    @given(st.text().filter(lambda t: "think>" not in t and "THINK]" not in t))
    def test_strip_without_tags(self, text: str) -> None:
        """Text without think tags is only trimmed."""
        self.assertEqual(strip_thinking(text), text.strip())
