"""
Tests for L{loopd.gateway.request}, the one request model: the thinking switches and their
two readings, the media a request carries, its upstream request, its session from the
headers; read through the chat-completions front door (L{parse_request}) where a body is
the natural way to say what a request is.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.chat_read import THINKING_ALIASES, parse_request
from loopd.gateway.errors import GatewayError
from loopd.gateway.request import (
    MAX_SESSION_ID_BYTES,
    SESSION_ID_HEADERS,
    GatewayRequest,
    SessionRef,
    ThinkingSwitch,
    read_session,
    session_id,
)
from loopd.llama.types import ChatRequest, ToolSchema, User

USER = {"role": "user", "content": "Hi"}


def parse(**fields: Any) -> GatewayRequest:
    """Parse a body of one user message plus C{fields}."""
    return parse_request(json.dumps({"messages": [USER], **fields}).encode())


def override(**fields: Any) -> bool | None:
    """The caller's thinking choice by the mesh's rules, for a body with C{fields}."""
    return parse(**fields).thinking_override


class ThinkingOverrideTests(SynchronousTestCase):
    """
    C{thinking_override}: the caller's thinking choice by the rules of reference
    C{mesh-moa.md} §1.6, later ones winning.
    """

    def test_nothing(self) -> None:
        """No knob: no choice; a reasoning value that is no object, or an empty one, neither."""
        self.assertIsNone(override(model="mesh"))
        self.assertIsNone(override(reasoning={}))
        self.assertIsNone(override(reasoning="high"))

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
            self.assertEqual(override(reasoning=reasoning), expected, reasoning)

    def test_reasoning_effort(self) -> None:
        """reasoning_effort: on unless "none"; null is absent; another type is a 400."""
        self.assertFalse(override(reasoning_effort="none"))
        self.assertTrue(override(reasoning_effort="low"))
        self.assertTrue(override(reasoning_effort=""))
        self.assertIsNone(override(reasoning_effort=None))
        error = self.assertRaises(GatewayError, parse, reasoning_effort=1)
        self.assertEqual(
            (error.code, error.message),
            ("invalid_parameter", "reasoning_effort: expected a string"),
        )

    def test_every_alias(self) -> None:
        """Each of the 9 aliases turns thinking on or off as a JSON boolean, at top level."""
        self.assertEqual(len(THINKING_ALIASES), 9)
        for alias in THINKING_ALIASES:
            self.assertTrue(override(**{alias: True}), alias)
            self.assertFalse(override(**{alias: False}), alias)
            self.assertIsNone(override(**{alias: 1}), alias)
            self.assertIsNone(override(**{alias: "true"}), alias)

    def test_alias_order(self) -> None:
        """Of several aliases the last in the list wins, whatever the body's key order."""
        self.assertFalse(override(think_enabled=False, enable_thinking=True))
        self.assertTrue(override(use_thinking=True, enableThinking=False))

    def test_thinking_budget(self) -> None:
        """thinking_budget 0 turns thinking off; any other value sets nothing."""
        self.assertFalse(override(thinking_budget=0))
        self.assertIsNone(override(thinking_budget=512))
        self.assertIsNone(override(thinking_budget=False))
        self.assertTrue(override(enable_thinking=True, thinking_budget=9))

    def test_kwargs_aliases(self) -> None:
        """The aliases inside chat_template_kwargs count, and last of all."""
        for alias in THINKING_ALIASES:
            self.assertFalse(override(chat_template_kwargs={alias: False}), alias)
            self.assertTrue(override(chat_template_kwargs={alias: True}), alias)
        self.assertIsNone(override(chat_template_kwargs={"use_thinking": 0}))
        error = self.assertRaises(GatewayError, parse, chat_template_kwargs={"enable_thinking": 0})
        self.assertEqual(
            error.message, "chat_template_kwargs.enable_thinking: expected true or false"
        )

    def test_reference_example(self) -> None:
        """{"reasoning_effort":"low","chat_template_kwargs":{"enable_thinking":false}} is off."""
        self.assertFalse(
            override(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False})
        )

    def test_later_rules_overwrite(self) -> None:
        """Each rule overwrites the ones before it."""
        self.assertTrue(override(reasoning={"enabled": False}, reasoning_effort="high"))
        self.assertFalse(override(reasoning_effort="high", enable_thinking=False))
        self.assertFalse(override(enable_thinking=True, thinking_budget=0))
        self.assertTrue(override(thinking_budget=0, chat_template_kwargs={"use_thinking": True}))

    def test_switches_in_rule_order(self) -> None:
        """Every switch set is kept, named, in the order the rules read them."""
        parsed = parse(
            chat_template_kwargs={"enable_thinking": True},
            thinking_budget=0,
            enable_reasoning=False,
            reasoning_effort="high",
            reasoning={"enabled": True},
        )
        self.assertEqual(
            parsed.thinking_switches,
            (
                ThinkingSwitch("reasoning", True),
                ThinkingSwitch("reasoning_effort", True),
                ThinkingSwitch("enable_reasoning", False),
                ThinkingSwitch("thinking_budget", False),
                ThinkingSwitch("chat_template_kwargs.enable_thinking", True),
            ),
        )


class PlainThinkingTests(SynchronousTestCase):
    """C{thinking}: a request for one endpoint thinks unless one of its two switches is off."""

    def test_two_switches(self) -> None:
        """Off only by reasoning_effort "none" or enable_thinking false; both must allow it."""
        self.assertTrue(parse().thinking)
        self.assertFalse(parse(reasoning_effort="none").thinking)
        self.assertFalse(parse(chat_template_kwargs={"enable_thinking": False}).thinking)
        both = parse(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
        self.assertFalse(both.thinking)
        self.assertTrue(both.thinking_override)

    def test_mesh_aliases_do_not_count(self) -> None:
        """The mesh's other switches leave a plain request's thinking on, as before."""
        self.assertTrue(parse(enable_thinking=False, reasoning={"enabled": False}).thinking)


class ModalitiesTests(SynchronousTestCase):
    """C{modalities}: the media of the user turns."""

    def test_image_and_audio(self) -> None:
        """An image part needs vision, an audio part audio; text needs nothing."""
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
        audio = {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}
        text = {"type": "text", "text": "look"}
        self.assertEqual(parse().modalities, frozenset())
        request = parse_request(
            json.dumps({"messages": [{"role": "user", "content": [text, image, audio]}]}).encode()
        )
        self.assertEqual(request.modalities, frozenset({"vision", "audio"}))


class ChatRequestTests(SynchronousTestCase):
    """C{chat_request}: the upstream request, pinned to a slot."""

    def test_fields(self) -> None:
        """Every field the llama client reads, from the request, on the slot given."""
        request = parse(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice="required",
            max_tokens=9,
            temperature=0.5,
            top_p=0.25,
            stop="END",
            reasoning_effort="none",
        )
        self.assertEqual(
            request.chat_request(slot=3),
            ChatRequest(
                slot=3,
                messages=(User("Hi"),),
                tools=(ToolSchema("f", ""),),
                thinking=False,
                max_tokens=9,
                temperature=0.5,
                top_p=0.25,
                stop=("END",),
                tool_choice="required",
            ),
        )


class ExtrasTests(SynchronousTestCase):
    """C{extras}: what the front door does not model, kept as sent."""

    def test_unmodelled_kept(self) -> None:
        """
        loopd's own and ignored fields are kept; modelled ones, thinking knobs and the
        fields for the server are not.
        """
        request = parse(user="u", seed=3, metadata={"a": "b"}, enable_thinking=True, n=1)
        self.assertEqual(dict(request.extras), {"user": "u", "metadata": {"a": "b"}})
        self.assertEqual(dict(request.fields), {"seed": 3})


class ReadSessionTests(SynchronousTestCase):
    """C{read_session}: a request's session from its headers."""

    def read(self, headers: dict[bytes, bytes]) -> SessionRef:
        """The session of a request with these C{headers}, on connection C{anon:1}."""
        return read_session(headers.get, lambda: "anon:1")

    def test_defaults(self) -> None:
        """No header: the connection's anonymous session, a parent, not ending."""
        self.assertEqual(self.read({}), SessionRef("anon:1", "parent", False, anonymous=True))

    def test_headers(self) -> None:
        """X-Session-Id names it; the role and the end are read in any case."""
        headers = {
            b"x-session-id": b"s\xc3\xa9",
            b"x-session-role": b" Child ",
            b"x-session-end": b"1",
        }
        self.assertEqual(self.read(headers), SessionRef("sé", "child", True))

    def test_bad_values(self) -> None:
        """Another role or end value is a 400 naming the header and the value."""
        error = self.assertRaises(GatewayError, self.read, {b"x-session-role": b"boss"})
        self.assertEqual(
            (error.status, error.code, error.message),
            (400, "invalid_session_role", "X-Session-Role must be parent or child, got 'boss'"),
        )
        error = self.assertRaises(GatewayError, self.read, {b"x-session-end": b"maybe"})
        self.assertEqual(error.code, "invalid_session_end")


#: A request without headers.
NONE: dict[bytes, bytes] = {}

#: Every session-id header, lower case, in the order decision 36 reads them.
ORDER = [
    b"x-session-id",
    b"x-claude-code-session-id",
    b"session-id",
    b"session_id",
    b"x-session-affinity",
    b"x-litellm-session-id",
    b"agent-session-id",
]


class SessionIdTests(SynchronousTestCase):
    """
    C{session_id}: the id a request names, from the agents' headers in decision 36's order,
    then the front door's body ids; every bad value a 400 naming where it came from.
    """

    def test_order(self) -> None:
        """Each header wins over every later one and over the body; the body comes last."""
        self.assertEqual([name for name, _ in SESSION_ID_HEADERS], ORDER)
        for i, name in enumerate(ORDER):
            headers = {later: b"later-" + later for later in ORDER[i + 1 :]}
            headers[name] = b"chosen"
            with self.subTest(header=name):
                self.assertEqual(session_id(headers.get, [("user", "u")]), "chosen")
        self.assertEqual(session_id(NONE.get, [("user", "u")]), "u")
        self.assertEqual(session_id(NONE.get, [("a", None), ("b", "second"), ("c", "x")]), "second")
        self.assertIsNone(session_id(NONE.get, [("user", None)]))
        self.assertIsNone(session_id(NONE.get))

    def test_good_values(self) -> None:
        """UTF-8 up to the bound, surrounding spaces dropped, inner ones kept."""
        table = [
            (b"abc", "abc"),
            (b" a b ", "a b"),
            (b"s\xc3\xa9", "s\u00e9"),
            (b"x" * MAX_SESSION_ID_BYTES, "x" * MAX_SESSION_ID_BYTES),
            (b"_session_4f1c", "_session_4f1c"),
        ]
        for raw, expected in table:
            with self.subTest(raw=raw):
                self.assertEqual(session_id({b"session-id": raw}.get), expected)

    def test_bad_header_values(self) -> None:
        """Empty, too long, not UTF-8, a control character: 400 invalid_session_id naming it."""
        table = [
            (b"", "is empty"),
            (b"   ", "is empty"),
            (b"x" * (MAX_SESSION_ID_BYTES + 1), "is 257 bytes, over 256"),
            ("é".encode() * 129, "is 258 bytes, over 256"),
            (b"s\xff", "is not UTF-8"),
            (b"a\x01b", "has a control character"),
            (b"a\tb", "has a control character"),
            (b"a\x7fb", "has a control character"),
            ("a\u0085b".encode(), "has a control character"),
        ]
        for name, shown in SESSION_ID_HEADERS:
            for raw, reason in table:
                with self.subTest(header=name, raw=raw):
                    error = self.assertRaises(GatewayError, session_id, {name: raw}.get)
                    self.assertEqual((error.status, error.code), (400, "invalid_session_id"))
                    self.assertEqual(error.type, "invalid_request_error")
                    self.assertIn(f"header {shown} {reason}", error.message)

    def test_bad_body_values(self) -> None:
        """A body id: the same checks, and it must be a string; the field is named."""
        table: list[tuple[object, str]] = [
            ("", "field user is empty"),
            ("x" * (MAX_SESSION_ID_BYTES + 1), "field user is 257 bytes"),
            ("a\nb", "field user has a control character"),
            ("\ud800", "field user is not UTF-8"),
            (7, "field user must be a string, got int"),
            ({"id": "x"}, "field user must be a string, got dict"),
        ]
        for value, reason in table:
            with self.subTest(value=value):
                error = self.assertRaises(GatewayError, session_id, {}.get, [("user", value)])
                self.assertEqual(error.code, "invalid_session_id")
                self.assertIn(reason, error.message)

    def test_only_the_first_is_read(self) -> None:
        """A bad later header or body id does not matter once an earlier one names the id."""
        headers = {b"x-session-id": b"good", b"session-id": b""}
        self.assertEqual(session_id(headers.get, [("user", 7)]), "good")

    def test_read_session_uses_it(self) -> None:
        """read_session: the named id, else the anonymous one, asked only then."""
        asked: list[int] = []

        def anonymous() -> str:
            asked.append(1)
            return "anon:1"

        headers = {b"x-claude-code-session-id": b"cc"}
        self.assertEqual(read_session(headers.get, anonymous).id, "cc")
        self.assertEqual(read_session(NONE.get, anonymous, [("user", "u")]).id, "u")
        self.assertEqual(asked, [])
        self.assertEqual(read_session(NONE.get, anonymous, [("user", None)]).id, "anon:1")
        error = self.assertRaises(GatewayError, read_session, {b"x-session-id": b""}.get, anonymous)
        self.assertEqual(error.code, "invalid_session_id")

    @given(
        st.dictionaries(st.sampled_from(ORDER), st.binary(max_size=300), max_size=6),
        st.one_of(st.none(), st.text(max_size=300)),
    )
    def test_parser(self, headers: dict[bytes, bytes], user: str | None) -> None:
        """
        Any headers and body id: the result is the first one present, checked, or a 400
        naming exactly that one; never another exception.
        """
        first = next((name for name in ORDER if name in headers), None)
        try:
            result = session_id(headers.get, [("user", user)])
        except GatewayError as error:
            self.assertEqual((error.status, error.code), (400, "invalid_session_id"))
            shown = dict(SESSION_ID_HEADERS)[first] if first is not None else "user"
            self.assertIn(f" {shown} ", error.message)
            return
        if first is None:
            self.assertEqual(result, None if user is None else user.strip(" \t"))
        else:
            self.assertEqual(result, headers[first].strip(b" \t").decode("utf-8"))
        if result is not None:
            self.assertTrue(0 < len(result.encode()) <= MAX_SESSION_ID_BYTES)
            self.assertFalse(any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in result))
