"""
Tests for L{loopd.llama.router}: a router's model list, the endpoints loopd makes of its
models and the config they replace the router in; and the llama client of a router's model,
which names the model in every per-model call, against the fake server.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.errors import Protocol
from loopd.llama import Client
from loopd.llama.router import (
    RouterError,
    RouterModel,
    expand_routers,
    model_endpoints,
    model_path,
    parse_router_models,
)
from loopd.llama.types import ChatRequest, User
from loopd.settings import Config, Endpoint, Limits
from loopd.testing.fake_llama import CHAT, FakeLlama, SlotFiles, json_reply
from loopd.testing.llama_replies import answer, props_reply, slots_reply
from loopd.testing.memory_net import MemoryNet
from loopd.testing.reactor import MemoryLoopdReactor

PATH = "/tmp/ld-memory/router.sock"
ROUTER = Endpoint(name="gpu", socket=PATH, kind="llama-server-router", models_max=1)
REQUEST = ChatRequest(slot=0, messages=(User("Hi"),))
#: A router's /v1/models answer (b11434's shape, trimmed).
LISTED = {
    "object": "list",
    "data": [
        {
            "id": "tiny",
            "object": "model",
            "status": {"value": "loaded", "args": ["-m", "x", "--parallel", "2"]},
        },
        {"id": "tiny-b", "object": "model", "status": {"value": "unloaded", "failed": True}},
        {"id": "odd", "object": "model"},
    ],
}


class ListTests(SynchronousTestCase):
    """What a router's C{/v1/models} says."""

    def test_parse(self) -> None:
        """Each model's id and status, in order; no status is unknown."""
        self.assertEqual(
            parse_router_models(LISTED),
            (
                RouterModel("tiny", "loaded", slots=2),
                RouterModel("tiny-b", "unloaded", failed=True),
                RouterModel("odd", "unknown"),
            ),
        )
        self.assertTrue(RouterModel("x", "sleeping").loaded)
        self.assertFalse(RouterModel("x", "loading").loaded)

    def test_malformed(self) -> None:
        """Anything but an object with a data array of objects with ids is Protocol."""
        bads: list[object] = [[], {}, {"data": {}}, {"data": [1]}, {"data": [{"id": ""}]}]
        for bad in [*bads, {"data": [{}]}]:
            self.assertRaises(Protocol, parse_router_models, bad)

    @given(
        st.recursive(
            st.none() | st.booleans() | st.text(),
            lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        )
    )
    def test_any_value(self, value: object) -> None:
        """Any JSON value is models or Protocol, never another exception."""
        try:
            parse_router_models({"data": [{"id": "m", "status": value}]})
            parse_router_models({"data": value})
        except Protocol:
            pass

    def test_model_path(self) -> None:
        """The model goes in the query, escaped; an existing query is extended."""
        self.assertEqual(model_path("/props", "tiny"), "/props?model=tiny")
        self.assertEqual(
            model_path("/slots?fail_on_no_slot=1", "a b/c"),
            "/slots?fail_on_no_slot=1&model=a%20b%2Fc",
        )


class ExpandTests(SynchronousTestCase):
    """The config with each router replaced by its models' endpoints."""

    def config(self, *endpoints: Endpoint) -> Config:
        """A config of C{endpoints}."""
        return Config(endpoints=endpoints)

    def test_model_endpoints(self) -> None:
        """Each model: a llama-server endpoint named by its id, on the router's socket."""
        (tiny,) = model_endpoints(dataclasses.replace(ROUTER, slot_save=True), ["tiny"])
        self.assertEqual(
            (tiny.name, tiny.kind, tiny.model, tiny.router, tiny.socket, tiny.slot_save),
            ("tiny", "llama-server", "tiny", "gpu", PATH, True),
        )
        self.assertEqual((tiny.models, tiny.models_max), (None, None))

    def test_all_listed_in_place(self) -> None:
        """Without models, every model the router lists, where the router stood."""
        other = Endpoint(name="big", socket="/tmp/ld-memory/big.sock")
        listed = {"gpu": parse_router_models(LISTED)}
        expanded = expand_routers(self.config(other, ROUTER), listed)
        self.assertEqual([e.name for e in expanded.endpoints], ["big", "tiny", "tiny-b", "odd"])

    def test_only_those_named(self) -> None:
        """models picks and orders the router's models."""
        router = dataclasses.replace(ROUTER, models=("tiny-b", "tiny"))
        expanded = expand_routers(self.config(router), {"gpu": parse_router_models(LISTED)})
        self.assertEqual([e.name for e in expanded.endpoints], ["tiny-b", "tiny"])

    def test_refusals(self) -> None:
        """A router with no model, a named model it lacks, a name already taken."""
        listed = {"gpu": parse_router_models(LISTED)}
        cases = [
            (self.config(ROUTER), {"gpu": ()}, "router gpu lists no model in /v1/models"),
            (
                self.config(dataclasses.replace(ROUTER, models=("tiny", "huge"))),
                listed,
                "router gpu has no model huge (it has tiny, tiny-b, odd)",
            ),
            (
                self.config(Endpoint(name="tiny", socket="/tmp/x.sock"), ROUTER),
                listed,
                "model tiny of router gpu has the name of another endpoint or group",
            ),
        ]
        for config, models, message in cases:
            error = self.assertRaises(RouterError, expand_routers, config, models)
            self.assertIn(message, str(error))

    def test_no_router_no_change(self) -> None:
        """A config without routers is itself."""
        config = self.config(Endpoint(name="big", socket="/tmp/ld-memory/big.sock"))
        self.assertEqual(expand_routers(config, {}), config)


class ModelClientTests(SynchronousTestCase):
    """The client of a router's model names the model in every per-model call."""

    def setUp(self) -> None:
        self.reactor = MemoryLoopdReactor()
        self.fake = FakeLlama(self.reactor)
        self.net = MemoryNet(self.reactor)
        self.net.listen(PATH, self.fake)
        (endpoint,) = model_endpoints(ROUTER, ["tiny"])
        config = Config(endpoints=(endpoint,), limits=Limits(poll_ms=100, liveness_ms=100))
        self.client = Client(self.reactor, config, endpoint)

    def sent(self) -> list[tuple[str, str, object]]:
        """Each request the fake got: method, target, JSON body."""
        return [(r.method, r.target, r.json) for r in self.fake.requests]

    def test_gets_name_the_model(self) -> None:
        """/props and /slots carry ?model=."""
        self.fake.script("GET", "/props", props_reply())
        self.fake.script("GET", "/slots", slots_reply([False, False]))
        props = self.client.props()
        slots = self.client.slots()
        self.net.pump()
        self.successResultOf(props)
        self.successResultOf(slots)
        targets = sorted(t for _, t, _ in self.sent())
        self.assertEqual(targets, ["/props?model=tiny", "/slots?model=tiny"])

    def test_posts_name_the_model(self) -> None:
        """/tokenize, a slot save and a chat carry the model in their bodies."""
        self.fake.script("POST", "/tokenize", json_reply(200, {"tokens": [1, 2]}))
        SlotFiles(self.fake, 1)
        self.fake.script("POST", CHAT, answer({"content": "hi"}))
        tokens = self.client.tokenize("hi")
        saved = self.client.save_slot(0, "s.bin")
        self.net.pump()
        self.successResultOf(tokens)
        self.successResultOf(saved)
        chat = self.client.chat_with_retry(REQUEST, lambda e: None)
        self.net.advance(1)
        self.successResultOf(chat)
        bodies = {t.split("?")[0]: b for _, t, b in self.sent()}
        for path in ("/tokenize", "/slots/0", CHAT):
            self.assertEqual(bodies[path]["model"], "tiny", path)  # type: ignore[index]

    def test_router_models(self) -> None:
        """The router's list, asked of /v1/models."""
        self.fake.script("GET", "/v1/models", json_reply(200, LISTED))
        asking = self.client.router_models()
        self.net.pump()
        self.assertEqual([m.id for m in self.successResultOf(asking)], ["tiny", "tiny-b", "odd"])

    def health(self, listed: object) -> tuple[bool, str]:
        """The model's health when the router answers /health 200 and /v1/models C{listed}."""
        self.fake.script("GET", "/health", json_reply(200, {"status": "ok"}))
        self.fake.script("GET", "/v1/models", json_reply(200, listed))
        checking = self.client.health()
        self.net.pump()
        health = self.successResultOf(checking)
        return health.ok, health.detail

    def test_health_per_model(self) -> None:
        """
        Up while the router lists the model (saying its status, and a failed last load);
        down once it does not.
        """
        self.assertEqual(self.health(LISTED), (True, "ok (loaded)"))
        failed = {"data": [{"id": "tiny", "status": {"value": "unloaded", "failed": True}}]}
        self.assertEqual(self.health(failed), (True, "ok (unloaded; its last load failed)"))
        gone = {"data": [{"id": "other"}]}
        self.assertEqual(self.health(gone), (False, "the router no longer lists the model"))

    def test_health_router_down(self) -> None:
        """The router not answering /health: the model is unreachable, /v1/models unasked."""
        self.net.stop_listening(PATH)
        checking = self.client.health()
        self.net.advance(1)
        self.assertFalse(self.successResultOf(checking).ok)
        self.assertEqual(self.fake.requests, [])

    def test_a_plain_endpoint_names_nothing(self) -> None:
        """A single-model server's client adds no ?model= to its GETs."""
        plain = Endpoint(name="tiny", socket=PATH, model="tiny")
        client = Client(self.reactor, Config(endpoints=(plain,)), plain)
        self.fake.script("GET", "/props", props_reply())
        props = client.props()
        self.net.pump()
        self.successResultOf(props)
        self.assertEqual([t for _, t, _ in self.sent()], ["/props"])
