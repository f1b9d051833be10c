# -*- test-case-name: loopd.test.test_gateway_site -*-
"""
The whole gateway in memory: L{loopd.gateway.site.Gateway}'s site with real HTTP parsing on
both sides, over one scripted L{FakeLlama} per endpoint, on one C{MemoryReactorClock}.

Public test kit (L{loopd.testing}): a program that embeds the gateway, or a client of its
OpenAI-compatible HTTP front, tests here without a socket, a process or a sleep. The site
reads raw request bytes from a C{StringTransport} (L{ClientConnection}) and writes raw
response bytes to it, which L{read_responses} parses (chunked or not); its upstream clients
reach their fakes through a L{MemoryNet}. The defaults (L{make_config}) put every limit
between 50 and 200 ms, so a test sees each timeout land at an exact clock time.

Typical use::

    harness = GatewayHarness()
    harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
    connection = harness.post({"messages": [{"role": "user", "content": "Hi"}]})
    harness.advance(1)
    response = connection.response()
    assert response.json()["choices"][0]["message"]["content"] == "Hello"
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.error import ConnectionLost
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from loopd.gateway.leases import GatewayLeases
from loopd.gateway.router import RandomSource
from loopd.gateway.site import Gateway
from loopd.gateway.swap_gate import RouterStart
from loopd.llama import Client
from loopd.queue.host import QueueHost
from loopd.settings import Config, Endpoint, Expect, Limits, Retry, Server
from loopd.testing.fake_llama import CHAT, FakeLlama
from loopd.testing.memory_net import MemoryNet
from loopd.testing.reactor import MemoryLoopdReactor

__all__ = [
    "BODY_BYTES",
    "HI",
    "LIMITS",
    "NOW",
    "OTHER_PATH",
    "PATH",
    "ClientConnection",
    "GatewayHarness",
    "Response",
    "make_config",
    "outcome",
    "read_responses",
]

#: The socket of L{make_config}'s endpoint C{tiny}: in memory only, never created on disk.
PATH = "/tmp/ld-gw/tiny.sock"
#: The socket of L{make_config}'s second endpoint, C{big}.
OTHER_PATH = "/tmp/ld-gw/big.sock"
#: L{make_config}'s limits: every wait between 50 and 200 ms, one request queued per slot.
LIMITS = Limits(
    poll_ms=50, busy_wait_ms=200, load_wait_ms=150, idle_grace_ms=100, liveness_ms=80, queue_depth=1
)
#: The gateway's wall clock: every answer's C{created}.
NOW = 1_700_000_000
#: L{make_config}'s request body cap.
BODY_BYTES = 2048
#: The smallest chat request: one user message.
HI: Mapping[str, Any] = {"messages": [{"role": "user", "content": "Hi"}]}


def make_config(*, slots: int = 2, endpoints: Sequence[str] = ("tiny",), **changes: Any) -> Config:
    """
    A gateway config for tests: endpoints C{tiny} at L{PATH} (then C{big} at L{OTHER_PATH})
    with C{slots} slots each and no self-test, L{LIMITS}, no retries and a body cap of
    L{BODY_BYTES}.

    @param endpoints: the endpoints, by name, from C{"tiny"} and C{"big"}.
    @param changes: other fields of L{Config} (they replace the ones above).
    """
    paths = {"tiny": PATH, "big": OTHER_PATH}
    chosen = tuple(
        Endpoint(name=name, socket=paths[name], selftest=False, expect=Expect(total_slots=slots))
        for name in endpoints
    )
    settings = dict(limits=LIMITS, retry=Retry(attempts=1), server=Server(body_bytes=BODY_BYTES))
    return Config(endpoints=chosen, **{**settings, **changes})


@dataclass
class Response:
    """
    One HTTP response as the client read it.

    @ivar status: the status code.
    @ivar headers: each header's last value, by lower-case name.
    @ivar body: the body without its framing (so far, if it is not complete).
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
        """
        The JSON of each C{: loopd {...}} comment line (loopd's own progress events), but
        the answer's cache report (L{cache_report}).
        """
        return [c for c in self.all_comments() if c.get("event") != "cache"]

    def all_comments(self) -> list[dict[str, Any]]:
        """The JSON of every C{: loopd {...}} comment line, the cache report's too."""
        prefix = ": loopd "
        return [json.loads(e[len(prefix) :]) for e in self.events() if e.startswith(prefix)]

    def cache_report(self) -> dict[str, Any] | None:
        """
        The stream's cache report (C{reused}, C{evaluated}, C{saved_ms}), or C{None} when it
        has none (L{loopd.gateway.cache_report}).
        """
        reports = [c for c in self.all_comments() if c.get("event") == "cache"]
        return reports[-1] if reports else None


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

    @ivar transport: the transport the site writes to.
    @ivar channel: the site's protocol for this connection.
    """

    def __init__(self, harness: GatewayHarness) -> None:
        """Connect to C{harness}'s site."""
        self._harness = harness
        self.transport = StringTransport()
        channel = harness.site.buildProtocol(None)
        assert channel is not None, "the gateway's site refused a connection"
        self.channel = channel
        self.channel.makeConnection(self.transport)

    def send(self, raw: bytes) -> None:
        """Deliver C{raw} to the site, then let the in-memory network settle."""
        self.channel.dataReceived(raw)
        self._harness.net.pump()

    def request(
        self, method: str, target: str, body: bytes | None = None, headers: Sequence[str] = ()
    ) -> None:
        """
        Send one HTTP/1.1 request; a C{body} goes with its C{Content-Length}.

        @param headers: extra header lines, each C{"Name: value"}.
        """
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
        """The connection's one response (so far); an error if there is none or several."""
        (only,) = self.responses()
        return only

    def drop(self) -> None:
        """The client goes away: the connection is lost under the site."""
        self.channel.connectionLost(Failure(ConnectionLost("client went away")))
        self._harness.net.pump()


class GatewayHarness:
    """
    A gateway over one L{FakeLlama} per endpoint of its config, each listening at the
    endpoint's socket path on a L{MemoryNet}, all on one C{MemoryReactorClock}.

    @ivar reactor: the clock and reactor of everything here.
    @ivar net: the in-memory network the upstream clients connect through.
    @ivar config: the gateway's config.
    @ivar fakes: the fake server of each endpoint, by name.
    @ivar fake: the first endpoint's fake (C{tiny} in L{make_config}'s).
    @ivar leases: the gateway's lease side, or C{None} without leases.
    @ivar host: the lease scheduler's host (L{QueueHost}), or C{None} without leases.
    @ivar gateway: the gateway under test.
    @ivar site: its twisted.web site.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        dead: Sequence[str] = (),
        leases: bool = False,
        grace_ms: int = 1000,
        slot_counts: Mapping[str, int] | None = None,
        props: Mapping[str, object] | None = None,
        rng: RandomSource | None = None,
        router_starts: Mapping[str, RouterStart] | None = None,
    ) -> None:
        """
        A fresh clock, network, fakes and gateway.

        @param config: the gateway's config (default: L{make_config}'s).
        @param dead: endpoints whose fake does not listen (their socket is missing).
        @param leases: whether each request takes a lease from an in-process scheduler, as
            C{twist loopd} wires it; C{GET /v1/queue} then serves its status.
        @param grace_ms: how long a session keeps its lease after a request (with leases).
        @param slot_counts: each endpoint queue's slot count, with leases (default: the
            endpoint's C{expect.total_slots}, else 1).
        @param props: each endpoint's C{/props} body for the C{auto} router, by name.
        @param rng: the C{auto} router's random source (default: a random one).
        @param router_starts: the routers whose models the config's endpoints are (their
            C{router} field), each as loopd found it at start: their calls pass the swap
            gate. Each model keeps a fake of its own here.
        """
        self.reactor = MemoryLoopdReactor()
        self.net = MemoryNet(self.reactor)
        self.config = config or make_config()
        self.fakes: dict[str, FakeLlama] = {}
        for endpoint in self.config.endpoints:
            fake = FakeLlama(self.reactor)
            self.fakes[endpoint.name] = fake
            if endpoint.name not in dead:
                self.net.listen(endpoint.socket, fake)
        self.fake = self.fakes[self.config.endpoints[0].name]
        clients = {e.name: Client(self.reactor, self.config, e) for e in self.config.endpoints}
        self.leases: GatewayLeases | None = None
        self.host: QueueHost | None = None
        if leases:
            self.leases = GatewayLeases(self.reactor, grace_ms)
            if slot_counts is None:
                slot_counts = {e.name: e.expect.total_slots or 1 for e in self.config.endpoints}
            self.host = QueueHost(self.reactor, self.leases.on_grant, slot_counts=slot_counts)
            self.leases.bind(self.host.scheduler)
        self.gateway = Gateway(
            self.reactor,
            self.config,
            clients,
            wall_clock=lambda: NOW,
            leases=self.leases,
            props=props,
            rng=rng,
            router_starts=router_starts,
        )
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
    """The key of C{loopd_requests_total{endpoint, outcome}} in L{GatewayHarness.scrape}."""
    labels = frozenset({("endpoint", endpoint), ("outcome", code)})
    return ("loopd_requests_total", labels)
