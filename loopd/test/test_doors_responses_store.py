"""Tests for L{loopd.gateway.doors.responses_store}."""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.responses_store import (
    MAX_AGE_SECONDS,
    MAX_RESPONSES,
    ResponseStore,
    StoredResponse,
)
from loopd.llama.types import Assistant, System, User


def stored(text: str) -> StoredResponse:
    """A stored response whose conversation is one user turn C{text}."""
    return StoredResponse((User(text),), Assistant("re: " + text))


class ResponseStoreTests(SynchronousTestCase):
    """L{ResponseStore}: by id, bounded by count and age."""

    def setUp(self) -> None:
        """A store with small limits on a fake clock."""
        self.clock = Clock()
        self.store = ResponseStore(self.clock.seconds, max_responses=3, max_age=60)

    def test_defaults(self) -> None:
        """The default limits are 1000 responses and one hour."""
        self.assertEqual((MAX_RESPONSES, MAX_AGE_SECONDS), (1000, 3600.0))

    def test_put_get(self) -> None:
        """A stored response comes back by its id; an unknown id gives None."""
        self.store.put("resp_1", stored("a"))
        self.assertEqual(self.store.get("resp_1"), stored("a"))
        self.assertIsNone(self.store.get("resp_2"))

    def test_messages(self) -> None:
        """A stored response's messages are its conversation and then its answer."""
        response = StoredResponse((System("s"), User("u")), Assistant("a"))
        self.assertEqual(response.messages, (System("s"), User("u"), Assistant("a")))

    def test_count_limit_evicts_oldest(self) -> None:
        """Past the count limit the oldest response goes first."""
        for n in range(4):
            self.store.put(f"resp_{n}", stored(str(n)))
            self.clock.advance(1)
        self.assertIsNone(self.store.get("resp_0"))
        self.assertEqual(
            [self.store.get(f"resp_{n}") for n in (1, 2, 3)],
            [stored("1"), stored("2"), stored("3")],
        )
        self.assertEqual(len(self.store), 3)

    def test_age_limit(self) -> None:
        """A response is kept for the age limit and no longer."""
        self.store.put("resp_old", stored("old"))
        self.clock.advance(30)
        self.store.put("resp_new", stored("new"))
        self.clock.advance(29.5)
        self.assertIsNotNone(self.store.get("resp_old"))
        self.clock.advance(0.5)
        self.assertIsNone(self.store.get("resp_old"))
        self.assertIsNotNone(self.store.get("resp_new"))
        self.clock.advance(30)
        self.assertIsNone(self.store.get("resp_new"))
        self.assertEqual(len(self.store), 0)

    def test_put_again_renews(self) -> None:
        """Storing an id again replaces it and makes it the newest."""
        self.store.put("resp_a", stored("a"))
        self.store.put("resp_b", stored("b"))
        self.store.put("resp_c", stored("c"))
        self.store.put("resp_a", stored("a2"))
        self.store.put("resp_d", stored("d"))
        self.assertIsNone(self.store.get("resp_b"))
        self.assertEqual(self.store.get("resp_a"), stored("a2"))

    def test_bad_limits(self) -> None:
        """A store must keep at least one response for some time."""
        self.assertRaises(ValueError, ResponseStore, self.clock.seconds, 0)
        self.assertRaises(ValueError, ResponseStore, self.clock.seconds, 1, 0)
