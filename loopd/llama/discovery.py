# -*- test-case-name: loopd.test.test_llama_discovery -*-
"""
Finding a router's models before loopd serves them (DESIGN decision 46): each
C{llama-server-router} endpoint of the config is asked for its models (C{GET /v1/models},
waited for up to its C{selftest_wait_ms} while it does not answer), the config is expanded
so that each model is an endpoint of its own (L{loopd.llama.router.expand_routers}), and
each model gets a client that shares its router's pacing (one socket, one inferproxy).
C{twist loopd} does this at start, and C{loopd selftest} before it checks each model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.logger import Logger

from loopd.llama.client import Client
from loopd.llama.retry import retry_loop
from loopd.llama.router import ROUTER_KIND, RouterError, RouterModel, expand_routers
from loopd.reactor import IUnixReactor
from loopd.settings import Config

__all__ = ["Discovered", "ask_router", "discover_routers", "router_capacity"]

_log: Final = Logger(namespace="loopd.llama.discovery")


@dataclass(frozen=True)
class Discovered:
    """
    The config with its routers' models, and their clients.

    @ivar config: the config, each router replaced by its models' endpoints.
    @ivar clients: a client for every endpoint of C{config} (the ones given, and one per
        router model sharing its router's pacing).
    @ivar routers: each router's own client, by the router's name (empty: no router).
    @ivar listed: what each router's C{/v1/models} said, by the router's name.
    """

    config: Config
    clients: dict[str, Client]
    routers: dict[str, Client] = field(default_factory=dict)
    listed: dict[str, tuple[RouterModel, ...]] = field(default_factory=dict)


@inlineCallbacks
def discover_routers(reactor: IUnixReactor, config: Config, clients: Mapping[str, Client]) -> Any:
    """
    Ask each router of C{config} for its models and expand the config with them.

    @param clients: a client for each endpoint of C{config}, the routers' included.
    @return: fires with a L{Discovered}; C{config} itself and C{clients} when there is no
        router. Fails with L{RouterError} when a router never answers, or its models
        cannot be served as the config says.
    """
    routers = {n: c for n, c in clients.items() if c.endpoint.kind == ROUTER_KIND}
    if not routers:
        return Discovered(config, dict(clients))
    listed = {}
    for name, client in routers.items():
        listed[name] = yield ask_router(reactor, client)
    expanded = expand_routers(config, listed)
    models = {}
    for endpoint in expanded.endpoints:
        router = routers.get(endpoint.router or "")
        if router is not None:
            models[endpoint.name] = Client(reactor, expanded, endpoint, pacer=router.pacer)
        else:
            models[endpoint.name] = clients[endpoint.name]
    return Discovered(expanded, models, routers, listed)


def ask_router(reactor: IUnixReactor, client: Client) -> Deferred[tuple[RouterModel, ...]]:
    """
    C{client}'s router's models (L{Client.router_models}), asked again every half second
    while it does not answer, for up to its endpoint's C{selftest_wait_ms}.

    @raise RouterError: (in the Deferred) it never answered, with its last error.
    """
    endpoint = client.endpoint
    limit = endpoint.selftest_wait_ms / 1000.0

    def pause(error: BaseException, tries: int, elapsed: float) -> float | None:
        if elapsed + ROUTER_ASK_PAUSE > limit:
            raise RouterError(
                f"router {endpoint.name}: /v1/models did not answer within "
                f"{endpoint.selftest_wait_ms} ms: {error}"
            )
        return ROUTER_ASK_PAUSE

    return retry_loop(client.router_models, clock=reactor, pause=pause)


@inlineCallbacks
def router_capacity(client: Client, models: int) -> Any:
    """
    How many models C{client}'s router keeps loaded, as its C{/props} says
    (C{max_instances}; 0 there means no limit: all its C{models}); 1 when it does not say.
    """
    try:
        props = yield client.props()
    except Exception as e:  # noqa: BLE001 - the capacity is a hint; 1 is the safe guess
        _log.warn(
            "router {router}: /props unavailable ({error}); assuming 1 model loaded at once",
            router=client.endpoint.name,
            error=e,
        )
        return 1
    value = props.get("max_instances")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return max(1, models) if value == 0 else 1


#: Seconds between two asks of a router that does not answer yet.
ROUTER_ASK_PAUSE: Final = 0.5
