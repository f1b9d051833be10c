"""
Tests for a session's side conversations through the gateway (DESIGN decision 45): the
front door's route placing each request in one conversation of its session
(L{loopd.gateway.upstream.Upstreams.conversation}), the leased call taking that
conversation's lease, slot and cache outcome (L{loopd.gateway.upstream}), and C{auto}
keeping a session on its endpoint only for a continuation (L{loopd.gateway.site}).

The patterns are the agents': OpenCode's title request (its C{small_model}: another system
prompt, no tools) under the main session's id, during or after the main's turn; Claude
Code's Haiku calls over the Messages door; one session id sending unrelated
conversations; a compaction. Scripted fake llama-servers in memory on a
C{MemoryReactorClock}, the lease scheduler in process.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from loopd.settings import Config
from loopd.testing.fake_llama import CHAT, FakeLlama
from loopd.testing.gateway import LIMITS, ClientConnection, GatewayHarness, make_config
from loopd.testing.llama_replies import answer

#: Limits under which a lease wait never times out in these tests.
PATIENT = dataclasses.replace(LIMITS, busy_wait_ms=60_000)
SESSION = "oc-1"
MAIN_SYSTEM = {"role": "system", "content": "You are opencode, an agent. Use the tools."}
TITLE_SYSTEM = {"role": "system", "content": "You are a title generator. Output a title."}
TOOL = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
ASK = {"role": "user", "content": "fix the failing test"}
MAIN_1 = {"messages": [MAIN_SYSTEM, ASK], "tools": [TOOL], "stream": True}
TITLE = {"messages": [TITLE_SYSTEM, ASK], "stream": True}


def then(document: Mapping[str, Any], answer_text: str, user: str) -> dict[str, Any]:
    """C{document}'s next turn: its messages, the answer, and a new user message."""
    more = [{"role": "assistant", "content": answer_text}, {"role": "user", "content": user}]
    return {**document, "messages": [*document["messages"], *more]}


MAIN_2 = then(MAIN_1, "Looking.", "and the other one")

#: The main's first turn: 2,050 tokens in its context.
MAIN_1_TIMINGS = {"cache_n": 0, "prompt_n": 2000, "predicted_n": 50}
#: The title: a longer context than the main's, which the main's next turn never reuses.
TITLE_TIMINGS = {"cache_n": 0, "prompt_n": 3000, "predicted_n": 20}
#: The main's next turn, back on its slot: the whole of its last context reused.
MAIN_2_TIMINGS = {"cache_n": 2050, "prompt_n": 30, "predicted_n": 40}
LOSSES = ("loopd_cache_losses_total", frozenset({("endpoint", "tiny")}))


def reply(timings: Mapping[str, Any], deltas: int = 2) -> Any:
    """An answer of C{deltas} pieces 50 ms apart, ending with C{timings}."""
    return answer(*[{"content": "x"}] * deltas, timings=timings)


class ConversationCase(SynchronousTestCase):
    """A two-slot gateway with leases (grace 1 s) per test, and the helpers the tests share."""

    config: Config = make_config(slots=2, limits=PATIENT)

    def setUp(self) -> None:
        self.harness = GatewayHarness(self.config, leases=True, grace_ms=1000)
        self.fake = self.harness.fake

    def chat(
        self,
        document: object,
        session: str | None = SESSION,
        header: str = "x-session-affinity",
        extra: Sequence[str] = (),
    ) -> ClientConnection:
        """POST C{document} on a new connection, its session in C{header} (OpenCode's)."""
        headers = ["Content-Type: application/json", *extra]
        if session is not None:
            headers.append(f"{header}: {session}")
        connection = self.harness.connect()
        connection.request("POST", CHAT, json.dumps(document).encode(), headers)
        return connection

    def slots(self, fake: FakeLlama | None = None) -> list[int]:
        """The C{id_slot} of each chat request C{fake} (C{tiny}'s) received, in order."""
        fake = fake or self.fake
        return [json.loads(r.body)["id_slot"] for r in fake.requests_to("POST", CHAT)]

    def holders(self) -> list[str]:
        """The lease keys holding C{tiny}'s queue (running or in their grace)."""
        assert self.harness.leases is not None
        return sorted(self.harness.leases.held_sessions("tiny"))

    def conversations(self) -> set[str]:
        """The keys of the session's remembered conversations."""
        return set(self.harness.gateway.sessions.conversations(SESSION))

    def losses(self) -> float:
        """How many cache losses C{/metrics} counted on C{tiny}."""
        return self.harness.scrape().get(LOSSES, 0.0)

    def ok(self, connection: ClientConnection) -> None:
        """Assert a whole 200 answer."""
        response = connection.response()
        self.assertEqual((response.status, response.complete), (200, True), response.body)


class TitleTests(ConversationCase):
    """OpenCode's title request under the main session's id (issue 24, item 4)."""

    def test_title_after_the_turn(self) -> None:
        """
        The title comes while the main's turn is in its grace: it goes to the other free
        slot on a lease of its own; the main's next turn gets its slot back, reuses all of
        its context and counts no cache loss (before: the title ran on the main's slot, and
        the main's next turn was compared with the title's context).
        """
        self.fake.script(
            "POST",
            CHAT,
            reply(MAIN_1_TIMINGS),
            reply(TITLE_TIMINGS),
            reply(MAIN_2_TIMINGS),
        )
        first = self.chat(MAIN_1)
        self.harness.advance(0.5)
        self.ok(first)
        with capturedLogs() as events:
            title = self.chat(TITLE)
            self.harness.advance(0.5)
        self.ok(title)
        self.assertEqual(self.holders(), [SESSION, f"{SESSION} side:1"])
        text = [formatEvent(e) for e in events]
        self.assertTrue(any(f"side conversation {SESSION} side:1" in t for t in text), text)
        with capturedLogs() as events:
            second = self.chat(MAIN_2)
            self.harness.advance(0.5)
        self.ok(second)
        self.assertEqual(self.slots(), [0, 1, 0])
        self.assertEqual(self.losses(), 0.0)
        text = [formatEvent(e) for e in events]
        hit = f"cache hit for session {SESSION} on slot 0: reused 2050 of 2000 tokens"
        self.assertIn(hit, text)
        self.assertFalse(any("cache loss" in t for t in text), text)

    def test_title_during_the_turn(self) -> None:
        """
        The title comes while the main's first turn runs, and ends after it: it runs at
        once on the other slot (its own lease), and the main's next turn still goes back to
        the main's slot, with no cache loss.
        """
        self.fake.script(
            "POST",
            CHAT,
            reply(MAIN_1_TIMINGS, deltas=2),
            reply(TITLE_TIMINGS, deltas=10),
            reply(MAIN_2_TIMINGS),
        )
        first = self.chat(MAIN_1)
        self.harness.advance(0.01)
        title = self.chat(TITLE)
        self.harness.advance(0.01)
        self.assertEqual(self.slots(), [0, 1])
        self.harness.advance(0.3)
        self.ok(first)
        self.assertEqual(title.responses()[0].complete, False)
        self.harness.advance(0.5)
        self.ok(title)
        second = self.chat(MAIN_2)
        self.harness.advance(0.5)
        self.ok(second)
        self.assertEqual(self.slots(), [0, 1, 0])
        self.assertEqual(self.losses(), 0.0)

    def test_title_with_the_main_system_prompt(self) -> None:
        """
        A title request with the main's own system prompt but no tools is a side
        conversation too (it begins otherwise than the main, which offers tools).
        """
        title = {"messages": [MAIN_SYSTEM, {"role": "user", "content": "A title for: fix it"}]}
        self.fake.script(
            "POST", CHAT, reply(MAIN_1_TIMINGS), reply(TITLE_TIMINGS), reply(MAIN_2_TIMINGS)
        )
        for document in (MAIN_1, title, MAIN_2):
            connection = self.chat(document)
            self.harness.advance(0.5)
            self.ok(connection)
        self.assertEqual(self.slots(), [0, 1, 0])
        self.assertEqual(self.losses(), 0.0)

    def test_title_again_continues_the_side_conversation(self) -> None:
        """The same title request again continues the side conversation: back on its slot."""
        self.fake.script(
            "POST", CHAT, reply(MAIN_1_TIMINGS), reply(TITLE_TIMINGS), reply(TITLE_TIMINGS)
        )
        for document in (MAIN_1, TITLE, TITLE):
            connection = self.chat(document)
            self.harness.advance(0.5)
            self.ok(connection)
        self.assertEqual(self.slots(), [0, 1, 1])
        self.assertEqual(self.conversations(), {SESSION, f"{SESSION} side:1"})

    def test_session_end_ends_every_conversation(self) -> None:
        """X-Session-End on the main's turn gives the title's lease in its grace back too."""
        self.fake.script(
            "POST", CHAT, reply(MAIN_1_TIMINGS), reply(TITLE_TIMINGS), reply(MAIN_2_TIMINGS)
        )
        for document in (MAIN_1, TITLE):
            connection = self.chat(document)
            self.harness.advance(0.5)
            self.ok(connection)
        self.assertEqual(self.holders(), [SESSION, f"{SESSION} side:1"])
        last = self.chat(MAIN_2, extra=["X-Session-End: true"])
        self.harness.advance(0.5)
        self.ok(last)
        self.assertEqual(self.holders(), [])

    def test_anonymous_connection_closed(self) -> None:
        """An anonymous session's side conversation ends with its connection too."""
        self.fake.script("POST", CHAT, reply(MAIN_1_TIMINGS), reply(TITLE_TIMINGS))
        kept = self.harness.connect()
        for document in (MAIN_1, TITLE):
            kept.post(document)
            self.harness.advance(0.5)
        self.assertEqual(len(self.holders()), 2)
        self.assertEqual(self.slots(), [0, 1])
        kept.drop()
        self.assertEqual(self.holders(), [])


class OneSlotTests(ConversationCase):
    """A title on an endpoint with one slot."""

    config = make_config(slots=1, limits=PATIENT)

    def test_title_waits_for_the_grace(self) -> None:
        """
        On one slot the title waits for the main's grace like any other session's request
        (decision 37 prices it; here the endpoint is still learning, so at once), and the
        main's next turn is compared with the main's last, not with the title.
        """
        self.fake.script(
            "POST", CHAT, reply(MAIN_1_TIMINGS), reply(TITLE_TIMINGS), reply(MAIN_2_TIMINGS)
        )
        for document in (MAIN_1, TITLE, MAIN_2):
            connection = self.chat(document)
            self.harness.advance(0.5)
            self.ok(connection)
        self.assertEqual(self.slots(), [0, 0, 0])
        self.assertEqual(self.losses(), 0.0)


class ClaudeCodeTests(ConversationCase):
    """Claude Code's Haiku calls over the Messages door, under its session header."""

    def messages(self, document: object) -> ClientConnection:
        """POST C{document} to the Messages door with Claude Code's session header."""
        connection = self.harness.connect()
        headers = ["Content-Type: application/json", f"X-Claude-Code-Session-Id: {SESSION}"]
        connection.request("POST", "/v1/messages", json.dumps(document).encode(), headers)
        return connection

    def test_haiku_call_is_a_side_conversation(self) -> None:
        """
        A Haiku call (another system prompt, no tools) between two main turns runs on the
        other slot; the main's next turn is back on its own.
        """
        tool = {"name": "Bash", "input_schema": {"type": "object"}}
        ask = {"role": "user", "content": "fix the failing test"}
        main = {
            "model": "tiny",
            "max_tokens": 50,
            "system": "You are Claude Code.",
            "tools": [tool],
            "messages": [ask],
        }
        haiku = {
            "model": "tiny",
            "max_tokens": 50,
            "system": "Write a 5-10 word title for the conversation.",
            "messages": [ask],
        }
        again = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "next"}]
        following = {**main, "messages": [ask, *again]}
        self.fake.script(
            "POST", CHAT, reply(MAIN_1_TIMINGS, 1), reply(TITLE_TIMINGS, 1), reply(MAIN_2_TIMINGS)
        )
        for document in (main, haiku, following):
            connection = self.messages(document)
            self.harness.advance(0.5)
            self.ok(connection)
        self.assertEqual(self.slots(), [0, 1, 0])
        self.assertEqual(self.losses(), 0.0)


class UnrelatedTests(ConversationCase):
    """One session id sending unrelated conversations (a script with a fixed id)."""

    def test_each_its_own(self) -> None:
        """
        Two unrelated conversations of one id, interleaved: each on its own slot and
        lease, each compared only with its own last turn (no cache loss, though each
        context is far from the other's).
        """
        first = {"messages": [{"role": "user", "content": "summarise a.txt"}], "stream": True}
        other = {"messages": [{"role": "user", "content": "translate b.txt"}], "stream": True}
        big = {"cache_n": 0, "prompt_n": 1500, "predicted_n": 20}
        small = {"cache_n": 0, "prompt_n": 200, "predicted_n": 20}
        self.fake.script(
            "POST",
            CHAT,
            reply(big),
            reply(small),
            reply({"cache_n": 1520, "prompt_n": 10, "predicted_n": 5}),
            reply({"cache_n": 220, "prompt_n": 10, "predicted_n": 5}),
        )
        documents = (first, other, then(first, "x", "more"), then(other, "x", "more"))
        for document in documents:
            connection = self.chat(document, header="X-Session-Id")
            self.harness.advance(0.5)
            self.ok(connection)
        self.assertEqual(self.slots(), [0, 1, 0, 1])
        self.assertEqual(self.losses(), 0.0)
        self.assertEqual(self.holders(), [SESSION, f"{SESSION} side:1"])


class CompactionTests(ConversationCase):
    """A compaction rewrites the main conversation; its later turns continue it."""

    def test_continuation_after_a_compaction(self) -> None:
        """
        After a title on the other slot, a compacted history (the same system prompt, a
        summary) goes to the main's slot and is no cache loss though it reuses only the
        system prompt; its next turn continues it there, and a real loss after that counts.
        """
        compacted = {
            "messages": [MAIN_SYSTEM, {"role": "user", "content": "Summary: tests fixed."}],
            "tools": [TOOL],
            "stream": True,
        }
        self.fake.script(
            "POST",
            CHAT,
            reply(MAIN_1_TIMINGS),
            reply(TITLE_TIMINGS),
            reply({"cache_n": 300, "prompt_n": 100, "predicted_n": 20}),
            reply({"cache_n": 420, "prompt_n": 10, "predicted_n": 5}),
            reply({"cache_n": 0, "prompt_n": 500, "predicted_n": 5}),
        )
        documents = (
            MAIN_1,
            TITLE,
            compacted,
            then(compacted, "x", "go on"),
            then(then(compacted, "x", "go on"), "y", "and?"),
        )
        losses = []
        for document in documents:
            connection = self.chat(document)
            self.harness.advance(0.5)
            self.ok(connection)
            losses.append(self.losses())
        self.assertEqual(self.slots(), [0, 1, 0, 0, 0])
        self.assertEqual(losses, [0.0, 0.0, 0.0, 0.0, 1.0])
        self.assertEqual(self.conversations(), {SESSION, f"{SESSION} side:1"})


class Scripted:
    """A random source that returns scripted numbers and fails when it runs out."""

    def __init__(self, *numbers: float) -> None:
        """Return C{numbers}, in order."""
        self.numbers = list(numbers)

    def random(self) -> float:
        """The next scripted number."""
        return self.numbers.pop(0)


#: Each auto request draws twice over tiny and big (weights 25/25): under 0.5 is tiny.
TO_TINY = (0.5, 0.4)
TO_BIG = (0.5, 0.6)


class AutoTests(SynchronousTestCase):
    """
    C{auto} over two endpoints keeps a session on its endpoint for a continuation only: a
    side conversation is routed like a new session (decision 45).
    """

    def harness(self, *draws: tuple[float, float], slots: int, leases: bool) -> GatewayHarness:
        """C{tiny} and C{big}, each with C{slots} slots, the router drawing C{draws}."""
        config = make_config(slots=slots, endpoints=("tiny", "big"), limits=PATIENT)
        numbers = [n for draw in draws for n in draw]
        return GatewayHarness(config, leases=leases, grace_ms=60_000, rng=Scripted(*numbers))

    def turns(self, harness: GatewayHarness, *documents: Mapping[str, Any]) -> list[str]:
        """Each of C{documents} as an auto request of the session, in turn; who answered."""
        models = []
        for document in documents:
            connection = harness.post({**document, "model": "auto", "stream": False}, SESSION)
            harness.advance(1)
            response = connection.response()
            self.assertEqual(response.status, 200, response.body)
            models.append(response.json()["model"])
        return models

    def script(self, harness: GatewayHarness, count: int) -> None:
        """Let each fake answer C{count} chat requests."""
        for name, fake in harness.fakes.items():
            fake.script("POST", CHAT, *[answer({"content": name})] * count)

    def test_continuation_stays_side_is_drawn(self) -> None:
        """
        The main's first turn is drawn to big; the title, drawn to tiny, goes to tiny
        (before: to big, the session's home); the main's next turn, drawn to tiny, stays on
        big.
        """
        harness = self.harness(TO_BIG, TO_TINY, TO_TINY, slots=2, leases=False)
        self.script(harness, 3)
        self.assertEqual(self.turns(harness, MAIN_1, TITLE, MAIN_2), ["big", "tiny", "big"])

    def test_side_goes_to_free_capacity(self) -> None:
        """
        One slot each, under leases: the main holds big in its grace; the title, drawn to
        big, is served by the free tiny at once (as a new session would be), and the
        main's next turn stays on big.
        """
        harness = self.harness(TO_BIG, TO_BIG, TO_TINY, slots=1, leases=True)
        self.script(harness, 3)
        self.assertEqual(self.turns(harness, MAIN_1, TITLE, MAIN_2), ["big", "tiny", "big"])

    def test_side_conversation_continues_on_its_endpoint(self) -> None:
        """The title's own next request continues it: it stays on the title's endpoint."""
        harness = self.harness(TO_BIG, TO_TINY, TO_BIG, slots=2, leases=False)
        self.script(harness, 3)
        self.assertEqual(self.turns(harness, MAIN_1, TITLE, TITLE), ["big", "tiny", "tiny"])


class AnonymousContinuationTests(ConversationCase):
    """
    An agent that sends no session id and opens a new connection for the request after a
    tool result (Qwen Code, issue 24): its old connection idles in its grace, holding the
    slot that has the conversation cached.
    """

    def test_new_connection_takes_its_slot(self) -> None:
        """
        The request that continues the idle anonymous session's conversation ends that
        session and takes its slot (0, cached), instead of the empty slot 1; the log says
        so.
        """
        self.fake.set_default("POST", CHAT, reply(MAIN_1_TIMINGS))
        first = self.chat(MAIN_1, session=None)
        self.harness.advance(0.5)
        self.ok(first)
        [old] = self.holders()
        self.assertTrue(old.startswith("anonymous:"))
        with capturedLogs() as events:
            second = self.chat(MAIN_2, session=None)
            self.harness.advance(0.5)
        self.ok(second)
        self.assertEqual(self.slots(), [0, 0])
        self.assertNotIn(old, self.holders())
        text = [formatEvent(e) for e in events]
        self.assertTrue(any(f"continues {old}'s conversation on slot 0" in t for t in text), text)

    def test_unrelated_connection_keeps_out(self) -> None:
        """
        Another agent's anonymous request (its own conversation) neither ends the idle
        session nor takes its slot: it goes to the empty slot.
        """
        self.fake.set_default("POST", CHAT, reply(MAIN_1_TIMINGS))
        first = self.chat(MAIN_1, session=None)
        self.harness.advance(0.5)
        self.ok(first)
        [old] = self.holders()
        other = self.chat(TITLE, session=None)
        self.harness.advance(0.5)
        self.ok(other)
        self.assertEqual(self.slots(), [0, 1])
        self.assertIn(old, self.holders())

    def test_running_session_not_ended(self) -> None:
        """A session whose request still runs on the slot is not ended by a continuation."""
        self.fake.set_default("POST", CHAT, reply(MAIN_1_TIMINGS, deltas=20))
        first = self.chat(MAIN_1, session=None)
        self.harness.advance(0.1)
        [old] = self.holders()
        second = self.chat(MAIN_2, session=None)
        self.harness.advance(0.1)
        self.assertIn(old, self.holders())
        self.harness.advance(5)
        self.ok(first)
        self.ok(second)
