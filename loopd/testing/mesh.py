# -*- test-case-name: loopd.test.test_gateway_mesh -*-
"""
A gateway over several scripted fake llama-servers, for scenario tests of C{model: "mesh"}.

Public test kit (L{loopd.testing}): L{MeshHarness} is L{loopd.testing.gateway.GatewayHarness}
over a mesh config (L{mesh_config}): one L{FakeLlama} per named endpoint, each at its own
in-memory socket path, and limits generous enough for scripted latencies of many seconds: no
C{/slots} poll, no liveness or wait limit and no client retry gets in the way, so a worker's
time is exactly what its script says. The helpers build the replies a worker gives
(L{says}, L{calls_tool}, L{fails}) and read what the fakes received
(L{MeshHarness.chat_bodies}, L{moa_headers}).

Typical use::

    harness = MeshHarness()
    harness.script(
        llama_70b=says("Paris.", 1.0), mistral_7b=says("Paris.", 0.5), qwen3_8b=says("Paris.", 0.7)
    )
    response = harness.ask(ASK, 2.0)
    assert content_of(response.json()) == "Paris."
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from loopd.settings import Config, Endpoint, EndpointKind, Expect, Limits, Mesh, Retry, Server
from loopd.testing.fake_llama import CHAT, Reply, error_reply, sse_reply
from loopd.testing.gateway import GatewayHarness, Response
from loopd.testing.llama_replies import TIMINGS, chunk

__all__ = [
    "ASK",
    "LIMITS",
    "MOA_HEADERS",
    "QUESTION",
    "THREE",
    "TWO",
    "MeshHarness",
    "calls_tool",
    "content_of",
    "fails",
    "mesh_config",
    "moa_headers",
    "says",
    "socket_path",
    "system_text",
]

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


class MeshHarness(GatewayHarness):
    """
    A L{GatewayHarness} over one L{FakeLlama} per endpoint of a mesh config
    (L{mesh_config}), with the helpers of mesh scenarios: script each worker by name, read
    what each received. With C{leases}, every upstream call takes a lease from an in-process
    scheduler with one slot per endpoint and a grace of C{grace_ms}.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        dead: Sequence[str] = (),
        leases: bool = False,
        grace_ms: int = 3000,
    ) -> None:
        """
        A fresh clock, network, fakes and gateway for C{config} (default: L{mesh_config}'s).

        @param dead: endpoints whose fake does not listen.
        """
        config = config or mesh_config()
        super().__init__(
            config,
            dead=dead,
            leases=leases,
            grace_ms=grace_ms,
            slot_counts={e.name: 1 for e in config.endpoints},
        )

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
