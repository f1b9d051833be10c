"""Tests for L{loopd.gateway.sessions}: slot choice, records and bounds of the session table."""

from __future__ import annotations

import gc

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.sessions import (
    DEFAULT_MAX_SESSIONS,
    MAX_CONVERSATIONS,
    ConversationRef,
    Placed,
    Sessions,
    conversation_key,
)
from loopd.llama.info import CacheOutcome
from loopd.llama.types import Assistant, System, Timings, User


def busy_of(*slots: int):
    """A busy callable saying that exactly C{slots} are busy."""
    taken = frozenset(slots)
    return lambda slot: slot in taken


def never_busy(slot: int) -> bool:
    """No slot is busy."""
    return False


T = Timings(cache_n=10, prompt_n=20, predicted_n=30)


class Connection:
    """A stand-in for a connection object: weakly referenceable, compared by identity."""


class ChooseSlotTests(SynchronousTestCase):
    """choose_slot, rule by rule."""

    def test_new_session_all_free_takes_lowest(self) -> None:
        """A new session on an idle server gets slot 0."""
        self.assertEqual(Sessions().choose_slot("a", 4, never_busy), 0)

    def test_keeps_last_slot_when_free(self) -> None:
        """A session keeps its last slot while it is free, even if others are fresher."""
        sessions = Sessions()
        sessions.record("a", 2, T, 64)
        self.assertEqual(sessions.choose_slot("a", 4, never_busy), 2)

    def test_keeps_last_slot_when_other_slots_busy(self) -> None:
        """Other slots being busy does not matter when the session's own slot is free."""
        sessions = Sessions()
        sessions.record("a", 1, T, 64)
        self.assertEqual(sessions.choose_slot("a", 3, busy_of(0, 2)), 1)

    def test_new_session_avoids_homes_of_others(self) -> None:
        """A new session picks a free slot no other session used last."""
        sessions = Sessions()
        sessions.record("a", 0, T, 64)
        sessions.record("b", 1, T, 64)
        self.assertEqual(sessions.choose_slot("c", 3, never_busy), 2)

    def test_moving_session_avoids_homes_of_others(self) -> None:
        """A session whose slot is busy moves to a free slot that is nobody's home."""
        sessions = Sessions()
        sessions.record("b", 1, T, 64)
        sessions.record("c", 2, T, 64)
        sessions.record("c", 3, T, 64)
        sessions.record("a", 0, T, 64)
        # Slot 1 was used longer ago than slot 2, but slot 1 is b's home and 2 is nobody's.
        self.assertEqual(sessions.choose_slot("a", 4, busy_of(0, 3)), 2)

    def test_unclaimed_free_slots_least_recently_used_first(self) -> None:
        """Among free slots nobody calls home, the least recently used wins."""
        sessions = Sessions()
        sessions.record("x", 0, T, 64)
        sessions.record("y", 1, T, 64)
        sessions.record("x", 2, T, 64)  # slot 0 is now nobody's home, used before slot 2
        sessions.record("y", 3, T, 64)  # slot 1 too, used after slot 0
        self.assertEqual(sessions.choose_slot("new", 4, busy_of(2, 3)), 0)

    def test_never_used_slot_before_used_one(self) -> None:
        """A slot that never ran a request counts as the least recently used."""
        sessions = Sessions()
        sessions.record("x", 1, T, 64)
        sessions.forget("x")
        self.assertEqual(sessions.choose_slot("new", 3, busy_of(0)), 2)

    def test_all_free_slots_claimed_takes_least_recently_used(self) -> None:
        """When every free slot is someone's home, the least recently used free one wins."""
        sessions = Sessions()
        sessions.record("b", 1, T, 64)
        sessions.record("c", 2, T, 64)
        sessions.record("a", 0, T, 64)
        self.assertEqual(sessions.choose_slot("a", 3, busy_of(0)), 1)
        sessions.record("b", 1, T, 64)
        self.assertEqual(sessions.choose_slot("a", 3, busy_of(0)), 2)

    def test_all_busy_known_session_queues_on_its_slot(self) -> None:
        """With every slot busy, a known session stays on its last slot."""
        sessions = Sessions()
        sessions.record("b", 0, T, 64)
        sessions.record("c", 0, T, 64)
        sessions.record("a", 0, T, 64)
        self.assertEqual(sessions.choose_slot("a", 2, busy_of(0, 1)), 0)

    def test_all_busy_new_session_takes_slot_with_fewest_sessions(self) -> None:
        """With every slot busy, a new session goes where the fewest sessions live."""
        sessions = Sessions()
        sessions.record("a", 0, T, 64)
        sessions.record("b", 0, T, 64)
        sessions.record("c", 2, T, 64)
        sessions.record("d", 1, T, 64)
        sessions.record("e", 1, T, 64)
        self.assertEqual(sessions.choose_slot("new", 3, busy_of(0, 1, 2)), 2)

    def test_all_busy_new_session_tie_goes_to_least_recently_used(self) -> None:
        """Slots with equally many sessions are told apart by when they were last used."""
        sessions = Sessions()
        sessions.record("a", 1, T, 64)
        sessions.record("b", 0, T, 64)
        self.assertEqual(sessions.choose_slot("new", 2, busy_of(0, 1)), 1)

    def test_single_slot(self) -> None:
        """With one slot, every session gets slot 0, busy or not."""
        sessions = Sessions()
        sessions.record("a", 0, T, 64)
        self.assertEqual(sessions.choose_slot("a", 1, busy_of(0)), 0)
        self.assertEqual(sessions.choose_slot("b", 1, busy_of(0)), 0)
        self.assertEqual(sessions.choose_slot("b", 1, never_busy), 0)

    def test_last_slot_out_of_range_is_ignored(self) -> None:
        """A remembered slot beyond n_slots (the server shrank) is treated as no slot."""
        sessions = Sessions()
        sessions.record("a", 5, T, 64)
        self.assertEqual(sessions.choose_slot("a", 2, never_busy), 0)
        self.assertEqual(sessions.choose_slot("a", 2, busy_of(0, 1)), 0)

    def test_choose_does_not_change_the_table(self) -> None:
        """choose_slot neither adds the session nor changes its last slot."""
        sessions = Sessions()
        sessions.choose_slot("a", 2, never_busy)
        self.assertEqual(len(sessions), 0)
        sessions.record("b", 0, T, 64)
        self.assertEqual(sessions.choose_slot("b", 2, busy_of(0)), 1)
        self.assertEqual(sessions.last_slot("b"), 0)

    def test_no_slots_is_an_error(self) -> None:
        """n_slots below 1 is a ValueError."""
        self.assertRaises(ValueError, Sessions().choose_slot, "a", 0, never_busy)


class OccupiedTests(SynchronousTestCase):
    """
    choose_slot rule 3 with an endpoint: a free occupied slot (one that served a request on
    that endpoint) before an empty one, for a moving session and a new one alike.
    """

    C = conversation_key([User("q")])

    def test_moving_session_takes_occupied_slot(self) -> None:
        """
        A session whose slot is busy moves to the occupied slot, though it is another's home
        and the empty one is nobody's (only there can the server restore it from its RAM cache).
        """
        sessions = Sessions()
        for session, slot in (("a", 0), ("b", 1)):
            sessions.record(session, slot, T, 64)
            sessions.remember_conversation("e", slot, self.C)
        self.assertEqual(sessions.choose_slot("a", 3, busy_of(0), endpoint="e"), 1)
        self.assertEqual(sessions.choose_slot("a", 3, busy_of(0)), 2)

    def test_new_session_takes_occupied_slot(self) -> None:
        """A new session too: its shared prefix (a system prompt) is in the occupied slot."""
        sessions = Sessions()
        sessions.record("a", 1, T, 64)
        sessions.remember_conversation("e", 1, self.C)
        self.assertEqual(sessions.choose_slot("new", 3, never_busy, endpoint="e"), 1)

    def test_occupied_only_on_its_endpoint(self) -> None:
        """A slot that served another endpoint is empty on this one."""
        sessions = Sessions()
        sessions.remember_conversation("f", 1, self.C)
        self.assertEqual(sessions.choose_slot("new", 3, never_busy, endpoint="e"), 0)
        self.assertEqual(sessions.choose_slot("new", 3, never_busy, endpoint="f"), 1)

    def test_among_occupied_nobodys_home_then_least_recently_used(self) -> None:
        """Among occupied slots, the usual order: nobody's home first, then the oldest."""
        sessions = Sessions()
        for session, slot in (("x", 0), ("y", 1), ("z", 2)):
            sessions.record(session, slot, T, 64)
            sessions.remember_conversation("e", slot, self.C)
        sessions.forget("z")
        self.assertEqual(sessions.choose_slot("new", 4, never_busy, endpoint="e"), 2)
        sessions.forget("y")
        self.assertEqual(sessions.choose_slot("new", 4, never_busy, endpoint="e"), 1)

    def test_busy_occupied_slot_is_not_taken(self) -> None:
        """Busy occupied slots are not free: then the empty one."""
        sessions = Sessions()
        sessions.remember_conversation("e", 0, self.C)
        self.assertEqual(sessions.choose_slot("new", 2, busy_of(0), endpoint="e"), 1)

    def test_own_free_slot_still_first(self) -> None:
        """The session's own free last slot comes before every other occupied slot."""
        sessions = Sessions()
        sessions.record("a", 2, T, 64)
        sessions.remember_conversation("e", 0, self.C)
        self.assertEqual(sessions.choose_slot("a", 3, never_busy, endpoint="e"), 2)


class NewSessionTests(SynchronousTestCase):
    """
    choose_slot rule 3 for a new session with its conversation: occupied first when its
    first message begins a slot's conversation (a shared system prompt), else empty first.
    """

    SYSTEM = conversation_key([User("you are an agent"), User("task one")])
    KIN = conversation_key([User("you are an agent"), User("task two")])
    STRANGER = conversation_key([User("something else")])

    def table(self) -> Sessions:
        """Slot 0 served the agent's conversation, slot 1 another; slot 2 is empty."""
        sessions = Sessions()
        sessions.record("a", 0, T, 64)
        sessions.remember_conversation("e", 0, self.SYSTEM)
        sessions.record("b", 1, T, 64)
        sessions.remember_conversation("e", 1, self.STRANGER[:0] + (7,))
        sessions.forget("a")
        sessions.forget("b")
        return sessions

    def test_kin_takes_the_slot_sharing_its_beginning(self) -> None:
        """A new session sharing the system prompt goes where that prompt is cached."""
        chosen = self.table().choose_slot("new", 3, never_busy, endpoint="e", conversation=self.KIN)
        self.assertEqual(chosen, 0)

    def test_stranger_takes_an_empty_slot(self) -> None:
        """A new session sharing nothing goes to the empty slot: it displaces nobody."""
        sessions = self.table()
        chosen = sessions.choose_slot(
            "new", 3, never_busy, endpoint="e", conversation=self.STRANGER
        )
        self.assertEqual(chosen, 2)

    def test_kin_of_a_busy_slot_still_prefers_occupied(self) -> None:
        """The sharing slot is busy: another occupied slot (the RAM cache may hold it)."""
        sessions = self.table()
        chosen = sessions.choose_slot("new", 3, busy_of(0), endpoint="e", conversation=self.KIN)
        self.assertEqual(chosen, 1)

    def test_longest_shared_beginning_first(self) -> None:
        """Of two occupied slots sharing the beginning, the one sharing more."""
        sessions = self.table()
        longer = conversation_key([User("you are an agent"), User("task one"), User("more")])
        sessions.remember_conversation("e", 1, self.KIN[:1])
        chosen = sessions.choose_slot("new", 3, never_busy, endpoint="e", conversation=longer)
        self.assertEqual(chosen, 0)

    def test_stranger_with_no_empty_slot(self) -> None:
        """Every free slot occupied: the usual order among them."""
        sessions = self.table()
        chosen = sessions.choose_slot(
            "new", 2, never_busy, endpoint="e", conversation=self.STRANGER
        )
        self.assertEqual(chosen, 0)

    def test_moving_stranger_still_takes_occupied(self) -> None:
        """A session that must move goes to an occupied slot, whatever its conversation."""
        sessions = self.table()
        sessions.record("m", 2, T, 64)
        chosen = sessions.choose_slot("m", 4, busy_of(2), endpoint="e", conversation=self.STRANGER)
        self.assertIn(chosen, (0, 1))


class AvoidTests(SynchronousTestCase):
    """
    choose_slot's avoid: the slots of the session's other conversations are taken only
    when no other slot is free (decision 45).
    """

    def test_other_free_slot_first(self) -> None:
        """A free slot outside avoid is taken, though the avoided one is older."""
        self.assertEqual(Sessions().choose_slot("side", 3, never_busy, avoid={0}), 1)

    def test_avoided_when_nothing_else_is_free(self) -> None:
        """Every other slot busy: the avoided slot rather than the gate."""
        self.assertEqual(Sessions().choose_slot("side", 2, busy_of(1), avoid={0}), 0)

    def test_own_last_slot_first(self) -> None:
        """A conversation's own free last slot stays its own, even when avoided."""
        sessions = Sessions()
        sessions.record("side", 1, T, 64)
        self.assertEqual(sessions.choose_slot("side", 3, never_busy, avoid={1}), 1)

    def test_before_occupied_first(self) -> None:
        """
        An empty slot rather than the session's occupied one: decision 45 before decision
        39, even for a request sharing that slot's beginning.
        """
        sessions = Sessions()
        kin = conversation_key([System("agent"), User("q")])
        sessions.record("s", 0, T, 64)
        sessions.remember_conversation("e", 0, kin)
        chosen = sessions.choose_slot(
            "s side:1", 2, never_busy, endpoint="e", conversation=kin[:1], avoid={0}
        )
        self.assertEqual(chosen, 1)

    def test_prefix_of_outside_avoid(self) -> None:
        """An anonymous request's prefix slot too is avoided while another is free."""
        sessions = Sessions()
        q1 = conversation_key([User("q1")])
        sessions.remember_conversation("e", 0, q1)
        chosen = sessions.choose_slot("anon", 2, never_busy, ("e", q1), avoid={0})
        self.assertEqual(chosen, 1)


class RecordTests(SynchronousTestCase):
    """record, forget and the table's bound."""

    def test_first_record_has_no_outcome(self) -> None:
        """A session's first completion has nothing to compare with."""
        self.assertIsNone(Sessions().record("a", 0, T, 64))

    def test_hit(self) -> None:
        """Reusing the whole previous prompt (and its answer) is not a loss."""
        sessions = Sessions()
        sessions.record("a", 0, Timings(cache_n=0, prompt_n=100, predicted_n=20), 64)
        outcome = sessions.record("a", 0, Timings(cache_n=120, prompt_n=15, predicted_n=5), 64)
        self.assertEqual(outcome, CacheOutcome(loss=False, expected=100, cached=120))

    def test_loss_with_both_numbers(self) -> None:
        """Falling more than the threshold short is a loss reporting expected and cached."""
        sessions = Sessions()
        sessions.record("a", 0, Timings(cache_n=50, prompt_n=100, predicted_n=50), 64)
        outcome = sessions.record("a", 1, Timings(cache_n=10, prompt_n=250), 64)
        self.assertEqual(outcome, CacheOutcome(loss=True, expected=150, cached=10))

    def test_threshold_is_passed_through(self) -> None:
        """The same shortfall is a loss or not depending on the threshold given."""
        sessions = Sessions()
        sessions.record("a", 0, Timings(prompt_n=100), 64)
        outcome = sessions.record("a", 0, Timings(cache_n=90), 5)
        self.assertEqual(outcome, CacheOutcome(loss=True, expected=100, cached=90))
        outcome = sessions.record("a", 0, Timings(cache_n=80), 64)
        self.assertEqual(outcome, CacheOutcome(loss=False, expected=90, cached=80))

    def test_sessions_are_independent(self) -> None:
        """One session's completions are never compared with another's."""
        sessions = Sessions()
        sessions.record("a", 0, Timings(prompt_n=1000), 64)
        self.assertIsNone(sessions.record("b", 0, Timings(cache_n=0, prompt_n=5), 64))

    def test_not_compared(self) -> None:
        """compare=False (no continuation): no outcome, but the slot and timings count."""
        sessions = Sessions()
        sessions.record("a", 0, Timings(prompt_n=1000), 64)
        self.assertIsNone(
            sessions.record("a", 1, Timings(cache_n=0, prompt_n=5), 64, compare=False)
        )
        self.assertEqual(sessions.last_slot("a"), 1)
        outcome = sessions.record("a", 1, Timings(cache_n=5), 64)
        self.assertEqual(outcome, CacheOutcome(loss=False, expected=5, cached=5))

    def test_record_remembers_slot(self) -> None:
        """The slot of the latest completion is the session's last slot."""
        sessions = Sessions()
        sessions.record("a", 0, T, 64)
        sessions.record("a", 3, T, 64)
        self.assertEqual(sessions.last_slot("a"), 3)
        self.assertIsNone(sessions.last_slot("b"))

    def test_bound_evicts_least_recently_recorded(self) -> None:
        """Past max_sessions the session recorded longest ago is forgotten."""
        sessions = Sessions(max_sessions=2)
        sessions.record("a", 0, T, 64)
        sessions.record("b", 1, T, 64)
        sessions.record("a", 0, T, 64)
        sessions.record("c", 2, T, 64)
        self.assertEqual(len(sessions), 2)
        self.assertIsNone(sessions.last_slot("b"))
        self.assertEqual(sessions.last_slot("a"), 0)
        self.assertIsNone(sessions.record("b", 1, T, 64))

    def test_evicted_session_no_longer_claims_its_slot(self) -> None:
        """Once a session is evicted its slot is nobody's home again."""
        sessions = Sessions(max_sessions=2)
        sessions.record("a", 0, T, 64)
        sessions.record("b", 1, T, 64)
        sessions.record("c", 1, T, 64)  # evicts a
        self.assertEqual(sessions.choose_slot("new", 3, busy_of(2)), 0)

    def test_forget(self) -> None:
        """A forgotten session is gone and no longer claims its slot."""
        sessions = Sessions()
        sessions.record("a", 0, T, 64)
        sessions.forget("a")
        sessions.forget("never-seen")
        self.assertEqual(len(sessions), 0)
        self.assertIsNone(sessions.record("a", 0, T, 64))

    def test_default_bound(self) -> None:
        """The default table holds 1024 sessions."""
        sessions = Sessions()
        for n in range(DEFAULT_MAX_SESSIONS + 10):
            sessions.record(str(n), 0, T, 64)
        self.assertEqual(len(sessions), 1024)
        self.assertIsNone(sessions.last_slot("9"))
        self.assertEqual(sessions.last_slot("10"), 0)

    def test_bound_must_be_positive(self) -> None:
        """max_sessions below 1 is a ValueError."""
        self.assertRaises(ValueError, Sessions, 0)


class PrefixTests(SynchronousTestCase):
    """
    choose_slot with prefix_of (an anonymous request): the free slot whose last conversation
    on the endpoint is the longest prefix of the request's.
    """

    Q1 = conversation_key([User("q1")])
    TURN2 = conversation_key([User("q1"), Assistant("a1"), User("q2")])
    OTHER = conversation_key([User("other")])

    def test_prefix_slot_chosen(self) -> None:
        """The slot that served the conversation's beginning, though another is older."""
        sessions = Sessions()
        sessions.remember_conversation("e", 1, self.Q1)
        self.assertEqual(sessions.choose_slot("anon", 3, never_busy, ("e", self.TURN2)), 1)
        self.assertEqual(sessions.choose_slot("anon", 3, never_busy), 0)

    def test_longest_prefix(self) -> None:
        """Of two prefixes, the longer one's slot; the same conversation is a prefix too."""
        sessions = Sessions()
        sessions.remember_conversation("e", 0, self.Q1)
        sessions.remember_conversation("e", 2, self.TURN2)
        self.assertEqual(sessions.choose_slot("anon", 3, never_busy, ("e", self.TURN2)), 2)

    def test_no_match(self) -> None:
        """No slot's conversation is a prefix (or it is longer): the usual rules."""
        sessions = Sessions()
        sessions.remember_conversation("e", 0, self.TURN2)
        sessions.remember_conversation("e", 1, self.OTHER)
        self.assertEqual(sessions.choose_slot("anon", 3, never_busy, ("e", self.Q1)), 0)
        sessions.record("x", 0, T, 64)
        self.assertEqual(sessions.choose_slot("anon", 3, never_busy, ("e", self.Q1)), 1)

    def test_busy_or_other_endpoint(self) -> None:
        """A busy matching slot is not taken; another endpoint's slots do not match."""
        sessions = Sessions()
        sessions.remember_conversation("e", 1, self.Q1)
        self.assertEqual(sessions.choose_slot("anon", 3, busy_of(1), ("e", self.TURN2)), 0)
        self.assertEqual(sessions.choose_slot("anon", 3, never_busy, ("f", self.TURN2)), 0)

    def test_own_last_slot_first(self) -> None:
        """The session's own free last slot still comes first."""
        sessions = Sessions()
        sessions.record("anon", 2, T, 64)
        sessions.remember_conversation("e", 1, self.Q1)
        self.assertEqual(sessions.choose_slot("anon", 3, never_busy, ("e", self.TURN2)), 2)

    def test_key(self) -> None:
        """Equal messages give equal keys, different ones different; prefixes are prefixes."""
        self.assertEqual(conversation_key([User("q1")]), self.Q1)
        self.assertNotEqual(self.Q1, self.OTHER)
        self.assertEqual(self.TURN2[:1], self.Q1)
        self.assertNotEqual(conversation_key([System("q1")]), self.Q1)

    def test_key_of_media(self) -> None:
        """A user turn with media parts (dicts, which do not hash) has a key all the same."""
        image = ({"type": "image_url", "image_url": {"url": "data:,"}},)
        key = conversation_key([User("look", image)])
        self.assertEqual(key, conversation_key([User("look", image)]))
        self.assertNotEqual(key, conversation_key([User("look")]))

    def test_key_without_thinking(self) -> None:
        """An assistant turn's key leaves its thinking out, and only its thinking."""
        plain = conversation_key([Assistant("a")])
        self.assertEqual(conversation_key([Assistant("a", reasoning_content="hmm")]), plain)
        self.assertNotEqual(conversation_key([Assistant("b", reasoning_content="hmm")]), plain)


class AnonymousTests(SynchronousTestCase):
    """anonymous_id: one session per connection."""

    def test_stable_per_connection(self) -> None:
        """The same connection always gets the same id."""
        sessions = Sessions()
        connection = Connection()
        self.assertEqual(sessions.anonymous_id(connection), sessions.anonymous_id(connection))

    def test_distinct_connections(self) -> None:
        """Two connections get different ids."""
        sessions = Sessions()
        self.assertNotEqual(
            sessions.anonymous_id(Connection()), sessions.anonymous_id(Connection())
        )

    def test_not_reused_after_connection_is_gone(self) -> None:
        """A connection created after another was collected never inherits its id."""
        sessions = Sessions()
        first = Connection()
        old = sessions.anonymous_id(first)
        del first
        gc.collect()
        self.assertNotEqual(sessions.anonymous_id(Connection()), old)

    def test_on_new_once(self) -> None:
        """on_new hears the id once, when the connection's first request made it."""
        sessions = Sessions()
        connection = Connection()
        heard: list[str] = []
        first = sessions.anonymous_id(connection, heard.append)
        sessions.anonymous_id(connection, heard.append)
        self.assertEqual(heard, [first])

    def test_value_keys(self) -> None:
        """Keys that cannot be weakly referenced are told apart by value."""
        sessions = Sessions()
        self.assertEqual(sessions.anonymous_id(7), sessions.anonymous_id(7))
        self.assertNotEqual(sessions.anonymous_id(7), sessions.anonymous_id(8))
        self.assertNotEqual(sessions.anonymous_id(7), sessions.anonymous_id("7"))
        self.assertEqual(sessions.anonymous_id(("a", 1)), sessions.anonymous_id(("a", 1)))


MAIN = System("You are an agent. Tools: read, edit, bash.")
TITLE = System("You are a title generator. Answer with a title only.")
SUB = System("You are a sub-agent: search the code.")
ASK = User("fix the failing test")


class ConversationTests(SynchronousTestCase):
    """
    conversation_of: which of its session's conversations a request belongs to
    (decision 45), by its messages.
    """

    def place(
        self,
        sessions: Sessions,
        messages: tuple[object, ...],
        session: str = "s",
        tools: bool = False,
    ):
        """Place a request of C{session} with C{messages}, offering tools or not."""
        return sessions.conversation_of(session, conversation_key(messages), tools=tools)

    def test_first_is_the_session(self) -> None:
        """A session's first conversation has the session's id as its key."""
        sessions = Sessions()
        self.assertEqual(self.place(sessions, (MAIN, ASK)), ConversationRef("s", Placed.NEW))
        self.assertEqual(sessions.conversations("s"), ("s",))

    def test_continues(self) -> None:
        """A next turn, and a retry of the same messages, continue the conversation."""
        sessions = Sessions()
        first = (MAIN, ASK)
        second = (*first, Assistant("Looking."), User("and the other one"))
        self.place(sessions, first)
        for messages in (second, second):
            ref = self.place(sessions, messages)
            self.assertEqual(ref, ConversationRef("s", Placed.CONTINUES))
            self.assertTrue(ref.continues)
            self.assertFalse(ref.side)

    def test_thinking_dropped_still_continues(self) -> None:
        """An earlier turn resent without its thinking (or with other thinking) continues."""
        sessions = Sessions()
        thought = (MAIN, ASK, Assistant("Done.", reasoning_content="hmm"), User("thanks"))
        self.place(sessions, thought)
        dropped = (MAIN, ASK, Assistant("Done."), User("thanks"), Assistant("ok"), User("bye"))
        self.assertEqual(self.place(sessions, dropped).placed, Placed.CONTINUES)

    def test_title_is_a_side_conversation(self) -> None:
        """
        OpenCode's title request (another system prompt) under the main session's id is a
        side conversation with a key of its own; the main's next turn continues the main.
        """
        sessions = Sessions()
        main = (MAIN, ASK)
        self.place(sessions, main)
        title = self.place(sessions, (TITLE, User("fix the failing test")))
        self.assertEqual(title.placed, Placed.SIDE)
        self.assertTrue(title.side)
        self.assertFalse(title.continues)
        self.assertNotEqual(title.key, "s")
        self.assertTrue(title.key.startswith("s side:"))
        nxt = self.place(sessions, (*main, Assistant("Reading."), User("go on")))
        self.assertEqual(nxt, ConversationRef("s", Placed.CONTINUES))
        self.assertEqual(sessions.siblings("s"), (title.key,))
        self.assertEqual(sessions.siblings(title.key), ("s",))

    def test_title_first(self) -> None:
        """The title may come first: then it is the session's key, and the main a side."""
        sessions = Sessions()
        self.assertEqual(self.place(sessions, (TITLE, ASK)).key, "s")
        main = self.place(sessions, (MAIN, ASK))
        self.assertEqual(main.placed, Placed.SIDE)
        later = self.place(sessions, (MAIN, ASK, Assistant("a"), User("b")))
        self.assertEqual(later, ConversationRef(main.key, Placed.CONTINUES))

    def test_unrelated_conversations(self) -> None:
        """
        One session id sending unrelated conversations (other first messages): each its
        own key, each continued under it, interleaved.
        """
        sessions = Sessions()
        starts = [(User(f"task {n}"),) for n in range(4)]
        keys = [self.place(sessions, start).key for start in starts]
        self.assertEqual(len(set(keys)), 4)
        self.assertEqual(keys[0], "s")
        for start, key in reversed(list(zip(starts, keys, strict=True))):
            ref = self.place(sessions, (*start, Assistant("a"), User("more")))
            self.assertEqual(ref, ConversationRef(key, Placed.CONTINUES))

    def test_compaction_rewrites(self) -> None:
        """
        After a compaction (the same system prompt, a summary in place of the history) the
        request rewrites the main conversation: its key, no cache outcome; its next turn
        continues it.
        """
        sessions = Sessions()
        history = (MAIN, ASK, Assistant("a1"), User("u2"), Assistant("a2"), User("u3"))
        self.place(sessions, history)
        self.place(sessions, (TITLE, ASK))
        compacted = (MAIN, User("Summary of the conversation so far: ..."))
        ref = self.place(sessions, compacted)
        self.assertEqual(ref, ConversationRef("s", Placed.REWRITES))
        self.assertFalse(ref.continues)
        nxt = self.place(sessions, (*compacted, Assistant("ok"), User("next")))
        self.assertEqual(nxt, ConversationRef("s", Placed.CONTINUES))

    def test_title_with_the_main_system_prompt(self) -> None:
        """
        A title request with the main's system prompt but no tools begins otherwise than
        the main with its tools: a side conversation, not a rewrite.
        """
        sessions = Sessions()
        self.place(sessions, (MAIN, ASK), tools=True)
        title = self.place(sessions, (MAIN, User("a title for: fix the failing test")))
        self.assertEqual(title.placed, Placed.SIDE)
        nxt = self.place(sessions, (MAIN, ASK, Assistant("a"), User("b")), tools=True)
        self.assertEqual(nxt, ConversationRef("s", Placed.CONTINUES))

    def test_summary_without_tools_then_compaction(self) -> None:
        """
        A summary request that extends the main's messages without its tools continues the
        main and leaves its beginning: the compacted history, with the tools, rewrites it.
        """
        sessions = Sessions()
        main = (MAIN, ASK, Assistant("a1"), User("u2"))
        self.place(sessions, main, tools=True)
        summary = self.place(sessions, (*main, User("Summarise the conversation.")))
        self.assertEqual(summary, ConversationRef("s", Placed.CONTINUES))
        compacted = self.place(sessions, (MAIN, User("Summary: ...")), tools=True)
        self.assertEqual(compacted, ConversationRef("s", Placed.REWRITES))

    def test_rewind_rewrites(self) -> None:
        """A shorter history (a rewind, an edit) rewrites the conversation too."""
        sessions = Sessions()
        self.place(sessions, (MAIN, ASK, Assistant("a1"), User("u2")))
        self.assertEqual(self.place(sessions, (MAIN, ASK)).placed, Placed.REWRITES)

    def test_parallel_sub_agents_split(self) -> None:
        """
        Two sub-agents of one kind (the same system prompt): the second rewrites the
        first's key until the first continues its own history; then each has its own key.
        """
        sessions = Sessions()
        self.place(sessions, (MAIN, ASK))
        a = (SUB, User("find foo"))
        b = (SUB, User("find bar"))
        first = self.place(sessions, a)
        self.assertEqual(first.placed, Placed.SIDE)
        self.assertEqual(self.place(sessions, b), ConversationRef(first.key, Placed.REWRITES))
        split = self.place(sessions, (*a, Assistant("x"), User("y")))
        self.assertEqual(split.placed, Placed.SIDE)
        self.assertNotIn(split.key, ("s", first.key))
        self.assertEqual(
            self.place(sessions, (*b, Assistant("x"), User("y"))),
            ConversationRef(first.key, Placed.CONTINUES),
        )
        self.assertEqual(
            self.place(sessions, (*a, Assistant("x"), User("y"), Assistant("z"), User("w"))),
            ConversationRef(split.key, Placed.CONTINUES),
        )

    def test_sessions_apart(self) -> None:
        """Two sessions with the same messages each have their own conversation."""
        sessions = Sessions()
        self.assertEqual(self.place(sessions, (MAIN, ASK), "a").key, "a")
        self.assertEqual(self.place(sessions, (MAIN, ASK), "b").key, "b")
        self.assertEqual(sessions.siblings("a"), ())

    def test_no_messages(self) -> None:
        """A request without messages is its session's; nothing is remembered."""
        sessions = Sessions()
        self.assertEqual(sessions.conversation_of("s", ()), ConversationRef("s", Placed.NEW))
        self.assertEqual(sessions.conversations("s"), ())

    def test_bounded_per_session(self) -> None:
        """A session keeps its MAX_CONVERSATIONS most recent conversations."""
        sessions = Sessions()
        keys = [self.place(sessions, (User(f"t{n}"),)).key for n in range(MAX_CONVERSATIONS + 2)]
        self.assertEqual(sessions.conversations("s"), tuple(reversed(keys[2:])))
        self.assertEqual(sessions.siblings(keys[0]), ())
        # The forgotten first conversation starts anew, as a side conversation.
        self.assertEqual(self.place(sessions, (User("t0"),)).placed, Placed.SIDE)

    def test_bounded_sessions(self) -> None:
        """The conversations of as many sessions as the table holds, the latest placed."""
        sessions = Sessions(max_sessions=2)
        for name in ("a", "b", "c"):
            self.place(sessions, (MAIN, ASK), name)
            self.place(sessions, (TITLE, ASK), name)
        self.assertEqual(sessions.conversations("a"), ())
        self.assertEqual(len(sessions.conversations("b")), 2)
        self.assertEqual(self.place(sessions, (MAIN, ASK), "a").placed, Placed.NEW)

    def test_forget_every_conversation(self) -> None:
        """forget(session) forgets its side conversations' slots too."""
        sessions = Sessions()
        self.place(sessions, (MAIN, ASK))
        side = self.place(sessions, (TITLE, ASK)).key
        sessions.record("s", 0, T, 64)
        sessions.record(side, 1, T, 64)
        sessions.forget("s")
        self.assertEqual((sessions.last_slot("s"), sessions.last_slot(side)), (None, None))
        self.assertEqual((len(sessions), sessions.siblings(side)), (0, ()))


records = st.lists(
    st.tuples(st.sampled_from("abcd"), st.integers(min_value=0, max_value=7)), max_size=30
)


@st.composite
def scenarios(draw):
    """A history of records on a server of n_slots, the asking session and the busy slots."""
    n_slots = draw(st.integers(min_value=1, max_value=6))
    # One slot past the end now and then: a server restarted with fewer slots.
    slot = st.integers(min_value=0, max_value=n_slots)
    history = draw(st.lists(st.tuples(st.sampled_from("abcd"), slot), max_size=30))
    busy = draw(st.lists(st.booleans(), min_size=n_slots, max_size=n_slots))
    # Mostly a session recorded lately (likely still in the table), sometimes a new one.
    session = draw(st.sampled_from([name for name, _ in history[-3:]] + ["new"]))
    return (
        history,
        draw(st.integers(min_value=1, max_value=6)),
        n_slots,
        session,
        frozenset(i for i, b in enumerate(busy) if b),
    )


class PropertyTests(SynchronousTestCase):
    """Properties of choose_slot and the bound over any history."""

    @settings(max_examples=400)
    @given(scenarios())
    def test_choose_slot(self, scenario) -> None:
        """The choice is in range, keeps a free last slot and never takes a busy slot needlessly."""
        history, max_sessions, n_slots, session, busy = scenario
        sessions = Sessions(max_sessions)
        for name, slot in history:
            sessions.record(name, slot, T, 64)
            sessions.remember_conversation("e", slot, conversation_key([User(name)]))
        own = conversation_key([User(session)])
        chosen = sessions.choose_slot(
            session, n_slots, busy.__contains__, endpoint="e", conversation=own
        )
        self.assertTrue(0 <= chosen < n_slots)
        last = sessions.last_slot(session)
        if last is not None and last < n_slots and last not in busy:
            self.assertEqual(chosen, last)
            return
        free = [slot for slot in range(n_slots) if slot not in busy]
        if free:
            self.assertNotIn(chosen, busy)
        served = {slot for _, slot in history}
        moving = last is not None and last < n_slots
        holder = {slot: name for name, slot in history if slot < n_slots}
        kin = session in holder.values()
        if (moving or kin) and any(slot in served for slot in free):
            # Never an empty slot while a free occupied one is there (decision 39).
            self.assertIn(chosen, served)
        elif free and not kin and any(slot not in served for slot in free):
            # A new session sharing nothing: an empty slot.
            self.assertNotIn(chosen, served)

    @settings(max_examples=200)
    @given(scenarios(), st.sets(st.integers(min_value=0, max_value=6)))
    def test_avoid(self, scenario, avoid) -> None:
        """
        A slot of avoid is chosen only as the session's own free last slot, or when every
        free slot is avoided, or when none is free.
        """
        history, max_sessions, n_slots, session, busy = scenario
        sessions = Sessions(max_sessions)
        for name, slot in history:
            sessions.record(name, slot, T, 64)
            sessions.remember_conversation("e", slot, conversation_key([User(name)]))
        chosen = sessions.choose_slot(
            session, n_slots, busy.__contains__, endpoint="e", avoid=avoid
        )
        last = sessions.last_slot(session)
        if chosen in avoid and chosen != last:
            free = [slot for slot in range(n_slots) if slot not in busy and slot != last]
            self.assertTrue(all(slot in avoid for slot in free), (chosen, free))

    @given(history=records, max_sessions=st.integers(min_value=1, max_value=6))
    def test_bounded(self, history, max_sessions) -> None:
        """The table never holds more than max_sessions, and always the latest recorded one."""
        sessions = Sessions(max_sessions)
        for name, slot in history:
            sessions.record(name, slot, T, 64)
            self.assertLessEqual(len(sessions), max_sessions)
            self.assertEqual(sessions.last_slot(name), slot)


@st.composite
def interleavings(draw):
    """
    Up to MAX_CONVERSATIONS conversations of one session, each beginning with its own first
    message, and the order their turns come in (a conversation's index per turn).
    """
    count = draw(st.integers(min_value=1, max_value=MAX_CONVERSATIONS))
    order = draw(st.lists(st.integers(min_value=0, max_value=count - 1), min_size=1, max_size=40))
    retries = draw(st.lists(st.booleans(), min_size=len(order), max_size=len(order)))
    return order, retries


class ConversationPropertyTests(SynchronousTestCase):
    """Properties of conversation_of over any interleaving of a session's conversations."""

    @given(interleavings())
    def test_each_conversation_keeps_its_key(self, interleaving) -> None:
        """
        The first conversation is the session's, each other one starts as a side
        conversation, every later turn (or a retry) continues it under the same key, and
        no two conversations share a key.
        """
        order, retries = interleaving
        sessions = Sessions()
        messages: dict[int, tuple[object, ...]] = {}
        keys: dict[int, str] = {}
        for turn, (index, retry) in enumerate(zip(order, retries, strict=True)):
            if index not in messages:
                messages[index] = (User(f"start {index}"),)
            elif not retry:
                messages[index] += (Assistant(f"a{turn}"), User(f"u{turn}"))
            ref = sessions.conversation_of("s", conversation_key(messages[index]))
            if index in keys:
                self.assertEqual(ref, ConversationRef(keys[index], Placed.CONTINUES))
                continue
            self.assertEqual(ref.placed, Placed.NEW if not keys else Placed.SIDE)
            self.assertNotIn(ref.key, keys.values())
            keys[index] = ref.key
        self.assertEqual(keys.get(order[0]), "s")

    @given(
        st.lists(
            st.tuples(
                st.sampled_from("ab"),
                st.lists(st.sampled_from(["x", "y", "z"]), min_size=1, max_size=4),
            ),
            max_size=40,
        ),
        st.integers(min_value=1, max_value=3),
    )
    def test_bounded_and_consistent(self, requests, max_sessions) -> None:
        """
        Whatever comes: at most MAX_CONVERSATIONS conversations per session and
        max_sessions sessions remembered; the placed key is the session's most recent
        conversation, and its siblings are the session's others.
        """
        sessions = Sessions(max_sessions)
        for session, texts in requests:
            key = conversation_key([User(t) for t in texts])
            ref = sessions.conversation_of(session, key)
            mine = sessions.conversations(session)
            self.assertLessEqual(len(mine), MAX_CONVERSATIONS)
            self.assertEqual(mine[0], ref.key)
            self.assertEqual(len(set(mine)), len(mine))
            self.assertEqual(sessions.siblings(ref.key), mine[1:])
        remembered = [name for name in "ab" if sessions.conversations(name)]
        self.assertLessEqual(len(remembered), max_sessions)
