"""
Tests for L{loopd.gateway.doors.door}: the events that replay a finished completion, and loopd's
own events as every door's comment lines.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.door import MESH_MODEL, loopd_comment, replay
from loopd.gateway.doors.table import front_doors
from loopd.gateway.request import GatewayRequest
from loopd.llama.types import (
    Completion,
    Content,
    FinishReason,
    Progress,
    Queued,
    Reasoning,
    Retrying,
    ThinkingCapped,
    Timings,
    ToolCall,
    ToolCallDelta,
    User,
    Waiting,
)
from loopd.moa.roles import VIRTUAL_MODEL_NAME


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


class LoopdCommentTests(SynchronousTestCase):
    """L{loopd_comment} renders loopd's own events for the SSE comment lines."""

    def test_each_kind(self) -> None:
        """Each of loopd's events has its comment object."""
        cases = [
            (Queued(2), {"event": "queued", "ahead": 2}),
            (Waiting(True, False), {"event": "waiting", "slot_busy": True, "loading": False}),
            (
                Progress(100, 40, 60),
                {"event": "progress", "total": 100, "cache": 40, "processed": 60},
            ),
            (ThinkingCapped(512), {"event": "thinking_capped", "tokens": 512}),
            (
                Retrying(2, 250, "Connect: refused"),
                {"event": "retrying", "attempt": 2, "after_ms": 250, "error": "Connect: refused"},
            ),
        ]
        self.assertEqual([(event, loopd_comment(event)) for event, _ in cases], cases)

    def test_chunk_events(self) -> None:
        """The events that become chunks have no comment."""
        for event in (Reasoning("r"), Content("c"), ToolCallDelta(0, "i", "n", "")):
            self.assertIsNone(loopd_comment(event))


class MeshAnswerTests(SynchronousTestCase):
    """
    Every door answers a mesh turn (L{loopd.gateway.doors.door.Door.mesh_answer}): chat
    completions in the reference's shapes, the others as any answer from the model C{mesh}.
    """

    def test_mesh_model(self) -> None:
        """The doors' name of the virtual model is the mixture of agents' own."""
        self.assertEqual(MESH_MODEL, VIRTUAL_MODEL_NAME)

    def test_every_door(self) -> None:
        """Each door's mesh answer writes the turn's text as a body of its API."""
        completion = Completion("chatcmpl-moa-1", "Paris.", None, (), FinishReason.STOP, Timings())
        request = GatewayRequest(model="mesh", messages=(User("Capital of France?"),))
        bodies: dict[str, Any] = {}
        for _, door in front_doors("drop", Clock().seconds).by_path:
            body = door.mesh_answer(request, "chatcmpl-moa-1", 1_700_000_000).body(completion)
            bodies[door.name] = body
        self.assertEqual(bodies["chat"]["id"], "chatcmpl-moa-1")
        self.assertEqual(bodies["chat"]["choices"][0]["message"]["content"], "Paris.")
        self.assertEqual(bodies["chat"]["usage"]["completion_tokens"], 2)
        self.assertEqual(bodies["messages"]["model"], "mesh")
        self.assertEqual(bodies["messages"]["content"], [{"type": "text", "text": "Paris."}])
        self.assertEqual(bodies["responses"]["model"], "mesh")
        self.assertEqual(bodies["responses"]["output"][0]["content"][0]["text"], "Paris.")
