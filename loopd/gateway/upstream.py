# -*- test-case-name: loopd.test.test_gateway_upstream -*-
"""
The one leased upstream call (DESIGN §3 decision 40): lease → slot → robust client call →
accounting → release or grace, cancellable as a whole. Plain requests, C{auto} and every
mesh worker and reducer call go through L{Upstreams.call}.

 1. B{Lease.} When the gateway leases (C{[queue] serve}), the call takes its session's lease
    on the endpoint's queue (L{GatewayLeases.acquire}), hearing how many wait ahead as a
    L{Queued} event. A lease not granted within C{limits.busy_wait_ms} is L{WaitTimeout}.
 2. B{Slot.} The session's slot on the endpoint: the one it used last when that is free,
    else (an anonymous request) the free one whose last conversation is a prefix of its
    messages, else a free occupied one before an empty one, then one nobody else calls home
    (L{Sessions.choose_slot}), and one that another conversation of the session calls home
    only when no other is free (a side conversation does not take its session's slot,
    decision 45); on a C{slot_save} endpoint the session the slot holds is saved
    to its file and the requesting session's file restored first (L{SlotSwap}); a slot is taken
    while a request runs on it and, under leases, while another session holding a lease on
    the endpoint calls it home, so that session's next turn finds its KV cache where it
    left it.
 3. B{Call.} The request's system messages after the first placed as the endpoint's
    template takes them (L{LateSystem}, which may ask the template once), then the
    endpoint's robust llama client (L{Client.chat_with_retry}: its slot gate,
    bounded waits and retries), the request pinned to the slot and carrying the session's
    id and tier (for an C{openai} endpoint's own affinity, decision 42; an anonymous
    session's id stays home); a streaming client's backpressure (a L{Flow}) pauses the
    upstream read while the client does not read.
 4. B{Accounting.} A completion's token counts go to the metrics, its speed to the C{auto}
    router, and its cache outcome against the session's previous completion on the endpoint
    (only for a request that continues its conversation: a side conversation's first
    request or a rewritten history is nobody's cache loss) to the session table, the
    metrics (a loss) and the log; under leases, all of it to the leases' switch costs,
    which price the grace (L{GatewayLeases.observe}).
 5. B{Give back.} The lease goes back when the call ends: with the grace (the session's next
    turn starts without a switch), or at once when the session said it ends or is gone (an
    anonymous session whose connection closed, L{Upstreams.end_session}), and at once after a
    refused connection (nothing of the session is cached where nothing answered). A session
    that says it ends gives back the leases of its other conversations too.

Whose call it is (L{CallKeys}) is one conversation of a session (DESIGN decision 45,
L{loopd.gateway.sessions}): the gateway asks L{Upstreams.conversation} before it routes a
request, and the call's lease, slot history and C{auto} home are that conversation's.

Cancelling the Deferred of L{Upstreams.call} withdraws the lease wait or aborts the request
(which makes llama-server stop generating) and gives the lease back.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace
from typing import Final

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from loopd.errors import Connect, ProxyRefused, WaitTimeout
from loopd.gateway.activity import Activity, CallRecord, RequestRecord
from loopd.gateway.health import EndpointUnavailableError, HealthBoard
from loopd.gateway.late_system import LateSystem
from loopd.gateway.leases import GatewayLeases, LeaseHold
from loopd.gateway.metrics import GatewayMetrics
from loopd.gateway.router import AutoRouter
from loopd.gateway.sessions import (
    DEFAULT_MAX_SESSIONS,
    Conversation,
    ConversationRef,
    Placed,
    Sessions,
    conversation_key,
)
from loopd.gateway.slot_swap import SlotSwap
from loopd.gateway.swap_gate import ModelSwaps, RouterStart
from loopd.llama import Client, Flow
from loopd.llama.retry import is_retryable
from loopd.llama.slot_files import SlotFile
from loopd.llama.types import (
    ChatEvent,
    ChatMessage,
    ChatRequest,
    Completion,
    Content,
    Queued,
    Reasoning,
    Retrying,
    ToolCallDelta,
    Waiting,
)
from loopd.queue.scheduler_types import Tier
from loopd.settings import Config

__all__ = ["CallKeys", "EventSink", "Upstreams"]

_log: Final = Logger(namespace="loopd.gateway")

EventSink = Callable[[ChatEvent], None]
"""Receives a call's events (queued, waiting, progress, deltas, retrying ...)."""


def _ignore(event: ChatEvent) -> None:
    """The events of a call nobody watches."""


@dataclass(frozen=True)
class CallKeys:
    """
    Whose call it is, for its lease and its slot.

    @ivar session: the key of the session's lease (its C{X-Session-Id} or anonymous id).
    @ivar tier: the lease's tier.
    @ivar ends: the session said this is its last request: no grace after it.
    @ivar slot_key: the key the session's slot history on this endpoint is kept under;
        the session's own key when C{None} (a mesh session keeps one per endpoint).
    @ivar anonymous: the request named no session (its connection's): its slot is chosen
        by the prefix of its conversation too (L{Sessions.choose_slot}).
    @ivar continues: the request continues its conversation's last request, so its cache
        outcome counts (L{ConversationRef.continues}); false for a new, side or rewritten
        conversation.
    """

    session: str
    tier: Tier = "parent"
    ends: bool = False
    slot_key: str | None = None
    anonymous: bool = False
    continues: bool = True

    @property
    def history(self) -> str:
        """The key of the slot history: C{slot_key}, else the session's."""
        return self.session if self.slot_key is None else self.slot_key


class Upstreams:
    """
    Every endpoint's way upstream for one gateway: its llama clients and the bookkeeping
    every call shares (the session table, the leases, the metrics, the router's speeds).
    """

    def __init__(
        self,
        reactor: IReactorTime,
        config: Config,
        clients: Mapping[str, Client],
        *,
        sessions: Sessions,
        metrics: GatewayMetrics,
        router: AutoRouter,
        leases: GatewayLeases | None = None,
        slot_counts: Mapping[str, int] | None = None,
        health: HealthBoard | None = None,
        routers: Mapping[str, RouterStart] | None = None,
        activity: Activity | None = None,
    ) -> None:
        """
        @param reactor: the clock of the lease wait and of the speed samples.
        @param config: the lease wait (C{limits.busy_wait_ms}) and the cache-loss threshold.
        @param clients: the llama client of each endpoint, by name.
        @param sessions: the session table (slots and cache outcomes).
        @param metrics: where completions and cache losses are counted.
        @param router: where each completion's speed is recorded.
        @param leases: the lease scheduler's gateway side; C{None}: no leases.
        @param slot_counts: each endpoint's number of slots (from its C{/props}); an
            endpoint not named uses its C{expect.total_slots}, else 1.
        @param health: the endpoints' health, fed by every call's outcome (L{call}).
        @param routers: the routers whose models the config's endpoints are, each with what
            loopd knew of it at start: their calls pass the swap gate (L{ModelSwaps}).
        @param activity: where a call made for a request's record tells its steps
            (L{loopd.gateway.activity}); one with no watchers when not given.
        """
        self.reactor = reactor
        self.activity = activity if activity is not None else Activity(reactor.seconds, time.time)
        self.health = health
        self.config = config
        self.clients: Mapping[str, Client] = dict(clients)
        self.sessions = sessions
        self.metrics = metrics
        self.router = router
        self.leases = leases
        self._slot_counts = dict(slot_counts or {})
        #: The slot files of C{slot_save} endpoints, kept for sessions the table still knows.
        self.slot_swap = SlotSwap(
            self.clients, lambda s: sessions.last_slot(s) is not None, config.cache_loss_tokens
        )
        #: The swap gates of the routers' models; None without routers.
        self.swaps: ModelSwaps | None = None
        if routers:
            self.swaps = ModelSwaps(
                reactor,
                routers,
                config.queue.grace_ms,
                self._swap_reprefill,
                self._before_evict,
            )
        #: Where each endpoint's template puts system messages after the first (decision 43).
        self.late_system = LateSystem(reactor, self.clients, config.limits.poll_ms)
        # The endpoint of each session's last completion, most recent last, bounded like the
        # session table: where the session's cache is, for auto (decision 34).
        self._homes: OrderedDict[str, str] = OrderedDict()
        # The calls waiting in a retry's backoff with nothing delivered yet, by endpoint:
        # they give up when the endpoint is confirmed down (L{_health_changed}).
        self._backing_off: dict[str, set[_LeasedCall]] = {}
        if health is not None:
            health.watch(self._health_changed)

    def _before_evict(self, endpoint: str) -> Deferred[None]:
        """
        C{endpoint}'s model is to be swapped out: save its slots (L{SlotSwap.save_residents}),
        then ask its router to unload it, so that the load that follows evicts this model
        and no other (the router's own choice is its least recently used). A failed unload
        is logged; the router then evicts as it would.
        """
        client = self.clients[endpoint]

        def unload(ignored: object) -> Deferred[None]:
            return client.unload_model().addErrback(failed)

        def failed(reason: Failure) -> None:
            _log.warn(
                "router model {endpoint}: unload failed: {why}",
                endpoint=endpoint,
                why=reason.getErrorMessage(),
            )

        return self.slot_swap.save_residents(endpoint).addCallback(unload)

    def _swap_reprefill(self, endpoint: str) -> float:
        """
        The seconds the sessions in their grace on C{endpoint} would spend evaluating their
        prompts again if its model were unloaded now; none with slot files (they are
        restored) or without leases (no session is known to be mid-task).
        """
        if self.leases is None or self.slot_swap.enabled(endpoint):
            return 0.0
        speed = self.leases.costs.costs(endpoint).prompt_tokens_per_second
        return sum(self.leases.graced_contexts(endpoint)) / speed

    def slot_count(self, endpoint: str) -> int:
        """How many slots endpoint C{endpoint} has."""
        if endpoint in self._slot_counts:
            return self._slot_counts[endpoint]
        expected = self.config.endpoint(endpoint).expect.total_slots
        return expected if expected else 1

    def home_of(self, session: str) -> str | None:
        """The endpoint that served C{session}'s last completion, if loopd remembers one."""
        return self._homes.get(session) if session else None

    def free_slots(self, endpoint: str, session: str = "") -> int:
        """
        How many of C{endpoint}'s slots are free for C{session} now: under leases, those no
        other session holds (running or in its grace; the session's own lease is its slot);
        else those with no request in flight at the gate.
        """
        if self.leases is not None:
            taken = len(self.leases.held_sessions(endpoint) - {session})
        else:
            gate = self.clients[endpoint].gate
            taken = sum(gate.in_flight(slot) for slot in range(self.slot_count(endpoint)))
        return max(0, self.slot_count(endpoint) - taken)

    def call(
        self,
        endpoint: str,
        request: ChatRequest,
        keys: CallKeys,
        *,
        on_event: EventSink = _ignore,
        retryable: Callable[[BaseException], bool] = is_retryable,
        flow: Flow | None = None,
        record: RequestRecord | None = None,
        role: str = "answer",
    ) -> Deferred[Completion]:
        """
        One leased call of C{request} (its C{slot} is chosen here) to C{endpoint}; see the
        module docstring for its steps.

        @param keys: whose call it is (lease and slot history).
        @param on_event: receives the call's events as they happen.
        @param retryable: which failures the client tries again (L{is_retryable} unless
            narrowed: a mesh call does not retry a refused connection, decision 29).
        @param flow: the backpressure of the consumer of the events (a streaming client):
            while it is paused the upstream answer is not read (L{Flow}).
        @param record: the record of the request the call is made for: the call adds its
            own (L{CallRecord}, as C{role}) and tells its steps to the gateway's activity.
        @return: fires with the completion; fails with the client's L{loopd.errors} kinds or
            L{WaitTimeout} for a lease wait that ran out; cancel it to abandon the call.

        With a health board, every failed attempt is told to the board as it happens (before
        C{retryable} judges it), so a failure that says the endpoint is down puts it down at
        once, while this call may still retry; a caller that can go elsewhere narrows
        C{retryable} not to retry such a failure (DESIGN decision 38). A completion tells the
        board that the endpoint answers.

        A call to a router's model first waits at its router's swap gate
        (L{loopd.gateway.swap_gate}) until a swap is worth it or its bound is reached.
        """
        settings = self.config.endpoint(endpoint)

        def tracked() -> tuple[RequestRecord, CallRecord] | None:
            # The call's record begins when it may go: a swap gate's wait is the request's.
            if record is None:
                return None
            return record, self.activity.call(record, endpoint, role, keys.session)

        if self.swaps is None or settings.router is None:
            return self._call_now(endpoint, request, keys, on_event, retryable, flow, tracked())
        swaps = self.swaps

        def go(key: Hashable) -> Deferred[Completion]:
            calling = self._call_now(endpoint, request, keys, on_event, retryable, flow, tracked())

            def ended(result: Completion | Failure) -> Completion | Failure:
                timings = result.timings if isinstance(result, Completion) else None
                swaps.done(settings, key, timings)
                return result

            return calling.addBoth(ended)

        return swaps.admit(settings, on_event).addCallback(go)

    def _call_now(
        self,
        endpoint: str,
        request: ChatRequest,
        keys: CallKeys,
        on_event: EventSink,
        retryable: Callable[[BaseException], bool],
        flow: Flow | None,
        tracked: tuple[RequestRecord, CallRecord] | None = None,
    ) -> Deferred[Completion]:
        """L{call} once its router (if any) lets it go: the leased call, told to the board."""
        if self.health is None:
            return _LeasedCall(
                self, endpoint, request, keys, on_event, retryable, flow, tracked
            ).start()
        telling = self._telling(endpoint, retryable)
        calling = _LeasedCall(
            self, endpoint, request, keys, on_event, telling, flow, tracked
        ).start()
        return calling.addCallbacks(
            self._answered, self._failed, callbackArgs=(endpoint,), errbackArgs=(endpoint,)
        )

    def backing_off(self, endpoint: str, call: _LeasedCall, waiting: bool) -> None:
        """
        C{call} to C{endpoint} waits in a retry's backoff with nothing delivered
        (C{waiting}), or no longer does. A call that starts waiting on an endpoint already
        confirmed down gives up at once.
        """
        calls = self._backing_off.setdefault(endpoint, set())
        if not waiting:
            calls.discard(call)
            if not calls:
                del self._backing_off[endpoint]
            return
        calls.add(call)
        if self.health is not None and self.health.confirmed_down(endpoint):
            self._give_up(endpoint)

    def _health_changed(self, endpoint: str) -> None:
        """The board changed C{endpoint}: confirmed down, its waiting calls give up."""
        assert self.health is not None
        if self.health.confirmed_down(endpoint) and endpoint in self._backing_off:
            self._give_up(endpoint)

    def _give_up(self, endpoint: str) -> None:
        """
        Every call waiting to retry on C{endpoint} ends now with the 503 of a down endpoint
        (DESIGN decision 38: a request naming it fails at once; C{auto} and groups fail over).
        """
        assert self.health is not None
        calls = self._backing_off.pop(endpoint, set())
        error = self.health.unavailable([endpoint], self.reactor.seconds())
        if calls:
            _log.warn(
                "endpoint {endpoint} is confirmed down: {count} request(s) waiting to retry "
                "on it give up",
                endpoint=endpoint,
                count=len(calls),
            )
        for call in calls:
            call.give_up(error)

    def _telling(
        self, endpoint: str, retryable: Callable[[BaseException], bool]
    ) -> Callable[[BaseException], bool]:
        """C{retryable}, telling the board about each failed attempt first."""

        def judged(error: BaseException) -> bool:
            self._note(endpoint, error)
            return retryable(error)

        return judged

    def _answered(self, completion: Completion, endpoint: str) -> Completion:
        """A call's completion: C{endpoint} answers."""
        assert self.health is not None
        self.health.request_answered(endpoint, self.reactor.seconds())
        return completion

    def _failed(self, reason: Failure, endpoint: str) -> Failure:
        """A call's failure (a lease wait's too): C{endpoint} is down when it says so."""
        if reason.value is not None:
            self._note(endpoint, reason.value)
        return reason

    def _note(self, endpoint: str, error: BaseException) -> None:
        """Tell the board that a call to C{endpoint} failed with C{error}; log a change."""
        assert self.health is not None
        if self.health.request_failed(endpoint, error, self.reactor.seconds()):
            _log.warn("endpoint {endpoint} is down: {error}", endpoint=endpoint, error=error)

    def end_session(self, session: str) -> None:
        """
        C{session} is gone (an anonymous session whose connection closed): its leases, and
        those of its other conversations, go back with no grace (L{GatewayLeases.end}) and
        the session table forgets it, so its slots are nobody's home (nor is any endpoint
        its home for C{auto}), and its slot files are deleted.
        """
        keys = {session, *self.sessions.conversations(session)}
        self.sessions.forget(session)
        for key in keys:
            self._homes.pop(key, None)
            self.slot_swap.forget(key)
            if self.leases is not None:
                self.leases.end(key)

    def hand_over(self, endpoint: str, keys: CallKeys, conversation: Conversation) -> None:
        """
        An anonymous request that continues the conversation that another anonymous
        session's slot of C{endpoint} holds, while that session idles in its grace, is the
        same agent on a new connection (an agent that sends no session id and does not reuse
        its connection: Qwen Code measured re-reading its whole 72,000-token prompt on the
        other slot within one turn). That session ends at once, its lease and slot with it,
        so the request takes the slot and reuses its cache instead of waiting out the grace
        or going to another slot.
        """
        if self.leases is None or not keys.anonymous:
            return
        gate = self.clients[endpoint].gate
        for holder in self.leases.held_sessions(endpoint):
            if holder == keys.session or not self.sessions.is_anonymous(holder):
                continue
            slot = self.sessions.last_slot(holder)
            if slot is None or gate.in_flight(slot):
                continue
            if self.sessions.continued_on(endpoint, slot, conversation):
                _log.info(
                    "anonymous session {new} continues {old}'s conversation on slot {slot}: "
                    "{old} ends, its slot goes to {new}",
                    new=keys.session,
                    old=holder,
                    slot=slot,
                )
                self.end_session(self.sessions.owner(holder))

    def conversation(
        self, session: str, conversation: Conversation, *, tools: bool = False
    ) -> ConversationRef:
        """
        The conversation of C{session} a request with C{conversation} (L{conversation_key}
        of its messages) belongs to (L{Sessions.conversation_of}, decision 45): its key is
        the request's lease, slot history and C{auto} home. A side conversation's start and
        a rewritten history are logged.

        @param tools: whether the request offers tools.
        """
        ref = self.sessions.conversation_of(session, conversation, tools=tools)
        if ref.placed is Placed.SIDE:
            _log.info(
                "session {session}: side conversation {key} (its messages continue none of "
                "the session's conversations and begin like none): placed as a new session",
                session=session,
                key=ref.key,
            )
        elif ref.placed is Placed.REWRITES:
            _log.info(
                "session {session}: conversation {key} rewritten (its first message as "
                "before, its history changed: a compaction or a rewind); not a cache loss",
                session=session,
                key=ref.key,
            )
        return ref

    def choose_slot(
        self, endpoint: str, keys: CallKeys, conversation: Conversation | None = None
    ) -> int:
        """
        The slot of C{endpoint} for the next request of C{keys}: L{Sessions.choose_slot}
        with the rule of step 2 (module docstring) for which slots are taken; an anonymous
        request's C{conversation} prefers the slot that served its beginning.
        """
        gate = self.clients[endpoint].gate
        reserved: set[int | None] = set()
        if self.leases is not None:
            holders = self.leases.held_sessions(endpoint)
            reserved = {self.sessions.last_slot(s) for s in holders if s != keys.session}
        prefix_of = None
        if keys.anonymous and conversation is not None:
            prefix_of = (endpoint, conversation)
        others = (self.sessions.last_slot(k) for k in self.sessions.siblings(keys.history))
        return self.sessions.choose_slot(
            keys.history,
            self.slot_count(endpoint),
            lambda s: s in reserved or gate.in_flight(s),
            prefix_of,
            endpoint=endpoint,
            conversation=conversation,
            avoid={slot for slot in others if slot is not None},
        )

    def account(
        self,
        endpoint: str,
        keys: CallKeys,
        slot: int,
        completion: Completion,
        conversation: Conversation | None = None,
    ) -> None:
        """
        Step 4 of the module docstring for a completion of C{endpoint} on C{slot}; the
        slot's last C{conversation}, when given, is remembered for anonymous requests.
        """
        timings = completion.timings
        if conversation is not None:
            self.sessions.remember_conversation(endpoint, slot, conversation)
        self.metrics.observe_completion(endpoint, timings)
        self.router.record(endpoint, timings.predicted_per_second, self.reactor.seconds())
        if keys.session:
            self._homes[keys.session] = endpoint
            self._homes.move_to_end(keys.session)
            while len(self._homes) > DEFAULT_MAX_SESSIONS:
                self._homes.popitem(last=False)
        outcome = self.sessions.record(
            keys.history, slot, timings, self.config.cache_loss_tokens, compare=keys.continues
        )
        if self.leases is not None:
            self.leases.observe(endpoint, keys.session, slot, keys.history, timings, outcome)
        if outcome is None:
            return
        if outcome.loss:
            self.metrics.observe_cache_loss(endpoint)
        emit, verdict = (_log.warn, "loss") if outcome.loss else (_log.info, "hit")
        emit(
            "cache " + verdict + " for session {session} on slot {slot}: reused {cached} of "
            "{expected} tokens",
            session=keys.history,
            slot=slot,
            cached=outcome.cached,
            expected=outcome.expected,
        )


class _LeasedCall:
    """One L{Upstreams.call}: the lease wait, then the client's call, then the give-back."""

    def __init__(
        self,
        upstreams: Upstreams,
        endpoint: str,
        request: ChatRequest,
        keys: CallKeys,
        on_event: EventSink,
        retryable: Callable[[BaseException], bool],
        flow: Flow | None,
        tracked: tuple[RequestRecord, CallRecord] | None = None,
    ) -> None:
        """
        See L{Upstreams.call} for the arguments; C{tracked} is the request's record and
        this call's, when the call is told to the activity.
        """
        self._up = upstreams
        self._tracked = tracked
        self._flow = flow
        self._endpoint = endpoint
        self._request = request
        self._keys = keys
        self._on_event = on_event
        self._retryable = retryable
        self._hold: LeaseHold | None = None
        self._step: (
            Deferred[LeaseHold]
            | Deferred[SlotFile | None]
            | Deferred[tuple[ChatMessage, ...]]
            | Deferred[Completion]
            | None
        )
        self._step = None
        self._slot = -1
        self._restored: SlotFile | None = None
        self._conversation = conversation_key(request.messages)
        self._result: Deferred[Completion] = Deferred(self._cancel)
        # Whether a piece of the answer reached on_event: a retry is then its resumption,
        # which a confirmed-down endpoint does not end (the server may be restarting).
        self._delivered = False
        self._backing_off = False
        self._given_up: EndpointUnavailableError | None = None

    def start(self) -> Deferred[Completion]:
        """
        Take the lease (when leasing; an anonymous request first takes over its own
        conversation from another connection, L{Upstreams.hand_over}), then L{_go}.
        """
        leases = self._up.leases
        if leases is None:
            self._go()
            return self._result
        self._up.hand_over(self._endpoint, self._keys, self._conversation)
        leasing = leases.acquire(
            self._endpoint,
            self._keys.session,
            self._keys.tier,
            on_queued=lambda ahead: self._on_event(Queued(ahead)),
        )
        wait_ms = self._up.config.limits.busy_wait_ms
        leasing.addTimeout(wait_ms / 1000.0, self._up.reactor, _lease_timeout(wait_ms))
        self._step = leasing
        leasing.addCallbacks(self._leased, self._failed)
        return self._result

    def _leased(self, hold: LeaseHold) -> None:
        """The lease is granted: go upstream."""
        self._step = None
        self._hold = hold
        if self._tracked is not None:
            self._up.activity.leased(self._tracked[1])
        self._go()

    def _go(self) -> None:
        """Choose the slot, save and restore slot files there (L{SlotSwap}), then L{_send}."""
        self._slot = self._up.choose_slot(self._endpoint, self._keys, self._conversation)
        preparing = self._up.slot_swap.prepare(self._endpoint, self._slot, self._keys.history)
        self._step = preparing
        preparing.addCallbacks(self._send, self._failed)

    def _send(self, restored: SlotFile | None) -> None:
        """Place the request's late system messages for the endpoint, then L{_call}."""
        self._restored = restored
        placing = self._up.late_system.placed(self._endpoint, self._request.messages)
        if not placing.called:
            self._step = placing
        placing.addCallbacks(self._call, self._failed)

    def _call(self, messages: tuple[ChatMessage, ...]) -> None:
        """Send the request upstream with C{messages}, pinned to the chosen slot."""
        client = self._up.clients[self._endpoint]
        keys = self._keys
        # An anonymous session's id names a connection, not a conversation: an engine's own
        # affinity (decision 42) is left to its prefix-aware routing for it.
        session = None if keys.anonymous or not keys.session else keys.session
        request = replace(
            self._request, messages=messages, slot=self._slot, session=session, tier=keys.tier
        )
        if self._tracked is not None:
            self._up.activity.sent(*self._tracked, self._slot)
        calling = client.chat_with_retry(request, self._event, self._retryable, flow=self._flow)
        self._step = calling
        calling.addCallbacks(self._completed, self._failed)

    def _event(self, event: ChatEvent) -> None:
        """
        One event of the client's call, handed on: a retry's wait with nothing delivered
        yet is one the endpoint's confirmed fall ends (L{Upstreams.backing_off}); the
        first piece of the answer, or the server's progress, ends that.
        """
        if isinstance(event, (Reasoning, Content, ToolCallDelta)):
            self._delivered = True
        if isinstance(event, Retrying):
            if self._tracked is not None:
                self._tracked[1].retries += 1
            if not self._delivered:
                self._waiting_to_retry(True)
        elif not isinstance(event, (Queued, Waiting)):
            self._waiting_to_retry(False)
        self._on_event(event)

    def _waiting_to_retry(self, waiting: bool) -> None:
        """Tell the upstreams when this call starts or stops waiting to retry."""
        if waiting != self._backing_off:
            self._backing_off = waiting
            self._up.backing_off(self._endpoint, self, waiting)

    def give_up(self, error: EndpointUnavailableError) -> None:
        """
        The endpoint is confirmed down while this call waits to retry: end it with
        C{error} (the wait, or the attempt that has just begun, is cancelled).
        """
        step = self._step
        if step is None or self._result.called:
            return
        self._given_up = error
        step.cancel()

    def _completed(self, completion: Completion) -> None:
        """The client answered: account for the answer, give the lease back, hand it on."""
        self._waiting_to_retry(False)
        self._step = None
        # The slot's file state first, then the accounts: the give-back may hand the slot on,
        # and the grace it starts is priced by this completion.
        self._up.slot_swap.settle(
            self._endpoint, self._slot, self._keys.history, self._restored, completion.timings
        )
        self._up.account(self._endpoint, self._keys, self._slot, completion, self._conversation)
        # Told before the give-back, which may hand the slot to a waiter at once.
        if self._tracked is not None:
            self._up.activity.call_completed(*self._tracked, completion)
        self._give_back(self._keys.ends)
        self._result.callback(completion)

    def _failed(self, reason: Failure) -> None:
        """The lease wait or the call failed: give the lease back, hand the failure on."""
        self._waiting_to_retry(False)
        self._step = None
        if self._given_up is not None:
            reason = Failure(self._given_up)
        # Nothing of the session is cached where nothing answered (no connection, or the
        # inferproxy refused it before the server saw it, or the server is gone): no grace.
        unanswered = reason.check(Connect, ProxyRefused, EndpointUnavailableError) is not None
        self._tell_ended(_why(reason))
        self._give_back(self._keys.ends or unanswered)
        if not self._result.called:
            self._result.errback(reason)

    def _cancel(self, result: Deferred[Completion]) -> None:
        """Withdraw the lease wait or abort the request; give the lease back."""
        self._waiting_to_retry(False)
        step, self._step = self._step, None
        if step is not None:
            step.cancel()
        self._tell_ended("cancelled")
        self._give_back(self._keys.ends)

    def _tell_ended(self, why: str) -> None:
        """Tell the activity the call ended without a completion (once)."""
        if self._tracked is not None and self._tracked[1].ended is None:
            self._up.activity.call_failed(*self._tracked, why)

    def _give_back(self, at_once: bool) -> None:
        """
        Give the lease back (once), at once or after the grace; a session that says it ends
        gives back its other conversations' leases too.
        """
        hold, self._hold = self._hold, None
        leases = self._up.leases
        if hold is None or leases is None:
            return
        leases.done(hold, at_once)
        if self._keys.ends:
            for key in self._up.sessions.siblings(self._keys.session):
                leases.end(key)


def _why(reason: Failure) -> str:
    """A failure's kind and message, for a call's record."""
    if reason.check(CancelledError):
        return "cancelled"
    return f"{type(reason.value).__name__}: {reason.getErrorMessage()}"


def _lease_timeout(wait_ms: int) -> Callable[[object, float], object]:
    """The C{onTimeoutCancel} of a lease wait: it ends as L{WaitTimeout}."""

    def timed_out(result: object, timeout: float) -> object:
        if isinstance(result, Failure) and result.check(CancelledError):
            return Failure(WaitTimeout(f"no lease on the endpoint's queue within {wait_ms} ms"))
        return result

    return timed_out
