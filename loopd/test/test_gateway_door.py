"""
Tests for L{loopd.gateway.door}: the events that replay a finished completion.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.door import replay
from loopd.llama.types import (
    Completion,
    Content,
    FinishReason,
    Reasoning,
    Timings,
    ToolCall,
    ToolCallDelta,
)


def _completion(
    content: str | None, reasoning: str | None = None, calls: tuple[ToolCall, ...] = ()
) -> Completion:
    """A completion with these parts and no counts."""
    finish = FinishReason.TOOL_CALLS if calls else FinishReason.STOP
    return Completion("c1", content, reasoning, calls, finish, Timings())


class ReplayTests(SynchronousTestCase):
    """
    L{replay} gives the events that stream a completion whole, in the order a server sends
    them: thinking, text, then each tool call.
    """

    def test_text(self) -> None:
        """A text answer is one content event."""
        self.assertEqual(replay(_completion("hello")), (Content("hello"),))

    def test_thinking_then_text(self) -> None:
        """Thinking comes before the text."""
        self.assertEqual(replay(_completion("hi", "hmm")), (Reasoning("hmm"), Content("hi")))

    def test_tool_calls(self) -> None:
        """Each tool call is one delta with its index, id, name and whole arguments."""
        calls = (ToolCall("a", "read", '{"p":1}'), ToolCall("b", "ls", "{}"))
        self.assertEqual(
            replay(_completion(None, calls=calls)),
            (ToolCallDelta(0, "a", "read", '{"p":1}'), ToolCallDelta(1, "b", "ls", "{}")),
        )

    def test_empty_parts(self) -> None:
        """Empty text and empty thinking give no events."""
        self.assertEqual(replay(_completion("", "")), ())
