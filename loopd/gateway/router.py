# -*- test-case-name: loopd.test.test_gateway_router -*-
"""
The C{auto} router: which endpoint serves a request whose C{model} is C{auto} or missing
(reference/mesh-moa.md §5), or the name of an endpoint group (DESIGN §3 decision 42), and
L{AutoRouter}, the router's state in one gateway (the candidates, the groups, the speeds
measured, the random source).

A group is the endpoints of loopd.toml that share a C{group} name: replicas of one model, one
per machine. A request naming it is routed as C{auto} is, among the group's members only:
same filters, same order, same placement (L{place}), so that what the gateway applies to an
C{auto} route (the members that are down left out, the fail-over to the next) applies to a
group's too. L{group_member} is the mesh's pick of the one member that stands for a group.

  1. L{classify} (L{loopd.gateway.classify}) reads the request: a category, a complexity,
     whether it needs tools, and which media it carries.
  2. The media filter keeps the endpoints that support every modality the request carries
     (vision, audio); none left is L{MediaUnsupportedError}.
  3. The capability filter prefers endpoints that suit the request: tool use (from
     C{/props} C{chat_template_caps}) for a request with tools, then reasoning for a
     reasoning request, then vision for an image request. When it would empty the list,
     every endpoint stays.
  4. The big tier is tried before the small tier (the single-digit-B name rule, or the
     endpoint's configured C{size_b}, as for mesh roles).
  5. Within a tier the pick is weighted by measured speed (L{SpeedStats}, the
     C{predicted_per_second} of each completion), with a 15 % uniform exploration pick.

The result is an order, not only a pick (L{Route}): the first endpoint is the §5 pick and each
next one is the §5 pick among the rest, so the gateway tries the next on a connection failure.

L{place} then applies DESIGN §3 decision 34 (replaced 2026-12-01) to that order: a session
stays on the endpoint that holds its cache (its home) while that endpoint is eligible, and no
request queues on a full endpoint while an eligible one has a free slot; a new session goes to
free capacity first, the §5 order deciding among equals. The home is that of the request's
conversation (decision 45, L{loopd.gateway.sessions}): only a continuation of a session's
conversation has one, and a side conversation (a title, a background call) is placed as a
new session.
The random source is injected; the reference seeds a SplitMix64 generator from the clock,
which loopd does not copy. L{route} orders each request on its own; the session's affinity
is L{place}'s. Where the reference is silent: the signal words are loopd's own, a
C{developer} message counts as system prompt, a speed sample ages out after an hour.

Pure: no reactor, no I/O; time comes in as a number of seconds from the caller's clock.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from loopd.gateway.classify import Classification, classify
from loopd.gateway.errors import GatewayError
from loopd.gateway.request import GatewayRequest
from loopd.moa.roles import Tier, tier_of
from loopd.settings import Endpoint

__all__ = [
    "AUTO_MODEL",
    "EXPLORATION_PROBABILITY",
    "MAX_SAMPLES",
    "MIN_SAMPLES",
    "NEUTRAL_WEIGHT",
    "SAMPLE_TTL",
    "WEIGHT_MAX",
    "WEIGHT_MIN",
    "AutoRouter",
    "Candidate",
    "MediaUnsupportedError",
    "NoEndpointError",
    "RandomSource",
    "Route",
    "SpeedStats",
    "candidate_weight",
    "capability_filter",
    "group_member",
    "make_candidate",
    "media_filter",
    "pick_weighted",
    "place",
    "route",
    "tools_from_props",
    "wants_auto",
]

AUTO_MODEL: Final = "auto"
"""The virtual model that asks for the router."""

#: A speed counts once an endpoint has at least this many samples; before, it weighs neutral.
MIN_SAMPLES = 3
#: The least weight a measured endpoint gets (tokens per second).
WEIGHT_MIN = 5.0
#: The most weight a measured endpoint gets (tokens per second).
WEIGHT_MAX = 100.0
#: The weight of an endpoint with fewer than L{MIN_SAMPLES} samples.
NEUTRAL_WEIGHT = 25.0
#: The chance that a pick ignores the weights and takes any endpoint of the tier.
EXPLORATION_PROBABILITY = 0.15
#: How long a speed sample counts, in seconds (the reference's metrics live one hour).
SAMPLE_TTL = 3600.0
#: How many recent samples an endpoint keeps at most (bounds memory; not in the reference).
MAX_SAMPLES = 256


@dataclass(frozen=True)
class Candidate:
    """One endpoint the router may pick, with the capabilities the filters look at."""

    name: str
    """The endpoint's name in loopd.toml (the model the gateway then addresses)."""
    tier: Tier
    """Big or small: L{loopd.moa.roles.tier_of} of the name and the configured C{size_b}."""
    tools: bool = True
    """Its chat template supports tools (L{tools_from_props})."""
    vision: bool = False
    """It accepts images (config)."""
    audio: bool = False
    """It accepts audio (config)."""
    reasoning: bool = True
    """It can reason; loopd has no source for this yet, so every endpoint qualifies."""


class RandomSource(Protocol):
    """The random numbers the router draws: C{random.Random} and test doubles fit."""

    def random(self) -> float:
        """A float in [0, 1)."""


class NoEndpointError(GatewayError):
    """No endpoint is configured, so an C{auto} request has nothing to run on (503)."""

    def __init__(self) -> None:
        """A 503 C{server_error}/C{no_endpoint}."""
        super().__init__(503, "no endpoint is configured", "server_error", "no_endpoint")


class MediaUnsupportedError(GatewayError):
    """The request carries images or audio that no endpoint accepts (400)."""

    def __init__(self, modalities: Sequence[str]) -> None:
        """A 400 C{invalid_request_error}/C{media_unsupported} naming the C{modalities}."""
        super().__init__(
            400,
            f"no endpoint accepts {' and '.join(modalities)} input",
            "invalid_request_error",
            "media_unsupported",
        )


@dataclass(frozen=True)
class Route:
    """The router's answer: the endpoints to try, in order, and why."""

    candidates: tuple[Candidate, ...]
    """Every endpoint that passed the filters, the pick first; never empty."""
    classification: Classification
    """What the request was classified as."""
    explored: bool
    """The first pick was the uniform exploration pick rather than the weighted one."""


@dataclass(frozen=True)
class SpeedStats:
    """
    An endpoint's recent generation speeds: the C{predicted_per_second} llama-server reports
    on each completion, with the time it was recorded. The speed is their plain mean; a sample
    counts for L{SAMPLE_TTL} seconds, and only the newest L{MAX_SAMPLES} are kept.
    """

    samples: tuple[tuple[float, float], ...] = field(default=())
    """(recorded at, tokens per second) pairs, oldest first."""

    def record(self, tokens_per_second: float | None, at: float) -> SpeedStats:
        """
        These statistics with one more sample recorded at C{at}. A missing, non-finite or
        non-positive speed (a server that reports none, a completion of no tokens) is no
        sample: the same statistics come back.
        """
        if tokens_per_second is None or not 0 < tokens_per_second < math.inf:
            return self
        kept = tuple(s for s in self.samples if at - s[0] < SAMPLE_TTL)
        return SpeedStats((*kept, (at, float(tokens_per_second)))[-MAX_SAMPLES:])

    def current(self, now: float) -> tuple[float, ...]:
        """The speeds that still count at C{now}."""
        return tuple(speed for at, speed in self.samples if now - at < SAMPLE_TTL)

    def weight(self, now: float) -> float:
        """The routing weight at C{now} (L{candidate_weight} of the current samples)."""
        speeds = self.current(now)
        average = math.fsum(speeds) / len(speeds) if speeds else None
        return candidate_weight(average, len(speeds))


def candidate_weight(average: float | None, samples: int) -> float:
    """
    §5 C{candidate_weight}: with at least L{MIN_SAMPLES} samples the average speed clamped
    to [L{WEIGHT_MIN}, L{WEIGHT_MAX}] (no average: L{NEUTRAL_WEIGHT}); otherwise
    L{NEUTRAL_WEIGHT}.
    """
    if samples < MIN_SAMPLES:
        return NEUTRAL_WEIGHT
    speed = NEUTRAL_WEIGHT if average is None or math.isnan(average) else average
    return min(max(speed, WEIGHT_MIN), WEIGHT_MAX)


def make_candidate(
    name: str,
    *,
    size_b: float | None = None,
    props: object = None,
    vision: bool = False,
    audio: bool = False,
) -> Candidate:
    """
    The L{Candidate} for an endpoint: its tier by L{tier_of} (C{size_b} when configured,
    else the single-digit-B name rule), tool use by L{tools_from_props} of its C{/props}
    body (C{None} when it has none), vision and audio from its config.
    """
    return Candidate(
        name, tier_of(name, size_b), tools=tools_from_props(props), vision=vision, audio=audio
    )


def tools_from_props(props: object) -> bool:
    """
    Whether an endpoint supports tool use, from its C{GET /props} body: C{False} only when
    C{chat_template_caps.supports_tools} is C{false}. An endpoint without C{/props} (C{None},
    an C{openai} server answering 404) or without the field is taken to support tools: the
    reference's filter also keeps a "likely" capability, and the filter is a preference.
    """
    if not isinstance(props, Mapping):
        return True
    caps = props.get("chat_template_caps")
    if not isinstance(caps, Mapping):
        return True
    return caps.get("supports_tools") is not False


def media_filter(
    candidates: Sequence[Candidate], classification: Classification
) -> tuple[Candidate, ...]:
    """
    The candidates that accept every modality the request carries (vision, audio). None
    left for a request with images or audio raises L{MediaUnsupportedError}; a request with
    only files (or no media) keeps every candidate.
    """
    kept = tuple(
        c
        for c in candidates
        if (c.vision or not classification.needs_vision)
        and (c.audio or not classification.needs_audio)
    )
    if not kept and candidates:
        media = (("image", classification.needs_vision), ("audio", classification.needs_audio))
        raise MediaUnsupportedError([name for name, needed in media if needed])
    return kept


def capability_filter(
    candidates: Sequence[Candidate], classification: Classification
) -> tuple[Candidate, ...]:
    """
    The candidates suited to the request: with tools, those that support tool use (this wins
    over the category); else for a reasoning request those that reason; else for an image
    request those with vision; else all. When the filter keeps none, all stay.
    """
    if classification.needs_tools:
        kept = tuple(c for c in candidates if c.tools)
    elif classification.category == "reasoning":
        kept = tuple(c for c in candidates if c.reasoning)
    elif classification.category == "image":
        kept = tuple(c for c in candidates if c.vision)
    else:
        kept = tuple(candidates)
    return kept or tuple(candidates)


def pick_weighted(weights: Sequence[float], rng: RandomSource) -> tuple[int, bool]:
    """
    §5 C{pick_weighted}: the index of the pick among candidates with these C{weights}, and
    whether it was the exploration pick. Draw one number; under L{EXPLORATION_PROBABILITY}
    the next draw picks uniformly. Otherwise, with a positive total, the next draw times the
    total picks the first candidate whose running sum exceeds it (the last if none); a total
    of zero or less (or not finite) picks uniformly. One candidate draws nothing.
    """
    count = len(weights)
    if count == 0:
        raise ValueError("pick_weighted needs at least one candidate")
    if count == 1:
        return 0, False
    if rng.random() < EXPLORATION_PROBABILITY:
        return _uniform(count, rng), True
    total = sum(weights)
    if not total > 0 or not math.isfinite(total):
        return _uniform(count, rng), False
    pick = rng.random() * total
    running = 0.0
    for index, weight in enumerate(weights):
        running += weight
        if pick < running:
            return index, False
    return count - 1, False


def _uniform(count: int, rng: RandomSource) -> int:
    """An index in [0, count) from one draw."""
    return min(int(rng.random() * count), count - 1)


def wants_auto(request: GatewayRequest) -> bool:
    """
    Whether the C{auto} router serves a request: its C{model} is C{"auto"}, or missing,
    C{null} or empty (no model named).
    """
    return request.model is None or request.model in ("", AUTO_MODEL)


def route(
    classification: Classification,
    endpoints: Sequence[Candidate],
    speeds: Mapping[str, SpeedStats],
    now: float,
    rng: RandomSource,
) -> Route:
    """
    Route one C{auto} request (§5) by its L{classify}: apply the media filter, then (with
    more than one candidate) the capability filter, and order what is left: the big tier
    before the small tier, and within a tier repeated L{pick_weighted} draws by each
    endpoint's L{SpeedStats} weight at C{now} (an endpoint missing from C{speeds} weighs
    neutral).

    The order is a permutation of the filtered endpoints: the gateway tries them in turn when
    a connection fails. Nothing about earlier requests or the session takes part.

    @raise NoEndpointError: C{endpoints} is empty.
    @raise MediaUnsupportedError: the request carries images or audio that no endpoint accepts.
    """
    if not endpoints:
        raise NoEndpointError()
    kept = media_filter(endpoints, classification)
    if len(kept) == 1:
        return Route(kept, classification, False)
    kept = capability_filter(kept, classification)
    ordered: list[Candidate] = []
    explored = False
    for tier in (Tier.BIG, Tier.SMALL):
        rest = [c for c in kept if c.tier == tier]
        while rest:
            weights = [speeds.get(c.name, SpeedStats()).weight(now) for c in rest]
            index, exploring = pick_weighted(weights, rng)
            if not ordered:
                explored = exploring
            ordered.append(rest.pop(index))
    return Route(tuple(ordered), classification, explored)


def group_member(members: Sequence[str], key: str) -> str:
    """
    The one of C{members} that stands for their group for C{key} (a session's id): the
    member with the highest hash of C{key} and its name (rendezvous hashing). The same key
    picks the same member while it is among C{members}, so a session's cache stays on one
    member; different keys spread over the members; when a member drops out, only the keys
    that picked it move.

    @raise ValueError: C{members} is empty.
    """
    if not members:
        raise ValueError("group_member needs at least one member")

    def score(name: str) -> bytes:
        """The rendezvous hash of C{key} and C{name}."""
        pair = key.encode("utf-8", "surrogatepass") + b"\0" + name.encode("utf-8", "surrogatepass")
        return hashlib.blake2b(pair, digest_size=8).digest()

    return max(members, key=score)


def place(routed: Route, home: str | None = None, free: Mapping[str, int] | None = None) -> Route:
    """
    Reorder C{routed} by where the session's cache is and where slots are free (decision 34).

    An endpoint has room when C{free} gives it a free slot, or when C{free} does not know it
    (or is C{None}: nothing is known, so every endpoint has room). Then:
     - the session's C{home} (the endpoint that served its last turn), when it is among the
       candidates (eligible for this request) and has room, or when no candidate has room
       (waiting at home is no worse than waiting elsewhere, and keeps the cache), goes first;
     - the others follow with those that have room before those that have none, each group
       in C{routed}'s order.
    So a home that is full while another eligible endpoint has a free slot is left for the
    free one: no request queues beside a free slot.

    @param home: the endpoint of the session's last turn, or C{None} for a new session.
    @param free: free slots by endpoint name, as the gateway knows them now.
    """
    candidates = routed.candidates

    def room(candidate: Candidate) -> bool:
        """Whether C{candidate} has a free slot, or nothing says it has none."""
        return free is None or free.get(candidate.name, 1) > 0

    any_room = any(room(c) for c in candidates)
    first = [c for c in candidates if c.name == home and (room(c) or not any_room)]
    rest = [c for c in candidates if c not in first]
    ordered = first + [c for c in rest if room(c)] + [c for c in rest if not room(c)]
    return Route(tuple(ordered), routed.classification, routed.explored and not first)


class AutoRouter:
    """
    The router's state for one gateway: the candidates, the groups, their speeds, the random
    source.

    L{route} orders each request on its own; L{place} holds decision 34's placement rule
    (the session's home first, free capacity before full endpoints), which the gateway
    applies with each session's home and each endpoint's free slots (C{Upstreams.home_of},
    C{Upstreams.free_slots}). The session's slot affinity inside the chosen endpoint stays.

    @ivar candidates: one L{Candidate} per configured endpoint, in config order.
    @ivar groups: each group's member names, in config order, by group name.
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
        @param endpoints: the configured endpoints (their C{size_b}, C{vision}, C{audio},
            C{group}).
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
        self.groups: dict[str, tuple[str, ...]] = {}
        for e in endpoints:
            if e.group is not None:
                self.groups[e.group] = (*self.groups.get(e.group, ()), e.name)
        self.speeds: dict[str, SpeedStats] = {}
        self.rng: RandomSource = rng if rng is not None else random.Random()

    def route(self, request: GatewayRequest, now: float) -> Route | None:
        """
        Route one request at time C{now}: C{auto} among every endpoint, a group's name among
        its members; C{None} when it is not the router's (its model names an endpoint or
        C{mesh}).

        @raise NoEndpointError: no endpoint is configured.
        @raise MediaUnsupportedError: no endpoint (of the group) takes its media.
        """
        if wants_auto(request):
            candidates = self.candidates
        elif request.model in self.groups:
            members = self.groups[request.model]
            candidates = tuple(c for c in self.candidates if c.name in members)
        else:
            return None
        return route(classify(request), candidates, self.speeds, now, self.rng)

    def takes_media(self, request: GatewayRequest) -> tuple[Candidate, ...]:
        """
        The candidates that take every modality of C{request} (L{media_filter}).

        @raise MediaUnsupportedError: none does, and the request carries images or audio.
        """
        return media_filter(self.candidates, classify(request))

    def record(self, name: str, tokens_per_second: float | None, now: float) -> None:
        """Record the generation speed of a completion endpoint C{name} finished at C{now}."""
        self.speeds[name] = self.speeds.get(name, SpeedStats()).record(tokens_per_second, now)
