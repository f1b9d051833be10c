"""
The llama client end to end: a real llama.cpp server (xllamacpp) with the project's tiny
models, a real `twist inferproxy` in front of it, and L{loopd.llama.Client} talking to the
inferproxy's Unix socket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import tempfile
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.trial.unittest import SkipTest, TestCase

from loopd.errors import Stalled
from loopd.llama import (
    Assistant,
    ChatEvent,
    ChatRequest,
    Client,
    Content,
    FinishReason,
    Progress,
    Reasoning,
    Retrying,
    System,
    ThinkingCapped,
    ToolSchema,
    User,
    cache_outcome,
)
from loopd.settings import Config, Endpoint, Limits, Retry, Thinking
from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import TwistProcess, spawn_twist, stop_twist

try:
    from loopd.demo.real_server import RealServer
    from loopd.demo.tiny_model import Ballast, write_tiny_model
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the real llama.cpp server needs the test extra: {e}") from None

ANSWER = "Hello from the tiny model!"
WEATHER = ToolSchema(
    "get_weather",
    "Get the weather for a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


#: Prompt processing that costs real time: the tiny model with zero-weight ballast, one slot,
#: batches of 8,192 tokens, each several seconds on 2 threads (a 2,048-token batch took
#: 0.96 s on an idle machine and 4.3 s on a loaded one: four times that leaves the liveness
#: limit below a batch on either).
PREFILL_BALLAST = Ballast(4096, 6)
PREFILL_SERVER = {"n_ctx": 32768, "parallel": 1, "batch": 8192}
#: A liveness limit well below one batch's time. /slots is asked 250 ms before it, then
#: every 750 ms while it shows the slot working: within what the inferproxy in front
#: accepts (a burst of 10, then 2 a second).
PREFILL_LIMITS = Limits(poll_ms=250, liveness_ms=1000)


def filler(tokens: int) -> str:
    """About C{tokens} tokens of text for the tiny model (words it does not merge)."""
    words, size, index = [], 0, 0
    while size < tokens:
        word = f" pq{index % 89}"
        words.append(word)
        size += len(word)
        index += 1
    return "".join(words)[:tokens]


class LlamaEndToEndTests(TestCase):
    """
    The client against the real thing.
    """

    timeout = 120

    @inlineCallbacks
    def start(
        self,
        model: str,
        *,
        ballast: Ballast | None = None,
        server: dict[str, Any] | None = None,
        **config: Any,
    ) -> Any:
        """
        Start the server (with C{server}, more of L{RealServer}'s options) and an inferproxy
        in front of it; build a client for them. C{ballast} makes the model cost real time.
        """
        reactor = real_reactor()
        self.directory = tempfile.mkdtemp(prefix="lde", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.socket = os.path.join(self.directory, "infer.sock")
        # The model is written per test (a few milliseconds): trial has no module teardown.
        model_path = os.path.join(self.directory, model)
        write_tiny_model(model_path, think_forever=model == "tiny-think.gguf", ballast=ballast)
        self.server = RealServer(reactor, model_path, **(server or {}))
        self.addCleanup(self.server.stop)
        yield self.server.start()
        yield self.start_proxy()
        endpoint = Endpoint(name="tiny", socket=self.socket)
        self.client = Client(reactor, Config(endpoints=(endpoint,), **config), endpoint)
        self.events: list[ChatEvent] = []

    @inlineCallbacks
    def start_proxy(self) -> Any:
        self.proxy: TwistProcess = spawn_twist(
            real_reactor(),
            b"inferproxy listening on",
            "inferproxy",
            "--listen",
            self.socket,
            "--upstream",
            f"127.0.0.1:{self.server.port}",
        )
        self.addCleanup(stop_twist, self.proxy)
        yield self.proxy.ready

    def ask(self, *messages: Any, tools: tuple[ToolSchema, ...] = (), thinking: bool = True) -> Any:
        request = ChatRequest(slot=0, messages=tuple(messages), tools=tools, thinking=thinking)
        return self.client.chat_with_retry(request, self.events.append)

    @inlineCallbacks
    def test_plain_answer(self) -> Any:
        """
        With thinking off the model answers at once: stop, no reasoning, timings counted.
        """
        yield self.start("tiny.gguf")
        completion = yield self.ask(User("Hi"), thinking=False)
        self.assertEqual(completion.content, ANSWER)
        self.assertIsNone(completion.reasoning_content)
        self.assertEqual(completion.finish_reason, FinishReason.STOP)
        self.assertGreater(completion.timings.predicted_n, 0)
        self.assertTrue(completion.id.startswith("chatcmpl-"))

    @inlineCallbacks
    def test_thinking_then_answer(self) -> Any:
        """
        With thinking on the reasoning streams first, then the answer.
        """
        yield self.start("tiny.gguf")
        completion = yield self.ask(System("Be brief."), User("Hi"))
        self.assertEqual(completion.reasoning_content, "Let me think about this...")
        self.assertEqual(completion.content, ANSWER)
        kinds = [type(e).__name__ for e in self.events]
        self.assertLess(kinds.index("Reasoning"), kinds.index("Content"))
        self.assertGreater(completion.reasoning_tokens, 0)

    @inlineCallbacks
    def test_tool_call(self) -> Any:
        """
        Offered a tool, the model calls it with valid JSON arguments.
        """
        yield self.start("tiny.gguf")
        completion = yield self.ask(User("Weather?"), tools=(WEATHER,))
        self.assertEqual(completion.finish_reason, FinishReason.TOOL_CALLS)
        (call,) = completion.tool_calls
        self.assertEqual(call.name, "get_weather")
        self.assertEqual(call.arguments.replace(" ", ""), '{"city":"test"}')

    @inlineCallbacks
    def test_second_turn_hits_cache(self) -> Any:
        """
        The second turn of a conversation on the same slot reuses the first turn's prompt.
        """
        yield self.start("tiny.gguf")
        first_messages = (System("You are a test."), User("Hi"))
        first = yield self.ask(*first_messages, thinking=False)
        second = yield self.ask(*first_messages, first.as_message(), User("Again"), thinking=False)
        outcome = cache_outcome(first.timings, second.timings)
        self.assertFalse(outcome.loss, outcome)
        self.assertGreater(second.timings.cache_n, 0)

    @inlineCallbacks
    def test_thinking_cap_real_control(self) -> Any:
        """
        A model that would think forever is stopped at the cap by the server's own
        reasoning_end control, and then answers.
        """
        yield self.start("tiny-think.gguf", thinking=Thinking(cap=40, overrun=256))
        completion = yield self.ask(User("Think"))
        capped = [e for e in self.events if isinstance(e, ThinkingCapped)]
        self.assertEqual(len(capped), 1)
        self.assertGreaterEqual(capped[0].tokens, 40)
        self.assertTrue(completion.thinking_capped)
        self.assertEqual(completion.content, ANSWER)

    @inlineCallbacks
    def test_partial_answer_continued(self) -> Any:
        """
        What a resume relies on: the server continues a final assistant message. Content
        is continued after the given text, and reasoning alone is thought on, then answered;
        only the new text streams.
        """
        yield self.start("tiny.gguf")
        hi = User("Hi")
        content = yield self.ask(hi, Assistant("Hello from"))
        self.assertEqual((content.content, content.reasoning_content), (" the tiny model!", None))
        thinking = yield self.ask(hi, Assistant(None, "Let me think"))
        self.assertEqual(thinking.reasoning_content, " about this...")
        self.assertEqual(thinking.content, ANSWER)
        plain = yield self.ask(hi, Assistant("Hello from"), thinking=False)
        self.assertEqual(plain.content, " the tiny model!")

    def _retrying_config(self) -> dict[str, Any]:
        return {
            "max_tokens": 2000,
            "thinking": Thinking(cap=100_000, overrun=256),
            "retry": Retry(attempts=6, backoff_ms=(300, 600, 1200), jitter=0.0),
            "limits": Limits(poll_ms=500, load_wait_ms=20_000, liveness_ms=10_000),
        }

    def after_reasoning(self, count: int) -> Deferred[None]:
        """
        Fire once C{count} reasoning events have arrived.
        """
        seen: Deferred[None] = Deferred()

        def watch(event: ChatEvent) -> None:
            self.events.append(event)
            reasoning = sum(isinstance(e, Reasoning) for e in self.events)
            if reasoning >= count and not seen.called:
                seen.callback(None)

        self.watch = watch
        return seen

    @inlineCallbacks
    def uninterrupted(self) -> Any:
        """The answer to the interrupted tests' request, asked once without interruption."""
        request = ChatRequest(slot=1, messages=(User("Think"),))
        reference = yield self.client.chat_with_retry(request, lambda e: None)
        self.assertEqual(reference.timings.predicted_n, 2000)
        return reference

    def assert_whole(self, completion: Any, reference: Any) -> None:
        """
        C{completion}, resumed after an interruption, is C{reference}: the same text, once,
        in the events as in the completion, after a retry (more than one while the
        restarted server is not back yet), with the counts of one answer.
        """
        self.assertTrue(any(isinstance(e, Retrying) for e in self.events))
        streamed = "".join(e.text for e in self.events if isinstance(e, Reasoning))
        self.assertEqual(streamed, reference.reasoning_content)
        self.assertEqual(completion.reasoning_content, reference.reasoning_content)
        self.assertEqual(completion.content, reference.content)
        self.assertEqual(completion.finish_reason, FinishReason.LENGTH)
        self.assertEqual(completion.timings.predicted_n, 2000)

    @inlineCallbacks
    def test_server_restart_survived(self) -> Any:
        """
        The server killed and restarted under a request: chat_with_retry continues the
        partial answer, and the answer is the one an uninterrupted request gets, each piece
        delivered once.
        """
        yield self.start("tiny-think.gguf", **self._retrying_config())
        reference = yield self.uninterrupted()
        midway = self.after_reasoning(5)
        request = ChatRequest(slot=0, messages=(User("Think"),))
        answer = self.client.chat_with_retry(request, lambda e: self.watch(e))
        yield midway
        yield self.server.kill()
        yield self.server.start()
        completion = yield answer
        self.assert_whole(completion, reference)

    @inlineCallbacks
    def test_inferproxy_restart_survived(self) -> Any:
        """
        The inferproxy killed and restarted under a request: the same, through the
        forwarder.
        """
        yield self.start("tiny-think.gguf", **self._retrying_config())
        reference = yield self.uninterrupted()
        midway = self.after_reasoning(5)
        request = ChatRequest(slot=0, messages=(User("Think"),))
        answer = self.client.chat_with_retry(request, lambda e: self.watch(e))
        yield midway
        yield stop_twist(self.proxy)
        yield self.start_proxy()
        completion = yield answer
        self.assert_whole(completion, reference)

    @inlineCallbacks
    def test_answer_cut_survived(self) -> Any:
        """
        Cut mid-answer (the inferproxy restarted after five pieces of content, the thought
        ended by the server's budget at 20 tokens): the continuation goes on after the
        delivered content, and the reasoning and the content are those of an uninterrupted
        answer, each piece once (llama.cpp b11434 sent the prefill back when the request did
        not name the part continued: "Hello fromHello from the tiny model!").
        """
        yield self.start("tiny-think.gguf", **self._retrying_config())
        fields = {"ignore_eos": True, "reasoning_budget_tokens": 20}
        whole = ChatRequest(slot=1, messages=(User("Think"),), max_tokens=300, fields=fields)
        reference = yield self.client.chat_with_retry(whole, lambda e: None)
        self.assertTrue(reference.reasoning_content and reference.content)
        midway: Deferred[None] = Deferred()

        def watch(event: ChatEvent) -> None:
            self.events.append(event)
            if sum(isinstance(e, Content) for e in self.events) >= 5 and not midway.called:
                midway.callback(None)

        answer = self.client.chat_with_retry(dataclasses.replace(whole, slot=0), watch)
        yield midway
        yield stop_twist(self.proxy)
        yield self.start_proxy()
        completion = yield answer
        self.assertTrue(any(isinstance(e, Retrying) for e in self.events))
        reasoning = "".join(e.text for e in self.events if isinstance(e, Reasoning))
        content = "".join(e.text for e in self.events if isinstance(e, Content))
        self.assertEqual((reasoning, content), (reference.reasoning_content, reference.content))
        self.assertEqual(
            (completion.reasoning_content, completion.content),
            (reference.reasoning_content, reference.content),
        )
        self.assertEqual(completion.timings.predicted_n, 300)

    # -- prompt processing (decision 44) ---------------------------------------------

    def long_prompt(self) -> ChatRequest:
        """A prompt of two full batches and a part of a third, thinking off, on slot 0."""
        system = System("You are a test." + filler(20000))
        return ChatRequest(slot=0, messages=(system, User("Hi")), thinking=False)

    @inlineCallbacks
    def test_slow_batches_complete(self) -> Any:
        """
        Every full batch of the prompt takes longer than liveness_ms by the server's own
        progress events (their time_ms), and the single attempt completes all the same.
        """
        yield self.start(
            "tiny.gguf", ballast=PREFILL_BALLAST, server=PREFILL_SERVER, limits=PREFILL_LIMITS
        )
        completion = yield self.client.chat(self.long_prompt(), self.events.append)
        self.assertEqual(completion.content, ANSWER)
        progress = [e for e in self.events if isinstance(e, Progress)]
        steps = [
            (later.processed - earlier.processed, (later.time_ms or 0) - (earlier.time_ms or 0))
            for earlier, later in zip(progress, progress[1:], strict=False)
        ]
        full = [ms for tokens, ms in steps if tokens == PREFILL_SERVER["batch"]]
        self.assertGreaterEqual(len(full), 2, steps)
        for ms in full:
            self.assertGreater(ms, PREFILL_LIMITS.liveness_ms, steps)
        self.assertEqual(progress[-1].processed, completion.timings.prompt_n)

    @inlineCallbacks
    def test_frozen_server_stalls(self) -> Any:
        """
        The server stopped (SIGSTOP) as its prompt processing starts: neither the stream
        nor /slots answers, and the call is Stalled, saying what /slots did.
        """
        yield self.start(
            "tiny.gguf", ballast=PREFILL_BALLAST, server=PREFILL_SERVER, limits=PREFILL_LIMITS
        )
        pid = self.server.pid
        assert pid is not None

        def resume() -> None:
            # contextlib.suppress by its full name: trial reads a module's "suppress".
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

        # Runs before the server's stop (cleanups run last added first).
        self.addCleanup(resume)

        def freeze(event: ChatEvent) -> None:
            if isinstance(event, Progress) and not self.events:
                os.kill(pid, signal.SIGSTOP)
            self.events.append(event)

        stalled = yield self.assertFailure(self.client.chat(self.long_prompt(), freeze), Stalled)
        # The poll's own time limit ends with the liveness limit; whichever the reactor runs
        # first, the message says what /slots did.
        self.assertRegex(str(stalled), r"^no data for \d+ ms; /slots (has not answered|failed)")
        self.assertEqual([type(e) for e in self.events], [Progress])
