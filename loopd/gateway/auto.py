# -*- test-case-name: loopd.test.test_gateway_auto -*-
"""
The gateway's side of the C{auto} router (reference/mesh-moa.md §5): the candidates built
from the config and each endpoint's C{/props}, the speed each endpoint was measured at, and
the random source, around the pure L{loopd.gateway.router.route}.

Each request is routed on its own (DESIGN §3 decision 34): nothing of a session carries over
from one endpoint to another; the session's slot affinity inside the chosen endpoint stays.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from loopd.gateway.router import (
    Candidate,
    RandomSource,
    Route,
    SpeedStats,
    make_candidate,
    route,
    wants_auto,
)
from loopd.settings import Endpoint

__all__ = ["AUTO_MODEL", "AutoRouter"]

#: The virtual model that asks for the router.
AUTO_MODEL = "auto"


class AutoRouter:
    """
    The router's state for one gateway: the candidates, their speeds, the random source.

    @ivar candidates: one L{Candidate} per configured endpoint, in config order.
    @ivar speeds: each endpoint's L{SpeedStats}, by name (an endpoint with no completion yet
        is missing and weighs neutral).
    @ivar rng: where the router's random numbers come from.
    """

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        props: Mapping[str, object] | None = None,
        rng: RandomSource | None = None,
    ) -> None:
        """
        @param endpoints: the configured endpoints (their C{size_b}, C{vision}, C{audio}).
        @param props: each endpoint's C{GET /props} body, by name; an endpoint not named
            gets L{make_candidate}'s defaults.
        @param rng: the random source; a fresh C{random.Random()} when not given.
        """
        known = dict(props or {})
        self.candidates: tuple[Candidate, ...] = tuple(
            make_candidate(
                e.name, size_b=e.size_b, props=known.get(e.name), vision=e.vision, audio=e.audio
            )
            for e in endpoints
        )
        self.speeds: dict[str, SpeedStats] = {}
        self.rng: RandomSource = rng if rng is not None else random.Random()

    def route(self, document: Mapping[str, object], now: float) -> Route | None:
        """
        Route one request from its decoded body at time C{now}: C{None} when it is not the
        router's (its model names an endpoint).

        It runs before the request is checked, so that an image or audio request no
        endpoint accepts is C{media_unsupported} rather than the check's refusal of
        non-text parts.

        @raise loopd.gateway.router.NoEndpointError: no endpoint is configured.
        @raise loopd.gateway.router.MediaUnsupportedError: no endpoint takes its media.
        """
        if not wants_auto(document):
            return None
        return route(document, self.candidates, self.speeds, now, self.rng)

    def record(self, name: str, tokens_per_second: float | None, now: float) -> None:
        """Record the generation speed of a completion endpoint C{name} finished at C{now}."""
        self.speeds[name] = self.speeds.get(name, SpeedStats()).record(tokens_per_second, now)
