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
from loopd.llama.types import (
    Choice,
    Completion,
    Content,
    FinishReason,
    Logprobs,
    Progress,
    Queued,
    Reasoning,
    Retrying,
    ThinkingCapped,
    Timings,
    ToolCall,
    ToolCallDelta,
    Waiting,
)
from loopd.testing.gateway import HI, NOW

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}


def encode(document: object) -> bytes:
    """A JSON request body."""
    return json.dumps(document).encode("utf-8")


TIMINGS = Timings(cache_n=100, prompt_n=20, predicted_n=7, predicted_per_second=55.5)


ANSWER = Completion("up-1", "Hello", "I think", (), FinishReason.STOP, TIMINGS)


USAGE = {
    "prompt_tokens": 120,
    "completion_tokens": 7,
    "total_tokens": 127,
    "prompt_tokens_details": {"cached_tokens": 100},
    "prompt_cache_hit_tokens": 100,
    "prompt_cache_miss_tokens": 20,
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

    def test_usage_cache_fields(self) -> None:
        """
        The tokens the server reused and evaluated are in OpenAI's C{cached_tokens} (read by
        OpenCode, pi, Cline, Qwen Code) and in DeepSeek's C{prompt_cache_hit_tokens} and
        C{prompt_cache_miss_tokens} (read by Aider through LiteLLM, and by pi), which add up
        to the prompt.
        """
        for cache_n, prompt_n in [(0, 12), (9000, 35), (4, 0)]:
            with self.subTest(cache_n=cache_n, prompt_n=prompt_n):
                timings = Timings(cache_n=cache_n, prompt_n=prompt_n, predicted_n=2)
                usage = completion_json(
                    replace(ANSWER, timings=timings), completion_id="c", model="m", created=1
                )["usage"]
                self.assertEqual(usage["prompt_tokens_details"], {"cached_tokens": cache_n})
                self.assertEqual(usage["prompt_cache_hit_tokens"], cache_n)
                self.assertEqual(usage["prompt_cache_miss_tokens"], prompt_n)
                self.assertEqual(usage["prompt_tokens"], cache_n + prompt_n)


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
