"""
loopd in front of a real router (issue 27, DESIGN decision 46): the genuine llama-server
b11434 in router mode with two tiny models and C{--models-max 1}, its slots saved to a
directory, behind C{twist inferproxy}, and C{twist loopd} with one C{llama-server-router}
endpoint. loopd serves each model as its own, lists them with their status, and a
session's second turn after its model was swapped out and back reuses its cache: loopd
saved its slot before the swap and restored it after.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase

try:
    from loopd.test.support.gateway_stack import (
        BUILD_TEST_TIMEOUT,
        httpx,
        serve_router_behind_proxy,
    )
    from loopd.test.support.peers import real_reactor
    from loopd.test.support.twist import TwistProcess, spawn_twist, stop_twist
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the router end-to-end tests need the test extra: {e}") from None


def conversation(session: str) -> list[dict[str, str]]:
    """A first turn of ~1,500 prompt tokens, its system prompt naming C{session}."""
    system = f"You are agent {session}. " + "Keep this context in mind. " * 250
    return [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}]


def next_turn(session: str) -> list[dict[str, str]]:
    """C{session}'s second turn."""
    return [*conversation(session), {"role": "assistant", "content": "ok"}] + [
        {"role": "user", "content": "and then?"}
    ]


class RouterThroughLoopdTests(TestCase):
    """Two sessions, two models, one loaded at a time."""

    timeout = BUILD_TEST_TIMEOUT

    @inlineCallbacks
    def start(self, slot_save: bool = True) -> Any:
        """The router (one slot per model, no RAM cache, slot files), inferproxy, loopd."""
        self.saves = tempfile.mkdtemp(prefix="lrs", dir="/tmp")
        self.directory, self.server, infer, self.names = yield serve_router_behind_proxy(
            self, 2, 1, parallel=1, cache_ram_mib=0, slot_save_path=self.saves
        )
        self.socket = os.path.join(self.directory, "loopd.sock")
        config = os.path.join(self.directory, "loopd.toml")
        with open(config, "w") as f:
            f.write(
                "[server]\n"
                f"listen = {json.dumps('unix:' + self.socket)}\n"
                "[queue]\ngrace_ms = 500\n"
                "[[endpoint]]\n"
                'name = "gpu"\nkind = "llama-server-router"\n'
                f"socket = {json.dumps(infer)}\n"
                "selftest = false\nmodels_max = 1\nswap_wait_ms = 5000\n"
                + (f"slot_save = true\nslot_dir = {json.dumps(self.saves)}\n" if slot_save else "")
            )
        self.loopd: TwistProcess = spawn_twist(
            real_reactor(), b"loopd serving", "loopd", "--config", config
        )
        self.addCleanup(stop_twist, self.loopd)
        yield self.loopd.ready

    def client(self) -> Any:
        """An HTTP client over loopd's socket."""
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), timeout=300)

    def ask(self, model: str, session: str, messages: list[dict[str, str]]) -> Any:
        """One chat of C{session} naming C{model} (in a thread): its usage."""

        def call() -> Any:
            with self.client() as client:
                body = {"model": model, "messages": messages, "max_tokens": 8}
                response = client.post(
                    "http://loopd/v1/chat/completions",
                    json=body,
                    headers={"X-Session-Id": session},
                )
                assert response.status_code == 200, response.text
                return response.json()["usage"]

        return deferToThread(call)

    def models(self) -> Any:
        """loopd's /v1/models (in a thread): each routed model's status."""

        def call() -> Any:
            with self.client() as client:
                data = client.get("http://loopd/v1/models").json()["data"]
            return {m["id"]: (m.get("router"), m.get("status")) for m in data}

        return deferToThread(call)

    @inlineCallbacks
    def test_cache_kept_across_a_swap(self) -> Any:
        """
        s1 on tiny1, s2 on tiny2 (tiny1 swapped out, its slot saved first), s1 back on
        tiny1 (tiny2 swapped out, tiny1's slot restored): s1's second turn reuses nearly
        its whole prompt. loopd's /v1/models lists both models of router gpu.
        """
        yield self.start()
        first, second = self.names
        listed = yield self.models()
        self.assertEqual(listed[first][0], "gpu")
        self.assertEqual(listed[second], ("gpu", "unloaded"))
        yield self.ask(first, "s1", conversation("s1"))
        yield self.ask(second, "s2", conversation("s2"))
        listed = yield self.models()
        self.assertEqual((listed[first][1], listed[second][1]), ("unloaded", "loaded"))
        usage = yield self.ask(first, "s1", next_turn("s1"))
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        self.assertGreater(usage["prompt_tokens"], 1000)
        self.assertGreater(cached, usage["prompt_tokens"] - 64)

    @inlineCallbacks
    def test_lost_without_slot_files(self) -> Any:
        """The same turns without slot files: s1's second turn evaluates its prompt again."""
        yield self.start(slot_save=False)
        first, second = self.names
        yield self.ask(first, "s1", conversation("s1"))
        yield self.ask(second, "s2", conversation("s2"))
        usage = yield self.ask(first, "s1", next_turn("s1"))
        self.assertLess(usage["prompt_tokens_details"]["cached_tokens"], 64)
