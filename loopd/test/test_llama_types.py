"""
L{loopd.llama.types}: the small behaviours of the values.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from loopd.llama import types
from loopd.llama.chat import retry_after_seconds


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
