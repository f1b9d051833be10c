"""
The gateway end to end, every part a real process: a real llama.cpp server (xllamacpp) with
the project's tiny models, `twist inferproxy` in front of it, and `twist loopd --config` with
a generated loopd.toml serving on a Unix socket. The clients are the official `openai` SDK
over that socket (an HTTP transport with `uds=`), `curl --unix-socket`, and raw HTTP.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import stat
from pathlib import Path
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.protocol import Factory
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import SkipTest, TestCase

from loopd.digest import sha256_hex
from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import ROOT, TwistProcess, spawn_twist, stop_twist

try:
    import openai

    from loopd.demo.tiny_model import ANSWER, THOUGHT
    from loopd.test.support.gateway_stack import (
        HI,
        SLOTS,
        WEATHER,
        RawStream,
        httpx,
        loopd_toml,
        serve_behind_proxy,
    )
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the gateway end-to-end tests need the test extra: {e}") from None

#: The recipe for the openai SDK over the Unix socket: the one Python block of each of these
#: pages (the manual's, and the README's copy of it) that builds a client with
#: C{HTTPTransport(uds=SOCKET)}.
RECIPE = re.compile(r"```python\n(import httpx2\b.*?uds=SOCKET.*?)```", re.DOTALL)
RECIPE_PAGES = ("docs/demo.md", "README.md")


def sdk_recipe(page: str, socket: str) -> str:
    """
    The SDK recipe of C{page} (relative to the checkout), its C{SOCKET} line pointed at
    C{socket}; with an SDK built on C{httpx} (1.x, 2.x) rather than C{httpx2}, its import as
    the recipe's comment says.
    """
    found = RECIPE.search(Path(ROOT, page).read_text(encoding="utf-8"))
    if found is None:
        raise AssertionError(f"{page} has no openai SDK recipe over the Unix socket")
    code = re.sub(r"^SOCKET = .*$", f"SOCKET = {socket!r}", found.group(1), flags=re.M)
    if httpx.__name__ != "httpx2":
        code = re.sub(r"^import httpx2\b.*$", "import httpx as httpx2", code, flags=re.M)
    return code


class GatewayEndToEndTests(TestCase):
    """
    The gateway as users run it.
    """

    timeout = 180

    @inlineCallbacks
    def start(self, model: str = "tiny.gguf", *, template_sha: str | None = None) -> Any:
        """
        Start the server with C{model}, an inferproxy and C{twist loopd}. With the tiny
        model loopd self-tests the endpoint against the server's own /props (but
        C{template_sha} when given); with the thinking one it does not, and streams long.
        """
        reactor = real_reactor()
        self.directory, self.server, infer = yield serve_behind_proxy(self, model, SLOTS)
        self.socket = os.path.join(self.directory, "loopd.sock")
        expect = None
        if model == "tiny.gguf":
            props = (yield self.server.query("/props")).json()
            self.template_sha = sha256_hex(props["chat_template"].encode("utf-8"))
            expect = {
                "chat_template_sha256": template_sha or self.template_sha,
                "n_ctx": props["default_generation_settings"]["n_ctx"],
                "total_slots": props["total_slots"],
            }
        config = os.path.join(self.directory, "loopd.toml")
        with open(config, "w") as f:
            f.write(loopd_toml(self.socket, infer, expect, long=expect is None))
        self.loopd: TwistProcess = spawn_twist(
            reactor, b"loopd serving", "loopd", "--config", config
        )
        self.addCleanup(stop_twist, self.loopd)

    def sdk(self) -> Any:
        """An OpenAI client that reaches loopd through its Unix socket."""
        transport = httpx.HTTPTransport(uds=self.socket)
        return openai.OpenAI(
            base_url="http://loopd/v1",
            api_key="x",
            max_retries=0,
            http_client=httpx.Client(transport=transport, timeout=60),
        )

    @inlineCallbacks
    def open_stream(self, marker: bytes, count: int) -> Any:
        """Start a streamed chat on a raw connection; fire with it once it has begun."""
        stream = RawStream(marker, count)
        endpoint = UNIXClientEndpoint(real_reactor(), self.socket)
        yield endpoint.connect(Factory.forProtocol(lambda: stream))
        body = json.dumps({"model": "tiny", "messages": HI, "stream": True}).encode()
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: loopd\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        assert stream.transport is not None
        stream.transport.write(head.encode() + body)
        yield stream.seen
        return stream

    @inlineCallbacks
    def busy_slots(self) -> Any:
        """How many of the real server's slots are processing a task now."""
        slots = (yield self.server.query("/slots")).json()
        return sum(bool(slot["is_processing"]) for slot in slots)

    @inlineCallbacks
    def test_openai_stream(self) -> Any:
        """The SDK streams role, reasoning and answer deltas, one finish_reason, and usage."""
        yield self.start()
        yield self.loopd.ready
        self.assertEqual(stat.S_IMODE(os.stat(self.socket).st_mode), 0o600)

        def ask() -> list[Any]:
            with self.sdk() as client:
                options = {"include_usage": True}
                return list(
                    client.chat.completions.create(
                        model="tiny", messages=HI, stream=True, stream_options=options
                    )
                )

        chunks = yield deferToThread(ask)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        self.assertEqual(deltas[0].role, "assistant")
        self.assertEqual("".join(d.content or "" for d in deltas), ANSWER)
        thought = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        self.assertEqual(thought, THOUGHT)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        self.assertEqual([f for f in finishes if f], ["stop"])
        usage = chunks[-1].usage
        self.assertEqual(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens)
        self.assertGreater(usage.completion_tokens, 0)

    @inlineCallbacks
    def test_sdk_recipe(self) -> Any:
        """
        The openai SDK recipe of docs/demo.md, and the README's copy of it, each run as it is
        written (only its socket path changed), print the model's answer: neither page can
        drift from the SDK the extras install.
        """
        yield self.start()
        yield self.loopd.ready

        def run(page: str) -> str:
            code = sdk_recipe(page, self.socket)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(code, page, "exec"), {"__name__": "recipe"})
            return printed.getvalue()

        for page in RECIPE_PAGES:
            printed = yield deferToThread(run, page)
            self.assertEqual(printed, ANSWER + "\n", page)

    @inlineCallbacks
    def test_openai_non_stream(self) -> Any:
        """With thinking off, the SDK gets the answer alone in one chat.completion."""
        yield self.start()
        yield self.loopd.ready

        def ask() -> Any:
            with self.sdk() as client:
                return client.chat.completions.create(
                    model="tiny", messages=HI, reasoning_effort="none"
                )

        completion = yield deferToThread(ask)
        self.assertTrue(completion.id.startswith("chatcmpl-"))
        self.assertEqual(completion.model, "tiny")
        (choice,) = completion.choices
        self.assertEqual((choice.message.content, choice.finish_reason), (ANSWER, "stop"))
        self.assertIsNone((choice.message.model_extra or {}).get("reasoning_content"))
        self.assertGreater(completion.usage.prompt_tokens, 0)

    @inlineCallbacks
    def test_openai_models(self) -> Any:
        """The SDK lists the models, retrieves one, and gets NotFoundError for an unknown id."""
        yield self.start()
        yield self.loopd.ready

        def ask() -> tuple[list[str], Any, Any]:
            with self.sdk() as client:
                listed = [m.id for m in client.models.list()]
                one = client.models.retrieve("tiny")
                try:
                    client.models.retrieve("gpt-9")
                except openai.NotFoundError as error:
                    return listed, one, error
                raise AssertionError("an unknown model was retrieved")

        listed, one, missing = yield deferToThread(ask)
        self.assertEqual(listed, ["tiny", "auto", "mesh"])
        self.assertEqual((one.id, one.object, one.owned_by), ("tiny", "model", "loopd"))
        self.assertEqual(missing.status_code, 404)
        self.assertEqual(missing.code, "model_not_found")

    @inlineCallbacks
    def test_openai_session_header(self) -> Any:
        """
        The SDK's default_headers session-id (as Codex CLI sends it) names the session that
        holds the lease in its grace; an empty one is a 400 invalid_session_id naming it.
        """
        yield self.start()
        yield self.loopd.ready

        def ask() -> tuple[Any, Any]:
            transport = httpx.HTTPTransport(uds=self.socket)
            with self.sdk() as client:
                named = client.with_options(default_headers={"session-id": "sdk-e2e"})
                named.chat.completions.create(model="tiny", messages=HI, max_tokens=4)
                with httpx.Client(transport=transport) as raw:
                    queues = raw.get("http://loopd/v1/queue").json()["queues"]
                empty = client.with_options(default_headers={"session-id": ""})
                try:
                    empty.chat.completions.create(model="tiny", messages=HI, max_tokens=4)
                except openai.BadRequestError as error:
                    return queues, error
                raise AssertionError("an empty session-id was accepted")

        queues, error = yield deferToThread(ask)
        holders = [h["sessionKey"] for q in queues for h in q["holders"]]
        self.assertEqual(holders, ["sdk-e2e"])
        self.assertEqual((error.status_code, error.code), (400, "invalid_session_id"))
        self.assertIn("header session-id is empty", error.message)

    @inlineCallbacks
    def test_openai_tool_round_trip(self) -> Any:
        """A tool call, its result, then the answer, turn 2 reusing turn 1 from the cache."""
        yield self.start()
        yield self.loopd.ready
        session = {"X-Session-Id": "e2e-tools"}

        def ask(messages: list[Any]) -> Any:
            with self.sdk() as client:
                return client.chat.completions.create(
                    model="tiny", messages=messages, tools=[WEATHER], extra_headers=session
                )

        messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = yield deferToThread(ask, messages)
        self.assertEqual(first.choices[0].finish_reason, "tool_calls")
        (call,) = first.choices[0].message.tool_calls
        self.assertEqual(call.function.name, "get_weather")
        self.assertEqual(json.loads(call.function.arguments), {"city": "test"})
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'})
        second = yield deferToThread(ask, messages)
        self.assertEqual(second.choices[0].finish_reason, "stop")
        self.assertEqual(second.choices[0].message.content, ANSWER)
        self.assertGreater(second.usage.prompt_tokens_details.cached_tokens, 0)

    @inlineCallbacks
    def test_curl_stream(self) -> Any:
        """curl --unix-socket gets a stream of chunks that spell the answer, then [DONE]."""
        curl = shutil.which("curl")
        if curl is None:
            raise SkipTest("curl is not installed (apt-get install curl)")
        yield self.start()
        yield self.loopd.ready
        body = json.dumps({"model": "tiny", "messages": HI, "stream": True})
        args = ["-sS", "-N", "--unix-socket", self.socket, "--data-binary", body]
        args += ["-H", "Content-Type: application/json", "http://loopd/v1/chat/completions"]
        out, err, code = yield getProcessOutputAndValue(curl, args, env=dict(os.environ))
        self.assertEqual(code, 0, err)
        data = [line[6:] for line in out.decode().splitlines() if line.startswith("data: ")]
        self.assertEqual(data[-1], "[DONE]")
        chunks = [json.loads(d) for d in data[:-1]]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        self.assertEqual(content, ANSWER)

    @inlineCallbacks
    def test_wrong_template_hash(self) -> Any:
        """A wrong template hash: exit non-zero, the check and both hashes on stderr."""
        wrong = "f" * 64
        yield self.start(template_sha=wrong)
        self.loopd.ready.addErrback(lambda _: None)
        code = yield self.loopd.ended
        self.assertNotEqual(code, 0)
        check = f"FAIL props: chat_template sha256 expected {wrong} got {self.template_sha}"
        self.assertIn(check.encode(), self.loopd.errors)
        self.assertFalse(os.path.exists(self.socket))

    @inlineCallbacks
    def test_disconnect_frees_slot(self) -> Any:
        """A client leaving mid-stream frees the busy server slot within about a second."""
        yield self.start("tiny-think.gguf")
        yield self.loopd.ready
        stream = yield self.open_stream(b'"reasoning_content"', 20)
        busy = yield self.busy_slots()
        self.assertEqual(busy, 1)
        stream.transport.loseConnection()
        yield stream.closed
        busy = yield self.busy_slots()
        for _ in range(4):
            if busy == 0:
                break
            yield deferLater(real_reactor(), 0.25, lambda: None)
            busy = yield self.busy_slots()
        self.assertEqual(busy, 0)

    @inlineCallbacks
    def streamed(self) -> Any:
        """
        One streamed chat read whole on a raw connection: its role chunks and its
        reasoning text.
        """
        stream = yield self.open_stream(b"data: ", 1)
        yield stream.closed
        return self.stream_parts(stream)

    def stream_parts(self, stream: RawStream) -> tuple[int, str, list[bytes]]:
        """A finished stream's role chunks, its reasoning text and its data lines."""
        # Each HTTP chunk holds whole events, maybe several (a comment and its chunks).
        pieces = stream.received.split(b"\r\n")
        lines = [e[6:] for p in pieces for e in p.split(b"\n") if e.startswith(b"data: {")]
        deltas = [json.loads(e)["choices"][0]["delta"] for e in lines if b'"choices":[{' in e]
        roles = sum("role" in d for d in deltas)
        return roles, "".join(d.get("reasoning_content") or "" for d in deltas), lines

    @inlineCallbacks
    def test_stream_resumed_after_server_restart(self) -> Any:
        """
        The server killed and restarted mid-stream: the client's stream has one role
        chunk and the reasoning of an uninterrupted answer, each piece once, then [DONE].
        """
        self.directory, self.server, infer = yield serve_behind_proxy(
            self, "tiny-think.gguf", SLOTS
        )
        self.socket = os.path.join(self.directory, "loopd.sock")
        settings = (
            "max_tokens = 1500\n[thinking]\ncap = 100000\n"
            "[retry]\nattempts = 6\nbackoff_ms = [300, 600, 1200]\njitter = 0.0\n"
            "[limits]\npoll_ms = 500\nload_wait_ms = 20000\n"
        )
        config = os.path.join(self.directory, "loopd.toml")
        with open(config, "w") as f:
            f.write(settings + loopd_toml(self.socket, infer, None, long=False))
        self.loopd = spawn_twist(real_reactor(), b"loopd serving", "loopd", "--config", config)
        self.addCleanup(stop_twist, self.loopd)
        yield self.loopd.ready
        roles, reference, _ = yield self.streamed()
        self.assertEqual(roles, 1)
        stream = yield self.open_stream(b'"reasoning_content"', 5)
        yield self.server.kill()
        yield self.server.start()
        yield stream.closed
        roles, reasoning, lines = self.stream_parts(stream)
        self.assertIn(b"[DONE]", stream.received)
        self.assertIn(b'"event":"retrying"', stream.received)
        self.assertEqual(roles, 1)
        self.assertEqual(reasoning, reference)
        finish = [e for e in lines if b'"finish_reason":"length"' in e]
        self.assertEqual(len(finish), 1)

    @inlineCallbacks
    def test_sigterm(self) -> Any:
        """SIGTERM: a shutting_down event ends the stream, then exit and no socket."""
        yield self.start("tiny-think.gguf")
        yield self.loopd.ready
        stream = yield self.open_stream(b'"reasoning_content"', 20)
        assert self.loopd.transport is not None
        self.loopd.transport.signalProcess("TERM")
        yield stream.closed
        yield self.loopd.ended
        self.assertEqual(self.loopd.signal, signal.SIGTERM)
        self.assertFalse(os.path.exists(self.socket))
        events = stream.received.split(b"\r\n")
        errors = [json.loads(e[6:]) for e in events if e.startswith(b'data: {"error"')]
        self.assertEqual([e["error"]["code"] for e in errors], ["shutting_down"])
        self.assertNotIn(b"[DONE]", stream.received)
