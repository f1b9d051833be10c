# -*- test-case-name: loopd.test.test_gateway_site -*-
"""
The gateway's wiring and its small routes: L{Gateway} holds what one gateway serves with (a
llama client per endpoint behind the leased upstream calls, the sessions, the router, the
endpoints' health and its probes, the metrics) and builds its twisted.web site: the front
doors C{/v1/chat/completions}, C{/v1/messages} (and its C{count_tokens}) and
C{/v1/responses}, then C{/v1/models}, C{/health}, C{/metrics}, C{/v1/status}, with leases
C{/v1/queue}, and the status page: C{/} (the page for a browser, the JSON index for everyone
else), its files under C{/ui/} and its login (L{loopd.gateway.page},
L{loopd.gateway.page_login}).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from twisted.internet.defer import Deferred, DeferredList, gatherResults
from twisted.internet.interfaces import IReactorTime
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from loopd.gateway.activity import Activity
from loopd.gateway.channel import ErrorShape, GatewaySite
from loopd.gateway.doors.table import front_doors
from loopd.gateway.errors import GatewayError
from loopd.gateway.exchange import DoorRoute
from loopd.gateway.health import HealthBoard, ProbePace
from loopd.gateway.leases import GatewayLeases, queue_status
from loopd.gateway.metrics import GatewayMetrics
from loopd.gateway.page import IndexRoute, page_routes
from loopd.gateway.page_login import LoginCodeRoute, LoginRoute, PageLogins
from loopd.gateway.probe import HealthProbes
from loopd.gateway.request import GatewayRequest
from loopd.gateway.router import AUTO_MODEL, AutoRouter, RandomSource, place
from loopd.gateway.sessions import Sessions
from loopd.gateway.status import status_document
from loopd.gateway.status_board import StatusBoard
from loopd.gateway.swap_gate import RouterStart
from loopd.gateway.token_count import CountTokens
from loopd.gateway.upstream import Upstreams
from loopd.gateway.web import Exchange, JsonRoute, Root
from loopd.llama import Client, Health
from loopd.llama.router import RouterModel
from loopd.moa.roles import VIRTUAL_MODEL_NAME as MESH_MODEL
from loopd.settings import Config, Endpoint

__all__ = ["Gateway"]


class _Metrics(Resource):
    """C{GET /metrics}: the Prometheus text of the gateway's metrics."""

    isLeaf = True

    def __init__(self, metrics: GatewayMetrics) -> None:
        """
        @param metrics: the gateway's metrics.
        """
        super().__init__()
        self._metrics = metrics

    def render_GET(self, request: Request) -> bytes:
        """The text exposition, with its content type."""
        text, content_type = self._metrics.render()
        request.setHeader(b"content-type", content_type.encode())
        return text


class Gateway:
    """
    Everything one gateway serves with: a client per endpoint behind the leased upstream
    calls, the sessions, the router, the metrics. It is the host the chat route and the
    mesh read (L{loopd.gateway.exchange.ExchangeHost}).

    @ivar in_flight: the exchanges under way, so stopping can end them.
    @ivar health: each endpoint's health state (L{HealthBoard}), fed by every upstream
        call and by the probes.
    @ivar probes: the background C{/health} probes (L{HealthProbes}); L{start} starts them.
    """

    def __init__(
        self,
        reactor: IReactorTime,
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
        routers: Mapping[str, Client] | None = None,
        router_starts: Mapping[str, RouterStart] | None = None,
    ) -> None:
        """
        @param reactor: the clock of every timer (and, for the site, of its timeouts).
        @param slot_counts: each endpoint's number of slots (from its C{/props}); an
            endpoint not named uses its C{expect.total_slots}, else 1.
        @param wall_clock: the time stamp of answers (C{created}).
        @param leases: the lease scheduler's gateway side (bound to its scheduler); each
            request then takes a lease on its endpoint's queue, and C{GET /v1/queue} serves
            the scheduler's status. C{None}: no leases, C{/v1/queue} answers 404.
        @param props: each endpoint's C{/props} body, by name, for the C{auto} router's
            candidates (tool use); an endpoint not named gets the defaults.
        @param rng: the C{auto} router's random source (default C{random.Random()}).
        @param routers: the client of each C{llama-server-router} endpoint the config's
            model endpoints came from (L{loopd.llama.router}), by name: C{/v1/models} asks
            each which of its models are loaded.
        @param router_starts: what loopd knew of each router at start (its capacity and
            loaded models): its models' calls pass its swap gate.
        """
        self.reactor = reactor
        self.config = config
        self.clients: Mapping[str, Client] = dict(clients)
        self.routers: Mapping[str, Client] = dict(routers or {})
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        self.sessions = sessions if sessions is not None else Sessions()
        self.wall_clock = wall_clock
        self.started = wall_clock()
        self.in_flight: set[Exchange] = set()
        #: What the gateway kept of its past, for C{/v1/status} (decision 48).
        self.board = StatusBoard()
        #: Every request's record and its watchers: the board, and telemetry and the
        #: capture when configured.
        self.activity = Activity(reactor.seconds, wall_clock, [self.board])
        #: The status page's login codes and session cookies (L{loopd.gateway.page_login}).
        self.logins = PageLogins(reactor)
        #: The TCP listener's URL as a browser reaches it (C{http://127.0.0.1:8421}), once
        #: it listens; C{None} without one. The login links C{loopd ui} prints start with it.
        self.page_url: str | None = None
        self._sites: list[GatewaySite] = []
        self.leases = leases
        if leases is not None and leases.scheduler is not None:
            self.metrics.watch_scheduler(leases.scheduler)
        if leases is not None:
            self.metrics.watch_grace(leases.costs, leases.cut_short, self.clients)
        self.router = AutoRouter(config.endpoints, props, rng)
        names = [e.name for e in config.endpoints]
        self.health = HealthBoard(names, ProbePace.from_settings(config.health), reactor.seconds())
        self.probes = HealthProbes(
            reactor, self.health, self.clients, config.health.timeout_ms / 1000.0
        )
        self.upstreams = Upstreams(
            reactor,
            config,
            self.clients,
            sessions=self.sessions,
            metrics=self.metrics,
            router=self.router,
            leases=leases,
            slot_counts=slot_counts,
            health=self.health,
            routers=router_starts,
            activity=self.activity,
        )
        self.metrics.watch_slot_files(self.upstreams.slot_swap.counts)
        if self.upstreams.swaps is not None:
            self.metrics.watch_swaps(self.upstreams.swaps)
        self.late_system = self.upstreams.late_system
        #: The front doors by path: the site's routes and every error shape come from here.
        self.doors = front_doors(config.doors.hosted_tools, reactor.seconds)
        self.metrics.watch_router(self.router, reactor.seconds)
        self.metrics.watch_health(self.health)
        self.metrics.watch_pacing({name: client.pacer for name, client in self.clients.items()})
        for name, client in self.clients.items():
            self.metrics.set_queue_depth(name, self._queue_depth(name, client.gate.waiting))

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
                param="model",
            ) from None

    def route_auto(self, request: GatewayRequest) -> tuple[Endpoint, ...] | None:
        """
        The endpoints to try, in order, for a request whose C{model} is C{auto} or missing,
        or a group's name (the C{auto} router's order among every endpoint, or among the
        group's members, placed by L{place} with the home of the request's conversation, so
        that a side conversation has none (decision 45), without the endpoints that are
        down); C{None} for any other request.

        @raise GatewayError: the router's errors (C{media_unsupported}, C{no_endpoint}), or
            503 C{endpoint_unavailable} when every candidate is down.
        """
        chosen = self.router.route(request, self.reactor.seconds())
        if chosen is None:
            return None
        up = self.upstreams
        # The key of the request's conversation: a side conversation has no home (decision 45).
        key = request.session.key
        free = {c.name: up.free_slots(c.name, key) for c in chosen.candidates}
        chosen = place(chosen, up.home_of(key), free)
        names = [c.name for c in chosen.candidates]
        eligible = [name for name in names if self.health.eligible(name)]
        if not eligible:
            raise self.health.unavailable(names, self.reactor.seconds())
        return tuple(self.config.endpoint(name) for name in eligible)

    def _queue_depth(self, name: str, waiting: Callable[[int], int]) -> Callable[[], int]:
        """How many requests wait at endpoint C{name}'s gate, over all its slots."""
        return lambda: sum(waiting(slot) for slot in range(self.upstreams.slot_count(name)))

    def site(self, guard: Callable[[Resource], Resource] | None = None) -> Site:
        """
        A twisted.web site serving this gateway; each listener has its own (its own
        connection cap), and C{loopd_http_connections_open} counts them all.

        @param guard: wraps the root resource, such as the TCP listener's token check
            (L{loopd.gateway.token_guard.TokenGuard}); None: the routes as they are, and
            the site is the Unix socket's, the only one that gives login codes
            (C{POST /v1/ui/login}, refused 403 elsewhere).
        """
        routes: dict[bytes, Resource] = {
            path: DoorRoute(self, door) for path, door in self.doors.by_path
        }
        routes.update(
            {
                b"/v1/messages/count_tokens": CountTokens(self, self.doors.messages),
                b"/v1/models": JsonRoute(self._models),
                b"/health": JsonRoute(self._health),
                b"/metrics": _Metrics(self.metrics),
                b"/v1/status": JsonRoute(self._status),
                b"/": IndexRoute(self._index),
                b"/ui/login": LoginRoute(self.logins),
                b"/v1/ui/login": LoginCodeRoute(
                    self.logins, lambda: self.page_url, local=guard is None
                ),
                **page_routes(),
            }
        )
        if self.leases is not None and self.leases.scheduler is not None:
            scheduler = self.leases.scheduler
            routes[b"/v1/queue"] = JsonRoute(
                lambda: (200, {**queue_status(scheduler), "endpoints": self._states()})
            )
        items = {b"/v1/models/": lambda model_id: JsonRoute(lambda: self._model(model_id))}
        root: Resource = Root(routes, items)
        site = GatewaySite(
            root if guard is None else guard(root),
            self.config.server,
            on_refusal=self.metrics.observe_refusal,
            shapes=self.error_shapes(),
            guarded=guard is not None,
            reactor=self.reactor,
        )
        self._sites.append(site)
        sites = self._sites
        self.metrics.watch_connections(lambda: sum(len(s.open_channels) for s in sites))
        return site

    def start(self) -> None:
        """Start probing every endpoint's health (L{loopd.gateway.probe})."""
        self.probes.start()

    def stop(self) -> None:
        """
        Stop the health probes; end every exchange under way with an error event (or status);
        stop the leases' and the swap gates' timers.
        """
        self.probes.stop()
        for exchange in list(self.in_flight):
            exchange.shutdown()
        if self.leases is not None:
            self.leases.stop()
        if self.upstreams.swaps is not None:
            self.upstreams.swaps.stop()

    def error_shapes(self) -> list[tuple[bytes, ErrorShape]]:
        """
        Each front door's error shape by its path, which also covers the paths under it
        (C{/v1/messages/count_tokens}): for the refusals of the HTTP channel and of the TCP
        listener's token guard, so that every error under a door's path is in that door's
        shape. Any other path gets OpenAI's.
        """
        return [(path, door.error) for path, door in self.doors.by_path]

    def _index(self) -> tuple[int, object]:
        """
        C{GET /} (and C{HEAD /}, the connectivity probe of agents such as Claude Code): what
        answers here, and where its front doors and its reports are.
        """
        return 200, {
            "service": "loopd",
            "doors": {
                "chat_completions": "/v1/chat/completions",
                "messages": "/v1/messages",
                "responses": "/v1/responses",
            },
            "models": "/v1/models",
            "health": "/health",
            "metrics": "/metrics",
            "status": "/v1/status",
        }

    def slot_count(self, endpoint: str) -> int:
        """How many slots C{endpoint} has."""
        return self.upstreams.slot_count(endpoint)

    def _status(self) -> tuple[int, object]:
        """C{GET /v1/status}: the live state (L{loopd.gateway.status})."""
        return 200, status_document(self, self.reactor.seconds(), self.wall_clock(), self.started)

    def _model_ids(self) -> list[str]:
        """
        The ids loopd serves: the endpoints in config order, the groups (in the order of
        their first member), then C{auto} and C{mesh}.
        """
        endpoints = [e.name for e in self.config.endpoints]
        return endpoints + list(self.config.groups) + [AUTO_MODEL, MESH_MODEL]

    def _model_object(self, model_id: str) -> dict[str, object]:
        """One model in OpenAI's shape."""
        created = int(self.wall_clock())
        return {"id": model_id, "object": "model", "created": created, "owned_by": "loopd"}

    def _models(self) -> tuple[int, object] | Deferred[tuple[int, object]]:
        """
        C{GET /v1/models}: the endpoints, the groups, then C{auto} and C{mesh}. A model of
        a router also says its C{router} and its C{status} there (C{loaded}, C{unloaded},
        C{loading}, ...; C{unknown} when the router did not answer), asked of each router
        now.
        """
        data = [self._model_object(model_id) for model_id in self._model_ids()]
        if not self.routers:
            return 200, {"object": "list", "data": data}
        names = list(self.routers)
        asking = [
            self.routers[name].router_models().addErrback(lambda reason: ()) for name in names
        ]

        def listed(answers: list[tuple[RouterModel, ...]]) -> tuple[int, object]:
            status = {
                (name, model.id): model.status
                for name, models in zip(names, answers, strict=True)
                for model in models
            }
            for entry in data:
                endpoint = self._routed(str(entry["id"]))
                if endpoint is not None and endpoint.router is not None:
                    entry["router"] = endpoint.router
                    key = (endpoint.router, endpoint.model or endpoint.name)
                    entry["status"] = status.get(key, "unknown")
            return 200, {"object": "list", "data": data}

        return gatherResults(asking).addCallback(listed)

    def _routed(self, model_id: str) -> Endpoint | None:
        """The endpoint called C{model_id}, if one is."""
        try:
            return self.config.endpoint(model_id)
        except KeyError:
            return None

    def _model(self, model_id: str) -> tuple[int, object]:
        """
        C{GET /v1/models/{id}} (the OpenAI SDKs' C{models.retrieve}): the model object of an
        id that C{/v1/models} lists, else 404 C{model_not_found} in the error shape.
        """
        if model_id in self._model_ids():
            return 200, self._model_object(model_id)
        error = GatewayError(
            404,
            f"no endpoint serves model {model_id!r}",
            "invalid_request_error",
            "model_not_found",
        )
        return error.status, error.body()

    def _health(self) -> Deferred[tuple[int, object]]:
        """
        C{GET /health}: every endpoint's own C{/health}, asked through its client (paced,
        and shared with any check already under way), and under C{states} each endpoint's
        health state (L{_states}). An endpoint whose inferproxy refuses loopd at its
        connection cap is named as refused by its inferproxy, not unreachable; no detail
        names a socket path.
        """
        checks = [self.clients[e.name].health() for e in self.config.endpoints]

        def summarise(results: list[tuple[bool, Health]]) -> tuple[int, object]:
            healths = [health for _, health in results]
            endpoints = {
                e.name: health.detail
                for e, health in zip(self.config.endpoints, healths, strict=True)
            }
            healthy = all(health.ok for health in healths)
            status = "ok" if healthy else "degraded"
            body = {"status": status, "endpoints": endpoints, "states": self._states()}
            return (200 if healthy else 503), body

        gathered: Deferred[list[tuple[bool, Health]]] = DeferredList(checks, consumeErrors=True)
        return gathered.addCallback(summarise)

    def _states(self) -> dict[str, dict[str, str]]:
        """
        Each endpoint's health state and what put it there (L{HealthBoard}), by name: what
        C{/health} and C{/v1/queue} show.
        """
        return {
            name: {"state": state.value, "detail": self.health.why(name)}
            for name, state in self.health.states().items()
        }
