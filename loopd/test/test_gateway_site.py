"""
Tests for L{loopd.gateway.site}: routing, refusals, C{/v1/models}, C{/health} and
C{/metrics}, with real HTTP parsing on both sides and nothing on disk.

The gateway's site reads raw request bytes from a C{StringTransport} and writes raw response
bytes to it, which L{read_responses} parses (chunked or not). Its upstream clients talk to a
scripted L{FakeLlama} through L{MemoryNet} on a C{MemoryReactorClock}, every limit between 50
and 200 ms. L{Harness} and the helpers here serve L{loopd.test.test_gateway_chat} too.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.error import ConnectionLost
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from loopd.config import Config, Endpoint, Expect, Limits, Retry, Server
from loopd.gateway.site import Gateway
from loopd.llama import Client
from loopd.test.support.fake_llama import (
    CHAT,
    LOADING,
    FakeLlama,
    Reply,
    json_reply,
    sse_reply,
)
from loopd.test.support.memory_net import MemoryNet

#: The fake llama-server's socket and a second endpoint's: in memory only.
PATH = "/tmp/ld-gw/tiny.sock"
OTHER_PATH = "/tmp/ld-gw/big.sock"
LIMITS = Limits(
    poll_ms=50, busy_wait_ms=200, load_wait_ms=150, idle_grace_ms=100, liveness_ms=80, queue_depth=1
)
#: The gateway's wall clock: every answer's C{created}.
NOW = 1_700_000_000
#: The gateway's request body cap in these tests.
BODY_BYTES = 2048
#: Upstream timings of a finished answer: 13 prompt tokens (3 from the cache), 2 generated.
TIMINGS = {"cache_n": 3, "prompt_n": 10, "predicted_n": 2, "predicted_per_second": 50.0}
HI = {"messages": [{"role": "user", "content": "Hi"}]}


def make_config(*, slots: int = 2, endpoints: Sequence[str] = ("tiny",), **changes: Any) -> Config:
    """
    Endpoints C{tiny} at L{PATH} (then C{big} at L{OTHER_PATH}) with C{slots} slots, the test
    limits, no retries, a body cap of L{BODY_BYTES}, and C{changes}.
    """
    paths = {"tiny": PATH, "big": OTHER_PATH}
    chosen = tuple(
        Endpoint(name=name, socket=paths[name], selftest=False, expect=Expect(total_slots=slots))
        for name in endpoints
    )
    settings = dict(limits=LIMITS, retry=Retry(attempts=1), server=Server(body_bytes=BODY_BYTES))
    return Config(endpoints=chosen, **{**settings, **changes})


def chunk(
    delta: Mapping[str, Any] | None = None,
    finish: str | None = None,
    *,
    timings: Mapping[str, Any] | None = None,
    progress: tuple[int, int, int] | None = None,
) -> dict[str, Any]:
    """
    One upstream C{chat.completion.chunk} as llama-server sends it; C{progress} is
    C{(total, cache, processed)} of a C{prompt_progress}.
    """
    choice = {"finish_reason": finish, "index": 0, "delta": dict(delta or {})}
    sent: dict[str, Any] = {"choices": [choice], "created": 1, "id": "chatcmpl-upstream"}
    sent.update(model="tiny", object="chat.completion.chunk")
    if timings is not None:
        sent["timings"] = dict(timings)
    if progress is not None:
        total, cache, processed = progress
        sent["prompt_progress"] = {"total": total, "cache": cache, "processed": processed}
    return sent


def answer(
    *deltas: Mapping[str, Any],
    finish: str = "stop",
    timings: Mapping[str, Any] = TIMINGS,
    delay_s: float = 0.05,
) -> Reply:
    """
    An upstream stream: one chunk per delta, then the finish chunk with C{timings}, each
    C{delay_s} after the one before, then C{[DONE]}.
    """
    events = [chunk(delta) for delta in deltas]
    return sse_reply([*events, chunk({}, finish, timings=timings)], delay_s=delay_s)


@dataclass
class Response:
    """
    One HTTP response as the client read it.

    @ivar headers: each header's last value, by lower-case name.
    @ivar complete: whether the whole body arrived (the last chunk, or C{Content-Length}).
    """

    status: int
    headers: dict[str, str]
    body: bytes
    complete: bool

    def json(self) -> Any:
        """The body as JSON."""
        return json.loads(self.body)

    def events(self) -> list[str]:
        """The body's server-sent events, each as its text without the blank line."""
        return [event for event in self.body.decode("utf-8").split("\n\n") if event]

    def data(self) -> list[Any]:
        """The payload of each C{data:} event: JSON, or the string C{"[DONE]"}."""
        payloads = [e[len("data: ") :] for e in self.events() if e.startswith("data: ")]
        return [p if p == "[DONE]" else json.loads(p) for p in payloads]

    def comments(self) -> list[dict[str, Any]]:
        """The JSON of each C{: loopd {...}} comment line."""
        prefix = ": loopd "
        return [json.loads(e[len(prefix) :]) for e in self.events() if e.startswith(prefix)]


def read_responses(raw: bytes) -> list[Response]:
    """Every response in C{raw}, the bytes one connection received, in order."""
    responses = []
    while raw:
        head, found, rest = raw.partition(b"\r\n\r\n")
        if not found:
            break
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding") == "chunked":
            body, complete, raw = _dechunk(rest)
        else:
            length = int(headers.get("content-length", "0"))
            body, raw = rest[:length], rest[length:]
            complete = len(body) == length
        responses.append(Response(status, headers, body, complete))
    return responses


def _dechunk(data: bytes) -> tuple[bytes, bool, bytes]:
    """The body of a chunked message so far, whether it ended, and the bytes after it."""
    body = b""
    while True:
        size_line, found, rest = data.partition(b"\r\n")
        if not found:
            return body, False, b""
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return body, rest.startswith(b"\r\n"), rest[2:]
        body += rest[:size]
        if len(rest) < size + 2:
            return body, False, b""
        data = rest[size + 2 :]


class ClientConnection:
    """
    One client connection to the gateway's site: raw request bytes in, the site's protocol
    writing its raw response bytes to a C{StringTransport}.
    """

    def __init__(self, harness: Harness) -> None:
        """Connect to C{harness}'s site."""
        self._harness = harness
        self.transport = StringTransport()
        self.channel = harness.site.buildProtocol(None)
        self.channel.makeConnection(self.transport)

    def send(self, raw: bytes) -> None:
        """Deliver C{raw} to the site, then let the in-memory network settle."""
        self.channel.dataReceived(raw)
        self._harness.net.pump()

    def request(
        self, method: str, target: str, body: bytes | None = None, headers: Sequence[str] = ()
    ) -> None:
        """Send one HTTP/1.1 request; a C{body} goes with its C{Content-Length}."""
        lines = [f"{method} {target} HTTP/1.1", "Host: loopd", *headers]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        self.send(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b""))

    def post(self, document: object, session: str | None = None) -> None:
        """POST C{document} as JSON to the chat route, with C{X-Session-Id} if given."""
        headers = ["Content-Type: application/json"]
        if session is not None:
            headers.append(f"X-Session-Id: {session}")
        self.request("POST", CHAT, json.dumps(document).encode(), headers)

    def responses(self) -> list[Response]:
        """Every response this connection has received so far."""
        return read_responses(self.transport.value())

    def response(self) -> Response:
        """The connection's one response (so far)."""
        (only,) = self.responses()
        return only

    def drop(self) -> None:
        """The client goes away: the connection is lost under the site."""
        self.channel.connectionLost(Failure(ConnectionLost("client went away")))
        self._harness.net.pump()


class Harness:
    """A gateway with a client per endpoint; C{tiny} is a L{FakeLlama} on a L{MemoryNet}."""

    def __init__(self, config: Config | None = None) -> None:
        """A fresh clock, fake, network and gateway for C{config} (L{make_config}'s)."""
        self.reactor = MemoryReactorClock()
        self.fake = FakeLlama(self.reactor)
        self.net = MemoryNet(self.reactor)
        self.net.listen(PATH, self.fake)
        self.config = config or make_config()
        clients = {e.name: Client(self.reactor, self.config, e) for e in self.config.endpoints}
        self.gateway = Gateway(self.reactor, self.config, clients, wall_clock=lambda: NOW)
        self.site = self.gateway.site()

    def connect(self) -> ClientConnection:
        """A new client connection."""
        return ClientConnection(self)

    def post(self, document: object, session: str | None = None) -> ClientConnection:
        """A new connection that POSTs C{document} to the chat route."""
        connection = self.connect()
        connection.post(document, session)
        return connection

    def get(self, target: str) -> ClientConnection:
        """A new connection that GETs C{target}."""
        connection = self.connect()
        connection.request("GET", target)
        return connection

    def advance(self, seconds: float) -> None:
        """Let C{seconds} pass on the clock, every timer running at its time."""
        self.net.advance(seconds)

    def scrape(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """C{GET /metrics}, parsed: (sample name, labels) → value."""
        text = self.get("/metrics").response().body.decode("utf-8")
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }


def outcome(endpoint: str, code: str) -> tuple[str, frozenset[tuple[str, str]]]:
    """The key of C{loopd_requests_total{endpoint, outcome}} in L{Harness.scrape}."""
    labels = frozenset({("endpoint", endpoint), ("outcome", code)})
    return ("loopd_requests_total", labels)


class RefusalTests(SynchronousTestCase):
    """
    Bad input gets a 4xx in the OpenAI error shape and nothing goes upstream.
    """

    def setUp(self) -> None:
        self.harness = Harness()

    def refused(self, connection: ClientConnection, status: int, code: str) -> Response:
        """Assert one whole JSON error response with C{status} and C{code}; return it."""
        response = connection.response()
        self.assertEqual((response.status, response.complete), (status, True))
        self.assertEqual(response.headers["content-type"], "application/json")
        error = response.json()["error"]
        self.assertEqual(sorted(error), ["code", "message", "type"])
        self.assertEqual(error["code"], code)
        self.assertEqual(self.harness.fake.requests, [])
        return response

    def test_not_json(self) -> None:
        """A body that is not JSON is 400 invalid_json."""
        connection = self.harness.connect()
        connection.request("POST", CHAT, b"{not json", ["Content-Type: application/json"])
        self.refused(connection, 400, "invalid_json")

    def test_not_an_object(self) -> None:
        """A JSON array body is 400 not_an_object."""
        self.refused(self.harness.post([HI]), 400, "not_an_object")

    def test_missing_messages(self) -> None:
        """A body without messages is 400 missing_messages, and the message names the field."""
        response = self.refused(self.harness.post({"model": "tiny"}), 400, "missing_messages")
        self.assertIn("messages", response.json()["error"]["message"])

    def test_unknown_model(self) -> None:
        """A model no endpoint serves is 404 model_not_found, naming the model."""
        response = self.refused(self.harness.post({**HI, "model": "gpt-9"}), 404, "model_not_found")
        self.assertIn("gpt-9", response.json()["error"]["message"])

    def test_declared_body_over_cap(self) -> None:
        """A Content-Length over [server] body_bytes is 413 too_large."""
        big = json.dumps({**HI, "pad": "x" * BODY_BYTES}).encode()
        connection = self.harness.connect()
        connection.request("POST", CHAT, big, ["Content-Type: application/json"])
        self.refused(connection, 413, "too_large")

    def test_chunked_body_over_cap(self) -> None:
        """A chunked body that grows past the cap is 413 too_large too."""
        connection = self.harness.connect()
        head = f"POST {CHAT} HTTP/1.1\r\nHost: loopd\r\nTransfer-Encoding: chunked\r\n\r\n"
        piece = b"x" * 1000
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(3))
        connection.send(head.encode() + chunks + b"0\r\n\r\n")
        self.refused(connection, 413, "too_large")

    def test_body_at_cap_accepted(self) -> None:
        """A body of exactly body_bytes is read and answered."""
        self.harness.fake.script("POST", CHAT, answer({"content": "ok"}, delay_s=0))
        document = {**HI, "pad": ""}
        document["pad"] = "x" * (BODY_BYTES - len(json.dumps(document)))
        connection = self.harness.post(document)
        self.assertEqual(connection.response().status, 200)
        self.assertEqual(len(self.harness.fake.requests), 1)

    def test_get_on_chat_route(self) -> None:
        """GET on the chat route is 405 with Allow naming POST alone."""
        response = self.refused(self.harness.get(CHAT), 405, "method_not_allowed")
        self.assertEqual(response.headers["allow"], "POST")

    def test_head_on_chat_route(self) -> None:
        """HEAD on the POST-only chat route is a 405 too, not a server error."""
        connection = self.harness.connect()
        connection.request("HEAD", CHAT)
        response = connection.response()
        self.assertEqual((response.status, response.headers["allow"]), (405, "POST"))

    def test_post_on_models(self) -> None:
        """POST on /v1/models is 405 with Allow naming GET and HEAD."""
        connection = self.harness.connect()
        connection.request("POST", "/v1/models", b"{}")
        response = self.refused(connection, 405, "method_not_allowed")
        self.assertEqual(response.headers["allow"], "GET, HEAD")

    def test_unknown_path(self) -> None:
        """An unknown path is 404 not_found naming the path, whatever the method."""
        for method in ("GET", "POST"):
            connection = self.harness.connect()
            connection.request(method, "/v2/chat", b"{}" if method == "POST" else None)
            response = self.refused(connection, 404, "not_found")
            self.assertIn("/v2/chat", response.json()["error"]["message"])

    def test_refusals_counted(self) -> None:
        """Each refused chat request counts under endpoint "-" with its code."""
        self.harness.post([HI])
        self.harness.post([HI])
        self.harness.post({**HI, "model": "gpt-9"})
        samples = self.harness.scrape()
        self.assertEqual(samples[outcome("-", "not_an_object")], 2.0)
        self.assertEqual(samples[outcome("-", "model_not_found")], 1.0)


class ModelsTests(SynchronousTestCase):
    """
    C{GET /v1/models} lists the endpoints and the virtual models C{auto} and C{mesh}.
    """

    def test_lists_endpoints(self) -> None:
        """Each endpoint is a model object, in config order, then auto and mesh; a slash too."""
        harness = Harness(make_config(endpoints=("tiny", "big")))
        models = [
            {"id": name, "object": "model", "created": NOW, "owned_by": "loopd"}
            for name in ("tiny", "big", "auto", "mesh")
        ]
        for target in ("/v1/models", "/v1/models/"):
            response = harness.get(target).response()
            self.assertEqual(response.status, 200)
            self.assertEqual(response.headers["content-type"], "application/json")
            self.assertEqual(response.json(), {"object": "list", "data": models})


class HealthTests(SynchronousTestCase):
    """
    C{GET /health} asks every endpoint's C{/health}.
    """

    def setUp(self) -> None:
        self.harness = Harness(make_config(endpoints=("tiny", "big")))
        self.big = FakeLlama(self.harness.reactor)
        self.harness.net.listen(OTHER_PATH, self.big)
        for fake in (self.harness.fake, self.big):
            fake.set_default("GET", "/health", json_reply(200, {"status": "ok"}))

    def health(self) -> Response:
        """Ask, let the probes run out their time, and return the answer."""
        connection = self.harness.get("/health")
        self.harness.advance(0.2)
        return connection.response()

    def test_all_reachable(self) -> None:
        """Both endpoints answer 200: 200 ok."""
        response = self.health()
        self.assertEqual(response.status, 200)
        expected = {"status": "ok", "endpoints": {"tiny": "ok", "big": "ok"}}
        self.assertEqual(response.json(), expected)
        self.assertEqual([r.path for r in self.big.requests], ["/health"])

    def test_socket_missing(self) -> None:
        """An endpoint nobody listens for: 503 naming it as unreachable."""
        self.harness.net.stop_listening(OTHER_PATH)
        response = self.health()
        self.assertEqual(response.status, 503)
        body = response.json()
        self.assertEqual(body["status"], "degraded")
        self.assertEqual(body["endpoints"]["tiny"], "ok")
        self.assertTrue(body["endpoints"]["big"].startswith("unreachable: "), body)

    def test_loading(self) -> None:
        """An endpoint answering 503 (loading): 503 naming it with the status."""
        self.big.set_default("GET", "/health", LOADING)
        response = self.health()
        self.assertEqual(response.status, 503)
        self.assertEqual(response.json()["endpoints"], {"tiny": "ok", "big": "HTTP 503"})

    def test_silent(self) -> None:
        """An endpoint that never answers: 503 after poll_ms, naming it as unreachable."""
        silent = dataclasses.replace(json_reply(200, {}), headers_delay=math.inf)
        self.big.set_default("GET", "/health", silent)
        connection = self.harness.get("/health")
        self.harness.advance(0.049)
        self.assertEqual(connection.responses(), [])
        self.harness.advance(0.001)
        response = connection.response()
        self.assertEqual(response.status, 503)
        self.assertTrue(response.json()["endpoints"]["big"].startswith("unreachable: "))
        self.assertFalse(self.big.connections[0].open)

    def test_client_gone_before_answer(self) -> None:
        """A client that leaves before the probes end is no error; the probes still end."""
        silent = dataclasses.replace(json_reply(200, {}), headers_delay=math.inf)
        self.big.set_default("GET", "/health", silent)
        connection = self.harness.get("/health")
        connection.drop()
        self.harness.advance(0.2)
        # A Deferred that failed unhandled is logged when collected: make that happen now.
        gc.collect()
        self.assertEqual(connection.responses(), [])
        self.assertFalse(self.big.connections[0].open)


class MetricsTests(SynchronousTestCase):
    """
    C{GET /metrics} serves the Prometheus text of the gateway's figures.
    """

    def test_requests_by_outcome(self) -> None:
        """After one answered and one refused request, both outcomes are counted."""
        harness = Harness()
        harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
        harness.post(HI)
        harness.post({})
        harness.advance(0.2)
        connection = harness.get("/metrics")
        response = connection.response()
        self.assertEqual(response.status, 200)
        self.assertTrue(response.headers["content-type"].startswith("text/plain"))
        self.assertIn(b'loopd_requests_total{endpoint="tiny",outcome="ok"} 1.0', response.body)
        samples = harness.scrape()
        self.assertEqual(samples[outcome("-", "missing_messages")], 1.0)
        tokens = {"endpoint": "tiny", "kind": "completion"}
        self.assertEqual(samples[("loopd_tokens_total", frozenset(tokens.items()))], 2.0)

    def test_queue_depth(self) -> None:
        """loopd_queue_depth counts the requests waiting at the slot gate, now."""
        harness = Harness(make_config(slots=1))
        harness.fake.script("POST", CHAT, answer({"content": "a"}), answer({"content": "b"}))
        depth = ("loopd_queue_depth", frozenset({("endpoint", "tiny")}))
        harness.post({**HI, "stream": True})
        harness.post({**HI, "stream": True})
        self.assertEqual(harness.scrape()[depth], 1.0)
        harness.advance(0.5)
        self.assertEqual(harness.scrape()[depth], 0.0)
