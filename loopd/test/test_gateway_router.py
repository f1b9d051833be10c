"""
Tests for L{loopd.gateway.router} (reference/mesh-moa.md §5): candidates, weights and speed
statistics, the weighted pick with exploration, the media and capability filters, the
candidate order of a route, and which requests are the router's. Requests are written as
bodies and read through the chat-completions front door, as the gateway reads them.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.classify import Classification, classify
from loopd.gateway.doors.chat_read import parse_request
from loopd.gateway.errors import GatewayError, error_for
from loopd.gateway.request import GatewayRequest
from loopd.gateway.router import (
    EXPLORATION_PROBABILITY,
    MAX_SAMPLES,
    MIN_SAMPLES,
    NEUTRAL_WEIGHT,
    SAMPLE_TTL,
    WEIGHT_MAX,
    WEIGHT_MIN,
    AutoRouter,
    Candidate,
    MediaUnsupportedError,
    NoEndpointError,
    Route,
    SpeedStats,
    candidate_weight,
    capability_filter,
    group_member,
    make_candidate,
    media_filter,
    pick_weighted,
    place,
    route,
    tools_from_props,
    wants_auto,
)
from loopd.moa.roles import Tier
from loopd.settings import Endpoint

BIG = Tier.BIG
SMALL = Tier.SMALL


class ScriptedRandom:
    """A random source that returns the given draws in order and fails when they run out."""

    def __init__(self, *draws: float) -> None:
        self.draws = list(draws)

    def random(self) -> float:
        """The next scripted draw."""
        if not self.draws:
            raise AssertionError("the router drew more numbers than scripted")
        return self.draws.pop(0)


def request(body: dict[str, Any]) -> GatewayRequest:
    """The request the front door reads from C{body}."""
    return parse_request(json.dumps(body).encode())


def user(*texts: Any, **fields: Any) -> Classification:
    """The classification of a request with one user message per text, and C{fields}."""
    return classify(
        request({"messages": [{"role": "user", "content": t} for t in texts], **fields})
    )


#: An image part and an audio part of a user turn.
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}
CHAT = Classification("chat", "quick", False)


def stats(*speeds: float, at: float = 0.0) -> SpeedStats:
    """Statistics with these samples, all recorded at C{at}."""
    result = SpeedStats()
    for speed in speeds:
        result = result.record(speed, at)
    return result


TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {}}}
HI_BODY: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}


class CandidateTests(SynchronousTestCase):
    """Candidates from endpoint facts: tier, tool use from /props."""

    def test_tier_by_name(self) -> None:
        """A single-digit-B name is the small tier, any other name the big tier."""
        self.assertEqual(make_candidate("Qwen3-8B").tier, SMALL)
        self.assertEqual(make_candidate("Qwen3-32B").tier, BIG)
        self.assertEqual(make_candidate("Coder-Next").tier, BIG)

    def test_tier_by_size(self) -> None:
        """A configured size overrides the name rule (below 10 B is small)."""
        self.assertEqual(make_candidate("Coder-Next", size_b=7).tier, SMALL)
        self.assertEqual(make_candidate("Qwen3-8B", size_b=10).tier, BIG)

    def test_tools_from_props(self) -> None:
        """chat_template_caps.supports_tools decides; without /props or the field, yes."""
        props = {"chat_template_caps": {"supports_tools": False, "supports_tool_calls": False}}
        self.assertFalse(tools_from_props(props))
        self.assertTrue(tools_from_props({"chat_template_caps": {"supports_tools": True}}))
        self.assertTrue(tools_from_props(None))
        self.assertTrue(tools_from_props({"total_slots": 2}))
        self.assertTrue(tools_from_props({"chat_template_caps": None}))
        self.assertFalse(make_candidate("a", props=props).tools)

    def test_media_from_config(self) -> None:
        """Vision and audio are what the config says."""
        self.assertEqual(
            make_candidate("a", vision=True, audio=False),
            Candidate("a", BIG, tools=True, vision=True, audio=False),
        )


class WeightTests(SynchronousTestCase):
    """candidate_weight and the speed statistics."""

    def test_candidate_weight_table(self) -> None:
        """Neutral under 3 samples; else the average clamped to 5-100."""
        table = [
            ((500.0, 0), NEUTRAL_WEIGHT),
            ((500.0, 2), NEUTRAL_WEIGHT),
            ((1.0, 2), NEUTRAL_WEIGHT),
            ((50.0, 3), 50.0),
            ((1.0, 3), WEIGHT_MIN),
            ((500.0, 9), WEIGHT_MAX),
            ((5.0, 3), 5.0),
            ((100.0, 3), 100.0),
            ((None, 3), NEUTRAL_WEIGHT),
        ]
        for (average, samples), expected in table:
            self.assertEqual(candidate_weight(average, samples), expected)
        self.assertEqual((MIN_SAMPLES, WEIGHT_MIN, WEIGHT_MAX), (3, 5.0, 100.0))

    def test_plain_mean(self) -> None:
        """The speed is the plain mean of the samples."""
        self.assertEqual(stats(20.0, 40.0, 90.0).weight(0.0), 50.0)

    def test_cold(self) -> None:
        """Two samples, however fast, weigh neutral."""
        self.assertEqual(stats(90.0, 90.0).weight(0.0), NEUTRAL_WEIGHT)
        self.assertEqual(SpeedStats().weight(0.0), NEUTRAL_WEIGHT)

    def test_ignored_samples(self) -> None:
        """No speed, zero, negative, NaN and infinite speeds are no samples."""
        before = stats(10.0)
        for speed in (None, 0.0, -3.0, math.nan, math.inf):
            self.assertIs(before.record(speed, 1.0), before)

    def test_ttl(self) -> None:
        """A sample counts for an hour, and no longer."""
        fresh = stats(10.0, 10.0, at=100.0).record(70.0, 200.0)
        self.assertEqual(fresh.weight(100.0 + SAMPLE_TTL - 0.5), 30.0)
        self.assertEqual(fresh.weight(100.0 + SAMPLE_TTL), NEUTRAL_WEIGHT)
        self.assertEqual(SAMPLE_TTL, 3600.0)

    def test_record_drops_expired(self) -> None:
        """Recording a sample forgets the expired ones."""
        self.assertEqual(
            stats(10.0, at=0.0).record(20.0, SAMPLE_TTL).samples, ((SAMPLE_TTL, 20.0),)
        )

    def test_bounded(self) -> None:
        """Only the newest samples are kept."""
        many = stats(*range(1, MAX_SAMPLES + 11))
        self.assertEqual(len(many.samples), MAX_SAMPLES)
        self.assertEqual(many.samples[0], (0.0, 11.0))


class PickWeightedTests(SynchronousTestCase):
    """pick_weighted with scripted draws."""

    def test_weighted(self) -> None:
        """No exploration: the second draw times the total picks by running sum."""
        weights = [25.0, 75.0]
        self.assertEqual(pick_weighted(weights, ScriptedRandom(0.5, 0.0)), (0, False))
        self.assertEqual(pick_weighted(weights, ScriptedRandom(0.5, 0.2499)), (0, False))
        self.assertEqual(pick_weighted(weights, ScriptedRandom(0.5, 0.26)), (1, False))

    def test_strictly_below(self) -> None:
        """The pick goes to the first candidate whose running sum is strictly above it."""
        self.assertEqual(pick_weighted([25.0, 75.0], ScriptedRandom(0.5, 0.25)), (1, False))

    def test_none_above(self) -> None:
        """When no running sum exceeds the pick, the last candidate is taken."""
        self.assertEqual(pick_weighted([25.0, 75.0, 0.0], ScriptedRandom(0.5, 1.0)), (2, False))

    def test_exploration(self) -> None:
        """A first draw under 0.15 picks uniformly with the next draw, weights ignored."""
        weights = [100.0, 5.0, 5.0]
        self.assertEqual(pick_weighted(weights, ScriptedRandom(0.1499, 0.99)), (2, True))
        self.assertEqual(pick_weighted(weights, ScriptedRandom(0.0, 0.34)), (1, True))
        self.assertEqual(pick_weighted(weights, ScriptedRandom(0.15, 0.99)), (2, False))
        self.assertEqual(EXPLORATION_PROBABILITY, 0.15)

    def test_zero_total(self) -> None:
        """A total of zero picks uniformly."""
        self.assertEqual(pick_weighted([0.0, 0.0, 0.0, 0.0], ScriptedRandom(0.9, 0.5)), (2, False))

    def test_single(self) -> None:
        """One candidate is the pick and draws nothing."""
        self.assertEqual(pick_weighted([7.0], ScriptedRandom()), (0, False))

    def test_empty(self) -> None:
        """No candidate is a programming error."""
        self.assertRaises(ValueError, pick_weighted, [], ScriptedRandom())

    def test_seeded_spread(self) -> None:
        """With random.Random(6), 10000 picks of weights 100/25/5 land as pinned (~70/21/8 %)."""
        # expected shares: 0.15 / 3 uniform + 0.85 * weight / 130 = 70.4 %, 21.3 %, 8.3 %
        rng = random.Random(6)
        counts = Counter(pick_weighted([100.0, 25.0, 5.0], rng)[0] for _ in range(10000))
        self.assertEqual([counts[0], counts[1], counts[2]], SEEDED_COUNTS)

    def test_seeded_exploration(self) -> None:
        """With random.Random(6), the share of exploration picks is pinned near 15 %."""
        rng = random.Random(6)
        explored = sum(pick_weighted([1.0, 1.0], rng)[1] for _ in range(10000))
        self.assertEqual(explored, SEEDED_EXPLORED)

    @given(
        st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=8),
        st.integers(0, 2**32),
    )
    def test_always_an_index(self, weights: list[float], seed: int) -> None:
        """Any weights, even nonsense ones, give an index into them."""
        index, _ = pick_weighted(weights, random.Random(seed))
        self.assertTrue(0 <= index < len(weights))


#: pick_weighted([100, 25, 5]) 10000 times with random.Random(6); expected about 7038/2135/827.
SEEDED_COUNTS = [6963, 2175, 862]
#: Exploration picks among 10000 with random.Random(6); expected about 1500.
SEEDED_EXPLORED = 1541


class PlaceTests(SynchronousTestCase):
    """place: a session stays where its cache is; nothing queues beside a free slot."""

    a = Candidate("a", BIG)
    b = Candidate("b", BIG)
    c = Candidate("c", SMALL)

    def routed(self, *candidates: Candidate, explored: bool = False) -> Route:
        """A route in the given order."""
        return Route(candidates, user("hi"), explored)

    def names(self, result: Route) -> list[str]:
        """The candidates' names, in order."""
        return [candidate.name for candidate in result.candidates]

    def test_home_first_when_it_has_room(self) -> None:
        """The session's endpoint leads even where the weights put it last."""
        result = place(self.routed(self.a, self.b, self.c), home="c", free={"a": 1, "c": 1})
        self.assertEqual(self.names(result), ["c", "a", "b"])

    def test_full_home_gives_way_to_a_free_slot(self) -> None:
        """A full home is passed over for an eligible endpoint with a free slot."""
        result = place(self.routed(self.a, self.b), home="a", free={"a": 0, "b": 2})
        self.assertEqual(self.names(result), ["b", "a"])

    def test_everything_full_stays_home(self) -> None:
        """With no free slot anywhere the session waits where its cache is."""
        result = place(self.routed(self.a, self.b, self.c), home="b", free={"a": 0, "b": 0, "c": 0})
        self.assertEqual(self.names(result), ["b", "a", "c"])

    def test_ineligible_home_ignored(self) -> None:
        """A home the filters removed (say it lacks vision) does not come back."""
        result = place(self.routed(self.a, self.b), home="c", free={"a": 1, "b": 1})
        self.assertEqual(self.names(result), ["a", "b"])

    def test_new_session_goes_to_free_capacity(self) -> None:
        """Without a home, endpoints with a free slot come first, in the routed order."""
        result = place(self.routed(self.a, self.b, self.c), free={"a": 0, "b": 0, "c": 1})
        self.assertEqual(self.names(result), ["c", "a", "b"])

    def test_nothing_known(self) -> None:
        """With no free counts the routed order stands, the home first."""
        routed = self.routed(self.a, self.b, self.c, explored=True)
        self.assertEqual(place(routed), routed)
        self.assertEqual(self.names(place(routed, home="b")), ["b", "a", "c"])
        self.assertFalse(place(routed, home="b").explored)

    @given(
        st.permutations(["a", "b", "c"]),
        st.sampled_from([None, "a", "b", "c", "gone"]),
        st.fixed_dictionaries({}, optional={n: st.integers(0, 2) for n in "abc"}),
    )
    def test_rules_hold(self, order: list[str], home: str | None, free: dict[str, int]) -> None:
        """Always a permutation; never a full endpoint before one with room, but the home."""
        by_name = {"a": self.a, "b": self.b, "c": self.c}
        routed = self.routed(*(by_name[n] for n in order))
        names = self.names(place(routed, home, free))
        self.assertEqual(sorted(names), ["a", "b", "c"])
        has_room = [free.get(n, 1) > 0 for n in names]
        tail = has_room[1:] if names[0] == home else has_room
        self.assertEqual(tail, sorted(tail, reverse=True))
        if home in order and (free.get(home, 1) > 0 or not any(has_room)):
            self.assertEqual(names[0], home)


class RouteTests(SynchronousTestCase):
    """route: the filters, the tiers and the order."""

    big_a = Candidate("big-a", BIG)
    big_b = Candidate("big-b", BIG)
    small_a = Candidate("small-a", SMALL)
    small_b = Candidate("small-b", SMALL)

    def test_no_endpoint(self) -> None:
        """No endpoint at all is a 503."""
        error = self.assertRaises(NoEndpointError, route, user("hi"), [], {}, 0.0, ScriptedRandom())
        self.assertIsInstance(error, GatewayError)
        self.assertEqual((error.status, error.code), (503, "no_endpoint"))

    def test_single(self) -> None:
        """One endpoint is the route, with no draw and no filter (even one without tools)."""
        bare = Candidate("bare", SMALL, tools=False)
        result = route(user("hi", tools=[TOOL]), [bare], {}, 0.0, ScriptedRandom())
        self.assertEqual((result.candidates, result.explored), ((bare,), False))

    def test_single_after_media_filter(self) -> None:
        """One endpoint left by the media filter is the route, with no draw."""
        eye = Candidate("eye", SMALL, vision=True)
        body = user([IMAGE])
        result = route(body, [self.big_a, eye], {}, 0.0, ScriptedRandom())
        self.assertEqual(result.candidates, (eye,))

    def test_media_unsupported(self) -> None:
        """Images that no endpoint accepts are refused."""
        body = user([IMAGE])
        self.assertRaises(
            MediaUnsupportedError, route, body, [self.big_a, self.big_b], {}, 0.0, ScriptedRandom()
        )

    def test_big_before_small(self) -> None:
        """The big tier comes first, even when a small endpoint is far faster."""
        speeds = {"small-a": stats(100.0, 100.0, 100.0), "big-a": stats(5.0, 5.0, 5.0)}
        # big tier: no exploration, pick 0.99 * 30 = 29.7 -> big-b (5 + 25);
        # small tier: no exploration, 0.1 * 125 = 12.5 -> small-a (100 first).
        rng = ScriptedRandom(0.5, 0.99, 0.5, 0.1)
        endpoints = [self.small_a, self.big_a, self.small_b, self.big_b]
        result = route(user("hi"), endpoints, speeds, 0.0, rng)
        self.assertEqual(result.candidates, (self.big_b, self.big_a, self.small_a, self.small_b))
        self.assertFalse(result.explored)

    def test_weighted_by_speed(self) -> None:
        """Within a tier the measured speed weighs: 90 tok/s against neutral 25."""
        speeds = {"big-b": stats(80.0, 90.0, 100.0)}
        # total 115; 0.3 * 115 = 34.5 is past big-a's 25 -> big-b.
        result = route(user("hi"), [self.big_a, self.big_b], speeds, 0.0, ScriptedRandom(0.5, 0.3))
        self.assertEqual(result.candidates, (self.big_b, self.big_a))

    def test_exploration_flag(self) -> None:
        """An exploration first pick is reported; later picks do not change the flag."""
        rng = ScriptedRandom(0.01, 0.0, 0.5, 0.9)
        result = route(
            user("hi"), [self.big_a, self.big_b, self.small_a, self.small_b], {}, 0.0, rng
        )
        self.assertEqual(result.candidates, (self.big_a, self.big_b, self.small_b, self.small_a))
        self.assertTrue(result.explored)

    def test_filters_before_order(self) -> None:
        """The capability filter runs first: endpoints without tools are not in the order."""
        bare = Candidate("bare", BIG, tools=False)
        rng = ScriptedRandom(0.5, 0.0)
        body = user("hi", tools=[TOOL])
        result = route(body, [bare, self.small_a, self.small_b], {}, 0.0, rng)
        self.assertEqual(result.candidates, (self.small_a, self.small_b))
        self.assertEqual(result.classification.category, "tool_call")

    def test_missing_speed_is_neutral(self) -> None:
        """An endpoint without statistics weighs like a cold one."""
        rng = ScriptedRandom(0.5, 0.49)
        result = route(user("hi"), [self.big_a, self.big_b], {}, 0.0, rng)
        self.assertEqual(result.candidates[0], self.big_a)

    def test_clock_ages_speeds(self) -> None:
        """Speeds older than an hour no longer weigh at C{now}."""
        speeds = {"big-a": stats(5.0, 5.0, 5.0, at=0.0)}
        # fresh: total 30, 0.5 * 30 = 15 -> big-b; aged: total 50, 15/50 -> big-a
        fresh = route(user("hi"), [self.big_a, self.big_b], speeds, 10.0, ScriptedRandom(0.5, 0.5))
        aged = route(
            user("hi"), [self.big_a, self.big_b], speeds, SAMPLE_TTL, ScriptedRandom(0.5, 0.3)
        )
        self.assertEqual((fresh.candidates[0], aged.candidates[0]), (self.big_b, self.big_a))

    def test_no_session_affinity(self) -> None:
        """route alone follows its draws, not the last endpoint; place adds the session's home."""
        body = user("hi", user="session-1")
        endpoints = [self.big_a, self.big_b]
        first = route(body, endpoints, {}, 0.0, ScriptedRandom(0.5, 0.1))
        second = route(body, endpoints, {}, 1.0, ScriptedRandom(0.5, 0.9))
        self.assertEqual((first.candidates[0], second.candidates[0]), (self.big_a, self.big_b))

    def test_seeded_order(self) -> None:
        """A seeded random.Random gives the pinned orders and exploration flags per request."""
        # random.Random(42) draws 0.6394, 0.0250, 0.2750, 0.2232, 0.7365, 0.6767, ...
        # request 1: big tier 0.6394 >= 0.15, 0.0250 * 65 = 1.6 < 40 -> big-a, then big-b
        # (alone, no draw); small tier 0.2750 >= 0.15, 0.2232 * 35 = 7.8 < 10 -> small-a.
        # request 2: 0.7365 >= 0.15, 0.6767 * 65 = 44 >= 40 -> big-b first.
        rng = random.Random(42)
        endpoints = [self.big_a, self.big_b, self.small_a, self.small_b]
        speeds = {"big-a": stats(40.0, 40.0, 40.0), "small-a": stats(10.0, 10.0, 10.0)}
        orders = []
        for _ in range(6):
            result = route(user("hi"), endpoints, speeds, 0.0, rng)
            orders.append((tuple(c.name for c in result.candidates), result.explored))
        self.assertEqual(orders, SEEDED_ORDERS)


SEEDED_ORDERS = [
    (("big-a", "big-b", "small-a", "small-b"), False),
    (("big-b", "big-a", "small-a", "small-b"), False),
    (("big-a", "big-b", "small-b", "small-a"), False),
    (("big-a", "big-b", "small-b", "small-a"), True),
    (("big-a", "big-b", "small-a", "small-b"), False),
    (("big-b", "big-a", "small-a", "small-b"), False),
]


_names = st.lists(st.text(min_size=1, max_size=12), min_size=0, max_size=6, unique=True)
_endpoints = _names.flatmap(
    lambda names: st.tuples(
        *[
            st.tuples(
                st.builds(
                    Candidate,
                    st.just(name),
                    st.sampled_from([BIG, SMALL]),
                    tools=st.booleans(),
                    vision=st.booleans(),
                    audio=st.booleans(),
                    reasoning=st.booleans(),
                ),
                st.lists(st.floats(0.1, 500.0), max_size=5),
            )
            for name in names
        ]
    )
)
_blocks = st.lists(
    st.sampled_from(
        [
            IMAGE,
            AUDIO,
            {"type": "text", "text": "prove that, with logic"},
            {"type": "text", "text": "the screenshot"},
            {"type": "text", "text": "hi"},
        ]
    ),
    max_size=3,
)


class RouteOrderPropertyTests(SynchronousTestCase):
    """Properties of the candidate order over open inputs."""

    @given(_endpoints, _blocks, st.booleans(), st.integers(0, 2**32))
    def test_permutation_of_filtered(
        self,
        measured: tuple[tuple[Candidate, list[float]], ...],
        blocks: list[dict[str, Any]],
        with_tools: bool,
        seed: int,
    ) -> None:
        """The order is a permutation of the filtered endpoints, big tier first, never empty."""
        # "Filtered" is what the media and capability filters keep; media that no endpoint
        # accepts is the only refusal once some endpoint exists.
        found = user(blocks or "hi", **({"tools": [TOOL]} if with_tools else {}))
        body = found
        endpoints = [candidate for candidate, _ in measured]
        speeds = {candidate.name: stats(*values) for candidate, values in measured}
        if not endpoints:
            self.assertRaises(
                NoEndpointError, route, body, endpoints, speeds, 0.0, ScriptedRandom()
            )
            return
        try:
            qualified = media_filter(endpoints, found)
        except MediaUnsupportedError:
            self.assertRaises(
                MediaUnsupportedError, route, body, endpoints, speeds, 0.0, ScriptedRandom()
            )
            self.assertFalse(
                any(
                    (c.vision or not found.needs_vision) and (c.audio or not found.needs_audio)
                    for c in endpoints
                )
            )
            return
        if len(qualified) > 1:
            qualified = capability_filter(qualified, found)
        result = route(body, endpoints, speeds, 0.0, random.Random(seed))
        self.assertTrue(result.candidates)
        self.assertEqual(sorted(result.candidates, key=repr), sorted(qualified, key=repr))
        self.assertEqual(len(set(result.candidates)), len(result.candidates))
        tiers = [c.tier for c in result.candidates]
        self.assertEqual(tiers, sorted(tiers, key=lambda tier: tier is SMALL))


class MediaFilterTests(SynchronousTestCase):
    """The media filter keeps endpoints that support every required modality."""

    eye = Candidate("eye", BIG, vision=True)
    ear = Candidate("ear", BIG, audio=True)
    both = Candidate("both", SMALL, vision=True, audio=True)
    plain = Candidate("plain", BIG)

    def test_vision(self) -> None:
        """An image request keeps the vision endpoints."""
        found = user([IMAGE])
        self.assertEqual(
            media_filter([self.eye, self.ear, self.both, self.plain], found), (self.eye, self.both)
        )

    def test_vision_and_audio(self) -> None:
        """A request with both keeps endpoints with both."""
        found = user([IMAGE, AUDIO])
        self.assertEqual(media_filter([self.eye, self.ear, self.both], found), (self.both,))

    def test_none_left(self) -> None:
        """No endpoint with the modality: media unsupported, a 400 naming it."""
        found = user([AUDIO])
        error = self.assertRaises(MediaUnsupportedError, media_filter, [self.eye], found)
        self.assertEqual((error.status, error.code), (400, "media_unsupported"))
        self.assertIn("audio", error.message)
        self.assertIs(error_for(error), error)

    def test_no_media(self) -> None:
        """A text request keeps every endpoint."""
        self.assertEqual(media_filter([self.plain, self.eye], CHAT), (self.plain, self.eye))


class CapabilityFilterTests(SynchronousTestCase):
    """The capability filter prefers suited endpoints and falls back to all."""

    tooled = Candidate("tooled", BIG, tools=True, reasoning=False)
    bare = Candidate("bare", BIG, tools=False, vision=True)
    thinker = Candidate("thinker", SMALL, tools=False, reasoning=True)

    def test_tools(self) -> None:
        """A request with tools keeps the endpoints that support tool use."""
        found = user("hi", tools=[TOOL])
        self.assertEqual(capability_filter([self.bare, self.tooled], found), (self.tooled,))

    def test_tools_win_over_category(self) -> None:
        """Tool use decides even for a reasoning request."""
        found = user("prove that, with logic", tools=[TOOL])
        self.assertEqual(found.category, "reasoning")
        self.assertEqual(capability_filter([self.thinker, self.tooled], found), (self.tooled,))

    def test_reasoning(self) -> None:
        """A reasoning request keeps the endpoints that reason."""
        found = user("prove that, with logic")
        self.assertEqual(capability_filter([self.tooled, self.thinker], found), (self.thinker,))

    def test_image(self) -> None:
        """An image request keeps the vision endpoints."""
        found = user("describe the screenshot")
        self.assertEqual(capability_filter([self.tooled, self.bare], found), (self.bare,))

    def test_other_categories(self) -> None:
        """Any other category keeps every endpoint."""
        found = user("a limerick")
        self.assertEqual(
            capability_filter([self.bare, self.tooled], found), (self.bare, self.tooled)
        )

    def test_fallback(self) -> None:
        """When nothing qualifies, every endpoint stays."""
        found = user("hi", tools=[TOOL])
        self.assertEqual(
            capability_filter([self.bare, self.thinker], found), (self.bare, self.thinker)
        )


class WantsAutoTests(SynchronousTestCase):
    """When the auto router runs: model auto or no model."""

    def test_table(self) -> None:
        """auto, missing, null and empty route; a named model and mesh do not."""
        table: list[tuple[dict[str, Any], bool]] = [
            ({"model": "auto"}, True),
            ({}, True),
            ({"model": None}, True),
            ({"model": ""}, True),
            ({"model": "mesh"}, False),
            ({"model": "Qwen3-8B"}, False),
            ({"model": "AUTO"}, False),
        ]
        for fields, expected in table:
            body = {"messages": [{"role": "user", "content": "hi"}], **fields}
            self.assertEqual((fields, wants_auto(request(body))), (fields, expected))


class GroupRouteTests(SynchronousTestCase):
    """L{AutoRouter.route} of a request naming an endpoint group (decision 42)."""

    def router(self, *draws: float) -> AutoRouter:
        """A router over a, b (group qwen), c (no group) and d (group llama)."""
        endpoints = [
            Endpoint(name="a", socket="/tmp/a", group="qwen"),
            Endpoint(name="b", socket="/tmp/b", group="qwen"),
            Endpoint(name="c", socket="/tmp/c"),
            Endpoint(name="d", socket="/tmp/d", group="llama"),
        ]
        return AutoRouter(endpoints, rng=ScriptedRandom(*draws))

    def names(self, routed: Route | None) -> list[str]:
        """The candidates' names of C{routed}, in order."""
        assert routed is not None
        return [c.name for c in routed.candidates]

    def test_groups(self) -> None:
        """Each group's members, in config order, by group name."""
        self.assertEqual(self.router().groups, {"qwen": ("a", "b"), "llama": ("d",)})

    def test_among_members_only(self) -> None:
        """A request for qwen is routed among a and b, with the weighted draws."""
        for draw, order in ((0.4, ["a", "b"]), (0.6, ["b", "a"])):
            routed = self.router(0.5, draw).route(request({**HI_BODY, "model": "qwen"}), 0.0)
            self.assertEqual(self.names(routed), order)

    def test_one_member(self) -> None:
        """A group of one is that member, with no draw."""
        routed = self.router().route(request({**HI_BODY, "model": "llama"}), 0.0)
        self.assertEqual(self.names(routed), ["d"])

    def test_auto_still_everything(self) -> None:
        """auto is routed among every endpoint, grouped or not."""
        routed = self.router(0.5, 0.0, 0.5, 0.0, 0.5, 0.0).route(request(HI_BODY), 0.0)
        self.assertEqual(sorted(self.names(routed)), ["a", "b", "c", "d"])

    def test_endpoint_and_unknown_not_the_routers(self) -> None:
        """A request naming an endpoint, or a name nobody has, is not the router's."""
        for model in ("a", "c", "nope", "mesh"):
            self.assertIsNone(self.router().route(request({**HI_BODY, "model": model}), 0.0))


class GroupMemberTests(SynchronousTestCase):
    """L{group_member}: the member that stands for a group for one session."""

    def test_stable(self) -> None:
        """The same key picks the same member, whatever the members' order."""
        members = ["a", "b", "c"]
        picks = {group_member(order, "s1") for order in (members, members[::-1])}
        self.assertEqual(len(picks), 1)

    def test_spread(self) -> None:
        """Many sessions spread over every member."""
        picks = Counter(group_member(["a", "b", "c"], f"session-{i}") for i in range(300))
        self.assertEqual(set(picks), {"a", "b", "c"})
        self.assertGreater(min(picks.values()), 50)

    def test_empty(self) -> None:
        """No member is a ValueError."""
        self.assertRaises(ValueError, group_member, [], "s")

    @given(
        st.lists(st.text(min_size=1, max_size=6), min_size=2, max_size=6, unique=True),
        st.text(max_size=12),
        st.data(),
    )
    def test_only_the_leavers_keys_move(self, members: list[str], key: str, data: Any) -> None:
        """A member leaving moves only the keys that had picked it."""
        chosen = group_member(members, key)
        self.assertIn(chosen, members)
        leaver = data.draw(st.sampled_from(members))
        rest = [m for m in members if m != leaver]
        if leaver != chosen:
            self.assertEqual(group_member(rest, key), chosen)
