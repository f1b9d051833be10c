"""
Tests for L{loopd.chatloop}: the chat session, against a scripted fake gateway
(L{FakeLlama}) on a L{MemoryNet}, in memory.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from loopd.chatloop import ChatSession
from loopd.chatui import Conversation
from loopd.test.support.fake_llama import CHAT, FakeLlama, Piece, Reply, json_reply, sse_reply
from loopd.test.support.memory_net import MemoryNet

GATEWAY = "/tmp/ld-memory/chatloop-loopd.sock"


def chunk(delta: dict[str, Any], finish: str | None = None) -> Any:
    """One streamed chat-completion chunk."""
    out: dict[str, Any] = {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}]}
    out.update(id="chatcmpl-1", object="chat.completion.chunk")
    return out


def comment(event: str, **fields: Any) -> Piece:
    """A C{: loopd {...}} comment piece, as the gateway writes it."""
    return Piece(0.0, b": loopd " + json.dumps({"event": event, **fields}).encode() + b"\n\n")


class ChatSessionTests(SynchronousTestCase):
    """
    L{ChatSession} streams turns from a (fake) gateway and keeps the history.
    """

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.net = MemoryNet(self.reactor)
        self.gateway = FakeLlama(self.reactor)
        self.net.listen(GATEWAY, self.gateway)
        self.output: list[str] = []
        conversation = Conversation(model="tiny")
        self.session = ChatSession(
            self.reactor, GATEWAY, conversation, self.output.append, session_id="s1"
        )
        self.session.start()

    def answer(self, text: str, *before: Piece) -> Reply:
        """A streamed answer of C{text}, after C{before} (loopd comments)."""
        return sse_reply([*before, chunk({"content": text}), chunk({}, "stop")])

    def say(self, line: str) -> str:
        """Type C{line}, run the turn; return what was written for it."""
        start = len(self.output)
        self.session.line(line)
        self.net.advance(1)
        return "".join(self.output[start:])

    def test_two_turns(self) -> None:
        """The second request repeats the first turn; both carry the same session id."""
        progress = comment("progress", total=10, cache=0, processed=10)
        self.gateway.script("POST", CHAT, self.answer("First.", progress), self.answer("Second."))
        self.assertIn("First.\nyou> ", self.say("One"))
        self.assertIn("Second.\nyou> ", self.say("Two"))
        first, second = self.gateway.requests_to("POST", CHAT)
        self.assertEqual(first.json["model"], "tiny")
        self.assertTrue(second.json["stream"])
        self.assertEqual(
            [(m["role"], m["content"]) for m in second.json["messages"]],
            [("user", "One"), ("assistant", "First."), ("user", "Two")],
        )
        self.assertEqual([r.header("X-Session-Id") for r in (first, second)], ["s1", "s1"])

    def test_progress_shown(self) -> None:
        """Progress and queue events are shown on the status line."""
        events = (comment("queued", ahead=1), comment("progress", total=4, cache=0, processed=2))
        self.gateway.script("POST", CHAT, self.answer("Hi", *events))
        out = self.say("One")
        self.assertIn("\rqueued: position 2 (1 ahead)", out)
        self.assertIn("  50% 2/4 tokens", out)

    def test_error_then_go_on(self) -> None:
        """An error is one line, the question leaves the history, and the chat goes on."""
        error = {"message": "no endpoint serves model 'tiny'", "code": "model_not_found"}
        refused = json_reply(404, {"error": {**error, "type": "invalid_request_error"}})
        self.gateway.script("POST", CHAT, refused, self.answer("Fine."))
        out = self.say("One")
        self.assertEqual(
            out, "error: HTTP 404: no endpoint serves model 'tiny' (model_not_found)\nyou> "
        )
        self.say("Two")
        last = self.gateway.requests_to("POST", CHAT)[-1]
        self.assertEqual([m["content"] for m in last.json["messages"]], ["Two"])
        self.assertFalse(self.session.finished.called)

    def test_stream_error(self) -> None:
        """An error event mid-stream is one line after the partial answer."""
        error = {"error": {"message": "upstream failed", "type": "server_error"}}
        reply = sse_reply([chunk({"content": "Hal"}), error], done=False)
        self.gateway.script("POST", CHAT, reply)
        self.assertEqual(self.say("One"), "Hal\nerror: upstream failed\nyou> ")
        self.assertEqual(self.session.conversation.messages, [])

    def test_no_gateway(self) -> None:
        """No loopd on the socket is one error line naming the socket."""
        self.net.stop_listening(GATEWAY)
        out = self.say("One")
        self.assertTrue(out.startswith("error: cannot connect to loopd: "), out)
        self.assertIn(GATEWAY, out)
        self.assertTrue(out.endswith("\nyou> "))

    def test_quit(self) -> None:
        """/quit ends the chat with status 0; blank lines just prompt again."""
        self.assertEqual(self.say("   "), "you> ")
        self.say("/quit")
        self.assertEqual(self.successResultOf(self.session.finished), 0)
        self.assertEqual(self.gateway.requests, [])

    def test_end_of_input_waits_for_the_turn(self) -> None:
        """Input that ends during a turn ends the chat after the answer is shown."""
        self.gateway.script("POST", CHAT, self.answer("Last."))
        self.session.line("One")
        self.session.end_of_input()
        self.assertNoResult(self.session.finished)
        self.net.advance(1)
        self.assertEqual(self.successResultOf(self.session.finished), 0)
        self.assertTrue("".join(self.output).endswith("Last.\n\n"))

    def test_lines_wait_their_turn(self) -> None:
        """Lines typed during a turn are asked one after the other."""
        self.gateway.script("POST", CHAT, self.answer("A."), self.answer("B."))
        self.session.line("One")
        self.session.line("Two")
        self.net.advance(1)
        self.net.advance(1)
        self.assertEqual(len(self.gateway.requests_to("POST", CHAT)), 2)
        self.assertIn("A.\nyou> B.\nyou> ", "".join(self.output))
