"""
Resuming a cut answer on the genuine llama-server b11434 (issue 26, item 10): the kit's
binary (L{loopd.demo.llama_binary}) serving the thinking test model, the llama client in
front of it through a real C{twist inferproxy} that is restarted under the stream, once in
the middle of the thought and once in the middle of the answer. The resumed answer must be
the uninterrupted one, each piece once, in the events as in the completion: b11434 sent the
whole delivered text back as the first chunk of a continuation that did not name the part
it continued (C{"... Let meLet me think about this..."}), which the xllamacpp server the
other resume tests run does not do.

The binary runs in router mode with the one model (the router proxies to a server of
b11434's own code); the client names the model as for any router's model.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.trial.unittest import SkipTest, TestCase

try:
    from loopd.demo.router_server import RouterServer, write_models_dir
    from loopd.llama import ChatRequest, Client
    from loopd.llama.router import model_endpoints
    from loopd.llama.types import ChatEvent, Content, Reasoning, Retrying, User
    from loopd.settings import Config, Endpoint, Limits, Retry, Thinking
    from loopd.test.support.gateway_stack import BUILD_TEST_TIMEOUT, ensure_binary
    from loopd.test.support.peers import real_reactor
    from loopd.test.support.twist import TwistProcess, spawn_twist, stop_twist
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the b11434 resume tests need the test extra: {e}") from None

MODEL = "tiny-think"


class ResumeOnB11434Tests(TestCase):
    """A stream cut mid-thought and mid-answer, resumed on the genuine server."""

    timeout = BUILD_TEST_TIMEOUT

    @inlineCallbacks
    def setUp(self) -> Any:
        binary = yield ensure_binary()
        reactor = real_reactor()
        directory = tempfile.mkdtemp(prefix="lb", dir="/tmp")
        self.addCleanup(lambda: __import__("shutil").rmtree(directory, True))
        models = os.path.join(directory, "models")
        write_models_dir(models, [MODEL])
        self.server = RouterServer(reactor, binary, models, models_max=1, parallel=2)
        self.addCleanup(self.server.stop)
        yield self.server.start()
        self.socket = os.path.join(directory, "infer.sock")
        yield self.start_proxy()
        router = Endpoint(name="b11434", socket=self.socket, kind="llama-server-router")
        (endpoint,) = model_endpoints(router, [MODEL])
        config = Config(
            endpoints=(endpoint,),
            max_tokens=300,
            thinking=Thinking(cap=100_000, overrun=256),
            retry=Retry(attempts=6, backoff_ms=(300, 600, 1200), jitter=0.0),
            limits=Limits(poll_ms=500, load_wait_ms=20_000, liveness_ms=10_000),
        )
        self.client = Client(reactor, config, endpoint)
        self.events: list[ChatEvent] = []

    @inlineCallbacks
    def start_proxy(self) -> Any:
        """A C{twist inferproxy} from the socket to the server."""
        self.proxy: TwistProcess = spawn_twist(
            real_reactor(),
            b"inferproxy listening on",
            *("inferproxy", "--listen", self.socket, "--upstream", f"127.0.0.1:{self.server.port}"),
        )
        self.addCleanup(stop_twist, self.proxy)
        yield self.proxy.ready

    @inlineCallbacks
    def cut_after(self, request: ChatRequest, kind: type, count: int) -> Any:
        """
        Send C{request} (on slot 0), restart the inferproxy once C{count} pieces of C{kind}
        arrived, and fire with the completion; C{self.events} has what the client saw.
        """
        midway: Deferred[None] = Deferred()

        def watch(event: ChatEvent) -> None:
            self.events.append(event)
            if sum(isinstance(e, kind) for e in self.events) >= count and not midway.called:
                midway.callback(None)

        answer = self.client.chat_with_retry(dataclasses.replace(request, slot=0), watch)
        yield midway
        yield stop_twist(self.proxy)
        yield self.start_proxy()
        completion = yield answer
        return completion

    def assert_once(self, completion: Any, reference: Any) -> None:
        """After a retry, the events and the completion hold the uninterrupted answer."""
        self.assertTrue(any(isinstance(e, Retrying) for e in self.events))
        reasoning = "".join(e.text for e in self.events if isinstance(e, Reasoning))
        content = "".join(e.text for e in self.events if isinstance(e, Content))
        self.assertNotIn("meLet", reasoning)
        self.assertEqual(
            (reasoning, content), (reference.reasoning_content or "", reference.content or "")
        )
        self.assertEqual(
            (completion.reasoning_content, completion.content),
            (reference.reasoning_content, reference.content),
        )

    @inlineCallbacks
    def test_cut_mid_thought(self) -> Any:
        """Cut after five pieces of thinking: the thought goes on where it stopped."""
        request = ChatRequest(slot=1, messages=(User("Think"),))
        reference = yield self.client.chat_with_retry(request, lambda e: None)
        completion = yield self.cut_after(request, Reasoning, 5)
        self.assert_once(completion, reference)

    @inlineCallbacks
    def test_cut_mid_answer(self) -> Any:
        """
        Cut after five pieces of the answer (the thought ended by the server's budget at 20
        tokens): the answer goes on after the delivered content, the thought not repeated.
        """
        fields = {"ignore_eos": True, "reasoning_budget_tokens": 20}
        request = ChatRequest(slot=1, messages=(User("Think"),), fields=fields)
        reference = yield self.client.chat_with_retry(request, lambda e: None)
        self.assertTrue(reference.reasoning_content and reference.content)
        completion = yield self.cut_after(request, Content, 5)
        self.assert_once(completion, reference)
