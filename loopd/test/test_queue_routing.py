"""
Tests for L{loopd.queue.routing}: the addressing rule for models and endpoints, and the
scheduler's L{PolicyRouter} over it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.catalog import ModelsCatalog
from loopd.queue.policy import DEFAULT_POLICY, QueueSettings, parse_policy
from loopd.queue.routing import PolicyRouter, Route, address_endpoint, address_model

GPU1 = "http://192.168.1.100:8001/v1"
GPU2 = "http://192.168.1.100:8002/v1"


def routes(
    queues: dict[str, Any], key: str, owner: str, streams: int = 1, **more: Any
) -> Callable[[SynchronousTestCase], None]:
    """A test method: with these entries (and C{catalog}), C{key} leads to the queue C{owner}."""
    catalog = ModelsCatalog(more.pop("catalog", ()))
    want = Route(owner, QueueSettings(max_streams=streams, **more))

    def test(self: SynchronousTestCase) -> None:
        self.assertEqual(address_endpoint(parse_policy({"queues": queues}), key, catalog), want)

    test.__doc__ = f"{key} leads to {want}, with {queues} and {catalog}."
    return test


ZEN3 = {"zen": {"maxStreams": 3}}
AT_GPU1: dict[str, Any] = {"catalog": (("zen", GPU1), ("llamacpp", GPU1), ("strata", GPU1))}
SPLIT = {"serial": {"match": ["llamacpp"]}, "m": {"match": [GPU1]}}


class AddressingTests(SynchronousTestCase):
    """The one addressing rule for models and endpoints (ADR 0005, DESIGN §24)."""

    def test_model_ungrouped(self) -> None:
        """A model no enabled group names queues under its baseUrl."""
        self.assertEqual(address_model(DEFAULT_POLICY, "llamacpp", GPU1), GPU1)
        policy = parse_policy({"queues": {"g": {"match": [GPU1], "enabled": False}}})
        self.assertEqual(address_model(policy, "llamacpp", GPU1), GPU1)

    def test_model_merge(self) -> None:
        """A group naming the model's endpoint owns it."""
        policy = parse_policy({"queues": {"one-gpu": {"match": [GPU1, GPU2]}}})
        self.assertEqual(address_model(policy, "llamacpp", GPU2), "one-gpu")

    def test_model_split_beats_merge(self) -> None:
        """A group naming the provider owns it ahead of one naming its endpoint, in any order."""
        groups = [("merge", {"match": [GPU1]}), ("split", {"match": ["strata"]})]
        for order in (groups, groups[::-1]):
            policy = parse_policy({"queues": dict(order)})
            self.assertEqual(address_model(policy, "strata", GPU1), "split")
            self.assertEqual(address_model(policy, "llama", GPU1), "merge")

    test_endpoint_unknown = routes({}, "anything", "anything")
    test_group_name = routes({"g": {"match": [GPU1], "maxStreams": 2}}, "g", "g", 2)
    test_group_ahead_of_entry = routes({GPU1: {"maxStreams": 5}, "g": {"match": [GPU1]}}, GPU1, "g")
    test_first_group = routes({"a": {"match": [GPU1]}, "b": {"match": [GPU1]}}, GPU1, "a")
    test_endpoint_own_entry = routes({GPU1: {"maxStreams": 2}}, GPU1, GPU1, 2)
    test_disabled_group = routes(
        {"g": {"match": [GPU1], "enabled": False}, GPU1: {"maxStreams": 2}}, GPU1, GPU1, 2
    )
    test_provider_without_catalog = routes(ZEN3, "zen", "zen", 3)
    test_endpoint_without_catalog = routes(ZEN3, GPU1, GPU1)
    test_provider_through_catalog = routes(ZEN3, "zen", GPU1, 3, **AT_GPU1)
    test_endpoint_through_catalog = routes(ZEN3, GPU1, GPU1, 3, **AT_GPU1)
    test_base_url_key_wins = routes(
        {**ZEN3, GPU1: {"enabled": False}}, "zen", GPU1, enabled=False, **AT_GPU1
    )
    test_provider_disable_alone = routes(
        {"zen": {"enabled": False}, GPU1: {"maxStreams": 1}}, "zen", GPU1, **AT_GPU1
    )
    test_provider_exact_group = routes(SPLIT, "llamacpp", "serial", **AT_GPU1)
    test_provider_endpoint_group = routes(SPLIT, "strata", "m", **AT_GPU1)
    test_split_needs_provider = routes({"serial": {"match": ["llamacpp"]}}, GPU1, GPU1, **AT_GPU1)


class PolicyRouterTests(SynchronousTestCase):
    """
    Policy addressing, with loopd's endpoints sized by their slots.
    """

    def test_unknown_key_defaults(self) -> None:
        """A key nothing names is its own queue with the defaults."""
        router = PolicyRouter(parse_policy({"defaults": {"maxStreams": 2}}))
        route = router("http://x/v1")
        self.assertEqual((route.queue_key, route.settings.max_streams), ("http://x/v1", 2))

    def test_endpoint_slots(self) -> None:
        """An endpoint's queue has as many streams as its server has slots."""
        router = PolicyRouter(parse_policy({}), slot_counts={"qwen": 4})
        self.assertEqual(router("qwen").settings.max_streams, 4)

    def test_policy_entry_wins(self) -> None:
        """An entry naming the endpoint decides its streams."""
        policy = parse_policy({"queues": {"qwen": {"maxStreams": 1, "leaseTtlMs": 5000}}})
        route = PolicyRouter(policy, slot_counts={"qwen": 4})("qwen")
        self.assertEqual((route.settings.max_streams, route.settings.lease_ttl_ms), (1, 5000))

    def test_group_owns_endpoint(self) -> None:
        """A group whose match names the endpoint owns it, with the group's settings."""
        policy = parse_policy({"queues": {"gpu": {"match": ["qwen", "llama"], "maxStreams": 1}}})
        route = PolicyRouter(policy, slot_counts={"qwen": 4})("qwen")
        self.assertEqual((route.queue_key, route.settings.max_streams), ("gpu", 1))

    def test_other_settings_from_defaults(self) -> None:
        """Only maxStreams comes from the slots; the rest is the policy's defaults."""
        policy = parse_policy({"defaults": {"leaseTtlMs": 9000}})
        self.assertEqual(
            PolicyRouter(policy, slot_counts={"q": 2})("q").settings.lease_ttl_ms, 9000
        )

    def test_provider_through_catalog(self) -> None:
        """A provider name reaches its endpoint through the catalog."""
        catalog = ModelsCatalog((("zen", "http://h:1/v1"),))
        route = PolicyRouter(parse_policy({}), catalog)("zen")
        self.assertEqual(route.queue_key, "http://h:1/v1")

    def test_routes_remembered_and_bounded(self) -> None:
        """A key's route is computed once; thousands of client keys never grow it unbounded."""
        router = PolicyRouter(parse_policy({}), slot_counts={"q": 2})
        self.assertIs(router("q"), router("q"))
        for number in range(10_000):
            router(f"http://h:{number}/v1")
        self.assertLessEqual(len(router._routes), 4096)
        self.assertEqual(router("q").settings.max_streams, 2)
