"""
Tests for L{loopd.gateway.token_count}: C{POST /v1/messages/count_tokens} over a gateway's
clients and scripted fake llama-servers, in memory.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from twisted.internet.error import ConnectionDone
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest

from loopd.gateway.doors.messages_read import parse_messages
from loopd.gateway.token_count import CountTokens, template_body
from loopd.testing.fake_llama import TOKENIZE, error_reply, json_reply
from loopd.testing.gateway import GatewayHarness, make_config

TEMPLATE = "/apply-template"
USER = {"role": "user", "content": "Hi"}


class Posted:
    """One request to a L{CountTokens}: its status and JSON body once answered."""

    def __init__(self, route: CountTokens, document: object, **headers: str) -> None:
        """POST C{document} (JSON) with C{headers}."""
        self.request = DummyRequest([b""])
        self.request.method = b"POST"
        for name, value in headers.items():
            self.request.requestHeaders.setRawHeaders(name.replace("_", "-"), [value])
        raw = document if isinstance(document, bytes) else json.dumps(document).encode()
        self.request.content = _Body(raw)  # type: ignore[attr-defined]
        self.result = route.render(self.request)

    def answer(self) -> tuple[int, Any]:
        """The status and decoded body written."""
        assert self.result == NOT_DONE_YET
        assert self.request.finished, "not answered yet"
        return self.request.responseCode or 200, json.loads(b"".join(self.request.written))


class _Body:
    """A request body a route can read."""

    def __init__(self, raw: bytes) -> None:
        """@param raw: the body's bytes."""
        self._raw = raw

    def read(self) -> bytes:
        """The whole body."""
        return self._raw


class CountTokensTests(SynchronousTestCase):
    """The endpoint's template and tokenizer count; errors are Anthropic's."""

    def setUp(self) -> None:
        """A gateway over two fake llama-servers, C{tiny} and C{big}."""
        self.harness = GatewayHarness(make_config(endpoints=("tiny", "big")))
        self.route = CountTokens(self.harness.gateway)

    def script(self, endpoint: str = "tiny", tokens: int = 5) -> None:
        """C{endpoint}'s server renders a prompt and tokenizes it into C{tokens} ids."""
        fake = self.harness.fakes[endpoint]
        fake.script("POST", TEMPLATE, json_reply(200, {"prompt": "<s>user: Hi"}))
        fake.script("POST", TOKENIZE, json_reply(200, {"tokens": list(range(tokens))}))

    def post(self, **fields: Any) -> tuple[int, Any]:
        """POST one user message plus C{fields}; the answer after the fakes have spoken."""
        posted = Posted(self.route, {"messages": [USER], **fields})
        self.harness.advance(1)
        return posted.answer()

    def test_counts(self) -> None:
        """The prompt the template makes, tokenized with special tokens, is the count."""
        self.script("big", tokens=7)
        tool = {"name": "read", "input_schema": {"type": "object"}}
        status, body = self.post(
            model="big", system="Be brief.", tools=[tool], thinking={"type": "disabled"}
        )
        self.assertEqual((status, body), (200, {"input_tokens": 7}))
        fake = self.harness.fakes["big"]
        [template] = fake.requests_to("POST", TEMPLATE)
        self.assertEqual(
            template.json,
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                ],
                "chat_template_kwargs": {"enable_thinking": False},
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "read",
                            "description": "",
                            "parameters": {"type": "object"},
                        },
                    }
                ],
                "reasoning_effort": "none",
            },
        )
        [tokenize] = fake.requests_to("POST", TOKENIZE)
        self.assertEqual(tokenize.json, {"content": "<s>user: Hi", "add_special": True})
        self.assertEqual(self.harness.fakes["tiny"].requests, [])

    def test_auto_and_mesh(self) -> None:
        """No model, C{auto} and C{mesh} count with the endpoint the router puts first."""
        for model in (None, "auto", "mesh"):
            self.script("tiny")
            self.script("big")
            fields = {} if model is None else {"model": model}
            status, body = self.post(**fields)
            self.assertEqual(status, 200)
            self.assertEqual(body, {"input_tokens": 5})

    def test_router_model(self) -> None:
        """An endpoint behind a router names its model in both requests."""
        config = make_config()
        routed = dataclasses.replace(config.endpoints[0], model="qwen")
        self.harness = GatewayHarness(dataclasses.replace(config, endpoints=(routed,)))
        self.route = CountTokens(self.harness.gateway)
        self.script()
        self.assertEqual(self.post(model="tiny"), (200, {"input_tokens": 5}))
        fake = self.harness.fake
        for path in (TEMPLATE, TOKENIZE):
            [sent] = fake.requests_to("POST", path)
            assert sent.json is not None
            self.assertEqual(sent.json["model"], "qwen")

    def test_bad_body(self) -> None:
        """A bad body is Anthropic's 400 naming the field; max_tokens is not required."""
        status, body = self.post(model="tiny", temperature=3)
        self.assertEqual(status, 400)
        self.assertEqual(body["type"], "error")
        self.assertEqual(body["error"]["type"], "invalid_request_error")
        self.assertTrue(body["error"]["message"].startswith("temperature:"))

    def test_unknown_model(self) -> None:
        """A model no endpoint serves is a 404 not_found_error."""
        status, body = self.post(model="nope")
        self.assertEqual((status, body["error"]["type"]), (404, "not_found_error"))

    def test_openai_endpoint(self) -> None:
        """An openai-kind endpoint cannot count: a 400 that says so."""
        config = make_config()
        openai = dataclasses.replace(config.endpoints[0], kind="openai")
        self.harness = GatewayHarness(dataclasses.replace(config, endpoints=(openai,)))
        self.route = CountTokens(self.harness.gateway)
        status, body = self.post(model="tiny")
        self.assertEqual((status, body["error"]["type"]), (400, "invalid_request_error"))
        self.assertIn("openai-kind", body["error"]["message"])
        self.assertEqual(self.harness.fake.requests, [])

    def test_server_error(self) -> None:
        """The server's own 400 reaches the client in Anthropic's shape."""
        fake = self.harness.fake
        fake.script("POST", TEMPLATE, error_reply(400, "invalid_request_error", "bad template"))
        status, body = self.post(model="tiny")
        self.assertEqual(status, 400)
        self.assertEqual(
            body["error"], {"type": "invalid_request_error", "message": "bad template"}
        )

    def test_unreachable(self) -> None:
        """A server that is not there is a 502 api_error."""
        self.harness = GatewayHarness(make_config(), dead=["tiny"])
        self.route = CountTokens(self.harness.gateway)
        status, body = self.post(model="tiny")
        self.assertEqual((status, body["error"]["type"]), (502, "api_error"))

    def test_bad_answer(self) -> None:
        """A template answer without a prompt is the server breaking the protocol: a 502."""
        self.harness.fake.script("POST", TEMPLATE, json_reply(200, {"text": "x"}))
        status, body = self.post(model="tiny")
        self.assertEqual((status, body["error"]["type"]), (502, "api_error"))

    def test_a_long_prompt(self) -> None:
        """
        A prompt of 4.5 MB, whose template answer and token list are each over the client's
        4 MiB cap on a server's answer, is counted (issue 26, item 6: it was a 502 "the
        model server broke the protocol" for loopd's own cap), the ids counted as they
        arrive rather than held.
        """
        text = "word " * 900_000
        tokens = 1_200_000
        fake = self.harness.fakes["tiny"]
        fake.script("POST", TEMPLATE, json_reply(200, {"prompt": "<s>user: " + text}))
        fake.script("POST", TOKENIZE, json_reply(200, {"tokens": list(range(tokens))}))
        document = {"model": "tiny", "messages": [{"role": "user", "content": text}]}
        posted = Posted(self.route, document)
        self.harness.advance(1)
        self.assertEqual(posted.answer(), (200, {"input_tokens": tokens}))

    def test_a_template_answer_past_its_bound(self) -> None:
        """
        A template answer many times longer than the request could make is still the
        server breaking the protocol (a 502), read no further than its bound.
        """
        fake = self.harness.fakes["tiny"]
        bound = max(self.harness.config.caps.body_bytes, 6 * 1000 + 65536)
        fake.script("POST", TEMPLATE, json_reply(200, {"prompt": "x" * (bound + 1)}))
        status, body = self.post(model="tiny")
        self.assertEqual((status, body["error"]["type"]), (502, "api_error"))

    def test_client_gone(self) -> None:
        """A client that leaves cancels the count, and nothing is written."""
        self.harness.fake.script("POST", TEMPLATE, json_reply(200, {"prompt": "p"}, delay_s=5))
        posted = Posted(self.route, {"messages": [USER], "model": "tiny"})
        self.harness.advance(1)
        posted.request.processingFailed(Failure(ConnectionDone("gone")))
        self.harness.advance(10)
        self.assertEqual(posted.request.written, [])
        self.assertFalse(posted.request.finished)
        self.assertEqual(self.harness.fake.requests_to("POST", TOKENIZE), [])


class TemplateBodyTests(SynchronousTestCase):
    """L{template_body}: what the template needs of a request."""

    def test_thinking_on(self) -> None:
        """Thinking on (the default) asks the template for it; no tools, none sent."""
        request = parse_messages(json.dumps({"messages": [USER]}).encode(), counting=True)
        self.assertEqual(
            template_body(request),
            {"messages": [USER], "chat_template_kwargs": {"enable_thinking": True}},
        )

    def test_tool_choice(self) -> None:
        """A tool choice goes with the tools."""
        tool = {"name": "read", "input_schema": {"type": "object"}}
        document = {"messages": [USER], "tools": [tool], "tool_choice": {"type": "any"}}
        request = parse_messages(json.dumps(document).encode(), counting=True)
        self.assertEqual(template_body(request)["tool_choice"], "required")
