"""
A gateway over several scripted fake llama-servers, for scenario tests of C{model: "mesh"}
(L{loopd.test.test_gateway_mesh}, L{loopd.test.test_gateway_mesh_tools}).

L{MeshHarness} is L{loopd.test.test_gateway_site.Harness} with one L{FakeLlama} per named
endpoint, each at its own in-memory socket path, and limits generous enough for scripted
latencies of many seconds: no C{/slots} poll, no liveness or wait limit and no client retry
gets in the way, so a worker's time is exactly what its script says. The helpers build
the replies a worker gives (L{says}, L{calls_tool}, L{fails}) and read what the fakes
received (L{MeshHarness.chat_bodies}).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from twisted.internet.testing import MemoryReactorClock

from loopd.config import Config, Endpoint, Expect, Limits, Mesh, Retry, Server
from loopd.gateway.leases import GatewayLeases
from loopd.gateway.site import Gateway
from loopd.llama import Client
from loopd.queue.host import QueueHost
from loopd.settings import EndpointKind
from loopd.test.support.fake_llama import CHAT, FakeLlama, Reply, error_reply, sse_reply
from loopd.test.support.memory_net import MemoryNet
from loopd.test.test_gateway_site import NOW, TIMINGS, Harness, Response, chunk

#: A pool of two small-tier workers and one big-tier worker: the roles are mistral-7b
#: Fast, qwen3-8b Specialist and llama-70b Strong; the reducer ladder starts at llama-70b.
THREE = ("llama-70b", "mistral-7b", "qwen3-8b")
#: A pool of one big-tier and one small-tier worker.
TWO = ("llama-70b", "mistral-7b")
#: Limits far above any scripted latency: a minute of silence is still no failure.
LIMITS = Limits(
    poll_ms=3_600_000,
    busy_wait_ms=3_600_000,
    load_wait_ms=3_600_000,
    idle_grace_ms=3_600_000,
    liveness_ms=3_600_000,
    queue_depth=8,
)
#: The message every scenario asks unless it says otherwise.
QUESTION: dict[str, Any] = {"role": "user", "content": "What is the capital of France?"}
#: A mesh request with one user message.
ASK: dict[str, Any] = {"model": "mesh", "messages": [QUESTION]}
#: The x-moa-* headers a turn reports, in the reference's order.
MOA_HEADERS = (
    "x-moa-elapsed-ms",
    "x-moa-turn",
    "x-moa-workers",
    "x-moa-workers-ok",
    "x-moa-reducer",
    "x-moa-reducer-attempts",
)


def socket_path(name: str) -> str:
    """The in-memory socket path of endpoint C{name} (never created on disk)."""
    return f"/tmp/ld-mesh/{name}.sock"


def mesh_config(
    names: Sequence[str] = THREE,
    *,
    sizes: Mapping[str, float] | None = None,
    kinds: Mapping[str, EndpointKind] | None = None,
    strong_patience_ms: int = 20_000,
) -> Config:
    """
    One endpoint per name at L{socket_path}, two slots each, with C{size_b} and C{kind}
    where given; L{LIMITS}, one attempt per request, the given strong patience.
    """
    sizes = sizes or {}
    kinds = kinds or {}
    endpoints = tuple(
        Endpoint(
            name=name,
            socket=socket_path(name),
            kind=kinds.get(name, "llama-server"),
            selftest=False,
            size_b=sizes.get(name),
            expect=Expect(total_slots=2),
        )
        for name in names
    )
    return Config(
        endpoints=endpoints,
        limits=LIMITS,
        retry=Retry(attempts=1),
        server=Server(body_bytes=1 << 20),
        mesh=Mesh(strong_patience_ms=strong_patience_ms),
    )


def says(
    text: str,
    after: float = 0.0,
    *,
    finish: str = "stop",
    reasoning: str | None = None,
) -> Reply:
    """
    A worker's streamed answer C{text}: nothing at all for C{after} seconds, then the
    whole stream at once (a reasoning delta first when given).
    """
    deltas: list[dict[str, Any]] = []
    if reasoning is not None:
        deltas.append({"reasoning_content": reasoning})
    if text:
        deltas.append({"content": text})
    events = [chunk(delta) for delta in deltas]
    events.append(chunk({}, finish, timings=TIMINGS))
    return sse_reply(events, headers_delay=after)


def calls_tool(name: str, arguments: object, after: float = 0.0) -> Reply:
    """
    A worker's streamed native tool call of C{name} with C{arguments} (a JSON value, sent
    as its JSON text), after C{after} seconds.
    """
    function = {"name": name, "arguments": json.dumps(arguments)}
    call = {"index": 0, "id": "call_up", "type": "function", "function": function}
    events = [chunk({"tool_calls": [call]}), chunk({}, "tool_calls", timings=TIMINGS)]
    return sse_reply(events, headers_delay=after)


def fails(status: int = 500, after: float = 0.0, **headers: str) -> Reply:
    """An upstream error C{status} after C{after} seconds, with extra C{headers}."""
    reply = error_reply(status, "server_error", f"scripted failure {status}")
    extra = tuple((name.replace("_", "-"), value) for name, value in headers.items())
    return dataclasses.replace(reply, headers=(*reply.headers, *extra), headers_delay=after)


class MeshHarness(Harness):
    """
    A gateway over one L{FakeLlama} per endpoint of C{config} (L{mesh_config}), each
    listening at its path unless named in C{dead}; with C{leases}, every upstream call
    takes a lease from an in-process scheduler (one slot per endpoint, a grace of
    C{grace_ms}).

    @ivar fakes: the fake server of each endpoint, by name.
    @ivar leases: the gateway's lease side, or None.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        dead: Sequence[str] = (),
        leases: bool = False,
        grace_ms: int = 3000,
    ) -> None:
        """A fresh clock, network, fakes and gateway for C{config}."""
        self.reactor = MemoryReactorClock()
        self.net = MemoryNet(self.reactor)
        self.config = config or mesh_config()
        self.fakes: dict[str, FakeLlama] = {}
        for endpoint in self.config.endpoints:
            fake = FakeLlama(self.reactor)
            self.fakes[endpoint.name] = fake
            if endpoint.name not in dead:
                self.net.listen(endpoint.socket, fake)
        self.fake = self.fakes[self.config.endpoints[0].name]
        clients = {e.name: Client(self.reactor, self.config, e) for e in self.config.endpoints}
        self.leases: GatewayLeases | None = None
        if leases:
            self.leases = GatewayLeases(self.reactor, grace_ms)
            counts = {e.name: 1 for e in self.config.endpoints}
            self.host = QueueHost(self.reactor, self.leases.on_grant, slot_counts=counts)
            self.leases.bind(self.host.scheduler)
        self.gateway = Gateway(
            self.reactor, self.config, clients, wall_clock=lambda: NOW, leases=self.leases
        )
        self.site = self.gateway.site()

    def script(self, **replies: Reply | Sequence[Reply]) -> None:
        """Queue each endpoint's chat replies (an endpoint name with C{-} spelled C{_})."""
        for key, reply in replies.items():
            name = self._name(key)
            queued = [reply] if isinstance(reply, Reply) else list(reply)
            self.fakes[name].script("POST", CHAT, *queued)

    def _name(self, key: str) -> str:
        for name in self.fakes:
            if name.replace("-", "_").replace(".", "_") == key:
                return name
        raise KeyError(key)

    def chat_bodies(self, name: str) -> list[Any]:
        """The JSON bodies of the chat requests endpoint C{name} received, in order."""
        return [request.json for request in self.fakes[name].requests_to("POST", CHAT)]

    def chat_times(self, name: str) -> list[float]:
        """When endpoint C{name} received each chat request, on the clock."""
        return [request.received_at for request in self.fakes[name].requests_to("POST", CHAT)]

    def served(self) -> dict[str, int]:
        """How many chat requests each endpoint received."""
        return {name: len(self.chat_bodies(name)) for name in self.fakes}

    def open_upstream(self) -> list[str]:
        """The endpoints with a connection still open to their fake."""
        return [
            name
            for name, fake in self.fakes.items()
            if any(record.open for record in fake.connections)
        ]

    def held(self) -> dict[str, set[str]]:
        """The sessions holding a lease on each endpoint (leases on)."""
        assert self.leases is not None
        return {name: self.leases.held_sessions(name) for name in self.fakes}

    def ask(self, document: object, seconds: float, session: str | None = None) -> Response:
        """POST C{document}, let C{seconds} pass, and return the response so far."""
        connection = self.post(document, session)
        self.advance(seconds)
        return connection.response()


def moa_headers(response: Response) -> dict[str, str]:
    """The x-moa-* headers of C{response} (missing ones left out)."""
    return {name: response.headers[name] for name in MOA_HEADERS if name in response.headers}


def content_of(body: Mapping[str, Any]) -> Any:
    """The C{choices[0].message.content} of a C{chat.completion} body."""
    return body["choices"][0]["message"]["content"]


def system_text(body: Mapping[str, Any]) -> str:
    """The first message's content of an upstream body, when it is the system prompt."""
    first = body["messages"][0]
    return str(first["content"]) if first.get("role") == "system" else ""
