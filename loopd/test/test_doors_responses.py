"""
Tests for L{loopd.gateway.doors.responses}: the reader against the issue's list, and the writer
against the C{openai} SDK's own models and stream accumulator.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
from openai.types.responses import Response

from loopd.gateway.errors import GatewayError
from loopd.llama.types import (
    Assistant,
    Completion,
    Content,
    FinishReason,
    Queued,
    Reasoning,
    ToolCall,
    ToolCallDelta,
    User,
)
from loopd.sse import SSEDecoder, SSEEvent
from loopd.test.support.responses_door import DoorCase, completion, events_of


def sdk_stream(data: bytes) -> tuple[list[str], Any]:
    """Run the SDK's own stream accumulator over C{data}: its event types, final response."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=data)

    client = openai.OpenAI(
        api_key="k",
        base_url="http://loopd/v1",
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )
    with client.responses.stream(model="m", input="hi") as stream:
        types: list[str] = [event.type for event in stream]
        return types, stream.get_final_response()


class AnswerBodyTests(DoorCase):
    """The non-streaming C{response} object."""

    def test_text(self) -> None:
        """A text answer: one message item, usage with cached and reasoning tokens."""
        request = self.read({"input": "x", "metadata": {"k": "v"}, "temperature": 0.2})
        answer = self.door.answer(request, "qwen", 1700)
        body = answer.body(completion("hello", "thought"))
        response = Response.model_validate(body)
        self.assertEqual(response.id, answer.response_id)
        self.assertTrue(response.id.startswith("resp_"))
        self.assertEqual(
            (response.status, response.model, response.created_at), ("completed", "qwen", 1700)
        )
        self.assertEqual(response.output_text, "hello")
        self.assertEqual([item.type for item in response.output], ["reasoning", "message"])
        reasoning = response.output[0]
        assert reasoning.type == "reasoning" and reasoning.content is not None
        self.assertEqual((reasoning.content[0].text, reasoning.summary), ("thought", []))
        usage = response.usage
        assert usage is not None
        self.assertEqual(
            (usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens),
            (7, 3, 5),
        )
        self.assertEqual(
            (usage.output_tokens_details.reasoning_tokens, usage.total_tokens), (2, 12)
        )
        self.assertEqual((response.metadata, response.temperature), ({"k": "v"}, 0.2))

    def test_function_calls(self) -> None:
        """Tool calls are function call items; a tool-call-only answer has no message."""
        request = self.read({"input": "x", "tools": [{"type": "function", "name": "f"}]})
        calls = (ToolCall("call_1", "f", '{"a":1}'), ToolCall("call_2", "f", "{}"))
        body = self.door.answer(request, "m", 1).body(
            completion(None, None, calls, FinishReason.TOOL_CALLS)
        )
        response = Response.model_validate(body)
        self.assertEqual(
            [(item.type, getattr(item, "call_id", None)) for item in response.output],
            [("function_call", "call_1"), ("function_call", "call_2")],
        )
        self.assertEqual([tool.type for tool in response.tools], ["function"])

    def test_length(self) -> None:
        """An answer cut at its token bound is C{incomplete}, reason C{max_output_tokens}."""
        request = self.read({"input": "x", "max_output_tokens": 5})
        body = self.door.answer(request, "m", 1).body(completion(finish=FinishReason.LENGTH))
        response = Response.model_validate(body)
        self.assertEqual(response.status, "incomplete")
        assert response.incomplete_details is not None
        self.assertEqual(response.incomplete_details.reason, "max_output_tokens")
        self.assertEqual(response.max_output_tokens, 5)

    def test_echo(self) -> None:
        """The response echoes instructions, text format, reasoning and tool choice."""
        request = self.read(
            {
                "input": "x",
                "instructions": "be",
                "text": {"format": {"type": "json_object"}},
                "reasoning": {"effort": "low", "summary": "auto"},
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": "required",
                "parallel_tool_calls": False,
            }
        )
        response = Response.model_validate(self.door.answer(request, "m", 1).body(completion()))
        self.assertEqual(response.instructions, "be")
        assert response.text is not None and response.text.format is not None
        assert response.reasoning is not None
        self.assertEqual(response.text.format.type, "json_object")
        self.assertEqual((response.reasoning.effort, response.reasoning.summary), ("low", "auto"))
        self.assertEqual((response.tool_choice, response.parallel_tool_calls), ("required", False))

    def test_error(self) -> None:
        """Errors in OpenAI's shape, with the error's status."""
        error = GatewayError(429, "busy now", "rate_limit_error", "busy")
        self.assertEqual(
            self.door.error(error),
            (
                429,
                {
                    "error": {
                        "message": "busy now",
                        "type": "rate_limit_error",
                        "code": "busy",
                        "param": None,
                    }
                },
            ),
        )
        context = GatewayError(400, "too long", "invalid_request_error", "context_exceeded")
        status, body = self.door.error(context)
        self.assertEqual((status, body["error"]["code"]), (400, "context_length_exceeded"))  # type: ignore[index]


class AnswerStreamTests(DoorCase):
    """The event stream, against the SDK's event models and its accumulator."""

    def stream(
        self, events: list[Any], done: Completion, body: dict[str, Any] | None = None
    ) -> bytes:
        """The bytes of a whole stream of C{events} ending with C{done}."""
        request = self.read(body or {"input": "x", "stream": True})
        self.answer = self.door.answer(request, "m", 1)
        data = self.answer.opening()
        for event in events:
            data += self.answer.during(event)
        return data + self.answer.closing(done)

    def test_text_thinking_and_calls(self) -> None:
        """Thinking, text and two tool calls: items in order, sequence numbers from 0."""
        calls = (ToolCall("call_1", "f", '{"a":1}'), ToolCall("call_2", "g", "{}"))
        data = self.stream(
            [
                Reasoning("thi"),
                Reasoning("nk"),
                Queued(2),
                Content("hel"),
                Content(""),
                Content("lo"),
                ToolCallDelta(0, "call_1", "f", '{"a"'),
                ToolCallDelta(0, None, None, ":1}"),
                ToolCallDelta(1, "call_2", "g", "{}"),
            ],
            completion("hello", "think", calls, FinishReason.TOOL_CALLS),
        )
        events = events_of(data)
        self.assertEqual([e["sequence_number"] for e in events], list(range(len(events))))
        self.assertEqual(
            [e["type"] for e in events],
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ],
        )
        self.assertIn(b': loopd {"event":"queued","ahead":2}\n\n', data)
        types, final = sdk_stream(data)
        self.assertEqual(types[-1], "response.completed")
        self.assertEqual(final.id, self.answer.response_id)
        self.assertEqual(final.output_text, "hello")
        self.assertEqual(
            [(o.call_id, o.name, o.arguments) for o in final.output if o.type == "function_call"],
            [("call_1", "f", '{"a":1}'), ("call_2", "g", "{}")],
        )
        reasoning = final.output[0]
        self.assertEqual((reasoning.type, reasoning.content[0].text), ("reasoning", "think"))
        self.assertEqual(final.usage.input_tokens_details.cached_tokens, 3)

    def test_timings_per_token(self) -> None:
        """
        With C{timings_per_token} every delta event carries its piece's server C{timings};
        without it, none does; a non-boolean is a 400.
        """
        timings = {"predicted_n": 1, "predicted_ms": 4.0}
        pieces = [
            Reasoning("hm", timings=timings),
            Content("hi", timings=timings),
            ToolCallDelta(0, "c1", "f", "{}", timings=timings),
        ]
        for asked in (True, False):
            body = {"input": "x", "stream": True, "timings_per_token": asked}
            data = self.stream(pieces, completion("hi", "hm"), body)
            deltas = [e for e in events_of(data) if e["type"].endswith(".delta")]
            self.assertEqual(len(deltas), 3)
            self.assertEqual(
                [e.get("timings") for e in deltas], [timings] * 3 if asked else [None] * 3
            )
        self.refused(
            {"input": "x", "timings_per_token": "yes"}, "invalid_parameter", "timings_per_token"
        )

    def test_stored_when_streamed(self) -> None:
        """A streamed response is stored at its end, for a follow-up."""
        self.stream([Content("hi there")], completion("hi there"))
        request = self.read({"previous_response_id": self.answer.response_id, "input": "more"})
        self.assertEqual(request.messages, (User("x"), Assistant("hi there"), User("more")))

    def test_incomplete(self) -> None:
        """An answer cut at its bound ends with C{response.incomplete}, as OpenAI's does."""
        events = events_of(
            self.stream([Content("abc")], completion("abc", finish=FinishReason.LENGTH))
        )
        last = events[-1]
        self.assertEqual(last["type"], "response.incomplete")
        self.assertEqual(last["response"]["incomplete_details"], {"reason": "max_output_tokens"})
        self.assertEqual(last["response"]["output"][0]["status"], "incomplete")

    def test_completion_not_streamed(self) -> None:
        """What the stream did not carry of the completion is sent before the end."""
        data = self.stream(
            [], completion("whole", None, (ToolCall("c", "f", "{}"),), FinishReason.TOOL_CALLS)
        )
        events_of(data)
        _, final = sdk_stream(data)
        self.assertEqual(final.output_text, "whole")
        self.assertEqual([o.type for o in final.output], ["message", "function_call"])

    def test_empty_answer(self) -> None:
        """An answer with nothing in it still completes, with no output items."""
        _, final = sdk_stream(self.stream([], completion(None)))
        self.assertEqual((final.status, final.output), ("completed", []))

    def test_stream_error(self) -> None:
        """A failure after the opening: an C{error} event, then C{response.failed}."""
        request = self.read({"input": "x", "stream": True})
        answer = self.door.answer(request, "m", 1)
        data = answer.opening() + answer.during(Content("par"))
        data += answer.stream_error(GatewayError(504, "went silent", "timeout", "stalled"))
        events = events_of(data)
        error, failed = events[-2:]
        self.assertEqual(
            (error["type"], error["code"], error["message"]), ("error", "stalled", "went silent")
        )
        self.assertEqual(failed["type"], "response.failed")
        self.assertEqual(failed["response"]["status"], "failed")
        self.assertEqual(failed["response"]["error"]["code"], "server_error")
        self.assertEqual(failed["response"]["output"][0]["content"][0]["text"], "par")
        busy = self.door.answer(request, "m", 1)
        busy.opening()
        failed = events_of(busy.stream_error(GatewayError(429, "b", "rate_limit_error", "busy")))[
            -1
        ]
        self.assertEqual(failed["response"]["error"]["code"], "rate_limit_exceeded")
        self.assertEqual(failed["sequence_number"], 3)

    def test_stream_error_context(self) -> None:
        """A context overflow fails with C{context_length_exceeded}, the code Codex acts on."""
        answer = self.door.answer(self.read({"input": "x"}), "m", 1)
        answer.opening()
        error = GatewayError(400, "too long", "invalid_request_error", "context_exceeded")
        data = answer.stream_error(error)
        last = [item for item in SSEDecoder().feed(data) if isinstance(item, SSEEvent)][-1]
        self.assertEqual(
            json.loads(last.data)["response"]["error"]["code"], "context_length_exceeded"
        )
