"""
The first line of C{loopd chat} (L{loopd.chatloop.ChatSession.start}) names the model it talks to,
and a chat that names none asks the gateway's C{auto} router.
"""

from __future__ import annotations

from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from loopd import chatloop
from loopd.chatui import Conversation
from loopd.test.support.fake_llama import CHAT, FakeLlama, sse_reply
from loopd.test.support.memory_net import MemoryNet
from loopd.testing.llama_replies import chunk

GATEWAY = "/tmp/ld-greeting/loopd.sock"


class GreetingTests(SynchronousTestCase):
    """What the chat says first, and which model its requests name."""

    def chat(self, model: str | None) -> tuple[list[str], FakeLlama]:
        """Start a chat with C{model}, ask one question; its output and the fake gateway."""
        reactor = MemoryReactorClock()
        net, gateway = MemoryNet(reactor), FakeLlama(reactor)
        net.listen(GATEWAY, gateway)
        gateway.script("POST", CHAT, sse_reply([chunk({"content": "Hi"}), chunk({}, "stop")]))
        output: list[str] = []
        session = chatloop.ChatSession(reactor, GATEWAY, Conversation(model=model), output.append)
        session.start()
        session.line("Hello")
        net.advance(1)
        return output, gateway

    def test_named_model(self) -> None:
        """A chat with --model names it in the greeting and in every request."""
        output, gateway = self.chat("mesh")
        self.assertIn(" with mesh; ", output[0])
        (request,) = gateway.requests_to("POST", CHAT)
        self.assertEqual(request.json["model"], "mesh")

    def test_default_is_auto(self) -> None:
        """Without --model the greeting says auto and the request names no model."""
        output, gateway = self.chat(None)
        self.assertIn(" with auto; ", output[0])
        (request,) = gateway.requests_to("POST", CHAT)
        self.assertNotIn("model", request.json)
