"""
Tests for L{loopd.gateway.doors.chat_read}: OpenAI requests in (image and audio parts of a user
turn included: kept as sent, refused anywhere else or malformed), completions and chunks
out.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.chat import ChatDoor, ChunkStream, completion_json, new_completion_id
from loopd.gateway.doors.chat_read import parse_request
from loopd.gateway.doors.door import data_line
from loopd.gateway.request import GatewayRequest
from loopd.llama.types import (
    Assistant,
    ChatMessage,
    ChatRequest,
    Choice,
    Completion,
    Content,
    FinishReason,
    Logprobs,
    Progress,
    Queued,
    Reasoning,
    Retrying,
    System,
    ThinkingCapped,
    Timings,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolSchema,
    User,
    Waiting,
)
from loopd.test.support.json_paths import paths
from loopd.testing.gateway import HI, NOW

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


TIMINGS = Timings(cache_n=100, prompt_n=20, predicted_n=7, predicted_per_second=55.5)


ANSWER = Completion("up-1", "Hello", "I think", (), FinishReason.STOP, TIMINGS)


USAGE = {
    "prompt_tokens": 120,
    "completion_tokens": 7,
    "total_tokens": 127,
    "prompt_tokens_details": {"cached_tokens": 100},
}


ENVELOPE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700, "model": "m"}


def delta_chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    """The chunk a stream of L{ENVELOPE} sends for C{delta}."""
    return {**ENVELOPE, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


class CompletionJsonTests(SynchronousTestCase):
    """L{completion_json} renders a finished completion as a chat.completion object."""

    def test_answer(self) -> None:
        """A plain answer with reasoning: message, finish reason, usage and timings."""
        message = {"role": "assistant", "content": "Hello", "reasoning_content": "I think"}
        speed = {"predicted_per_second": 55.5}
        self.assertEqual(
            completion_json(ANSWER, completion_id="chatcmpl-1", model="m", created=1700),
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1700,
                "model": "m",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": USAGE,
                "timings": {"cache_n": 100, "prompt_n": 20, "predicted_n": 7, **speed},
            },
        )

    def test_tool_calls(self) -> None:
        """Tool calls are listed, content stays null, no reasoning key, no unknown speed."""
        calls = (ToolCall("c1", "f", '{"a":1}'), ToolCall("c2", "g", "{}"))
        completion = Completion("up", None, None, calls, FinishReason.TOOL_CALLS, Timings(0, 5, 3))
        rendered = completion_json(completion, completion_id="chatcmpl-2", model="m", created=1)
        second = {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}
        message = {"role": "assistant", "content": None, "tool_calls": [CALL, second]}
        self.assertEqual(
            rendered["choices"][0], {"index": 0, "message": message, "finish_reason": "tool_calls"}
        )
        self.assertEqual(rendered["timings"], {"cache_n": 0, "prompt_n": 5, "predicted_n": 3})
        self.assertEqual(rendered["usage"]["total_tokens"], 8)


class ChunkStreamTests(SynchronousTestCase):
    """L{ChunkStream} renders a streamed answer as chat.completion.chunk dicts."""

    def setUp(self) -> None:
        """A stream with the usage chunk asked for."""
        self.stream = ChunkStream("chatcmpl-1", "m", 1700, True)

    def test_role_chunk(self) -> None:
        """The first chunk sets the role, with content null as llama-server's."""
        self.assertEqual(
            self.stream.role_chunk(), delta_chunk({"role": "assistant", "content": None})
        )

    def test_logprobs(self) -> None:
        """A piece's logprobs ride on its chunk; entries without a piece get an empty delta."""
        entry = {"token": "a", "logprob": -1.0}
        logprobs = {"logprobs": {"content": [entry]}}
        [piece] = self.stream.chunks_for(Content("a", logprobs=(entry,)))
        self.assertEqual(
            piece["choices"][0], {**delta_chunk({"content": "a"})["choices"][0], **logprobs}
        )
        [bare] = self.stream.chunks_for(Logprobs((entry,)))
        self.assertEqual(bare["choices"][0], {**delta_chunk({})["choices"][0], **logprobs})

    def test_progress(self) -> None:
        """With return_progress, progress is the server's prompt_progress chunk."""
        progress = Progress(10, 2, 5, time_ms=7)
        self.assertEqual(self.stream.chunks_for(progress), [])
        stream = ChunkStream("chatcmpl-1", "m", 1700, True, return_progress=True)
        expected = delta_chunk({"role": "assistant", "content": None})
        expected["prompt_progress"] = {"total": 10, "cache": 2, "processed": 5, "time_ms": 7}
        self.assertEqual(stream.chunks_for(progress), [expected])

    def test_choices(self) -> None:
        """A piece of choice 1 has index 1; every choice gets its finish chunk."""
        [piece] = self.stream.chunks_for(Content("b", choice=1))
        self.assertEqual(piece["choices"][0]["index"], 1)
        more = Choice(1, "b", None, (), FinishReason.LENGTH)
        completion = replace(ANSWER, choices=(more,))
        finishes = self.stream.finish_chunks(completion)
        self.assertEqual(
            [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in finishes[:2]],
            [(0, "stop"), (1, "length")],
        )
        body = completion_json(completion, completion_id="c", model="m", created=1)
        self.assertEqual([c["index"] for c in body["choices"]], [0, 1])
        self.assertEqual(body["choices"][1]["message"]["content"], "b")
        self.assertNotIn("logprobs", body["choices"][0])

    def test_reasoning(self) -> None:
        """Thinking text is a reasoning_content delta."""
        self.assertEqual(
            self.stream.chunks_for(Reasoning("hm")), [delta_chunk({"reasoning_content": "hm"})]
        )

    def test_content(self) -> None:
        """Answer text is a content delta."""
        self.assertEqual(self.stream.chunks_for(Content("Hi")), [delta_chunk({"content": "Hi"})])

    def test_tool_call_first_sight(self) -> None:
        """The first piece of a tool call carries its index, id, type and name."""
        call = {
            "index": 1,
            "id": "c1",
            "type": "function",
            "function": {"name": "f", "arguments": ""},
        }
        self.assertEqual(
            self.stream.chunks_for(ToolCallDelta(1, "c1", "f", "")),
            [delta_chunk({"tool_calls": [call]})],
        )

    def test_tool_call_arguments(self) -> None:
        """Later pieces carry the index and argument text only."""
        self.assertEqual(
            self.stream.chunks_for(ToolCallDelta(0, None, None, '{"a"')),
            [delta_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]})],
        )

    def test_empty_pieces(self) -> None:
        """Empty text and an empty tool call piece give no chunk."""
        for event in (Reasoning(""), Content(""), ToolCallDelta(0, None, None, "")):
            self.assertEqual(self.stream.chunks_for(event), [])

    def test_other_events(self) -> None:
        """loopd's own events give no chunk."""
        for event in (
            Queued(1),
            Waiting(True),
            Progress(10, 2, 5),
            ThinkingCapped(3),
            Retrying(1, 5, "x"),
        ):
            self.assertEqual(self.stream.chunks_for(event), [])

    def test_finish_with_usage(self) -> None:
        """The finish chunk has an empty delta and the reason; the usage chunk has no choices."""
        self.assertEqual(
            self.stream.finish_chunks(ANSWER),
            [delta_chunk({}, "stop"), {**ENVELOPE, "choices": [], "usage": USAGE}],
        )

    def test_finish_without_usage(self) -> None:
        """Without include_usage only the finish chunk is sent."""
        stream = ChunkStream("chatcmpl-1", "m", 1700, False)
        length = Completion("u", "x", None, (), FinishReason.LENGTH, TIMINGS)
        self.assertEqual(stream.finish_chunks(length), [delta_chunk({}, "length")])


class CompletionIdTests(SynchronousTestCase):
    """L{new_completion_id} gives OpenAI-shaped, fresh ids."""

    def test_shape(self) -> None:
        """chatcmpl- and 24 hex digits, different each time."""
        first, second = new_completion_id(), new_completion_id()
        self.assertRegex(first, r"\Achatcmpl-[0-9a-f]{24}\Z")
        self.assertNotEqual(first, second)


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


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


class TextLineTests(SynchronousTestCase):
    """
    A plain text piece's SSE line comes from a template (L{loopd.gateway.doors.chat._TextLine});
    it is byte for byte the line of the chunk the general renderer builds for it.
    """

    def general(self, stream: ChunkStream, event: Reasoning | Content) -> bytes:
        """The line of L{ChunkStream}'s chunk for C{event}, encoded by L{data_line}."""
        (chunk,) = stream.chunks_for(event)
        return data_line(chunk)

    @example(text="a", model="\x00", content=True, include_usage=False)
    @given(
        text=st.text(min_size=1),
        model=st.text(max_size=20),
        content=st.booleans(),
        include_usage=st.booleans(),
    )
    def test_same_bytes_as_the_chunk(
        self, text: str, model: str, content: bool, include_usage: bool
    ) -> None:
        """
        Any text (escapes, quotes, non-ASCII, control characters), any model name, the
        template's own sample text among them.
        """
        stream = ChunkStream("chatcmpl-1", model, NOW, include_usage)
        answer = ChatDoor().answer(
            dataclasses.replace(
                parse_request(json.dumps(HI).encode()), include_usage=include_usage
            ),
            model,
            NOW,
        )
        kind = Content if content else Reasoning
        event = kind(text, 7)
        line = answer.during(event)
        expected = self.general(stream, event)
        # Only the completion id differs: the answer made a fresh one.
        self.assertEqual(line.replace(json.loads(line[6:])["id"].encode(), b"chatcmpl-1"), expected)

    def test_others_from_the_chunks(self) -> None:
        """A piece with logprobs or of another choice is rendered whole, as before."""
        answer = ChatDoor().answer(parse_request(json.dumps(HI).encode()), "tiny", NOW)
        with_logprobs = json.loads(answer.during(Content("a", logprobs=({"token": "a"},)))[6:])
        self.assertEqual(with_logprobs["choices"][0]["logprobs"], {"content": [{"token": "a"}]})
        second = json.loads(answer.during(Reasoning("b", choice=1))[6:])
        self.assertEqual(second["choices"][0]["index"], 1)
