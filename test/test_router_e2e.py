"""
llama-server's router mode end to end (issue 27): the genuine C{llama-server} b11434, from
the kit's cache (L{loopd.demo.llama_binary}: built there on first use, 6-9 minutes), serving
a models dir of two tiny models with at most one loaded, behind a real C{twist inferproxy};
chats go through the inferproxy's Unix socket, as loopd's would.

A binary that cannot be had (no network, no compiler and not root) fails the test with the
kit's reason: it is never skipped.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase

try:
    from loopd.demo.tiny_model import ANSWER
    from loopd.test.support.gateway_stack import (
        BUILD_TEST_TIMEOUT,
        HI,
        httpx,
        serve_router_behind_proxy,
    )
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the router end-to-end tests need the test extra: {e}") from None


def chat(socket: str, model: str) -> Any:
    """One chat completion naming C{model}, through the inferproxy at C{socket}."""
    transport = httpx.HTTPTransport(uds=socket)
    with httpx.Client(transport=transport, timeout=120) as client:
        body = {"model": model, "messages": HI, "max_tokens": 64}
        response = client.post("http://llama/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()


def listed(socket: str) -> dict[str, str]:
    """C{/v1/models} through the inferproxy at C{socket}: each model's status."""
    transport = httpx.HTTPTransport(uds=socket)
    with httpx.Client(transport=transport, timeout=60) as client:
        response = client.get("http://llama/v1/models")
        assert response.status_code == 200, response.text
        return {m["id"]: m["status"]["value"] for m in response.json()["data"]}


class RouterEndToEndTests(TestCase):
    """
    One router, two models, one loaded at a time.
    """

    timeout = BUILD_TEST_TIMEOUT

    @inlineCallbacks
    def test_models_load_on_demand(self) -> Any:
        """
        C{/v1/models} lists both models of the models dir, unloaded; a chat naming the
        first answers from it and leaves it loaded; a chat naming the second loads that one
        and, with C{--models-max 1}, unloads the first.
        """
        _, server, infer, names = yield serve_router_behind_proxy(self, 2, 1)
        first, second = names
        self.assertEqual((yield server.models()), {first: "unloaded", second: "unloaded"})
        answer = yield deferToThread(chat, infer, first)
        self.assertEqual(answer["choices"][0]["message"]["content"], ANSWER)
        self.assertEqual(answer["model"], first)
        self.assertEqual((yield server.models()), {first: "loaded", second: "unloaded"})
        answer = yield deferToThread(chat, infer, second)
        self.assertEqual(
            (answer["model"], answer["choices"][0]["message"]["content"]), (second, ANSWER)
        )
        self.assertEqual(
            (yield deferToThread(listed, infer)), {first: "unloaded", second: "loaded"}
        )
