# -*- test-case-name: loopd.test.test_queue_client -*-
"""
A Twisted client of the lease daemon (the seed's "Client contract"), for any Twisted program.

Design:

 - B{One persistent connection}, made on the first op and again whenever an op needs it after
   it died. A connect that finds no daemon runs the optional C{spawn} once, then retries on
   reactor time (L{loopd.queue.client_connect}).
 - B{Reply matching.} C{granted} replies and keyed-beat C{ok} replies are matched by their
   C{queueKey}/C{sessionKey}; a C{granted} nobody waits for, or a beat reply for a beat this
   client did not send, is dropped, never kept for a later request. The replies the daemon
   gives in order (a bare C{ok} of C{release} or of the heartbeat, C{status}, C{error}) are
   matched first-in first-out; an C{ok} or C{status} with nothing waiting for it is dropped.
 - B{Beats on the lease's terms.} A held lease beats C{renew} with its keys every
   C{lease.terms.beat_period_ms()} (the terms of its C{granted} reply, never this client's
   copy of the config), unless paused. While any lease is held, one connection-wide bare
   C{renew} runs at L{heartbeat_period_ms} of the held leases' terms, so a paused lease keeps
   its TTL; its period is recomputed as leases come and go.
 - B{Losing a slot.} A keyed beat answered C{granted: false}, or a connection that dies under
   a held lease, means the slot is gone: the lease stops being held, the client re-queues it
   at once with the same role, group and activity flag, and then tells its lost observers
   (L{Lease.when_held} fires on the re-grant). A run that lost its slot never streams
   unqueued, unless the daemon is unreachable and the client fails open.
 - B{Fail-open.} When the daemon cannot be reached (after the spawn and its retries), or its
   connection dies while an C{acquire} waits, the waiter is released: with C{fail_open} it gets
   an unqueued lease (C{queued=False}), without it fails with L{QueueUnavailable}.
 - B{Queue-wait warning.} A parent's C{acquire} still waiting C{queue_timeout_ms} after it was
   made calls C{on_warning(message)} once and stays queued; a child's wait is never warned.
 - Every timer runs on the injected reactor, so C{task.Clock} drives them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from loopd.queue.client_connect import LeaseWire, spawn_daemon
from loopd.queue.client_lease import (
    ClientClosed,
    DuplicateLease,
    Lease,
    LeaseEnded,
    QueueError,
    QueueReplyError,
    QueueUnavailable,
)
from loopd.queue.client_link import DaemonLink
from loopd.queue.scheduler_types import Tier
from loopd.queue.terms import LeaseTerms, heartbeat_period_ms
from loopd.reactor import IUnixReactor

__all__ = [
    "FALLBACK_TERMS",
    "ClientClosed",
    "DuplicateLease",
    "Lease",
    "LeaseClient",
    "LeaseEnded",
    "QueueError",
    "QueueReplyError",
    "QueueUnavailable",
    "spawn_daemon",
]

_log = Logger(namespace="loopd.queue.client")

#: The client's copy of the config's lease terms when none is given (the seed's defaults).
FALLBACK_TERMS = LeaseTerms(30_000, 30_000)

_TIERS: tuple[Tier, ...] = ("parent", "child")


def _check_keys(queue_key: object, session_key: object) -> None:
    """
    Refuse keys the daemon would answer with an error (a keyless op must never reach it).
    """
    if not isinstance(queue_key, str) or not queue_key:
        raise ValueError(f"queue_key must be a non-empty string (got {queue_key!r})")
    if not isinstance(session_key, str):
        raise ValueError(f"session_key must be a string (got {session_key!r})")


def _reply_key(message: dict[str, Any]) -> tuple[str, str] | None:
    """
    Return a keyed reply's C{(queueKey, sessionKey)}, or C{None} if it names none.
    """
    queue_key, session_key = message.get("queueKey"), message.get("sessionKey")
    if isinstance(queue_key, str) and isinstance(session_key, str):
        return (queue_key, session_key)
    return None


class LeaseClient:
    """
    Leases from the daemon on one Unix socket, over one persistent connection.
    """

    def __init__(
        self,
        reactor: IUnixReactor,
        socket_path: str,
        *,
        fallback_terms: LeaseTerms = FALLBACK_TERMS,
        fail_open: bool = True,
        queue_timeout_ms: int | None = None,
        spawn: Callable[[], object] | None = None,
        on_warning: Callable[[str], None] | None = None,
        spawn_retry_ms: int = 100,
        spawn_wait_ms: int = 3_000,
    ) -> None:
        """
        @param reactor: provides C{IReactorUNIX} and C{IReactorTime}; every timer uses it.
        @param socket_path: the daemon's socket.
        @param fallback_terms: the terms of a lease whose daemon sent none, and of an
            unqueued lease; also the heartbeat's period when no lease is held.
        @param fail_open: whether an unreachable daemon lets acquires through unqueued.
        @param queue_timeout_ms: warn a parent acquire still waiting after this long.
        @param spawn: run once per connect attempt that found no daemon (see
            L{spawn_daemon}).
        @param on_warning: receives the queue-wait warning; by default it is logged.
        @param spawn_retry_ms: how often to retry the connect after a spawn.
        @param spawn_wait_ms: how long to keep retrying after a spawn.
        """
        self._reactor = reactor
        self._fallback = fallback_terms
        self._fail_open = fail_open
        self._queue_timeout_ms = queue_timeout_ms
        self._on_warning = on_warning
        self._link = DaemonLink(
            reactor,
            socket_path,
            spawn=spawn,
            spawn_retry_ms=spawn_retry_ms,
            spawn_wait_ms=spawn_wait_ms,
            on_keyed=self._on_keyed,
            on_lost=self._on_lost,
        )
        self._waiting: dict[tuple[str, str], Lease] = {}
        self._held: dict[tuple[str, str], Lease] = {}
        self._heartbeat: LoopingCall | None = None
        self._heartbeat_period = 0.0

    @property
    def connected(self) -> bool:
        """
        Whether the connection to the daemon is up now.
        """
        return self._link.wire is not None

    # -- public ops --------------------------------------------------------------------

    def acquire(
        self,
        queue_key: str,
        session_key: str,
        role: Tier = "parent",
        group: str | None = None,
        activity: bool = True,
    ) -> Deferred[Lease]:
        """
        Ask for a slot of C{queue_key} for C{session_key}.

        @return: a Deferred that fires with the held L{Lease} on its C{granted} reply (or
            with an unqueued one when the daemon is unreachable and the client fails open);
            it fails with L{QueueUnavailable} when it does not, L{DuplicateLease} when this
            client already waits for or holds those keys, and L{ClientClosed} after
            L{close}. Cancelling it sends C{cancel} and fails it with C{CancelledError}.
        @raise ValueError: an empty C{queue_key} or a role that is not a tier.
        """
        _check_keys(queue_key, session_key)
        if role not in _TIERS:
            raise ValueError(f"role must be 'parent' or 'child' (got {role!r})")
        if self._link.closed:
            return fail(ClientClosed("the lease client is closed"))
        key = (queue_key, session_key)
        if key in self._waiting or key in self._held:
            return fail(DuplicateLease(f"{session_key!r} already asked for {queue_key!r}"))
        lease = Lease(queue_key, session_key, role, group, activity, self._fallback)
        lease.beat_clock, lease.send_beat = self._reactor, self._beat
        acquired: Deferred[Lease] = Deferred(lambda d: self._acquire_cancelled(lease))
        lease.acquired = acquired
        self._waiting[key] = lease
        self._send_acquire(lease)
        return acquired

    def release(self, lease: Lease) -> Deferred[None]:
        """
        Return the lease's slot and stop its beats; fire on the daemon's C{ok}.

        Releasing an unqueued (fail-open) or ended lease is a no-op; releasing a lease that
        is still waiting (or re-queued) cancels its request instead.
        """
        if lease.ended or not lease.queued:
            lease.became_ended(None)
            return succeed(None)
        if self._waiting.get(lease.key) is lease:
            self._abandon(lease, Failure(CancelledError()), send_cancel=True)
            return succeed(None)
        wire = self._link.wire
        if self._held.get(lease.key) is not lease or wire is None:
            lease.became_ended(None)
            return succeed(None)
        self._drop_held(lease)
        lease.became_ended(None)
        answered: Deferred[None] = Deferred()
        self._link.expect("ok", answered)
        wire.send({"op": "release", "queueKey": lease.queue_key, "sessionKey": lease.session_key})
        return answered

    def cancel(self, queue_key: str, session_key: str) -> Deferred[None]:
        """
        Drop the session's queued request and release the slot it holds (the daemon's
        C{cancel}, which has no reply); this client's own lease for the keys ends, and its
        pending acquire fails with C{CancelledError}. Fires once sent.
        """
        _check_keys(queue_key, session_key)
        key = (queue_key, session_key)
        waiting, held = self._waiting.get(key), self._held.get(key)
        if waiting is not None:
            self._abandon(waiting, Failure(CancelledError()), send_cancel=False)
        if held is not None:
            self._drop_held(held)
            held.became_ended(None)
        return self._link.send({"op": "cancel", "queueKey": queue_key, "sessionKey": session_key})

    def role(self, session_key: str, role: Tier) -> Deferred[None]:
        """
        Re-tier the session's live waiters (the daemon's C{role}, no reply); this client's
        leases of the session ask with the new role from now on. Fires once sent.
        """
        if role not in _TIERS:
            raise ValueError(f"role must be 'parent' or 'child' (got {role!r})")
        for lease in [*self._waiting.values(), *self._held.values()]:
            if lease.session_key == session_key:
                lease.role = role
        return self._link.send({"op": "role", "sessionKey": session_key, "role": role})

    def status(self) -> Deferred[list[dict[str, Any]]]:
        """
        Return the C{queues} of the daemon's C{status} reply; fails with
        L{QueueUnavailable} when the daemon cannot be reached (there is no open way).
        """
        return self._link.request({"op": "status"}, "status")

    def close(self) -> Deferred[None]:
        """
        Say C{bye} (the daemon releases this connection's leases and drops its waiters at
        once), then close the connection; fire when it is closed. Every lease ends, pending
        acquires fail with L{ClientClosed}, and later ops fail with it too.
        """
        if not self._link.closed:
            closed = Failure(ClientClosed("the lease client is closed"))
            leases = [*self._waiting.values(), *self._held.values()]
            self._waiting.clear()
            self._held.clear()
            self._stop_heartbeat()
            for lease in leases:
                lease.became_ended(closed)
        return self._link.close()

    # -- replies and losses ------------------------------------------------------------

    def _on_keyed(self, wire: LeaseWire, message: dict[str, Any]) -> None:
        """
        Route a keyed reply (C{granted}, a keyed beat's C{ok}) by its keys.
        """
        if message.get("op") == "granted":
            self._granted(wire, message)
        else:
            self._beat_answered(message)

    def _on_lost(self, wire: LeaseWire, gone: QueueError) -> None:
        """
        The connection died: release the waiters it carried and re-queue its held leases
        (their slots went with it).
        """
        self._stop_heartbeat()
        for lease in [w for w in self._waiting.values() if w.sent_on is wire]:
            self._release_waiter(lease, Failure(gone))
        for lease in list(self._held.values()):
            self._lose(lease)

    def _granted(self, wire: LeaseWire, message: dict[str, Any]) -> None:
        """
        A C{granted} reply: hold the lease that asked with its keys on this connection.
        """
        key = _reply_key(message)
        lease = None if key is None else self._waiting.get(key)
        if lease is None or lease.sent_on is not wire:
            return
        del self._waiting[lease.key]
        lease.terms = LeaseTerms.from_wire(message, self._fallback)
        self._held[lease.key] = lease
        self._update_heartbeat()
        lease.became_held(queued=True)

    def _beat_answered(self, message: dict[str, Any]) -> None:
        """
        A keyed beat's C{ok}: C{granted: false} means the slot is gone, so re-queue.
        """
        key = _reply_key(message)
        lease = None if key is None else self._held.get(key) or self._waiting.get(key)
        if lease is None or lease.beats_in_flight == 0:
            return
        lease.beats_in_flight -= 1
        if message.get("granted") is False and self._held.get(lease.key) is lease:
            self._lose(lease)

    # -- lease bookkeeping -------------------------------------------------------------

    def _send_acquire(self, lease: Lease) -> None:
        """
        Send the waiting lease's C{acquire} (connecting first if needed) and arm its
        queue-wait warning.
        """
        if self._queue_timeout_ms is not None:
            lease.stop_warning()
            lease.warning = self._reactor.callLater(
                self._queue_timeout_ms / 1000.0, self._warn, lease
            )

        def write(wire: LeaseWire) -> None:
            """
            Connected: send the C{acquire}, unless the lease stopped waiting meanwhile, and note
            the connection it went out on (a reply on another one is not for it).
            """
            if self._waiting.get(lease.key) is not lease:
                return
            message: dict[str, object] = {
                "op": "acquire",
                "queueKey": lease.queue_key,
                "sessionKey": lease.session_key,
                "role": lease.role,
                "activity": lease.activity,
            }
            if lease.group is not None:
                message["group"] = lease.group
            lease.sent_on = wire
            wire.send(message)

        def unreachable(failure: Failure) -> None:
            """
            No connection to the daemon: a lease still waiting goes through unqueued or fails
            (L{_release_waiter}).
            """
            if self._waiting.get(lease.key) is lease:
                self._release_waiter(lease, failure)

        self._link.connection().addCallbacks(write, unreachable)

    def _release_waiter(self, lease: Lease, failure: Failure) -> None:
        """
        Let a waiter whose daemon is out of reach through unqueued, or fail it.
        """
        del self._waiting[lease.key]
        if self._fail_open:
            lease.became_held(queued=False)
        elif failure.check(QueueError):
            lease.became_ended(failure)
        else:
            lease.became_ended(Failure(QueueUnavailable(str(failure.value))))

    def _abandon(self, lease: Lease, failure: Failure, send_cancel: bool) -> None:
        """
        Stop waiting: forget the request, end the lease, and tell the daemon if it heard it.
        """
        del self._waiting[lease.key]
        lease.became_ended(failure)
        wire = self._link.wire
        if send_cancel and wire is not None and lease.sent_on is wire:
            wire.send(
                {"op": "cancel", "queueKey": lease.queue_key, "sessionKey": lease.session_key}
            )

    def _acquire_cancelled(self, lease: Lease) -> None:
        """
        The acquire's Deferred was cancelled (it then fails with C{CancelledError}).
        """
        lease.acquired = None
        if self._waiting.get(lease.key) is lease:
            self._abandon(lease, Failure(CancelledError()), send_cancel=True)

    def _drop_held(self, lease: Lease) -> None:
        """
        Stop counting a held lease (its beats stop with it).
        """
        del self._held[lease.key]
        lease.stop_beats()
        self._update_heartbeat()

    def _lose(self, lease: Lease) -> None:
        """
        A held lease's slot is gone: re-queue it, then tell its observers.
        """
        self._drop_held(lease)
        self._waiting[lease.key] = lease
        lease.became_lost()
        self._send_acquire(lease)
        lease.tell_lost()

    def _beat(self, lease: Lease) -> None:
        """
        Send one keyed activity beat for a held lease.
        """
        wire = self._link.wire
        if wire is None or self._held.get(lease.key) is not lease:
            return
        lease.beats_in_flight += 1
        wire.send({"op": "renew", "queueKey": lease.queue_key, "sessionKey": lease.session_key})

    def _warn(self, lease: Lease) -> None:
        """
        Warn, once, about a parent that is still waiting for its slot.
        """
        lease.warning = None
        if self._waiting.get(lease.key) is not lease or lease.role != "parent":
            return
        message = (
            f"session {lease.session_key!r} has waited over {self._queue_timeout_ms} ms "
            f"for a slot of {lease.queue_key!r}; it stays queued"
        )
        if self._on_warning is not None:
            self._on_warning(message)
        else:
            _log.warn("{message}", message=message)

    # -- the bare heartbeat --------------------------------------------------------------

    def _update_heartbeat(self) -> None:
        """
        Run one bare C{renew} at the smallest beat period of the held leases while any is
        held; restart it when that period changes.
        """
        if not self._held or self._link.wire is None:
            self._stop_heartbeat()
            return
        terms = [lease.terms for lease in self._held.values()]
        period = heartbeat_period_ms(terms, self._fallback) / 1000.0
        if self._heartbeat is not None and period == self._heartbeat_period:
            return
        self._stop_heartbeat()
        heartbeat = LoopingCall(self._heartbeat_tick)
        heartbeat.clock = self._reactor
        heartbeat.start(period, now=False)
        self._heartbeat, self._heartbeat_period = heartbeat, period

    def _stop_heartbeat(self) -> None:
        """
        Stop the bare heartbeat, if it runs.
        """
        if self._heartbeat is not None:
            if self._heartbeat.running:
                self._heartbeat.stop()
            self._heartbeat = None

    def _heartbeat_tick(self) -> None:
        """
        Send one bare C{renew}; its C{ok} is expected in order.
        """
        wire = self._link.wire
        if wire is not None:
            self._link.expect("ok", None)
            wire.send({"op": "renew"})
