# -*- test-case-name: loopd.test.test_gateway_site -*-
"""
The gateway's HTTP site: routing, the small routes (models, health, metrics), JSON errors
for everything that is not a route, and a request body cap that twisted.web lacks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.defer import Deferred, DeferredList
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from loopd import http
from loopd.gateway.auto import AUTO_MODEL, AutoRouter
from loopd.gateway.chat_resource import ChatCompletions
from loopd.gateway.errors import GatewayError
from loopd.gateway.leases import GatewayLeases, queue_status
from loopd.gateway.mesh_calls import Reachability
from loopd.gateway.metrics import GatewayMetrics
from loopd.gateway.responses import write_json
from loopd.gateway.router import RandomSource
from loopd.gateway.sessions import Sessions
from loopd.llama import Client
from loopd.moa.roles import VIRTUAL_MODEL_NAME as MESH_MODEL
from loopd.settings import Config, Endpoint

__all__ = ["CappedRequest", "Gateway"]


class CappedRequest(Request):
    """
    A request whose body may not pass the site's C{body_bytes}: a larger body is read and
    dropped, and the request is answered 413. twisted.web itself keeps any body, spilling
    big ones to a temporary file.
    """

    _too_large = False
    _received = 0

    def _cap(self) -> int:
        # The site is where Gateway.site() put the cap; twisted.web has no typed slot for it.
        channel: Any = self.channel
        cap: int = channel.site.body_bytes
        return cap

    def gotLength(self, length: int | None) -> None:
        """
        Refuse a declared length over the cap before any of the body arrives.
        """
        if length is not None and length > self._cap():
            self._too_large = True
        super().gotLength(None if self._too_large else length)

    def handleContentChunk(self, data: bytes) -> None:
        """
        Keep body bytes only while under the cap.
        """
        self._received += len(data)
        if self._received > self._cap():
            self._too_large = True
        if not self._too_large:
            super().handleContentChunk(data)

    def process(self) -> None:
        """
        Answer 413 for a body over the cap; route anything else.
        """
        if not self._too_large:
            super().process()
            return
        error = GatewayError(
            413, f"request body over {self._cap()} bytes", "invalid_request_error", "too_large"
        )
        self.write(write_json(self, 413, error.body()))
        self.finish()


class _Json(Resource):
    """
    A leaf that answers GET with JSON computed by C{render_json} (a Deferred is fine).
    """

    isLeaf = True

    def __init__(self, render_json: Callable[[], Any]) -> None:
        super().__init__()
        self._render_json = render_json

    def render_GET(self, request: Request) -> bytes | int:
        outcome = self._render_json()
        if not isinstance(outcome, Deferred):
            status, body = outcome
            return write_json(request, status, body)
        gone: list[Failure] = []
        request.notifyFinish().addErrback(gone.append)

        def answer(result: tuple[int, object]) -> None:
            # twisted.web refuses to finish a request whose client has left.
            if not gone:
                request.write(write_json(request, *result))
                request.finish()

        outcome.addCallback(answer)
        return NOT_DONE_YET


class _Metrics(Resource):
    isLeaf = True

    def __init__(self, gateway: Gateway) -> None:
        super().__init__()
        self._gateway = gateway

    def render_GET(self, request: Request) -> bytes:
        text, content_type = self._gateway.metrics.render()
        request.setHeader(b"content-type", content_type.encode())
        return text


class _Root(Resource):
    """
    Routes by path; an unknown path is 404 and a known path with the wrong method 405,
    both in the OpenAI error shape.
    """

    def __init__(self, routes: Mapping[bytes, Resource]) -> None:
        super().__init__()
        self._routes = routes

    def getChild(self, path: bytes, request: Request) -> Resource:
        whole = b"/" + b"/".join([path, *(request.postpath or [])])
        route = self._routes.get(whole.rstrip(b"/") or b"/")
        if route is None:
            return _Refusal(404, f"no route {whole.decode('latin-1')}", "not_found")
        request.postpath = []
        return _MethodGuard(route)


class _Refusal(Resource):
    isLeaf = True

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__()
        self._error = GatewayError(status, message, "invalid_request_error", code)

    def render(self, request: Request) -> bytes:
        return write_json(request, self._error.status, self._error.body())


class _MethodGuard(Resource):
    """
    Delegates to a route, answering an unsupported method with a JSON 405.
    """

    isLeaf = True

    def __init__(self, route: Resource) -> None:
        super().__init__()
        self._route = route

    def render(self, request: Request) -> bytes | int:
        method = (request.method or b"").decode("latin-1")
        allowed = _methods(self._route)
        if method.encode("latin-1") not in allowed:
            request.setHeader(b"allow", b", ".join(allowed))
            error = GatewayError(
                405, f"{method} is not allowed here", "invalid_request_error", "method_not_allowed"
            )
            return write_json(request, 405, error.body())
        result: bytes | int = self._route.render(request)
        return result


def _methods(route: Resource) -> list[bytes]:
    """
    The methods C{route} answers, sorted. HEAD counts only beside GET: every Resource
    inherits a C{render_HEAD} that calls C{render_GET}.
    """
    methods = [
        name[len("render_") :]
        for name in dir(route)
        if name.startswith("render_") and name[len("render_") :].isupper()
    ]
    if "GET" not in methods and "HEAD" in methods:
        methods.remove("HEAD")
    return [method.encode() for method in methods]


class Gateway:
    """
    Everything one gateway serves with: a client per endpoint, the sessions, the metrics.

    @ivar in_flight: the chat exchanges under way, so stopping can end them.
    """

    def __init__(
        self,
        reactor: Any,
        config: Config,
        clients: Mapping[str, Client],
        *,
        slot_counts: Mapping[str, int] | None = None,
        metrics: GatewayMetrics | None = None,
        sessions: Sessions | None = None,
        wall_clock: Callable[[], float] = time.time,
        leases: GatewayLeases | None = None,
        props: Mapping[str, object] | None = None,
        rng: RandomSource | None = None,
    ) -> None:
        """
        @param slot_counts: each endpoint's number of slots (from its C{/props}); an
            endpoint not named uses its C{expect.total_slots}, else 1.
        @param wall_clock: the time stamp of answers (C{created}).
        @param leases: the lease scheduler's gateway side (bound to its scheduler); each
            request then takes a lease on its endpoint's queue, and C{GET /v1/queue} serves
            the scheduler's status. C{None}: no leases, C{/v1/queue} answers 404.
        @param props: each endpoint's C{/props} body, by name, for the C{auto} router's
            candidates (tool use); an endpoint not named gets the defaults.
        @param rng: the C{auto} router's random source (default C{random.Random()}).
        """
        self.reactor = reactor
        self.config = config
        self.clients = dict(clients)
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        self.sessions = sessions if sessions is not None else Sessions()
        self.wall_clock = wall_clock
        self.in_flight: set[Any] = set()
        self.leases = leases
        if leases is not None and leases.scheduler is not None:
            self.metrics.watch_scheduler(leases.scheduler)
        self._slot_counts = dict(slot_counts or {})
        self.router = AutoRouter(config.endpoints, props, rng)
        self.reachability = Reachability()
        self.metrics.watch_router(self.router, reactor.seconds)
        for name, client in self.clients.items():
            waiting = getattr(client.gate, "waiting", None)
            # Gates other than SlotGate may not say how many requests wait.
            if waiting is not None:
                self.metrics.set_queue_depth(name, self._queue_depth(name, waiting))

    def endpoint_for(self, model: str | None) -> Endpoint:
        """
        The endpoint a request's C{model} names; the first one when it names none.

        @raise GatewayError: 404 for a model no endpoint serves.
        """
        if not model:
            return self.config.endpoints[0]
        try:
            return self.config.endpoint(model)
        except KeyError:
            raise GatewayError(
                404,
                f"no endpoint serves model {model!r}",
                "invalid_request_error",
                "model_not_found",
            ) from None

    def route_auto(self, document: Mapping[str, object]) -> tuple[Endpoint, ...] | None:
        """
        The endpoints to try, in order, for a request whose C{model} is C{auto} or missing
        (the C{auto} router's order for its decoded body); C{None} for any other request.

        @raise GatewayError: the router's errors (C{media_unsupported}, C{no_endpoint}).
        """
        chosen = self.router.route(document, self.reactor.seconds())
        if chosen is None:
            return None
        return tuple(self.config.endpoint(c.name) for c in chosen.candidates)

    def record_speed(self, name: str, tokens_per_second: float | None) -> None:
        """Note the generation speed of a completion endpoint C{name} just finished."""
        self.router.record(name, tokens_per_second, self.reactor.seconds())

    def slot_count(self, name: str) -> int:
        """
        How many slots endpoint C{name} has.
        """
        if name in self._slot_counts:
            return self._slot_counts[name]
        expected = self.config.endpoint(name).expect.total_slots
        return expected if expected else 1

    def _queue_depth(self, name: str, waiting: Callable[[int], int]) -> Callable[[], int]:
        """How many requests wait at endpoint C{name}'s gate, over all its slots."""
        return lambda: sum(waiting(slot) for slot in range(self.slot_count(name)))

    def site(self) -> Site:
        """
        The twisted.web site serving this gateway.
        """
        routes: dict[bytes, Resource] = {
            b"/v1/chat/completions": ChatCompletions(self),
            b"/v1/models": _Json(self._models),
            b"/health": _Json(self._health),
            b"/metrics": _Metrics(self),
        }
        if self.leases is not None and self.leases.scheduler is not None:
            scheduler = self.leases.scheduler
            routes[b"/v1/queue"] = _Json(lambda: (200, queue_status(scheduler)))
        site = Site(_Root(routes), reactor=self.reactor)
        site.requestFactory = CappedRequest
        site.body_bytes = self.config.server.body_bytes  # type: ignore[attr-defined]
        site.displayTracebacks = False
        site.noisy = False
        return site

    def stop(self) -> None:
        """
        End every exchange under way with an error event (or status).
        """
        for exchange in list(self.in_flight):
            exchange.shutdown()
        if self.leases is not None:
            self.leases.stop()

    def _models(self) -> tuple[int, object]:
        created = int(self.wall_clock())
        data = [
            {"id": e.name, "object": "model", "created": created, "owned_by": "loopd"}
            for e in self.config.endpoints
        ]
        for virtual in (AUTO_MODEL, MESH_MODEL):
            data.append({"id": virtual, "object": "model", "created": created, "owned_by": "loopd"})
        return 200, {"object": "list", "data": data}

    def _health(self) -> Deferred[tuple[int, object]]:
        checks = [self._reachable(e) for e in self.config.endpoints]

        def summarise(results: list[tuple[bool, str]]) -> tuple[int, object]:
            endpoints = {
                e.name: detail
                for e, (_, detail) in zip(self.config.endpoints, results, strict=True)
            }
            healthy = all(detail == "ok" for detail in endpoints.values())
            status = "ok" if healthy else "degraded"
            return (200 if healthy else 503), {"status": status, "endpoints": endpoints}

        gathered = DeferredList(checks, consumeErrors=True)
        return gathered.addCallback(lambda results: summarise([r for _, r in results]))

    def _reachable(self, endpoint: Endpoint) -> Deferred[tuple[bool, str]]:
        caps = http.HttpCaps(self.config.caps.header_bytes, self.config.caps.body_bytes)
        probe = http.request(
            self.reactor,
            endpoint.socket,
            "GET",
            "/health",
            caps=caps,
            connect_timeout=self.config.limits.poll_ms / 1000.0,
        )

        def answered(response: http.HttpResponse) -> tuple[bool, str]:
            response.abort()
            # An OpenAI-compatible server need not have /health: any answer will do.
            if response.status == 200 or endpoint.kind == "openai":
                return True, "ok"
            return False, f"HTTP {response.status}"

        def failed(reason: Failure) -> tuple[bool, str]:
            return False, f"unreachable: {reason.getErrorMessage()}"

        probe.addTimeout(self.config.limits.poll_ms / 1000.0, self.reactor)
        return probe.addCallbacks(answered, failed)
