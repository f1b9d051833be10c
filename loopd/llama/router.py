# -*- test-case-name: loopd.test.test_llama_router -*-
"""
llama-server's router mode (DESIGN decision 46): one server that serves several models,
loads each on demand and keeps at most C{--models-max} of them loaded
(reference/llama-server-api.md §7.1). A C{llama-server-router} endpoint of loopd's config
is such a server; loopd serves each of its models as an endpoint of its own, named by the
model's id, that names the model in every call (C{model} in a POST body, C{?model=} on a
GET: L{model_path}).

This module is what the router says and what loopd makes of it: the router's model list
(C{GET /v1/models}, L{parse_router_models}), the endpoints of its models
(L{model_endpoints}) and the config with every router replaced by them (L{expand_routers}).
Pure: no I/O (the client asks, L{loopd.llama.Client.router_models}).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import quote

from loopd.errors import Protocol
from loopd.settings import Config, Endpoint

__all__ = [
    "ROUTER_KIND",
    "RouterError",
    "RouterModel",
    "expand_routers",
    "model_endpoints",
    "model_path",
    "parse_router_models",
]

ROUTER_KIND = "llama-server-router"
"""The kind of a router endpoint in loopd's config."""


class RouterError(Exception):
    """A router's models cannot be served as the config says (one line: what and why)."""


@dataclass(frozen=True)
class RouterModel:
    """
    One model a router knows.

    @ivar id: its id: what a request names.
    @ivar status: C{loaded}, C{loading}, C{unloaded}, C{sleeping} (the router's
        C{status.value}), or C{unknown} when it said none.
    @ivar failed: its last load failed.
    @ivar slots: the slots its server gets (the C{--parallel} or C{-np} of the arguments the
        router starts it with), when they say.
    """

    id: str
    status: str = "unknown"
    failed: bool = False
    slots: int | None = None

    @property
    def loaded(self) -> bool:
        """Whether a child serves it now (loaded, or asleep: a request wakes it)."""
        return self.status in ("loaded", "sleeping")


def parse_router_models(value: object) -> tuple[RouterModel, ...]:
    """
    The models of a router's C{GET /v1/models} answer (C{data}: one object per model, its
    C{id} and C{status.value}), in its order.

    @raise Protocol: it is not an object with a C{data} array of objects with string ids.
    """
    data = value.get("data") if isinstance(value, dict) else None
    if not isinstance(data, list):
        raise Protocol("/v1/models did not answer an object with a data array")
    models = []
    for entry in data:
        model_id = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(model_id, str) or not model_id:
            raise Protocol("/v1/models listed a model without an id")
        status = entry.get("status")
        named = status.get("value") if isinstance(status, dict) else None
        failed = isinstance(status, dict) and status.get("failed") is True
        args = status.get("args") if isinstance(status, dict) else None
        slots = _parallel(args) if isinstance(args, list) else None
        named = named if isinstance(named, str) else "unknown"
        models.append(RouterModel(model_id, named, failed, slots))
    return tuple(models)


def _parallel(args: list[object]) -> int | None:
    """The slot count a model server's arguments give (C{--parallel N} or C{-np N})."""
    for flag, value in zip(args, args[1:], strict=False):
        if flag in ("--parallel", "-np") and isinstance(value, str) and value.isdigit():
            return int(value) or None
    return None


def model_path(path: str, model: str) -> str:
    """C{path} with C{?model=<model>} (or C{&model=}) added: a GET of a router's model."""
    joiner = "&" if "?" in path else "?"
    return f"{path}{joiner}model={quote(model, safe='')}"


def model_endpoints(router: Endpoint, models: Sequence[str]) -> tuple[Endpoint, ...]:
    """
    The endpoints loopd serves C{router}'s C{models} as: each named by the model's id, a
    C{llama-server} endpoint on the router's socket with the router's settings, its
    C{model} the id and its C{router} the router's name.
    """
    return tuple(
        dataclasses.replace(
            router,
            name=model,
            kind="llama-server",
            model=model,
            router=router.name,
            models=None,
            models_max=None,
        )
        for model in models
    )


def expand_routers(config: Config, listed: Mapping[str, Sequence[RouterModel]]) -> Config:
    """
    C{config} with each C{llama-server-router} endpoint replaced, in its place, by the
    endpoints of its models (L{model_endpoints}): those its C{models} names, else every
    model C{listed} for it (what its C{/v1/models} said).

    @param listed: each router's models, by the router endpoint's name.
    @raise RouterError: a router listed no model, one that C{models} names is not among its
        models, or a model's id is already another endpoint's (or group's) name.
    """
    endpoints: list[Endpoint] = []
    for endpoint in config.endpoints:
        if endpoint.kind != ROUTER_KIND:
            endpoints.append(endpoint)
            continue
        known = [m.id for m in listed.get(endpoint.name, ())]
        if not known:
            raise RouterError(f"router {endpoint.name} lists no model in /v1/models")
        wanted = list(endpoint.models) if endpoint.models is not None else known
        missing = [m for m in wanted if m not in known]
        if missing:
            raise RouterError(
                f"router {endpoint.name} has no model {', '.join(missing)} "
                f"(it has {', '.join(known)})"
            )
        endpoints.extend(model_endpoints(endpoint, wanted))
    names = [e.name for e in endpoints]
    taken = set(config.groups)
    for endpoint in endpoints:
        clash = names.count(endpoint.name) > 1 or endpoint.name in taken
        if endpoint.router is not None and clash:
            raise RouterError(
                f"model {endpoint.name} of router {endpoint.router} has the name of another "
                "endpoint or group; list the router's models in its models key without it"
            )
    return dataclasses.replace(config, endpoints=tuple(endpoints))
