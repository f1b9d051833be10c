"""
Tests for the C{auto} model in the gateway (L{loopd.gateway.router} and its wiring in
L{loopd.gateway.site} and L{loopd.gateway.exchange}): routed requests, speeds recorded
from completions, the capability and media filters, fail-over on a connection failure and
C{/v1/models}; and endpoint groups (decision 42), routed the same way among their members and
one worker each in the mesh's pool. Two scripted fake llama-servers (C{tiny} and C{big}) in
memory on a C{MemoryReactorClock}; the router's random numbers come from a script, so picks
are exact.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from loopd.errors import ProxyRefused
from loopd.gateway.doors.chat_read import parse_request
from loopd.gateway.mesh import mesh_pool
from loopd.gateway.request import SessionRef
from loopd.gateway.router import group_member
from loopd.settings import Config, Endpoint, Expect, Retry
from loopd.testing.fake_llama import CHAT, LOADING, Reply, error_reply
from loopd.testing.gateway import HI, GatewayHarness, make_config
from loopd.testing.llama_replies import TIMINGS, answer

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
IMAGE = {
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        }
    ]
}
NO_TOOLS = {"chat_template_caps": {"supports_tools": False}}


class Scripted:
    """A random source that returns scripted numbers and fails when it runs out."""

    def __init__(self, *numbers: float) -> None:
        """Return C{numbers}, in order."""
        self.numbers = list(numbers)

    def random(self) -> float:
        """The next scripted number."""
        return self.numbers.pop(0)


def auto_config(**endpoint_changes: Mapping[str, Any]) -> Config:
    """L{make_config} with C{tiny} and C{big}, each endpoint's fields changed as given."""
    config = make_config(endpoints=("tiny", "big"))
    endpoints = tuple(
        dataclasses.replace(e, **endpoint_changes.get(e.name, {})) for e in config.endpoints
    )
    return dataclasses.replace(config, endpoints=endpoints)


class AutoHarness(GatewayHarness):
    """
    L{GatewayHarness} with C{tiny} and C{big} (the second listening unless C{big_listens} is
    false), the router's random source scripted, C{/props} bodies given, and leases when
    asked for.
    """

    def __init__(
        self,
        config: Config,
        rng: Scripted,
        props: Mapping[str, object] | None = None,
        *,
        big_listens: bool = True,
        leases: bool = False,
    ) -> None:
        """A gateway over C{config} routing with C{rng}."""
        super().__init__(
            config,
            dead=() if big_listens else ("big",),
            leases=leases,
            grace_ms=60_000,
            props=props,
            rng=rng,
        )
        self.big = self.fakes["big"]

    def served(self) -> tuple[int, int]:
        """How many chat requests C{tiny} and C{big} received."""
        return len(self.fake.requests_to("POST", CHAT)), len(self.big.requests_to("POST", CHAT))


class AutoTestCase(SynchronousTestCase):
    """Helpers the tests share."""

    def ask(self, harness: AutoHarness, document: object) -> Any:
        """POST C{document}, let the answer come; the whole 200 JSON answer."""
        connection = harness.post(document)
        harness.advance(1)
        response = connection.response()
        self.assertEqual((response.status, response.complete), (200, True), response.body)
        return response.json()

    def script_both(self, harness: AutoHarness, count: int = 1) -> None:
        """Let each fake answer C{count} chat requests."""
        harness.fake.script("POST", CHAT, *[answer({"content": "tiny"})] * count)
        harness.big.script("POST", CHAT, *[answer({"content": "big"})] * count)


class PickTests(AutoTestCase):
    """Which endpoint an C{auto} request goes to."""

    def test_weighted_pick(self) -> None:
        """Neutral weights 25/25: a draw under half the total picks tiny, over half big."""
        for draw, served, model in ((0.4, (1, 0), "tiny"), (0.6, (0, 1), "big")):
            harness = AutoHarness(auto_config(), Scripted(0.5, draw))
            self.script_both(harness)
            body = self.ask(harness, {**HI, "model": "auto"})
            self.assertEqual((harness.served(), body["model"]), (served, model))

    def test_no_model_is_auto(self) -> None:
        """No model, a null model and an empty model are routed like auto."""
        for document in (HI, {**HI, "model": None}, {**HI, "model": ""}):
            harness = AutoHarness(auto_config(), Scripted(0.5, 0.6))
            self.script_both(harness)
            self.assertEqual(self.ask(harness, document)["model"], "big")
            self.assertEqual(harness.served(), (0, 1))

    def test_named_model_unchanged(self) -> None:
        """A request that names an endpoint goes there and draws no random number."""
        harness = AutoHarness(auto_config(), Scripted())
        self.script_both(harness)
        self.assertEqual(self.ask(harness, {**HI, "model": "big"})["model"], "big")
        self.assertEqual(harness.served(), (0, 1))

    def test_exploration(self) -> None:
        """A first draw under 15 % picks uniformly with the second draw."""
        harness = AutoHarness(auto_config(), Scripted(0.1, 0.7))
        self.script_both(harness)
        self.assertEqual(self.ask(harness, HI)["model"], "big")

    def test_big_tier_first(self) -> None:
        """A big-tier endpoint is picked before a small-tier one, with no draw."""
        config = auto_config(tiny={"size_b": 70.0}, big={"size_b": 3.0})
        harness = AutoHarness(config, Scripted())
        self.script_both(harness)
        self.assertEqual(self.ask(harness, HI)["model"], "tiny")


class SpeedTests(AutoTestCase):
    """Speeds from completions weigh the picks."""

    def test_speeds_recorded(self) -> None:
        """Each completion's predicted_per_second is a sample, at the reactor's time."""
        harness = AutoHarness(auto_config(), Scripted())
        self.script_both(harness)
        harness.advance(5)
        self.ask(harness, {**HI, "model": "tiny"})
        samples = harness.gateway.router.speeds["tiny"].samples
        self.assertEqual([speed for _, speed in samples], [TIMINGS["predicted_per_second"]])
        self.assertNotIn("big", harness.gateway.router.speeds)

    def test_no_speed_no_sample(self) -> None:
        """A completion without predicted_per_second records nothing."""
        harness = AutoHarness(auto_config(), Scripted())
        harness.fake.script("POST", CHAT, answer({"content": "x"}, timings={"predicted_n": 1}))
        self.ask(harness, {**HI, "model": "tiny"})
        self.assertEqual(harness.gateway.router.speeds["tiny"].samples, ())

    def test_speeds_in_metrics(self) -> None:
        """/metrics shows each endpoint's mean speed, its sample count and its weight."""
        harness = AutoHarness(auto_config(), Scripted())
        speeds = (40.0, 60.0, 80.0)
        replies = [
            answer({"content": "x"}, timings={**TIMINGS, "predicted_per_second": v}) for v in speeds
        ]
        harness.fake.script("POST", CHAT, *replies)
        for _ in speeds:
            self.ask(harness, {**HI, "model": "tiny"})
        scraped = harness.scrape()

        def gauge(name: str, endpoint: str) -> float | None:
            return scraped.get((name, frozenset({("endpoint", endpoint)})))

        self.assertEqual(gauge("loopd_auto_speed_tokens_per_second", "tiny"), 60.0)
        self.assertEqual(gauge("loopd_auto_samples", "tiny"), 3)
        self.assertEqual(gauge("loopd_auto_weight", "tiny"), 60.0)
        self.assertIsNone(gauge("loopd_auto_speed_tokens_per_second", "big"))
        self.assertEqual(gauge("loopd_auto_samples", "big"), 0)
        self.assertEqual(gauge("loopd_auto_weight", "big"), 25.0)

    def test_speeds_change_the_pick(self) -> None:
        """Three fast answers from tiny (100 t/s vs neutral 25) turn a 0.7 draw to tiny."""
        fast = {**TIMINGS, "predicted_per_second": 100.0}
        harness = AutoHarness(auto_config(), Scripted(0.5, 0.7))
        harness.fake.script("POST", CHAT, *[answer({"content": "x"}, timings=fast)] * 4)
        for _ in range(3):
            self.ask(harness, {**HI, "model": "tiny"})
        self.assertEqual(self.ask(harness, HI)["model"], "tiny")
        unmeasured = AutoHarness(auto_config(), Scripted(0.5, 0.7))
        self.script_both(unmeasured)
        self.assertEqual(self.ask(unmeasured, HI)["model"], "big")


class FilterTests(AutoTestCase):
    """The capability and media filters."""

    def test_tools_to_tool_endpoint(self) -> None:
        """A request with tools goes to the endpoint whose /props says it supports tools."""
        harness = AutoHarness(auto_config(), Scripted(0.5, 0.1), {"tiny": NO_TOOLS})
        self.script_both(harness)
        self.assertEqual(self.ask(harness, {**HI, "tools": [TOOL]})["model"], "big")
        self.assertEqual(harness.served(), (0, 1))

    def test_no_tools_any_endpoint(self) -> None:
        """Without tools the endpoint without tool support may still be picked."""
        harness = AutoHarness(auto_config(), Scripted(0.5, 0.1), {"tiny": NO_TOOLS})
        self.script_both(harness)
        self.assertEqual(self.ask(harness, HI)["model"], "tiny")

    def test_image_without_vision(self) -> None:
        """An image request and no vision endpoint: 400 media_unsupported, nothing sent."""
        harness = AutoHarness(auto_config(), Scripted(0.5, 0.5))
        response = harness.post(IMAGE).response()
        self.assertEqual(response.status, 400)
        self.assertEqual(response.json()["error"]["code"], "media_unsupported")
        self.assertEqual(harness.served(), (0, 0))

    def test_image_with_vision(self) -> None:
        """With a vision endpoint an image request goes there, its parts as sent."""
        harness = AutoHarness(auto_config(big={"vision": True}), Scripted(0.5, 0.5))
        harness.big.script("POST", CHAT, answer({"content": "a cat"}))
        body = self.ask(harness, IMAGE)
        self.assertEqual((body["model"], harness.served()), ("big", (0, 1)))
        (sent,) = harness.big.requests_to("POST", CHAT)
        self.assertEqual(json.loads(sent.body)["messages"], IMAGE["messages"])


class FailOverTests(AutoTestCase):
    """A connection failure on the chosen endpoint moves to the next candidate."""

    def test_connect_fails_over(self) -> None:
        """tiny unreachable: the request is answered by big."""
        harness = AutoHarness(auto_config(), Scripted(0.5, 0.1))
        harness.net.stop_listening(harness.config.endpoints[0].socket)
        self.script_both(harness)
        body = self.ask(harness, HI)
        self.assertEqual((body["model"], harness.served()), ("big", (0, 1)))

    def test_connect_fails_over_stream(self) -> None:
        """A streamed auto request fails over too: the client sees only big's stream."""
        harness = AutoHarness(auto_config(), Scripted(0.5, 0.1))
        harness.net.stop_listening(harness.config.endpoints[0].socket)
        self.script_both(harness)
        connection = harness.post({**HI, "stream": True})
        harness.advance(1)
        data = connection.response().data()
        self.assertEqual(data[-1], "[DONE]")
        self.assertEqual({d["model"] for d in data[:-1]}, {"big"})

    def test_fail_over_without_retries(self) -> None:
        """
        With the client's retries on (2 s before the first), a candidate that cannot be
        reached fails over at once, stream or not: no retry waited, no retrying comment (a
        stream opens on big's answer), and the next auto request skips the down endpoint.
        Each way of being down: refused, the inferproxy closing at once, an upstream 502.
        """
        retrying = dataclasses.replace(auto_config(), retry=Retry(attempts=4))
        downs = {
            "refused": None,
            "closed": Reply(head=b""),
            "502": error_reply(502, "server_error", "bad gateway"),
        }
        for why, reply in downs.items():
            for stream in (False, True):
                harness = AutoHarness(retrying, Scripted(0.5, 0.1, 0.5, 0.9))
                if reply is None:
                    harness.net.stop_listening(harness.config.endpoints[0].socket, stale=True)
                else:
                    harness.fake.script("POST", CHAT, reply)
                harness.big.script("POST", CHAT, *[answer({"content": "big"})] * 2)
                connection = harness.post({**HI, "stream": stream})
                harness.advance(0.5)
                response = connection.response()
                self.assertEqual((response.status, response.complete), (200, True), why)
                if stream:
                    self.assertEqual(response.comments(), [], why)
                    self.assertEqual({d["model"] for d in response.data()[:-1]}, {"big"}, why)
                else:
                    self.assertEqual(response.json()["model"], "big", why)
                self.assertFalse(harness.gateway.health.eligible("tiny"), why)
                self.assertEqual(self.ask(harness, HI)["model"], "big", why)
                self.assertEqual(len(harness.fake.requests_to("POST", CHAT)), int(bool(reply)))

    def test_loading_is_not_down(self) -> None:
        """A 503 while the model loads is not down: the endpoint stays eligible."""
        harness = AutoHarness(auto_config(), Scripted(0.5, 0.1))
        harness.fake.script("POST", CHAT, LOADING)
        harness.big.script("POST", CHAT, answer({"content": "big"}))
        connection = harness.post(HI)
        harness.advance(1)
        self.assertEqual(connection.response().status, 502)
        self.assertTrue(harness.gateway.health.eligible("tiny"))

    def test_connect_fails_over_with_leases(self) -> None:
        """Under leases the failed endpoint's lease goes back at once (no grace)."""
        harness = AutoHarness(auto_config(), Scripted(0.5, 0.1), leases=True)
        harness.net.stop_listening(harness.config.endpoints[0].socket)
        self.script_both(harness)
        self.assertEqual(self.ask(harness, HI)["model"], "big")
        assert harness.leases is not None
        self.assertEqual(len(harness.leases.held_sessions("tiny")), 0)
        self.assertEqual(len(harness.leases.held_sessions("big")), 1)

    def test_proxy_refusal_fails_over(self) -> None:
        """tiny's inferproxy refuses at its connection cap: big answers, stream or not."""
        refused = Reply(status=503, headers=[(ProxyRefused.HEADER, ProxyRefused.CONNECTIONS)])
        for stream in (False, True):
            harness = AutoHarness(auto_config(), Scripted(0.5, 0.1), leases=True)
            harness.fake.script("POST", CHAT, refused)
            harness.big.script("POST", CHAT, answer({"content": "big"}))
            connection = harness.post({**HI, "stream": stream})
            harness.advance(1)
            response = connection.response()
            self.assertEqual(response.status, 200)
            if stream:
                data = response.data()
                self.assertEqual(data[-1], "[DONE]")
                self.assertEqual({d["model"] for d in data[:-1]}, {"big"})
            else:
                self.assertEqual(response.json()["model"], "big")
            assert harness.leases is not None
            self.assertEqual(len(harness.leases.held_sessions("tiny")), 0)

    def test_all_unreachable(self) -> None:
        """
        Every candidate unreachable: 503 endpoint_unavailable naming each and why, with a
        Retry-After.
        """
        harness = AutoHarness(auto_config(), Scripted(0.5, 0.1), big_listens=False)
        harness.net.stop_listening(harness.config.endpoints[0].socket)
        connection = harness.post(HI)
        harness.advance(1)
        response = connection.response()
        error = response.json()["error"]
        self.assertEqual((response.status, error["code"]), (503, "endpoint_unavailable"))
        self.assertEqual(
            error["message"],
            "every candidate endpoint is down (tiny: no socket (nothing is serving it);"
            " big: no socket (nothing is serving it)); retry after 1 s",
        )
        self.assertEqual(response.headers["retry-after"], "1")

    def test_named_model_no_fail_over(self) -> None:
        """
        A named endpoint that cannot be connected to is a 503 endpoint_unavailable, not
        another endpoint.
        """
        harness = AutoHarness(auto_config(), Scripted())
        harness.net.stop_listening(harness.config.endpoints[0].socket)
        self.script_both(harness)
        connection = harness.post({**HI, "model": "tiny"})
        harness.advance(1)
        response = connection.response()
        self.assertEqual((response.status, response.headers["retry-after"]), (503, "1"))
        self.assertEqual(harness.served(), (0, 0))


class PlacementTests(AutoTestCase):
    """A session stays where its cache is; a new one goes to free capacity (decision 34)."""

    def turn(self, harness: AutoHarness, session: str) -> str:
        """One non-streamed auto turn of C{session}; the model that answered it."""
        connection = harness.post(HI, session=session)
        harness.advance(1)
        response = connection.response()
        self.assertEqual(response.status, 200, response.body)
        model: str = response.json()["model"]
        return model

    def test_session_stays_home(self) -> None:
        """Turn 1 drawn to big; turn 2's draw says tiny, but the session stays on big."""
        harness = AutoHarness(auto_config(), Scripted(0.5, 0.6, 0.5, 0.4, 0.5, 0.4))
        self.script_both(harness, 2)
        self.assertEqual(self.turn(harness, "s1"), "big")
        self.assertEqual(self.turn(harness, "s1"), "big")
        self.assertEqual(self.turn(harness, "s2"), "tiny")
        self.assertEqual(harness.served(), (1, 2))

    def test_own_grace_is_room(self) -> None:
        """s1 holds big's one slot in its own grace: its next turn stays on big."""
        one_slot = {"expect": Expect(total_slots=1)}
        harness = AutoHarness(
            auto_config(big=one_slot, tiny=one_slot), Scripted(0.5, 0.6, 0.5, 0.4), leases=True
        )
        self.script_both(harness, 2)
        self.assertEqual(self.turn(harness, "s1"), "big")
        self.assertEqual(self.turn(harness, "s1"), "big")
        self.assertEqual(harness.served(), (0, 2))

    def test_new_session_goes_to_the_free_endpoint(self) -> None:
        """big's one slot is held in s1's grace: s2, drawn to big, is served by tiny at once."""
        one_slot = {"expect": Expect(total_slots=1)}
        harness = AutoHarness(
            auto_config(big=one_slot, tiny=one_slot), Scripted(0.5, 0.6, 0.5, 0.6), leases=True
        )
        self.script_both(harness, 2)
        self.assertEqual(self.turn(harness, "s1"), "big")
        assert harness.leases is not None
        self.assertEqual(harness.leases.held_sessions("big"), {"s1"})
        # Well inside s1's 60 s grace: s2 does not wait for big's slot.
        self.assertEqual(self.turn(harness, "s2"), "tiny")
        self.assertEqual(harness.served(), (1, 1))


class ModelsTests(SynchronousTestCase):
    """C{/v1/models} lists the virtual models auto and mesh after the endpoints."""

    def test_auto_listed(self) -> None:
        """The ids are the endpoints in config order, then auto and mesh."""
        harness = AutoHarness(auto_config(), Scripted())
        ids = [m["id"] for m in harness.get("/v1/models").response().json()["data"]]
        self.assertEqual(ids, ["tiny", "big", "auto", "mesh"])


#: A third endpoint, in no group, beside tiny and big (which form group qwen).
OTHER = Endpoint(name="other", socket="/tmp/ld-gw/other.sock", selftest=False)


def group_config(**endpoint_changes: Mapping[str, Any]) -> Config:
    """L{auto_config} with tiny and big in group C{qwen}, then L{OTHER} in none."""
    grouped = {
        name: {"group": "qwen", **endpoint_changes.get(name, {})} for name in ("tiny", "big")
    }
    config = auto_config(**grouped)
    return dataclasses.replace(config, endpoints=(*config.endpoints, OTHER))


class GroupTests(AutoTestCase):
    """
    A request naming a group (decision 42) is routed among its members as auto is: the
    session's home member first, free capacity first for a new session, fail-over.
    """

    def turn(self, harness: AutoHarness, session: str, model: str = "qwen") -> str:
        """One non-streamed turn of C{session} for C{model}; the model that answered it."""
        connection = harness.post({**HI, "model": model}, session=session)
        harness.advance(1)
        response = connection.response()
        self.assertEqual(response.status, 200, response.body)
        answered: str = response.json()["model"]
        return answered

    def other_served(self, harness: AutoHarness) -> int:
        """How many chat requests the endpoint in no group received."""
        return len(harness.fakes["other"].requests_to("POST", CHAT))

    def test_among_members(self) -> None:
        """The draw picks among tiny and big; other, in no group, never serves."""
        for draw, model in ((0.4, "tiny"), (0.6, "big")):
            harness = AutoHarness(group_config(), Scripted(0.5, draw))
            self.script_both(harness)
            self.assertEqual(self.turn(harness, "s1"), model)
            self.assertEqual(self.other_served(harness), 0)

    def test_session_stays_home(self) -> None:
        """Turn 1 drawn to big; turn 2's draw says tiny, but the session stays on big."""
        harness = AutoHarness(group_config(), Scripted(0.5, 0.6, 0.5, 0.4, 0.5, 0.4))
        self.script_both(harness, 2)
        self.assertEqual(self.turn(harness, "s1"), "big")
        self.assertEqual(self.turn(harness, "s1"), "big")
        self.assertEqual(self.turn(harness, "s2"), "tiny")
        self.assertEqual(harness.served(), (1, 2))

    def test_own_grace_is_room(self) -> None:
        """s1 holds big's one slot in its own grace: its next turn stays on big."""
        one_slot = {"expect": Expect(total_slots=1)}
        harness = AutoHarness(
            group_config(big=one_slot, tiny=one_slot), Scripted(0.5, 0.6, 0.5, 0.4), leases=True
        )
        self.script_both(harness, 2)
        self.assertEqual(self.turn(harness, "s1"), "big")
        self.assertEqual(self.turn(harness, "s1"), "big")
        self.assertEqual(harness.served(), (0, 2))

    def test_new_session_goes_to_the_free_endpoint(self) -> None:
        """big's one slot is held in s1's grace: s2, drawn to big, is served by tiny at once."""
        one_slot = {"expect": Expect(total_slots=1)}
        harness = AutoHarness(
            group_config(big=one_slot, tiny=one_slot), Scripted(0.5, 0.6, 0.5, 0.6), leases=True
        )
        self.script_both(harness, 2)
        self.assertEqual(self.turn(harness, "s1"), "big")
        # Well inside s1's 60 s grace: s2 does not wait for big's slot.
        self.assertEqual(self.turn(harness, "s2"), "tiny")
        self.assertEqual(harness.served(), (1, 1))

    def test_home_outside_the_group_ignored(self) -> None:
        """A session last served by other (by name) is routed by the draw within qwen."""
        harness = AutoHarness(group_config(), Scripted(0.5, 0.6))
        self.script_both(harness)
        harness.fakes["other"].script("POST", CHAT, answer({"content": "other"}))
        self.assertEqual(self.turn(harness, "s1", "other"), "other")
        self.assertEqual(self.turn(harness, "s1"), "big")

    def test_fails_over_to_a_member(self) -> None:
        """tiny unreachable: the group's request is answered by big, stream or not."""
        for stream in (False, True):
            harness = AutoHarness(group_config(), Scripted(0.5, 0.1))
            harness.net.stop_listening(harness.config.endpoints[0].socket)
            self.script_both(harness)
            connection = harness.post({**HI, "model": "qwen", "stream": stream})
            harness.advance(1)
            response = connection.response()
            self.assertEqual(response.status, 200)
            served = response.data()[0] if stream else response.json()
            self.assertEqual((served["model"], harness.served()), ("big", (0, 1)))
            self.assertEqual(self.other_served(harness), 0)

    def test_all_members_unreachable(self) -> None:
        """
        Every member unreachable: 503 endpoint_unavailable (each is down once it failed;
        decision 38), and the endpoint outside the group is not tried.
        """
        harness = AutoHarness(group_config(), Scripted(0.5, 0.1), big_listens=False)
        harness.net.stop_listening(harness.config.endpoints[0].socket)
        connection = harness.post({**HI, "model": "qwen"})
        harness.advance(1)
        response = connection.response()
        code = response.json()["error"]["code"]
        self.assertEqual((response.status, code), (503, "endpoint_unavailable"))
        self.assertEqual(self.other_served(harness), 0)

    def test_listed(self) -> None:
        """/v1/models lists the group after the endpoints; /v1/models/qwen is its object."""
        harness = AutoHarness(group_config(), Scripted())
        ids = [m["id"] for m in harness.get("/v1/models").response().json()["data"]]
        self.assertEqual(ids, ["tiny", "big", "other", "qwen", "auto", "mesh"])
        retrieved = harness.get("/v1/models/qwen").response()
        self.assertEqual((retrieved.status, retrieved.json()["id"]), (200, "qwen"))


class GroupMeshTests(SynchronousTestCase):
    """In the mesh's pool a group is one worker (mesh-moa.md §1.2: one per model)."""

    def pool(self, session: str) -> list[str]:
        """The mesh pool's worker names for a request of C{session}."""
        harness = AutoHarness(group_config(), Scripted())
        parsed = dataclasses.replace(
            parse_request(json.dumps({**HI, "model": "mesh"}).encode()),
            session=SessionRef(session),
        )
        return sorted(w.name for w in mesh_pool(harness.gateway, parsed))

    def test_group_counts_once(self) -> None:
        """tiny and big (group qwen) give one worker beside other: the session's member."""
        for session in ("s1", "s2", "s3", "s4"):
            member = group_member(["tiny", "big"], session)
            self.assertEqual(self.pool(session), sorted([member, "other"]))

    def test_sessions_spread(self) -> None:
        """Each session's pool has two workers; different sessions' pools use both members."""
        pools = [self.pool(f"s{i}") for i in range(20)]
        self.assertEqual({len(pool) for pool in pools}, {2})
        self.assertEqual({name for pool in pools for name in pool}, {"tiny", "big", "other"})
