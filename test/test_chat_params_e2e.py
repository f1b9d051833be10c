"""
Chat completions side by side (issue 14, Deliver 0): the same request sent to a real
llama.cpp server (xllamacpp, the project's tiny model) directly and through `twist loopd`
in front of it, and the answers compared: structured output, the server's own 400s,
logprobs in the JSON and the stream, n choices, the role chunk, return_progress chunks, the
context error.
"""

from __future__ import annotations

import json
import os
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase

from loopd.digest import sha256_hex
from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import TwistProcess, spawn_twist, stop_twist

try:
    from loopd.demo.tiny_model import ANSWER
    from loopd.test.support.gateway_stack import (
        HI,
        SLOTS,
        httpx,
        loopd_toml,
        serve_behind_proxy,
    )
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the chat parameter end-to-end tests need the test extra: {e}") from None

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}
#: Far more tokens than a slot's context (the tiny model makes about six of each word).
TOO_LONG = [{"role": "user", "content": "hello " * 8000}]


def events(text: str) -> list[dict[str, Any]]:
    """The data events of an SSE body, C{[DONE]} and comment lines left out."""
    found = []
    for block in text.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                found.append(json.loads(line[len("data: ") :]))
    return found


def tokens(entries: list[dict[str, Any]]) -> list[str]:
    """The tokens of logprobs entries."""
    return [entry["token"] for entry in entries]


def streamed_logprobs(chunks: list[dict[str, Any]]) -> list[str]:
    """The tokens of every chunk's logprobs, in order."""
    found: list[str] = []
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            found += tokens((choice.get("logprobs") or {}).get("content") or [])
    return found


def texts_by_choice(chunks: list[dict[str, Any]]) -> dict[int, str]:
    """The streamed content of each choice, by index."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            piece = choice["delta"].get("content") or ""
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


class SideBySideTests(TestCase):
    """The same request to llama-server and through loopd."""

    timeout = 180

    @inlineCallbacks
    def start(self) -> Any:
        """Start the server, an inferproxy and C{twist loopd}, which self-tests it."""
        reactor = real_reactor()
        directory, self.server, infer = yield serve_behind_proxy(self, "tiny.gguf", SLOTS)
        self.socket = os.path.join(directory, "loopd.sock")
        props = (yield self.server.query("/props")).json()
        expect = {
            "chat_template_sha256": sha256_hex(props["chat_template"].encode("utf-8")),
            "n_ctx": props["default_generation_settings"]["n_ctx"],
            "total_slots": props["total_slots"],
        }
        config = os.path.join(directory, "loopd.toml")
        with open(config, "w") as f:
            f.write(loopd_toml(self.socket, infer, expect, long=False))
        self.loopd: TwistProcess = spawn_twist(
            reactor, b"loopd serving", "loopd", "--config", config
        )
        self.addCleanup(stop_twist, self.loopd)
        yield self.loopd.ready

    def both(self, body: dict[str, Any]) -> Any:
        """
        Post C{body} (with C{model: tiny}) to the server and to loopd, in a thread; fire
        with both responses, the server's first.
        """
        body = {"model": "tiny", **body}

        def post() -> tuple[Any, Any]:
            direct = httpx.Client(base_url=self.server.base_url, timeout=60)
            transport = httpx.HTTPTransport(uds=self.socket)
            through = httpx.Client(base_url="http://loopd", transport=transport, timeout=60)
            with direct, through:
                return tuple(
                    client.post("/v1/chat/completions", json=body) for client in (direct, through)
                )

        return deferToThread(post)

    @inlineCallbacks
    def test_structured_output_and_errors(self) -> Any:
        """
        A json_schema response_format gives JSON matching the schema both ways; an invalid
        grammar, an unknown response_format type and a prompt over the context are the
        server's own 400s, type and message unchanged.
        """
        yield self.start()
        response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
        body = {"messages": HI, "response_format": response_format, "reasoning_effort": "none"}
        direct, through = yield self.both(body)
        self.assertEqual((direct.status_code, through.status_code), (200, 200))
        answers = [r.json()["choices"][0]["message"]["content"] for r in (direct, through)]
        self.assertEqual(answers[0], answers[1])
        self.assertIsInstance(json.loads(answers[1])["a"], int)

        bad: list[dict[str, Any]] = [
            {"messages": HI, "grammar": "root ::= ["},
            {"messages": HI, "response_format": {"type": "xml"}},
            {"messages": TOO_LONG, "max_tokens": 3},
            {"messages": TOO_LONG, "max_tokens": 3, "stream": True},
        ]
        for body in bad:
            direct, through = yield self.both(body)
            self.assertEqual((direct.status_code, through.status_code), (400, 400), body)
            server, loopd = direct.json()["error"], through.json()["error"]
            self.assertEqual((loopd["type"], loopd["message"]), (server["type"], server["message"]))
        self.assertEqual(loopd["type"], "exceed_context_size_error")
        self.assertEqual(loopd["n_ctx"], server["n_ctx"])
        self.assertIn("n_prompt_tokens", loopd)

    @inlineCallbacks
    def test_logprobs(self) -> Any:
        """
        logprobs come back in the stream, the server's tokens, and in the JSON answer: there
        the tokens of the server's own stream (loopd streams from the server), which leaves
        out the tokens no chunk carries (C{</think>} and the newlines after it) that the
        server's JSON answer lists.
        """
        yield self.start()
        body = {"messages": HI, "logprobs": True, "top_logprobs": 2, "max_tokens": 12}
        direct, through = yield self.both({**body, "stream": True})
        server_tokens = streamed_logprobs(events(direct.text))
        self.assertEqual(streamed_logprobs(events(through.text)), server_tokens)
        self.assertGreater(len(server_tokens), 3)

        direct, through = yield self.both(body)
        (server,), (loopd,) = direct.json()["choices"], through.json()["choices"]
        self.assertEqual(tokens(loopd["logprobs"]["content"]), server_tokens)
        every = iter(tokens(server["logprobs"]["content"]))
        self.assertTrue(all(token in every for token in server_tokens))
        self.assertEqual(len(loopd["logprobs"]["content"][0]["top_logprobs"]), 2)

        direct, through = yield self.both({"messages": HI, "max_tokens": 5})
        self.assertNotIn("logprobs", through.json()["choices"][0])

    @inlineCallbacks
    def test_n_choices(self) -> Any:
        """n=2 gives two choices as the server does, in the JSON and the stream; n=3 its 400."""
        yield self.start()
        body = {"messages": HI, "n": 2, "reasoning_effort": "none"}
        direct, through = yield self.both(body)
        contents = [
            [(c["index"], c["message"]["content"]) for c in r.json()["choices"]]
            for r in (direct, through)
        ]
        self.assertEqual(contents[1], contents[0])
        self.assertEqual(contents[1], [(0, ANSWER), (1, ANSWER)])

        direct, through = yield self.both({**body, "stream": True})
        self.assertEqual(
            texts_by_choice(events(through.text)), texts_by_choice(events(direct.text))
        )
        finishes = [
            (choice["index"], choice["finish_reason"])
            for chunk in events(through.text)
            for choice in chunk["choices"]
            if choice["finish_reason"]
        ]
        self.assertEqual(sorted(finishes), [(0, "stop"), (1, "stop")])

        direct, through = yield self.both({**body, "n": SLOTS + 1})
        self.assertEqual((direct.status_code, through.status_code), (400, 400))
        self.assertEqual(through.json()["error"]["message"], direct.json()["error"]["message"])

    @inlineCallbacks
    def test_stream_shapes(self) -> Any:
        """
        The role chunk's content is null as the server's; with return_progress, loopd's
        stream has the server's prompt_progress chunks (loopd's comments besides).
        """
        yield self.start()
        body = {"messages": HI, "stream": True, "return_progress": True}
        direct, through = yield self.both(body)
        server, loopd = events(direct.text), events(through.text)
        self.assertEqual(loopd[0]["choices"][0]["delta"], {"role": "assistant", "content": None})
        progress = [chunk["prompt_progress"] for chunk in loopd if "prompt_progress" in chunk]
        expected = [chunk["prompt_progress"] for chunk in server if "prompt_progress" in chunk]
        self.assertEqual(sorted(progress[-1]), ["cache", "processed", "time_ms", "total"])
        self.assertEqual(progress[-1]["processed"], progress[-1]["total"])
        self.assertEqual(len(progress), len(expected))
        self.assertIn(b": loopd ", through.content)

        direct, through = yield self.both({"messages": HI, "stream": True})
        self.assertFalse(any("prompt_progress" in chunk for chunk in events(through.text)))
