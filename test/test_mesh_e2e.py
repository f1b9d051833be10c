"""
C{mesh} and C{auto} end to end, every part a real process: two real llama.cpp servers
(xllamacpp) with the project's tiny model, a C{twist inferproxy} in front of each, and one
C{twist loopd --config} whose loopd.toml names them as two endpoints of different names.
The clients are the official C{openai} SDK and its HTTP transport over loopd's Unix socket.

The tiny model answers L{ANSWER}; offered tools (natively) and no call yet, it calls the
first one with C{"test"} arguments; after a tool result it answers again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections import Counter
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase

from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import TwistProcess, spawn_twist, stop_twist

try:
    import openai

    from loopd.demo.tiny_model import ANSWER
    from loopd.test.support.gateway_stack import HI, SLOTS, WEATHER, httpx, serve_behind_proxy
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the mesh end-to-end tests need the test extra: {e}") from None

#: The two endpoints, one server each; neither name spells a single-digit-B size and no
#: C{size_b} is given, so both are the big tier: the mesh pool's order makes C{tiny-a} Fast
#: (no native tools) and C{tiny-b} Strong, and the auto router weighs them by speed alone.
NAMES = ("tiny-a", "tiny-b")
#: The endpoint group of L{MeshEndToEndTests.test_group}: both endpoints.
GROUP = "tiny"
#: Sequential C{auto} requests. The tiny model generates far above the weight's clamp of
#: 100 tokens/s, so both weigh the same: one endpoint or the other misses all of them
#: with probability 2 * 2**-24.
AUTO_REQUESTS = 24
#: The C{x-moa-*} headers every mesh response carries (reference §1.12).
MOA_HEADERS = (
    "x-moa-elapsed-ms",
    "x-moa-turn",
    "x-moa-workers",
    "x-moa-workers-ok",
    "x-moa-reducer",
    "x-moa-reducer-attempts",
)
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def mesh_toml(listen: str, sockets: dict[str, str], group: str | None = None) -> str:
    """
    A loopd.toml: the gateway on C{listen}, one endpoint per item of C{sockets} (name to
    inferproxy socket), self-test off, each in C{group} when one is given.
    """
    lines = ["[server]", f"listen = {json.dumps('unix:' + listen)}"]
    for name, socket in sockets.items():
        lines += ["[[endpoint]]", f"name = {json.dumps(name)}"]
        lines += [f"socket = {json.dumps(socket)}", "selftest = false"]
        if group is not None:
            lines.append(f"group = {json.dumps(group)}")
    return "\n".join(lines) + "\n"


def metric_values(text: str, metric: str) -> dict[tuple[str, ...], float]:
    """
    The samples of C{metric} in Prometheus text: label values (in label order) to value.
    """
    found: dict[tuple[str, ...], float] = {}
    pattern = re.compile(rf"^{re.escape(metric)}\{{(.*)\}} (\S+)$")
    for line in text.splitlines():
        match = pattern.match(line)
        if match:
            labels = tuple(re.findall(r'="((?:[^"\\]|\\.)*)"', match.group(1)))
            found[labels] = float(match.group(2))
    return found


def server_counter(text: str, metric: str) -> float | None:
    """The value of an unlabelled C{metric} in llama-server's Prometheus text, if there."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == metric:
            return float(value)
    return None


class MeshEndToEndTests(TestCase):
    """
    C{mesh} and C{auto} over two real endpoints, as users run them.
    """

    timeout = 180

    @inlineCallbacks
    def start(self, group: str | None = None) -> Any:
        """
        Start a server and an inferproxy per name of L{NAMES}, then C{twist loopd} over
        both (in endpoint group C{group} when given); fire once loopd serves.
        """
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
            f.write(mesh_toml(self.socket, sockets, group))
        self.loopd: TwistProcess = spawn_twist(
            reactor, b"loopd serving", "loopd", "--config", config
        )
        self.addCleanup(stop_twist, self.loopd)
        yield self.loopd.ready

    def http(self) -> Any:
        """An HTTP client that reaches loopd through its Unix socket."""
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), timeout=120)

    def sdk(self) -> Any:
        """An OpenAI client that reaches loopd through its Unix socket."""
        return openai.OpenAI(
            base_url="http://loopd/v1", api_key="x", max_retries=0, http_client=self.http()
        )

    def mesh(self, messages: list[Any], **extra: Any) -> Any:
        """
        One non-streaming C{mesh} request through the SDK (call from a thread): the
        parsed completion and the response headers (the status must be 200).
        """
        with self.sdk() as client:
            raw = client.chat.completions.with_raw_response.create(
                model="mesh", messages=messages, **extra
            )
            self.assertEqual(raw.status_code, 200)
            return raw.parse(), raw.headers

    def assert_moa_headers(self, headers: Any, turn: str, workers: int) -> None:
        """Every C{x-moa-*} header is there, the turn is C{turn}, with C{workers} workers."""
        for name in MOA_HEADERS:
            self.assertIn(name, headers)
        self.assertEqual(headers["x-moa-turn"], turn)
        self.assertEqual(headers["x-moa-workers"], str(workers))
        self.assertGreaterEqual(int(headers["x-moa-elapsed-ms"]), 0)

    @inlineCallbacks
    def test_mesh_answers(self) -> Any:
        """mesh, not streaming: 200, model mesh, the tiny model's answer, 2 workers, both ok."""
        yield self.start()
        completion, headers = yield deferToThread(self.mesh, HI)
        self.assertEqual(completion.object, "chat.completion")
        self.assertEqual(completion.model, "mesh")
        (choice,) = completion.choices
        self.assertEqual((choice.message.content, choice.finish_reason), (ANSWER, "stop"))
        # Both workers answer within the 3 s grace (a loaded machine may let grace ship the
        # first answer alone, an early exit); either way agreeing answers need no reducer.
        turn = headers["x-moa-turn"]
        self.assertIn(turn, ("fanout", "early-exit"))
        self.assert_moa_headers(headers, turn, 2)
        self.assertEqual(headers["x-moa-workers-ok"], "2" if turn == "fanout" else "1")
        self.assertEqual(headers["x-moa-reducer"], "false")

    @inlineCallbacks
    def test_mesh_stream_sdk(self) -> Any:
        """mesh streaming through the SDK: chunks that spell the answer, one stop, no error."""
        yield self.start()

        def ask() -> list[Any]:
            with self.sdk() as client:
                return list(client.chat.completions.create(model="mesh", messages=HI, stream=True))

        chunks = yield deferToThread(ask)
        self.assertTrue(chunks)
        self.assertTrue(all(c.choices for c in chunks))
        self.assertEqual({c.model for c in chunks}, {"mesh"})
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        self.assertEqual(content, ANSWER)
        finishes = [c.choices[0].finish_reason for c in chunks]
        self.assertEqual([f for f in finishes if f], ["stop"])

    @inlineCallbacks
    def test_mesh_stream_raw(self) -> Any:
        """mesh streaming on the wire: worker progress comments, data chunks, then [DONE]."""
        yield self.start()

        def ask() -> tuple[int, str, str]:
            body = {"model": "mesh", "messages": HI, "stream": True}
            with self.http() as client:
                response = client.post("http://loopd/v1/chat/completions", json=body)
                return response.status_code, response.headers["content-type"], response.text

        status, content_type, text = yield deferToThread(ask)
        self.assertEqual((status, content_type), (200, "text/event-stream"))
        events = [e for e in text.split("\n\n") if e]
        data = [e[6:] for e in events if e.startswith("data: ")]
        self.assertEqual(data[-1], "[DONE]")
        self.assertEqual(len(data), len(events) - sum(e.startswith(": loopd ") for e in events))
        progress = [json.loads(e[8:]) for e in events if e.startswith(": loopd ")]
        workers = [p for p in progress if p.get("event") == "mesh_worker"]
        self.assertTrue(workers, progress)
        chunks = [json.loads(d) for d in data[:-1]]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        self.assertEqual(content, ANSWER)

    @inlineCallbacks
    def test_mesh_tool_round_trip(self) -> Any:
        """mesh calls the declared tool, then answers its result on a tool-result turn."""
        yield self.start()
        messages: list[Any] = list(WEATHER_QUESTION)
        first, headers = yield deferToThread(self.mesh, messages, tools=[WEATHER])
        self.assertEqual(first.model, "mesh")
        (choice,) = first.choices
        self.assertEqual(choice.finish_reason, "tool_calls")
        (call,) = choice.message.tool_calls
        self.assertEqual(call.function.name, "get_weather")
        self.assertEqual(json.loads(call.function.arguments), {"city": "test"})
        # The Fast worker has no native tools and answers; the Strong one calls the tool;
        # the disagreement goes to the reducer, which calls it too.
        self.assert_moa_headers(headers, "fanout", 2)
        self.assertEqual(headers["x-moa-workers-ok"], "2")
        self.assertEqual(headers["x-moa-reducer"], "true")

        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'})
        second, headers = yield deferToThread(self.mesh, messages, tools=[WEATHER])
        self.assertEqual(second.model, "mesh")
        (choice,) = second.choices
        self.assertEqual((choice.message.content, choice.finish_reason), (ANSWER, "stop"))
        self.assertFalse(choice.message.tool_calls)
        # A tool-result turn goes to the reducer only, which counts as its one worker.
        self.assert_moa_headers(headers, "tool-result", 1)
        self.assertEqual(headers["x-moa-reducer"], "true")

    @inlineCallbacks
    def test_auto_spreads(self) -> Any:
        """
        auto: sequential requests of new sessions reach both endpoints while the turns of
        one session stay on one (decision 34), the router's measured speeds are the mean of
        the speeds the answers report, and loopd's per-endpoint counters match.
        """
        yield self.start()

        def ask() -> tuple[list[Any], str]:
            with self.sdk() as client:
                answers = [
                    client.chat.completions.create(
                        model="auto",
                        messages=HI,
                        reasoning_effort="none",
                        extra_headers={"X-Session-Id": f"session-{n}"},
                    )
                    for n in range(AUTO_REQUESTS - 4)
                ]
                # Then four turns of one session: they stay where its first went.
                answers += [
                    client.chat.completions.create(
                        model="auto",
                        messages=HI,
                        reasoning_effort="none",
                        extra_headers={"X-Session-Id": "one-session"},
                    )
                    for _ in range(4)
                ]
            with self.http() as http:
                metrics = http.get("http://loopd/metrics").text
            return answers, metrics

        answers, metrics = yield deferToThread(ask)
        served = Counter(a.model for a in answers)
        self.assertEqual(set(served), set(NAMES))
        self.assertEqual(len({a.model for a in answers[-4:]}), 1)
        speeds: dict[str, list[float]] = {name: [] for name in NAMES}
        for answer in answers:
            self.assertEqual(answer.choices[0].message.content, ANSWER)
            # The speed the server measured, which the router records for the endpoint.
            speed = (answer.model_extra or {})["timings"]["predicted_per_second"]
            self.assertGreater(speed, 0)
            speeds[answer.model].append(speed)
        measured = metric_values(metrics, "loopd_auto_speed_tokens_per_second")
        samples = metric_values(metrics, "loopd_auto_samples")
        weights = metric_values(metrics, "loopd_auto_weight")
        for name in NAMES:
            self.assertAlmostEqual(measured[(name,)], sum(speeds[name]) / len(speeds[name]))
            self.assertEqual(samples[(name,)], len(speeds[name]))
            # With 3 samples or more the weight is the mean speed clamped to 5-100 (the tiny
            # model usually outruns the clamp, so both weigh 100); with fewer, 25.
            mean = measured[(name,)]
            expected = min(100.0, max(5.0, mean)) if len(speeds[name]) >= 3 else 25.0
            self.assertAlmostEqual(weights[(name,)], expected)
        requests = metric_values(metrics, "loopd_requests_total")
        self.assertEqual(
            {name: requests.get((name, "ok"), 0.0) for name in NAMES},
            {name: float(served[name]) for name in NAMES},
        )
        tokens = metric_values(metrics, "loopd_tokens_total")
        for name in NAMES:
            generated = sum(a.usage.completion_tokens for a in answers if a.model == name)
            self.assertGreater(generated, 0)
            self.assertEqual(tokens[(name, "completion")], float(generated))
            # The server's own count: every token it generated went to an answer of its name.
            own = yield self.servers[name].query("/metrics")
            self.assertEqual(
                server_counter(own.body.decode(), "llamacpp:tokens_predicted_total"), generated
            )

    @inlineCallbacks
    def test_group(self) -> Any:
        """
        Both endpoints in group "tiny" (decision 42): new sessions asking for "tiny" reach
        both members, one session's turns stay on one, /v1/models lists the group, and
        mesh counts the group as one worker (so the one model answers alone).
        """
        yield self.start(group=GROUP)

        def ask() -> tuple[list[Any], list[str], Any]:
            with self.sdk() as client:
                answers = [
                    client.chat.completions.create(
                        model=GROUP,
                        messages=HI,
                        reasoning_effort="none",
                        extra_headers={"X-Session-Id": f"session-{n}"},
                    )
                    for n in range(AUTO_REQUESTS - 4)
                ]
                answers += [
                    client.chat.completions.create(
                        model=GROUP,
                        messages=HI,
                        reasoning_effort="none",
                        extra_headers={"X-Session-Id": "one-session"},
                    )
                    for _ in range(4)
                ]
                ids = [m.id for m in client.models.list()]
                alone = client.chat.completions.with_raw_response.create(
                    model="mesh",
                    messages=HI,
                    reasoning_effort="none",
                    extra_headers={"X-Session-Id": "one-session"},
                )
            return answers, ids, alone

        answers, ids, alone = yield deferToThread(ask)
        self.assertEqual({a.model for a in answers}, set(NAMES))
        self.assertEqual(len({a.model for a in answers[-4:]}), 1)
        for answer in answers:
            self.assertEqual(answer.choices[0].message.content, ANSWER)
        self.assertEqual(ids, [*NAMES, GROUP, "auto", "mesh"])
        self.assertEqual(alone.status_code, 200)
        self.assertNotIn("x-moa-workers", alone.headers)
        self.assertIn(alone.parse().model, NAMES)
