# -*- test-case-name: loopd.test.test_gateway_sessions -*-
"""
The gateway's session table: which server slot each session used last, and how its last
completion went.

A session keeps the slot it used last whenever that slot is free, because its prompt prefix
is still in that slot's KV cache (DESIGN §3 decision 16). When it must move, it goes to a free
occupied slot before an empty one, then to one that no other session calls home, so sessions
do not trample each other's caches.

Occupied before empty (DESIGN §3 decision 39) holds for every session that moves, and for a
new session whose first message begins a conversation that one of the endpoint's slots
served last (agents of one kind share their system prompt); among occupied slots, the one
whose conversation shares the most leading messages comes first. A new session that shares
nothing with any slot goes to an empty slot when there is one: nothing of it is cached
anywhere loopd knows of, and an empty slot displaces nobody, so sessions spread over the
slots instead of crowding one. A slot is occupied once it served a request on its endpoint
(L{Sessions.remember_conversation}); one that never did is empty.

llama.cpp looks in its host-RAM prompt cache (C{--cache-ram}, 8 GiB by default) only when a
request lands on a slot that holds something, and moves what that slot held into the RAM
cache first. Measured on the C{xllamacpp} wheel's server (llama.cpp
b11549, 2 slots, the tiny model):

 - a session switched out of its slot (2,340-token prompt) and pinned to an empty slot
   re-evaluated all of it; pinned to an idle occupied slot it was restored from the RAM
   cache (2,309 cached). The issue measured the same on b11434 (2,325 against 2,307 of 2,323).
 - a new session sharing a 2,000-token system prompt with a conversation that only the RAM
   cache still held reused 2,004 tokens on an unrelated occupied slot, none on an empty one;
   the occupant it displaced came back with 2,708 of 2,739 tokens cached, as it would have
   without the newcomer.
 - with the RAM cache off (C{--cache-ram 0}) the same newcomer reused nothing on either slot,
   and the occupant it displaced came back with 1 of 2,739 tokens cached: there an empty slot
   would have been the better choice for a new session whose prefix no slot holds (on a
   slot whose own conversation shares the system prompt it reused 2,004 tokens, RAM cache
   or not). loopd cannot see the server's C{--cache-ram}; it sends a new session that shares
   a beginning with a slot's conversation to an occupied slot, and one that shares none to
   an empty slot, which costs that session nothing in either case.

Slots whose occupant holds a lease are never free (L{Upstreams}).

A limit: with a unified KV cache (C{--kv-unified}, llama-server's default when C{-np} is not
given), llama.cpp moves every idle slot to the RAM cache and clears it whenever a task
starts, so a slot the table calls occupied may be empty on the server: measured on the same
server, a session back on its own slot after another session ran on the other one
re-evaluated its whole prompt (cache_n 0 of 2,340), while any slot that still held something
would have restored it.

An anonymous request (no session id, DESIGN §3 decision 36) has no history of its own beyond
its connection; it goes to the free slot whose last conversation is a prefix of its messages,
when there is one (L{conversation_key}), since that slot's cache holds the turns it resends.

Pure: no reactor, no I/O. The table is bounded; the least recently recorded session goes first.
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loopd.llama.info import CacheOutcome, cache_outcome
from loopd.llama.types import Timings

__all__ = ["DEFAULT_MAX_SESSIONS", "Conversation", "Sessions", "conversation_key"]

#: How many sessions a table remembers unless told otherwise.
DEFAULT_MAX_SESSIONS = 1024

#: Slots never recorded are older than any recorded one.
_NEVER = -1


Conversation = tuple[int, ...]
"""A conversation as the table keeps it: one hash per message, in order (L{conversation_key})."""


def conversation_key(messages: Sequence[object]) -> Conversation:
    """
    C{messages} as the table compares them: one hash of each message's C{repr} (messages
    are frozen dataclasses, so equal messages have equal C{repr}s), in order. A slot's
    last conversation is a prefix of a request's when its key is a prefix of the request's.
    """
    return tuple(hash(repr(message)) for message in messages)


@dataclass(frozen=True)
class _Entry:
    """What the table knows about one session: its last slot and last completion's timings."""

    slot: int
    timings: Timings


class Sessions:
    """
    A bounded table of session id → the slot it used last and the timings of its last
    completion, evicting the least recently recorded session beyond C{max_sessions}.
    """

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        """
        @param max_sessions: how many sessions to remember, at least 1.
        """
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self._max = max_sessions
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # How many remembered sessions used each slot last.
        self._homes: Counter[int] = Counter()
        # When each slot last completed a request, in record() calls.
        self._slot_used: dict[int, int] = {}
        self._clock = itertools.count()
        self._anonymous: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()
        self._anonymous_serial = itertools.count(1)
        # The last conversation each endpoint's slot served: at most one per slot.
        self._conversations: dict[tuple[str, int], Conversation] = {}

    def __len__(self) -> int:
        """How many sessions the table remembers now."""
        return len(self._entries)

    def last_slot(self, session: str) -> int | None:
        """The slot C{session} used last, or C{None} for a session the table does not know."""
        entry = self._entries.get(session)
        return None if entry is None else entry.slot

    def choose_slot(
        self,
        session: str,
        n_slots: int,
        busy: Callable[[int], bool],
        prefix_of: tuple[str, Conversation] | None = None,
        *,
        endpoint: str | None = None,
        conversation: Conversation | None = None,
    ) -> int:
        """
        Pick the slot for C{session}'s next request. The table is not changed.

          1. The session's last slot, when it is not busy.
          2. With C{prefix_of} (an anonymous request): the free slot whose last
             conversation on that endpoint is the longest prefix of that conversation.
          3. Otherwise a free slot, preferring an occupied one to an empty one (module
             docstring), then the one whose last conversation shares the most leading
             messages with C{conversation}, then one that no other session used last, then
             the one least recently used, then the lowest. A new session whose first
             message begins no conversation of the endpoint's slots prefers an empty one
             instead: nothing of it is cached, and an empty slot displaces nobody.
          4. Every slot busy: the session's last slot (the request queues at the gate), or,
             for a new session, the slot fewest sessions call home.

        @param n_slots: how many slots the endpoint has, at least 1. A remembered slot
            outside C{range(n_slots)} is ignored.
        @param busy: whether a slot has a request in flight now.
        @param prefix_of: the endpoint and the request's conversation (L{conversation_key}),
            for rule 2.
        @param endpoint: the endpoint whose slots these are, for rule 3: its slots that never
            served a request (L{remember_conversation}) are empty. C{None}: no slot counts as
            occupied.
        @param conversation: the request's conversation (L{conversation_key}), for rule 3;
            C{None}: every new session counts as sharing a beginning.
        """
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        last = self.last_slot(session)
        if last is not None and not 0 <= last < n_slots:
            last = None
        if last is not None and not busy(last):
            return last
        free = [slot for slot in range(n_slots) if slot != last and not busy(slot)]
        if free and prefix_of is not None:
            matched = self._longest_prefix(*prefix_of, free)
            if matched is not None:
                return matched
        if free:
            held = {s: self._conversation(endpoint, s) for s in range(n_slots)}
            shared = {s: _shared(conversation, held[s]) for s in free}
            kin = any(_shared(conversation, c) for c in held.values())
            want_occupied = last is not None or conversation is None or kin
            return min(
                free,
                key=lambda s: (
                    endpoint is None or (held[s] is None) == want_occupied,
                    -shared[s],
                    self._homes[s] > 0,
                    self._age(s),
                    s,
                ),
            )
        if last is not None:
            return last
        return min(range(n_slots), key=lambda s: (self._homes[s], self._age(s), s))

    def record(
        self, session: str, slot: int, timings: Timings, threshold: int
    ) -> CacheOutcome | None:
        """
        Remember that C{session}'s latest completion ran on C{slot} with C{timings}.

        @param threshold: how many tokens short of the previous context is a cache loss
            (the config's C{cache_loss_tokens}).
        @return: the cache outcome against the session's previous completion, or C{None}
            when the table had none (a new session, or one evicted since).
        """
        previous = self._entries.pop(session, None)
        outcome = None
        if previous is not None:
            self._homes[previous.slot] -= 1
            outcome = cache_outcome(previous.timings, timings, threshold)
        self._entries[session] = _Entry(slot, timings)
        self._homes[slot] += 1
        self._slot_used[slot] = next(self._clock)
        while len(self._entries) > self._max:
            _, evicted = self._entries.popitem(last=False)
            self._homes[evicted.slot] -= 1
        return outcome

    def remember_conversation(self, endpoint: str, slot: int, conversation: Conversation) -> None:
        """
        C{endpoint}'s C{slot} served C{conversation} last (its cache holds it now): the slot
        is occupied from now on (L{choose_slot} rule 3).
        """
        self._conversations[(endpoint, slot)] = conversation

    def forget(self, session: str) -> None:
        """Drop C{session} from the table (a closed connection's anonymous session)."""
        entry = self._entries.pop(session, None)
        if entry is not None:
            self._homes[entry.slot] -= 1

    def anonymous_id(
        self, connection_key: object, on_new: Callable[[str], None] | None = None
    ) -> str:
        """
        A stable session id for a request without a session id: one anonymous session
        per connection.

        @param connection_key: the connection (for instance the request's channel). The
            same object always gets the same id and a later object never reuses an earlier
            one's id; a key that cannot be weakly referenced is identified by its value.
        @param on_new: told the id when this call made it (the connection's first
            anonymous request), so the caller can end the session with the connection.
        """
        try:
            known = self._anonymous.get(connection_key)
        except TypeError:
            return f"anonymous:{type(connection_key).__name__}:{connection_key!r}"
        if known is None:
            known = f"anonymous:{next(self._anonymous_serial)}"
            self._anonymous[connection_key] = known
            if on_new is not None:
                on_new(known)
        return known

    def _longest_prefix(
        self, endpoint: str, conversation: Conversation, free: Sequence[int]
    ) -> int | None:
        """The slot of C{free} whose last conversation is the longest prefix of C{conversation}."""
        best: tuple[int, int] | None = None
        for slot in free:
            last = self._conversations.get((endpoint, slot))
            if not last or conversation[: len(last)] != last:
                continue
            if best is None or len(last) > best[0]:
                best = (len(last), slot)
        return None if best is None else best[1]

    def _conversation(self, endpoint: str | None, slot: int) -> Conversation | None:
        """The last conversation of C{endpoint}'s C{slot}; C{None}: the slot is empty."""
        return None if endpoint is None else self._conversations.get((endpoint, slot))

    def _age(self, slot: int) -> int:
        """When C{slot} last completed a request; smaller is longer ago."""
        return self._slot_used.get(slot, _NEVER)


def _shared(one: Conversation | None, other: Conversation | None) -> int:
    """How many leading messages two conversations share (0 when either is unknown)."""
    if not one or not other:
        return 0
    count = 0
    for mine, theirs in zip(one, other, strict=False):
        if mine != theirs:
            break
        count += 1
    return count
