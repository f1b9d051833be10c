"""
Tests for L{loopd.queue.routing.PolicyRouter}.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.policy import ModelsCatalog, parse_policy
from loopd.queue.routing import PolicyRouter


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
