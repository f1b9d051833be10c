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

B{A session's conversations} (DESIGN §3 decision 45). One session id may carry several
conversations: an agent's title or summary request (OpenCode's C{small_model}, Claude Code's
Haiku calls: another system prompt, no tools), a sub-agent, a new task, what a compaction
leaves. The table remembers each session's L{MAX_CONVERSATIONS} most recent conversations,
each by its last request's messages (L{conversation_key}: one hash a message, an assistant
turn's thinking left out, since clients drop or re-render it), kept as their count and one
chained hash, and by its beginning, as its first request had it: the first message (the
agent's system prompt) and whether it offers tools (an agent's title or background request
offers none). The table records a request's messages, not the answer: the client sends the
answer back as the next request's message, so the next turn of a conversation begins with
all of this request's messages. A request (L{Sessions.conversation_of}):

 1. B{continues} a conversation when its messages begin with all of that conversation's last
    request's messages (the same messages again, a retry, continue it too; the longest such
    conversation wins). It keeps that conversation's key: its slot, its lease and its C{auto}
    home, and its cache outcome is that conversation's.
 2. B{rewrites} a conversation when it continues none but has the same beginning as one (the
    most recent such): the same agent with its history rewritten, by a compaction, a rewind, an
    edit or a client trimming its context. It keeps that conversation's key, since that slot
    holds the shared beginning (with an agent's system prompt and tools, often tens of thousands
    of tokens), but its cache outcome is not counted: the server reuses only the shared part, as
    it should. The history it departed from is kept without a key: a request that continues that
    one after all was a parallel conversation of the same agent (two sub-agents of one kind),
    not a compaction, and becomes a side conversation of its own.
 3. Otherwise it is a B{side conversation}: a new key, C{<session> side:<n>}, and so its own
    lease (of the session's tier) and slot history. It is placed like a new session: rule 3
    of L{Sessions.choose_slot}, and for C{auto} or a group a free slot first, then the
    speed-weighted draw. It does not take the slot of another conversation of its session
    while another slot is free (the C{avoid} slots of L{Sessions.choose_slot}), and under
    leases that slot is the other conversation's while its lease is held; its first
    completion is compared with nothing, so it is nobody's cache loss, and its grace holds
    its own slot. Its completion is remembered as its slot's conversation, so the next
    request that begins the same way (the next title) finds it. Its own later turns continue
    it (rule 1).

The session's first conversation has the session's id as its key, so a session that sends
no side conversation is keyed as it always was. After a compaction, the conversation that
follows rewrites the one it summarised (rule 2) and its later turns continue it (rule 1).
Memory is bounded: at most L{MAX_CONVERSATIONS} conversations per session, each four
numbers, for as many sessions as the table holds.

The beginning tells a title apart from a compaction when an agent sends both with the main
system prompt: the title offers no tools. A summary request that extends the main
conversation's messages (with the tools or without them) continues the main conversation
and leaves its beginning as it was, so the compacted history that follows, with the tools,
still rewrites it.

Pure: no reactor, no I/O. The table is bounded; the least recently recorded session goes first.
"""

from __future__ import annotations

import enum
import itertools
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Final

from loopd.llama.info import CacheOutcome, cache_outcome
from loopd.llama.types import Assistant, Timings

__all__ = [
    "ANONYMOUS_PREFIX",
    "DEFAULT_MAX_SESSIONS",
    "MAX_CONVERSATIONS",
    "Conversation",
    "ConversationRef",
    "Placed",
    "Sessions",
    "conversation_key",
]

#: How every anonymous session's id starts (L{Sessions.anonymous_id}).
ANONYMOUS_PREFIX = "anonymous:"
#: How many sessions a table remembers unless told otherwise.
DEFAULT_MAX_SESSIONS = 1024

#: How many recent conversations a session's record keeps (module docstring).
MAX_CONVERSATIONS: Final = 8

#: Slots never recorded are older than any recorded one.
_NEVER = -1


Conversation = tuple[int, ...]
"""A conversation as the table keeps it: one hash per message, in order (L{conversation_key})."""


def conversation_key(messages: Sequence[object]) -> Conversation:
    """
    C{messages} as the table compares them: one hash of each message, in order, from its
    kind and fields (messages are frozen dataclasses, so equal messages hash alike; a user
    turn with media parts, whose dicts do not hash, by its C{repr}), an assistant turn's
    thinking left out (a client may drop or re-render an earlier turn's thinking, and chat
    templates mostly leave it out of the prompt). A slot's last conversation is a prefix of a
    request's when its key is a prefix of the request's.

    Python keeps a string's hash once computed, so the key of a request's messages costs
    its text's length once (0.4 ms a MB of text measured), and little more when asked again.
    """
    return tuple(_message_hash(message) for message in messages)


def _message_hash(message: object) -> int:
    """One message's hash for L{conversation_key}."""
    if isinstance(message, Assistant):
        return hash((Assistant, message.content, message.tool_calls))
    try:
        return hash((type(message), message))
    except TypeError:
        return hash(repr(message))


class Placed(enum.Enum):
    """How a request stands to its session's conversations (module docstring)."""

    NEW = "the session's first conversation the table knows of"
    CONTINUES = "it continues one of the session's conversations"
    REWRITES = "it rewrites one of the session's conversations (same beginning)"
    SIDE = "a side conversation: it continues none and begins like none"


@dataclass(frozen=True)
class ConversationRef:
    """
    The conversation of its session a request belongs to (L{Sessions.conversation_of}).

    @ivar key: the key its lease, its slot history and its C{auto} home are kept under: the
        session's id for the session's first conversation, C{<id> side:<n>} for the others.
    @ivar placed: how the request stands to that conversation.
    """

    key: str
    placed: Placed

    @property
    def continues(self) -> bool:
        """Whether its cache outcome counts: it extends its conversation's last request."""
        return self.placed is Placed.CONTINUES

    @property
    def side(self) -> bool:
        """Whether it starts a side conversation: placed like a new session."""
        return self.placed is Placed.SIDE


@dataclass(frozen=True)
class _History:
    """
    One remembered conversation of a session: its last request's messages, as their count
    and chained hash (L{_chains}), and its beginning (L{_beginning}).

    @ivar key: its key; C{None} for a history a rewrite departed from (module docstring).
    """

    key: str | None
    length: int
    chain: int
    beginning: int


def _beginning(conversation: Conversation, tools: bool) -> int:
    """What an agent's requests begin with: the first message, and whether tools are offered."""
    return hash((conversation[0], tools))


def _chains(conversation: Conversation) -> list[int]:
    """The chained hash of each prefix of C{conversation}: C{[0]} is the empty one's."""
    chains = [0]
    for message in conversation:
        chains.append(hash((chains[-1], message)))
    return chains


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
        # Each session's recent conversations, most recent first; the session that placed a
        # request longest ago first.
        self._histories: OrderedDict[str, list[_History]] = OrderedDict()
        # The session each remembered conversation's key belongs to.
        self._owners: dict[str, str] = {}
        self._side_serial = itertools.count(1)

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
        avoid: Collection[int] = (),
    ) -> int:
        """
        Pick the slot for C{session}'s next request. The table is not changed.

          1. The session's last slot, when it is not busy.

        Then, among the free slots (those of C{avoid} only when no other is free):

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
        @param avoid: slots taken only when no other slot is free: those of the other
            conversations of the request's session (module docstring, rule 3), so that a
            side conversation does not take its session's slot (decision 45 comes before
            decision 39's occupied-before-empty here).
        """
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        last = self.last_slot(session)
        if last is not None and not 0 <= last < n_slots:
            last = None
        if last is not None and not busy(last):
            return last
        free = [slot for slot in range(n_slots) if slot != last and not busy(slot)]
        free = [slot for slot in free if slot not in avoid] or free
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
        self, session: str, slot: int, timings: Timings, threshold: int, *, compare: bool = True
    ) -> CacheOutcome | None:
        """
        Remember that C{session}'s latest completion ran on C{slot} with C{timings}.

        @param threshold: how many tokens short of the previous context is a cache loss
            (the config's C{cache_loss_tokens}).
        @param compare: whether the completion continued the previous one's conversation,
            so that its cache outcome means something (L{ConversationRef.continues}).
        @return: the cache outcome against the session's previous completion, or C{None}
            when the table had none (a new session, or one evicted since) or C{compare} is
            false.
        """
        previous = self._entries.pop(session, None)
        outcome = None
        if previous is not None:
            self._homes[previous.slot] -= 1
            if compare:
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
        """
        Drop C{session} from the table (a closed connection's anonymous session), with
        every conversation of it (L{conversations}).
        """
        histories = self._histories.pop(session, [])
        for key in {session, *(h.key for h in histories if h.key is not None)}:
            self._owners.pop(key, None)
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._homes[entry.slot] -= 1

    def conversation_of(
        self, session: str, conversation: Conversation, *, tools: bool = False
    ) -> ConversationRef:
        """
        Which conversation of C{session} a request belongs to, by the rules of the module
        docstring, and remember the request as that conversation's last.

        @param conversation: the request's messages (L{conversation_key}).
        @param tools: whether the request offers tools (part of its beginning).
        @return: its conversation's key, and how the request stands to it. A request
            without messages is its session's, and nothing is remembered of it.
        """
        if not conversation:
            return ConversationRef(session, Placed.NEW)
        chains = _chains(conversation)
        beginning = _beginning(conversation, tools)
        histories = self._histories.pop(session, [])
        self._histories[session] = histories
        extended = [
            h for h in histories if h.length <= len(conversation) and chains[h.length] == h.chain
        ]
        kin = [h for h in histories if h.key is not None and h.beginning == beginning]
        if extended:
            found = max(extended, key=lambda h: h.length)
            histories.remove(found)
            if found.key is not None:
                # A turn without the tools (a fork that summarises) leaves its beginning.
                beginning = found.beginning
                ref = ConversationRef(found.key, Placed.CONTINUES)
            else:
                ref = ConversationRef(self._side_key(session), Placed.SIDE)
        elif kin and kin[0].key is not None:
            # Kept without a key: continued later, it was a parallel conversation.
            histories[histories.index(kin[0])] = replace(kin[0], key=None)
            ref = ConversationRef(kin[0].key, Placed.REWRITES)
        elif not histories:
            ref = ConversationRef(session, Placed.NEW)
        else:
            ref = ConversationRef(self._side_key(session), Placed.SIDE)
        histories.insert(0, _History(ref.key, len(conversation), chains[-1], beginning))
        for gone in histories[MAX_CONVERSATIONS:]:
            if gone.key is not None:
                self._owners.pop(gone.key, None)
        del histories[MAX_CONVERSATIONS:]
        self._owners[ref.key] = session
        while len(self._histories) > self._max:
            _, evicted = self._histories.popitem(last=False)
            for history in evicted:
                if history.key is not None:
                    self._owners.pop(history.key, None)
        return ref

    def conversations(self, session: str) -> tuple[str, ...]:
        """The keys of C{session}'s remembered conversations, the most recent first."""
        return tuple(h.key for h in self._histories.get(session, ()) if h.key is not None)

    def siblings(self, key: str) -> tuple[str, ...]:
        """
        The keys of the other remembered conversations of the session whose conversation
        C{key} is (none for a key the table does not know as a conversation's).
        """
        owner = self._owners.get(key)
        if owner is None:
            return ()
        return tuple(k for k in self.conversations(owner) if k != key)

    def owner(self, key: str) -> str:
        """The session whose conversation C{key} is; C{key} itself for a session's own key."""
        return self._owners.get(key, key)

    def is_anonymous(self, key: str) -> bool:
        """Whether C{key} is an anonymous session's, or one of its conversations'."""
        return self.owner(key).startswith(ANONYMOUS_PREFIX)

    def continued_on(self, endpoint: str, slot: int, conversation: Conversation) -> bool:
        """
        Whether C{conversation} goes on from what C{endpoint}'s C{slot} served last: it
        begins with all of it and has more (the same messages again may be another client
        that sends the same request).
        """
        last = self._conversations.get((endpoint, slot))
        if not last or len(conversation) <= len(last):
            return False
        return conversation[: len(last)] == last

    def _side_key(self, session: str) -> str:
        """A new side conversation's key: unique, and naming its session."""
        return f"{session} side:{next(self._side_serial)}"

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
            return f"{ANONYMOUS_PREFIX}{type(connection_key).__name__}:{connection_key!r}"
        if known is None:
            known = f"{ANONYMOUS_PREFIX}{next(self._anonymous_serial)}"
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
