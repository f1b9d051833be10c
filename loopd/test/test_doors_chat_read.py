"""
Tests for L{loopd.gateway.doors.chat_read}: OpenAI requests in (image and audio parts of a user
turn included: kept as sent, refused anywhere else or malformed), completions and chunks
out.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.chat_read import parse_request
from loopd.gateway.errors import GatewayError
from loopd.gateway.request import GatewayRequest
from loopd.llama.types import (
    Assistant,
    ChatMessage,
    ChatRequest,
    System,
    Tool,
    ToolCall,
    ToolSchema,
    User,
)
from loopd.test.support.json_paths import paths

USER = {"role": "user", "content": "Hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
TOOL_F = {"type": "function", "function": {"name": "f"}}
TOOL_G = {"type": "function", "function": {"name": "g", "description": "G.", "parameters": {}}}


def encode(document: object) -> bytes:
    """A JSON request body."""
    return json.dumps(document).encode("utf-8")


def parse(**fields: Any) -> GatewayRequest:
    """Parse a body of one user message plus C{fields}."""
    return parse_request(encode({"messages": [USER], **fields}))


def chat(**fields: Any) -> ChatRequest:
    """The upstream request of L{parse}."""
    return parse(**fields).chat_request()


#: What the round trip compares of a request: model, stream, usage and the upstream request.
Summary = tuple[str | None, bool, bool, ChatRequest]


def summary(request: GatewayRequest) -> Summary:
    """The model, stream, include_usage and upstream request of C{request}."""
    return (request.model, request.stream, request.include_usage, request.chat_request())


class ParseAcceptedTests(SynchronousTestCase):
    """The forms of an OpenAI chat request that L{parse_request} accepts."""

    def test_minimal(self) -> None:
        """One user message gives the defaults: no model, no stream, slot -1, thinking on."""
        self.assertEqual(parse(), GatewayRequest(None, (User("Hi"),)))
        self.assertEqual(parse().chat_request(), ChatRequest(-1, (User("Hi"),)))

    def test_every_role(self) -> None:
        """Each role becomes its message kind, in order; developer reads as system."""
        messages = [
            {"role": "system", "content": "S"},
            {"role": "developer", "content": "D"},
            USER,
            {"role": "assistant", "content": "A", "reasoning_content": "R"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ]
        self.assertEqual(
            parse_request(encode({"messages": messages})).messages,
            (
                System("S"),
                System("D"),
                User("Hi"),
                Assistant("A", "R"),
                Assistant(None, None, (ToolCall("c1", "f", '{"a":1}'),)),
                Tool("c1", "42"),
            ),
        )

    def test_content_parts(self) -> None:
        """Arrays of text parts are joined with nothing between them, for every role."""
        parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        messages = [
            {"role": role, "content": parts, "tool_call_id": "c"}
            for role in ("system", "user", "assistant", "tool")
        ]
        self.assertEqual(
            parse_request(encode({"messages": messages})).messages,
            (System("ab"), User("ab"), Assistant("ab"), Tool("c", "ab")),
        )

    def test_assistant_without_content(self) -> None:
        """Content may be absent with tool calls (the call's type too) or null with reasoning."""
        call = {"id": "c", "function": {"name": "f", "arguments": "{}"}}
        thought = {"role": "assistant", "content": None, "reasoning_content": "r"}
        messages = [{"role": "assistant", "tool_calls": [call]}, thought]
        self.assertEqual(
            parse_request(encode({"messages": messages})).messages,
            (Assistant(None, None, (ToolCall("c", "f", "{}"),)), Assistant(None, "r")),
        )

    def test_tools(self) -> None:
        """Tools keep their order; description and parameters default when absent."""
        self.assertEqual(
            chat(tools=[TOOL_F, TOOL_G]).tools,
            (ToolSchema("f", ""), ToolSchema("g", "G.", {})),
        )

    def test_tool_choice_strings(self) -> None:
        """auto, none and required pass through with every tool still offered."""
        for choice in ("auto", "none", "required"):
            request = chat(tools=[TOOL_F, TOOL_G], tool_choice=choice)
            self.assertEqual((request.tool_choice, len(request.tools)), (choice, 2))

    def test_tool_choice_object(self) -> None:
        """The object form is required with the tools narrowed to the one named."""
        choice = {"type": "function", "function": {"name": "g"}}
        request = chat(tools=[TOOL_F, TOOL_G], tool_choice=choice)
        self.assertEqual(
            (request.tool_choice, request.tools), ("required", (ToolSchema("g", "G.", {}),))
        )

    def test_options(self) -> None:
        """model, stream, include_usage and the sampling overrides are all read."""
        parsed = parse(
            model="local",
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=64,
            temperature=0.5,
            top_p=1,
            stop=["a", "b", "c", "d"],
        )
        self.assertEqual((parsed.model, parsed.stream, parsed.include_usage), ("local", True, True))
        self.assertEqual(
            parsed.chat_request(),
            ChatRequest(
                -1, (User("Hi"),), max_tokens=64, temperature=0.5, top_p=1.0, stop=tuple("abcd")
            ),
        )

    def test_max_completion_tokens(self) -> None:
        """max_completion_tokens alone counts; with max_tokens, the lower counts."""
        self.assertEqual(chat(max_completion_tokens=9).max_tokens, 9)
        self.assertEqual(chat(max_tokens=5, max_completion_tokens=9).max_tokens, 5)
        self.assertEqual(chat(max_tokens=9, max_completion_tokens=5).max_tokens, 5)

    def test_integral_numbers(self) -> None:
        """An integral number such as 7.0 is an integer (JSON has one number type)."""
        self.assertEqual(chat(max_tokens=7.0, n=1.0).max_tokens, 7)

    def test_bounds_inclusive(self) -> None:
        """temperature 0 and 2 and top_p 0 and 1 are in range."""
        self.assertEqual((chat(temperature=0).temperature, chat(temperature=2).temperature), (0, 2))
        self.assertEqual((chat(top_p=0).top_p, chat(top_p=1).top_p), (0, 1))

    def test_stop_string(self) -> None:
        """A single stop string is one stop string."""
        self.assertEqual(chat(stop="END").stop, ("END",))

    def test_thinking(self) -> None:
        """Thinking is on unless reasoning_effort is none or enable_thinking is false."""
        cases: list[tuple[dict[str, Any], bool]] = [
            ({}, True),
            ({"reasoning_effort": "none"}, False),
            ({"reasoning_effort": "high"}, True),
            ({"chat_template_kwargs": {"enable_thinking": False}}, False),
            ({"chat_template_kwargs": {"enable_thinking": True, "other": 1}}, True),
            ({"chat_template_kwargs": {}}, True),
            (
                {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
                False,
            ),
        ]
        self.assertEqual([(fields, chat(**fields).thinking) for fields, _ in cases], cases)

    def test_nulls_are_absent(self) -> None:
        """null for an optional field reads as absent."""
        names = "model n tools tool_choice max_tokens max_completion_tokens temperature top_p"
        names += " stop stream stream_options reasoning_effort chat_template_kwargs"
        self.assertEqual(parse(**dict.fromkeys(names.split())), parse())
        self.assertEqual(parse(stream_options={"include_usage": None}), parse())

    def test_passed_fields(self) -> None:
        """
        The server's fields go to C{fields} (and on to the upstream request); loopd's own
        and the ignored ones stay in C{extras}; n=1 is dropped.
        """
        extras = {"n": 1, "user": "u", "metadata": {"a": "b"}, "seed": 3, "logprobs": False}
        request = parse(**extras, top_k=40, response_format={"type": "json_object"})
        passed: dict[str, Any] = {"seed": 3, "logprobs": False, "top_k": 40}
        passed["response_format"] = {"type": "json_object"}
        self.assertEqual(request.fields, passed)
        self.assertEqual(request.chat_request().fields, passed)
        self.assertEqual(request.extras, {"user": "u", "metadata": {"a": "b"}})
        self.assertEqual(parse(n=2).fields, {"n": 2})

    def test_return_progress(self) -> None:
        """return_progress is loopd's own: read, never passed."""
        request = parse(return_progress=True)
        self.assertEqual((request.return_progress, request.fields), (True, {}))
        self.assertFalse(parse(return_progress=False).return_progress)


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


class MediaPartTests(SynchronousTestCase):
    """A user turn may carry image and audio parts, kept as sent."""

    def test_user_parts_kept(self) -> None:
        """Text parts are joined into content; every part, in order, is kept."""
        parts: list[dict[str, Any]] = [
            {"type": "text", "text": "Listen "},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            {"type": "text", "text": "and look"},
            {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}},
        ]
        body = json.dumps({"messages": [{"role": "user", "content": parts}]}).encode()
        (message,) = parse_request(body).messages
        self.assertEqual(message, User("Listen and look", tuple(parts)))

    def test_text_only_has_no_parts(self) -> None:
        """A turn of text parts only is plain text, with no parts kept."""
        parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        body = json.dumps({"messages": [{"role": "user", "content": parts}]}).encode()
        self.assertEqual(parse_request(body).messages, (User("ab"),))


class MediaRefusalTests(SynchronousTestCase):
    """Media where it cannot go, or malformed, is a 400 naming the field."""

    def refused(self, message: dict[str, Any], field: str, code: str) -> None:
        """
        A conversation of C{message} alone is refused with C{code}, naming C{field} in its
        message and as its C{param}.
        """
        body = json.dumps({"messages": [message]}).encode()
        error = self.assertRaises(GatewayError, parse_request, body)
        self.assertEqual((error.status, error.code, error.param), (400, code, field))
        self.assertIn(field, error.message)

    def test_media_outside_a_user_turn(self) -> None:
        """An image in a system, assistant or tool message is unsupported_content."""
        for role in ("system", "assistant", "tool"):
            message = {"role": role, "content": [IMAGE], "tool_call_id": "c1"}
            with self.subTest(role):
                self.refused(message, "messages[0].content[0].type", "unsupported_content")

    def test_malformed_media(self) -> None:
        """An image or audio part without its object or its string fields names the field."""
        cases = {
            "image_url": ({"type": "image_url"}, ".image_url"),
            "url": ({"type": "image_url", "image_url": {"url": 1}}, ".image_url.url"),
            "format": (
                {"type": "input_audio", "input_audio": {"data": "AAAA"}},
                ".input_audio.format",
            ),
        }
        for name, (part, field) in cases.items():
            message = {"role": "user", "content": [{"type": "text", "text": "a"}, part]}
            with self.subTest(name):
                self.refused(message, "messages[0].content[1]" + field, "invalid_message")


_text = st.text(max_size=6)


_name = st.text("abcxyz_-0123", min_size=1, max_size=5)


_ROLES = ("system", "developer", "user", "assistant", "tool")


TOOL_CHOICE_STRINGS = ("auto", "none", "required")


# Keys and words of the request format, so that generated values come close to valid ones.
_KEYS = st.sampled_from(
    "model messages tools tool_choice max_tokens max_completion_tokens temperature top_p stop"
    " stream stream_options include_usage n reasoning_effort chat_template_kwargs"
    " enable_thinking role content tool_calls tool_call_id reasoning_content id type function"
    " name arguments description parameters text".split()
)


_WORDS = st.sampled_from(["function", "text", "image_url", *TOOL_CHOICE_STRINGS, *_ROLES])


_scalar = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
)


_json = st.recursive(
    _scalar | st.text(max_size=5) | _WORDS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS | _text, inner, max_size=4),
    max_leaves=12,
)


@st.composite
def openai_message(draw: st.DrawFn) -> tuple[dict[str, Any], ChatMessage]:
    """A valid OpenAI message and the message loopd should read from it."""
    role = draw(st.sampled_from(_ROLES))
    pieces = draw(st.lists(_text, min_size=1, max_size=3))
    text = "".join(pieces)
    content: object = [{"type": "text", "text": p} for p in pieces] if len(pieces) > 1 else text
    if role == "tool":
        call_id = draw(_name)
        return {"role": role, "tool_call_id": call_id, "content": content}, Tool(call_id, text)
    if role != "assistant":
        return {"role": role, "content": content}, (User if role == "user" else System)(text)
    calls = tuple(draw(st.lists(st.builds(ToolCall, _name, _name, _text), max_size=2)))
    reasoning = draw(st.none() | _text)
    null = bool(calls) and draw(st.booleans())
    message: dict[str, Any] = {"role": role, "content": None if null else content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return message, Assistant(None if null else text, reasoning, calls)


@st.composite
def openai_request(draw: st.DrawFn) -> tuple[dict[str, Any], Summary]:
    """A valid OpenAI request and the summary of the request loopd should read from it."""
    pairs = draw(st.lists(openai_message(), min_size=1, max_size=5))
    names = draw(st.lists(_name, unique=True, max_size=3))
    tools = tuple(ToolSchema(name, f"{name}.", {"type": "object"}) for name in names)
    document: dict[str, Any] = {"messages": [pair[0] for pair in pairs]}
    if tools:
        document["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description}}
            for t in tools
        ]
    choice = draw(st.sampled_from([None, *TOOL_CHOICE_STRINGS, *names]))
    if choice in names:
        tools = tuple(tool for tool in tools if tool.name == choice)
        document["tool_choice"] = {"type": "function", "function": {"name": choice}}
        choice = "required"
    fields: dict[str, Any] = {
        "model": draw(st.none() | _name),
        "stream": draw(st.booleans()),
        draw(st.sampled_from(["max_tokens", "max_completion_tokens"])): draw(
            st.none() | st.integers(1, 10**6)
        ),
        "temperature": draw(st.none() | st.floats(0, 2)),
        "top_p": draw(st.none() | st.floats(0, 1)),
        "stop": draw(st.lists(_name, max_size=4)),
        "tool_choice": document.get("tool_choice", choice),
        "reasoning_effort": draw(st.sampled_from([None, "none", "low", "high"])),
        "stream_options": draw(st.none() | st.builds(dict, include_usage=st.booleans())),
        "chat_template_kwargs": draw(st.none() | st.builds(dict, enable_thinking=st.booleans())),
    }
    document.update({key: value for key, value in fields.items() if value is not None})
    get = document.get
    chat = ChatRequest(
        -1,
        tuple(pair[1] for pair in pairs),
        tools,
        get("reasoning_effort") != "none"
        and get("chat_template_kwargs", {}).get("enable_thinking", True),
        get("max_tokens", get("max_completion_tokens")),
        fields["temperature"],
        fields["top_p"],
        tuple(fields["stop"]),
        choice,
    )
    usage = get("stream_options", {}).get("include_usage", False)
    return document, (fields["model"], fields["stream"], usage, chat)


@st.composite
def near_valid(draw: st.DrawFn) -> object:
    """A valid request with one value in it, at any depth, replaced by an arbitrary one."""
    document: Any = draw(openai_request())[0]
    every = paths(document)[1:]
    depth = draw(st.integers(1, max(map(len, every))))
    *parents, key = draw(st.sampled_from([path for path in every if len(path) == depth]))
    node = document
    for parent in parents:
        node = node[parent]
    if isinstance(node, dict) and draw(st.integers(0, 4)) == 0:
        key = draw(_KEYS)
    node[key] = draw(_json)
    return document


class PropertyTests(SynchronousTestCase):
    """Properties of L{parse_request} over generated input."""

    @given(openai_request())
    def test_round_trip(self, case: tuple[dict[str, Any], Summary]) -> None:
        """Any valid generated request reads back as the request it was made from."""
        document, expected = case
        self.assertEqual(summary(parse_request(encode(document))), expected)

    @settings(max_examples=300)
    @given(st.binary(max_size=30) | _json.map(encode) | near_valid().map(encode))
    def test_only_gateway_errors(self, body: bytes) -> None:
        """On any bytes or JSON value, parse_request answers or raises a 400 GatewayError."""
        try:
            parsed = parse_request(body)
        except GatewayError as error:
            self.assertEqual((error.status, error.type), (400, "invalid_request_error"))
        else:
            self.assertIsInstance(parsed, GatewayRequest)
