"""
Endpoint health end to end (DESIGN decision 38), every part a real process: two real
llama.cpp servers (xllamacpp) with the project's tiny model, a C{twist inferproxy} in front
of each, and one C{twist loopd --config} over both. One server is killed between the turns
of a stream of C{auto} requests while its inferproxy stays up (so loopd's connections are
accepted and closed at once), then restarted on the same port.

The client's retries are given a wait far past the test's timeout, so a turn that went
through the retry schedule would never end: every turn answering proves none did.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase

from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import TwistProcess, spawn_twist, stop_twist

try:
    from loopd.demo.tiny_model import ANSWER
    from loopd.test.support.gateway_stack import HI, SLOTS, httpx, serve_behind_proxy
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the health end-to-end tests need the test extra: {e}") from None

NAMES = ("tiny-a", "tiny-b")
#: The endpoint that is killed, and the one that stays.
DEAD, LIVE = NAMES
#: Turns in each phase: both up, one down, both up again.
TURNS = 8
CHAT_URL = "http://loopd/v1/chat/completions"


def health_toml(listen: str, sockets: dict[str, str]) -> str:
    """
    A loopd.toml: the gateway on C{listen}, one endpoint per item of C{sockets}, self-test
    off, probes every 1 s while up and 0.2 s while down, retries that wait 10 minutes.
    """
    lines = ["[server]", f"listen = {json.dumps('unix:' + listen)}"]
    lines += ["[retry]", "backoff_ms = [600000]", "total_ms = 1200000"]
    lines += ["[health]", "up_interval_ms = 1000", "down_interval_ms = 200"]
    for name, socket in sockets.items():
        lines += ["[[endpoint]]", f"name = {json.dumps(name)}"]
        lines += [f"socket = {json.dumps(socket)}", "selftest = false"]
    return "\n".join(lines) + "\n"


class HealthEndToEndTests(TestCase):
    """A server killed and restarted under C{auto} traffic."""

    timeout = 240

    @inlineCallbacks
    def start(self) -> Any:
        """Two servers behind inferproxies and C{twist loopd} over both; fire once it serves."""
        reactor = real_reactor()
        self.servers: dict[str, Any] = {}
        sockets: dict[str, str] = {}
        for name in NAMES:
            _, server, infer = yield serve_behind_proxy(self, "tiny.gguf", SLOTS)
            self.servers[name], sockets[name] = server, infer
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        self.socket = os.path.join(directory, "loopd.sock")
        config = os.path.join(directory, "loopd.toml")
        with open(config, "w") as f:
            f.write(health_toml(self.socket, sockets))
        self.loopd: TwistProcess = spawn_twist(
            reactor, b"loopd serving", "loopd", "--config", config
        )
        self.addCleanup(stop_twist, self.loopd)
        yield self.loopd.ready

    def http(self) -> Any:
        """A new HTTP client over loopd's socket (a new connection: a new session)."""
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), timeout=600)

    def turns(self, count: int) -> list[tuple[str, str]]:
        """
        C{count} C{auto} turns, each of a new session, alternating stream and not (call from
        a thread): per turn the model that answered and the raw body; each must be a 200
        whose answer is the tiny model's and whose stream has no C{retrying} comment.
        """
        served = []
        for n in range(count):
            stream = n % 2 == 1
            body = {"model": "auto", "messages": HI, "stream": stream}
            with self.http() as client:
                response = client.post(CHAT_URL, json=body)
            self.assertEqual(response.status_code, 200, response.text)
            if stream:
                events = [e for e in response.text.split("\n\n") if e]
                self.assertFalse([e for e in events if '"retrying"' in e], events)
                data = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
                text = "".join(c["choices"][0]["delta"].get("content") or "" for c in data)
                served.append((data[-1]["model"], text))
            else:
                answer = response.json()
                served.append((answer["model"], answer["choices"][0]["message"]["content"]))
        return served

    def get(self, path: str) -> Any:
        """C{GET path} on loopd (call from a thread): the response."""
        with self.http() as client:
            return client.get(f"http://loopd{path}")

    def named(self, name: str) -> Any:
        """One request naming endpoint C{name} (call from a thread): the response."""
        with self.http() as client:
            return client.post(CHAT_URL, json={"model": name, "messages": HI})

    @inlineCallbacks
    def test_killed_and_restarted(self) -> Any:
        """
        Both endpoints answer; with one server killed every auto turn, streamed or not, is
        answered by the other without a retry, /health, /v1/queue and /metrics say it is
        down, and a request naming it is 503 endpoint_unavailable with Retry-After; once the
        server is back its probe brings it back and it answers again.
        """
        yield self.start()
        before = yield deferToThread(self.turns, TURNS)
        self.assertEqual({text for _, text in before}, {ANSWER})
        mark = len(self.loopd.output)
        yield self.servers[DEAD].kill()
        during = yield deferToThread(self.turns, TURNS)
        self.assertEqual(during, [(LIVE, ANSWER)] * TURNS)
        yield self.loopd.seen(f"endpoint {DEAD} is down".encode(), mark)

        refused = yield deferToThread(self.named, DEAD)
        self.assertEqual(refused.status_code, 503)
        self.assertEqual(refused.json()["error"]["code"], "endpoint_unavailable")
        self.assertGreaterEqual(int(refused.headers["retry-after"]), 1)
        health = yield deferToThread(self.get, "/health")
        self.assertEqual(health.json()["states"][DEAD]["state"], "down")
        self.assertEqual(health.json()["states"][LIVE]["state"], "up")
        queue = yield deferToThread(self.get, "/v1/queue")
        self.assertEqual(queue.json()["endpoints"][DEAD]["state"], "down")
        metrics = yield deferToThread(self.get, "/metrics")
        self.assertIn(f'loopd_endpoint_up{{endpoint="{DEAD}"}} 0.0', metrics.text)

        mark = len(self.loopd.output)
        yield self.servers[DEAD].start()
        yield self.loopd.seen(f"endpoint {DEAD} is probing".encode(), mark)
        back = yield deferToThread(self.named, DEAD)
        self.assertEqual(back.status_code, 200, back.text)
        self.assertEqual(back.json()["choices"][0]["message"]["content"], ANSWER)
        after = yield deferToThread(self.turns, TURNS)
        self.assertEqual({text for _, text in after}, {ANSWER})
        health = yield deferToThread(self.get, "/health")
        self.assertEqual(health.json()["states"][DEAD]["state"], "up")
