"""Tests for L{loopd.gateway.doors.responses_store}."""

from __future__ import annotations

import json

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.responses_store import (
    MAX_AGE_SECONDS,
    MAX_RESPONSES,
    MAX_TEXT,
    ResponseStore,
    StoredResponse,
    text_size,
)
from loopd.llama.types import Assistant, System, Tool, ToolCall, User


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
        self.assertRaises(ValueError, ResponseStore, self.clock.seconds, 1, 1, 0)


class TextBudgetTests(SynchronousTestCase):
    """
    The store's text budget (issue 26, item 3): each response counts its conversation's
    text, the oldest go first past the budget, and a response over it alone is not kept.
    """

    def setUp(self) -> None:
        """A store of many responses but 100 characters of text."""
        self.clock = Clock()
        self.store = ResponseStore(self.clock.seconds, max_responses=50, max_text=100)

    def response(self, text: str) -> StoredResponse:
        """A response whose conversation and answer hold C{text} and C{"ok"}."""
        return StoredResponse((System("s"), User(text)), Assistant("ok", "hm"))

    def test_text_size(self) -> None:
        """Every kind of message counts its text: content, thinking, calls, results, parts."""
        call = ToolCall("c1", "read", '{"p":1}')
        part = {"type": "image_url", "image_url": {"url": "data:x"}}
        messages = (
            System("sys"),
            User("hi", (part,)),
            Assistant("a", "think", (call,)),
            Tool("c1", "result"),
        )
        expected = 3 + 2 + len(json.dumps(part)) + 1 + 5 + 2 + 4 + 7 + 6 + 2
        self.assertEqual(text_size(messages), expected)

    def test_oldest_go_first(self) -> None:
        """Past the budget the oldest responses go, until the text fits."""
        for n in range(4):
            self.store.put(f"resp_{n}", self.response("x" * 40))
        self.assertEqual(
            [self.store.get(f"resp_{n}") is None for n in range(4)], [True] * 2 + [False] * 2
        )
        self.assertEqual(self.store.text, 2 * text_size(self.response("x" * 40).messages))

    def test_too_large_alone(self) -> None:
        """A response over the whole budget is not kept, and evicts nothing."""
        self.assertTrue(self.store.put("resp_small", self.response("x")))
        self.assertFalse(self.store.put("resp_big", self.response("x" * 200)))
        self.assertIsNone(self.store.get("resp_big"))
        self.assertIsNotNone(self.store.get("resp_small"))

    def test_text_returned(self) -> None:
        """Expired and replaced responses no longer count against the budget."""
        self.store.put("resp_a", self.response("x" * 40))
        self.store.put("resp_a", self.response("x"))
        self.assertEqual(self.store.text, text_size(self.response("x").messages))
        self.clock.advance(MAX_AGE_SECONDS)
        self.assertEqual((len(self.store), self.store.text), (0, 0))

    def test_default_budget(self) -> None:
        """The default budget is 64 Mi characters."""
        self.assertEqual(MAX_TEXT, 64 * 1024 * 1024)
