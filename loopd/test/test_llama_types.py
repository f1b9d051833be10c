"""
L{loopd.llama.types}: the error family and the small behaviours of the values.
"""

from __future__ import annotations

import json

from twisted.trial.unittest import SynchronousTestCase

from loopd.llama import types
from loopd.llama.chat import retry_after_seconds


class InferErrorTests(SynchronousTestCase):
    """
    The error kinds are one family, reachable as attributes of the base as the design names
    them.
    """

    def test_kinds_are_attributes(self) -> None:
        """
        C{InferError.Http} and its siblings are the module's classes and subclass the base.
        """
        for name in (
            "Busy",
            "Connect",
            "WaitTimeout",
            "LoadTimeout",
            "Stalled",
            "StreamClosedEarly",
            "ThinkingOverrun",
            "Http",
            "Protocol",
        ):
            kind = getattr(types.InferError, name)
            self.assertIs(kind, getattr(types, name))
            self.assertTrue(issubclass(kind, types.InferError))

    def test_http_body_capped(self) -> None:
        """
        An error body is kept to 4 KiB, never cutting a character in half.
        """
        error = types.Http(500, "é" * 5000)
        self.assertLessEqual(len(error.body.encode("utf-8")), types.HTTP_BODY_CAP)
        self.assertEqual(set(error.body), {"é"})

    def test_context_exceeded(self) -> None:
        """
        A 400 of type exceed_context_size_error is flagged; other errors are not.
        """
        body = {
            "error": {
                "code": 400,
                "message": "request (9000 tokens) exceeds the available context size",
                "type": "exceed_context_size_error",
                "n_prompt_tokens": 9000,
                "n_ctx": 8192,
            }
        }
        self.assertTrue(types.Http(400, json.dumps(body)).context_exceeded)
        other = {"error": {"code": 400, "message": "x", "type": "invalid_request_error"}}
        self.assertFalse(types.Http(400, json.dumps(other)).context_exceeded)
        self.assertFalse(types.Http(500, json.dumps(body)).context_exceeded)
        self.assertFalse(types.Http(400, "not json").context_exceeded)


class ValueTests(SynchronousTestCase):
    """
    Timings and completions.
    """

    def test_timings_total(self) -> None:
        """
        A request's context is its cached, evaluated and generated tokens together.
        """
        self.assertEqual(types.Timings(cache_n=10, prompt_n=5, predicted_n=7).total, 22)

    def test_completion_as_message(self) -> None:
        """
        A completion becomes the assistant message of the next request unchanged.
        """
        call = types.ToolCall("c1", "get_weather", '{"city":"test"}')
        completion = types.Completion(
            id="chatcmpl-1",
            content=None,
            reasoning_content="hmm",
            tool_calls=(call,),
            finish_reason=types.FinishReason.TOOL_CALLS,
            timings=types.Timings(),
        )
        self.assertEqual(completion.as_message(), types.Assistant(None, "hmm", (call,)))


class RetryAfterTests(SynchronousTestCase):
    """L{retry_after_seconds} reads a response's Retry-After as seconds."""

    def test_values(self) -> None:
        """Numbers are seconds; a date, a negative, NaN, garbage or no header is None."""
        table = {
            "1": 1.0,
            " 2 ": 2.0,
            "0.5": 0.5,
            "0": 0.0,
            "-1": None,
            "nan": None,
            "inf": None,
            "Wed, 21 Oct 2015 07:28:00 GMT": None,
            "soon": None,
        }
        for value, expected in table.items():
            self.assertEqual(retry_after_seconds({"retry-after": value}), expected, value)
        self.assertIsNone(retry_after_seconds({}))
