"""
Tests for L{loopd.moa.knobs}: sampling per role, the caller's thinking choice, the thinking
injection (reference C{mesh-moa.md} §1.6) and the upstream body (DESIGN decision 28).
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.moa.context import Packed, pack_fast, pack_strong
from loopd.moa.knobs import (
    REDUCER_SAMPLING,
    THINKING_ALIASES,
    WORKER_SAMPLING,
    SamplingParams,
    apply_enable_thinking,
    effective_enable_thinking,
    extract_override,
    sampling_for,
    upstream_body,
)
from loopd.moa.roles import Role
from loopd.moa.turn import read_turn

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=10,
)

knob_keys = st.sampled_from(
    [
        "reasoning",
        "reasoning_effort",
        "thinking_budget",
        "chat_template_kwargs",
        *THINKING_ALIASES,
        "max_tokens",
    ]
)

bodies = st.dictionaries(
    knob_keys,
    json_values
    | st.fixed_dictionaries(
        {},
        optional={
            "enabled": json_values,
            "effort": json_values,
            "max_tokens": json_values,
            "enable_thinking": json_values,
            "think_enabled": json_values,
        },
    ),
    max_size=5,
)


class SamplingTests(SynchronousTestCase):
    """Sampling per role."""

    def test_values(self) -> None:
        """Workers 0.8 / 0.95, the reducer 0.3 / 0.9."""
        self.assertEqual(WORKER_SAMPLING, SamplingParams(0.8, 0.95))
        self.assertEqual(REDUCER_SAMPLING, SamplingParams(0.3, 0.9))

    def test_by_role(self) -> None:
        """Every worker role samples as a worker; the reducer as the reducer."""
        for role in (Role.FAST, Role.SPECIALIST, Role.STRONG, Role.GENERALIST):
            self.assertEqual(sampling_for(role), WORKER_SAMPLING)
        self.assertEqual(sampling_for(Role.REDUCER), REDUCER_SAMPLING)


class ExtractOverrideTests(SynchronousTestCase):
    """C{extract_override}: the caller's thinking choice, rules in order, later ones winning."""

    def test_nothing(self) -> None:
        """No knob: no choice; a body that is not an object neither."""
        self.assertIsNone(extract_override({"model": "mesh", "messages": []}))
        self.assertIsNone(extract_override([]))
        self.assertIsNone(extract_override({"reasoning": {}}))
        self.assertIsNone(extract_override({"reasoning": "high"}))

    def test_reasoning_object(self) -> None:
        """reasoning: off on enabled false, effort none, max_tokens 0; on when any is set."""
        table = [
            ({"enabled": False}, False),
            ({"effort": "none"}, False),
            ({"max_tokens": 0}, False),
            ({"max_tokens": 0.0}, False),
            ({"enabled": True}, True),
            ({"effort": "low"}, True),
            ({"effort": None}, True),
            ({"max_tokens": 100}, True),
            ({"max_tokens": None}, True),
            ({"enabled": True, "effort": "none"}, False),
            ({"enabled": "yes"}, None),
            ({"max_tokens": False}, True),
        ]
        for reasoning, expected in table:
            self.assertEqual(extract_override({"reasoning": reasoning}), expected, reasoning)

    def test_reasoning_effort(self) -> None:
        """reasoning_effort as a string: on unless "none"; not a string: nothing."""
        self.assertFalse(extract_override({"reasoning_effort": "none"}))
        self.assertTrue(extract_override({"reasoning_effort": "low"}))
        self.assertTrue(extract_override({"reasoning_effort": ""}))
        self.assertIsNone(extract_override({"reasoning_effort": None}))

    def test_every_alias(self) -> None:
        """Each of the 9 aliases turns thinking on or off as a JSON boolean, at top level."""
        self.assertEqual(len(THINKING_ALIASES), 9)
        for alias in THINKING_ALIASES:
            self.assertTrue(extract_override({alias: True}), alias)
            self.assertFalse(extract_override({alias: False}), alias)
            self.assertIsNone(extract_override({alias: 1}), alias)
            self.assertIsNone(extract_override({alias: "true"}), alias)

    def test_alias_order(self) -> None:
        """Of several aliases the last in the list wins, whatever the body's key order."""
        body = {"think_enabled": False, "enable_thinking": True}
        self.assertFalse(extract_override(body))
        body = {"use_thinking": True, "enableThinking": False}
        self.assertTrue(extract_override(body))

    def test_thinking_budget(self) -> None:
        """thinking_budget 0 turns thinking off; any other value sets nothing."""
        self.assertFalse(extract_override({"thinking_budget": 0}))
        self.assertIsNone(extract_override({"thinking_budget": 512}))
        self.assertIsNone(extract_override({"thinking_budget": False}))
        self.assertTrue(extract_override({"enable_thinking": True, "thinking_budget": 9}))

    def test_kwargs_aliases(self) -> None:
        """The aliases inside chat_template_kwargs count, and last of all."""
        for alias in THINKING_ALIASES:
            self.assertFalse(extract_override({"chat_template_kwargs": {alias: False}}), alias)
            self.assertTrue(extract_override({"chat_template_kwargs": {alias: True}}), alias)
        self.assertIsNone(extract_override({"chat_template_kwargs": {"enable_thinking": 0}}))

    def test_reference_example(self) -> None:
        """{"reasoning_effort":"low","chat_template_kwargs":{"enable_thinking":false}} is off."""
        body = {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}
        self.assertFalse(extract_override(body))

    def test_later_rules_overwrite(self) -> None:
        """Each rule overwrites the ones before it."""
        self.assertTrue(
            extract_override({"reasoning": {"enabled": False}, "reasoning_effort": "high"})
        )
        self.assertFalse(extract_override({"reasoning_effort": "high", "enable_thinking": False}))
        self.assertFalse(extract_override({"enable_thinking": True, "thinking_budget": 0}))
        self.assertTrue(
            extract_override({"thinking_budget": 0, "chat_template_kwargs": {"use_thinking": True}})
        )

    @given(bodies)
    def test_any_body(self, body: dict[str, Any]) -> None:
        """Any body gives None or a boolean, and the body is left as it was."""
        before = copy.deepcopy(body)
        self.assertIn(extract_override(body), (None, True, False))
        self.assertEqual(body, before)


class PolicyTests(SynchronousTestCase):
    """C{effective_enable_thinking}: off unless the caller turns it on."""

    def test_silent_caller(self) -> None:
        """A caller that says nothing gets thinking off."""
        self.assertFalse(effective_enable_thinking({"model": "mesh"}))

    def test_explicit(self) -> None:
        """An explicit choice wins either way (v1's escape hatch)."""
        self.assertTrue(effective_enable_thinking({"reasoning_effort": "low"}))
        self.assertFalse(effective_enable_thinking({"enable_thinking": False}))

    def test_tool_turn(self) -> None:
        """Tools change nothing: still off by default."""
        self.assertFalse(effective_enable_thinking({"tools": [{"function": {"name": "f"}}]}))


class ApplyTests(SynchronousTestCase):
    """C{apply_enable_thinking}: the injection into an outbound body."""

    def test_off(self) -> None:
        """False: enable_thinking false and reasoning_effort "none"."""
        self.assertEqual(
            apply_enable_thinking({"model": "m", "reasoning_effort": "high"}, False),
            {
                "model": "m",
                "reasoning_effort": "none",
                "chat_template_kwargs": {"enable_thinking": False},
            },
        )

    def test_on(self) -> None:
        """True: enable_thinking true; reasoning_effort left alone (absent or present)."""
        self.assertEqual(
            apply_enable_thinking({}, True), {"chat_template_kwargs": {"enable_thinking": True}}
        )
        body = {"reasoning_effort": "low"}
        self.assertEqual(apply_enable_thinking(body, True)["reasoning_effort"], "low")

    def test_merge(self) -> None:
        """An existing chat_template_kwargs object is merged into, not replaced."""
        body = {"chat_template_kwargs": {"foo": 1, "enable_thinking": True}}
        self.assertEqual(
            apply_enable_thinking(body, False)["chat_template_kwargs"],
            {"foo": 1, "enable_thinking": False},
        )

    def test_non_object_kwargs(self) -> None:
        """A kwargs that is a string, number, array or null is replaced by an object."""
        for bogus in ("x", 3, [1], None):
            injected = apply_enable_thinking({"chat_template_kwargs": bogus}, False)
            self.assertEqual(injected["chat_template_kwargs"], {"enable_thinking": False})

    def test_none_changes_nothing(self) -> None:
        """None leaves the body as it is."""
        body = {"reasoning_effort": "low"}
        self.assertIs(apply_enable_thinking(body, None), body)

    def test_non_object_body(self) -> None:
        """A body that is not an object is returned untouched."""
        self.assertEqual(apply_enable_thinking([1], False), [1])
        self.assertEqual(apply_enable_thinking("x", True), "x")

    @given(bodies, st.booleans())
    def test_not_mutated(self, body: dict[str, Any], enable: bool) -> None:
        """The caller's body is never changed, and the injected value reads back."""
        before = copy.deepcopy(body)
        injected = apply_enable_thinking(body, enable)
        self.assertEqual(body, before)
        kwargs = injected["chat_template_kwargs"]
        self.assertIs(kwargs["enable_thinking"], enable)
        if not any(isinstance(kwargs.get(a), bool) for a in THINKING_ALIASES[1:]):
            self.assertIs(extract_override(injected), enable)


class UpstreamBodyTests(SynchronousTestCase):
    """C{upstream_body}: DESIGN decision 28's wire form."""

    def test_worker_body(self) -> None:
        """Role budget, worker sampling, thinking off as kwargs plus reasoning_effort none."""
        turn = read_turn({"messages": [{"role": "user", "content": "q"}]})
        packed = pack_fast(turn)
        body = upstream_body(packed, model="qwen", sampling=WORKER_SAMPLING, enable_thinking=False)
        self.assertEqual(
            body,
            {
                "model": "qwen",
                "messages": list(packed.messages),
                "max_tokens": 256,
                "temperature": 0.8,
                "top_p": 0.95,
                "stream": False,
                "chat_template_kwargs": {"enable_thinking": False},
                "reasoning_effort": "none",
            },
        )

    def test_tools_and_thinking_on(self) -> None:
        """Tools when packed; thinking on sends enable_thinking true and no reasoning_effort."""
        tools = [{"type": "function", "function": {"name": "f"}}]
        turn = read_turn({"messages": [{"role": "user", "content": "q"}], "tools": tools})
        body = upstream_body(
            pack_strong(turn),
            model=None,
            sampling=REDUCER_SAMPLING,
            enable_thinking=True,
            stream=True,
        )
        self.assertNotIn("model", body)
        self.assertNotIn("reasoning_effort", body)
        self.assertEqual(body["tools"], tools)
        self.assertEqual(body["chat_template_kwargs"], {"enable_thinking": True})
        self.assertEqual((body["max_tokens"], body["temperature"], body["top_p"]), (1024, 0.3, 0.9))
        self.assertIs(body["stream"], True)

    def test_no_tools_field(self) -> None:
        """A packing without tools sends no tools field."""
        body = upstream_body(
            Packed((), None, 2048), model="m", sampling=REDUCER_SAMPLING, enable_thinking=False
        )
        self.assertNotIn("tools", body)
        self.assertEqual(body["max_tokens"], 2048)
