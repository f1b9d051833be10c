# -*- test-case-name: loopd.test.test_gateway_slot_swap -*-
"""
The slot-file requests around a leased call on an endpoint with C{slot_save = true}
(DESIGN §3 decision 39): before the request, save the session the slot holds and restore the
requesting session's file (L{SlotSwap.prepare}, what L{SlotStore.plan} says); after it,
judge the restore by the answer's C{cache_n} (L{SlotSwap.settle}).

A save or restore that fails (an error status, no answer within the limits of
L{Client.restore_slot}, no connection) is logged and the request goes on as a plain one: the
server still has its own prompt cache, and the request is what matters. On an endpoint
without C{slot_save} nothing is asked and nothing is kept.

Every outcome is counted in L{SlotSwap.counts} (C{/metrics} shows them as
C{loopd_slot_files_total}): a save C{saved} or C{failed}; a restore C{worked} (the next
answer reused the file), C{did_nothing} (it loaded, the answer did not reuse it), C{empty}
(the server loaded no tokens) or C{failed}; a file deleted, by why: C{restored} (loaded
into its slot), C{failed} (its save or restore failed or did nothing), C{ended} (its
session is over: L{SlotSwap.forget}) or C{budget} (beyond the table's bounds). The files
are deleted in the endpoint's C{slot_dir} (L{loopd.gateway.slot_dir}) as the table
(L{loopd.gateway.slot_store}) says, and each saved file is made 0600 first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Final

from twisted.internet.defer import CancelledError, Deferred, gatherResults, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from loopd.gateway.slot_dir import SlotDirectory
from loopd.gateway.slot_store import SlotPlan, SlotStore, filename, restore_worked
from loopd.llama import Client
from loopd.llama.slot_files import SlotFile
from loopd.llama.types import Timings

__all__ = ["SlotSwap"]

_log: Final = Logger(namespace="loopd.gateway.slots")


class SlotSwap:
    """
    The slot files of every C{slot_save} endpoint of one gateway.

    @ivar counts: how many saves and restores ended how, by C{(endpoint, action, outcome)}
        (module docstring).
    """

    def __init__(
        self,
        clients: Mapping[str, Client],
        keep: Callable[[str], bool],
        threshold: int,
        store: SlotStore | None = None,
    ) -> None:
        """
        @param clients: each endpoint's llama client; those whose endpoint says
            C{slot_save} are used.
        @param keep: whether a session's conversation is still worth saving (the session
            table still knows it).
        @param threshold: the cache-loss threshold (C{cache_loss_tokens}): a restore
            worked when the next answer reused more than this.
        @param store: the table of slots and files; a new one, with each endpoint's
            C{slot_dir_bytes} as its budget, when not given.
        """
        self._clients = clients
        self._keep = keep
        self._threshold = threshold
        saving = [c.endpoint for c in clients.values() if c.endpoint.slot_save]
        budgets = {e.name: e.slot_dir_bytes for e in saving}
        self.store = store if store is not None else SlotStore(budgets=budgets)
        self._directories = {
            e.name: SlotDirectory(e.name, e.slot_dir) for e in saving if e.slot_dir is not None
        }
        self.counts: Counter[tuple[str, str, str]] = Counter()

    def enabled(self, endpoint: str) -> bool:
        """Whether C{endpoint} saves and restores slots."""
        client = self._clients.get(endpoint)
        return client is not None and client.endpoint.slot_save

    def prepare(self, endpoint: str, slot: int, session: str) -> Deferred[SlotFile | None]:
        """
        Make C{slot} ready for C{session}'s request: save the session it holds, then
        restore C{session}'s file (L{SlotStore.plan}).

        @return: fires with what the restore loaded, or C{None} when nothing was restored
            (nothing to restore, or it failed); it fails only with C{CancelledError} when
            cancelled. On an endpoint without C{slot_save}, fires at once with C{None}.
        """
        if not self.enabled(endpoint):
            return succeed(None)
        plan = self.store.plan(endpoint, slot, session, self._keep)
        client = self._clients[endpoint]
        saving: Deferred[None] = succeed(None)
        if plan.save is not None and plan.save_file is not None:
            saving = self._save(client, endpoint, slot, plan)
        restoring: Deferred[SlotFile | None] = saving.addCallback(
            self._restore, client, endpoint, slot, session, plan
        )
        return restoring

    def settle(
        self, endpoint: str, slot: int, session: str, restored: SlotFile | None, timings: Timings
    ) -> None:
        """
        C{session}'s request on C{slot} completed with C{timings}: the slot holds it now;
        a restore before it worked when C{cache_n} says so, else its file is dropped.
        """
        if not self.enabled(endpoint):
            return
        if restored is not None:
            if restore_worked(timings.cache_n, self._threshold):
                self.counts[endpoint, "restore", "worked"] += 1
                _log.info(
                    "slot restore worked for session {session} on {endpoint} slot {slot}: "
                    "restored {restored}, reused {cached} tokens",
                    session=session,
                    endpoint=endpoint,
                    slot=slot,
                    restored=restored.tokens,
                    cached=timings.cache_n,
                )
            else:
                self.counts[endpoint, "restore", "did_nothing"] += 1
                _log.warn(
                    "slot restore did nothing for session {session} on {endpoint} slot "
                    "{slot}: restored {restored}, reused {cached} tokens",
                    session=session,
                    endpoint=endpoint,
                    slot=slot,
                    restored=restored.tokens,
                    cached=timings.cache_n,
                )
                self._delete(self.store.restore_failed(endpoint, slot, session), "failed")
        self.store.completed(endpoint, slot, session)

    def save_residents(self, endpoint: str) -> Deferred[None]:
        """
        C{endpoint}'s model is about to be unloaded (a router's swap): save the
        conversation each of its slots holds (those run since their last save, of sessions
        still kept) to their files, then count its slots empty, so that each session is
        restored when it comes back. On an endpoint without C{slot_save} only the latter.
        Fires when every save ended (a failed one is logged and passed over).
        """
        if not self.enabled(endpoint):
            self.store.emptied(endpoint)
            return succeed(None)
        client = self._clients[endpoint]
        saves = [
            self._save(client, endpoint, slot, SlotPlan(session, filename(endpoint, session)))
            for slot, session, dirty in self.store.residents(endpoint)
            if dirty and self._keep(session)
        ]

        def emptied(ignored: object) -> None:
            self.store.emptied(endpoint)

        return gatherResults(saves).addCallback(emptied)

    def forget(self, session: str) -> None:
        """C{session} is over: its files are deleted on every endpoint (C{ended})."""
        self._delete(self.store.forget(session), "ended")

    def _delete(self, files: list[tuple[str, str]], why: str) -> None:
        """Delete C{files} (endpoint, name) in their endpoints' directories; count each."""
        for endpoint, name in files:
            directory = self._directories.get(endpoint)
            if directory is not None and directory.delete(name):
                self.counts[endpoint, "delete", why] += 1

    def _save(self, client: Client, endpoint: str, slot: int, plan: SlotPlan) -> Deferred[None]:
        """Save the session C{plan} names; a failure is logged and passed over."""
        assert plan.save is not None and plan.save_file is not None
        session = plan.save

        def saved(answer: SlotFile) -> None:
            directory = self._directories.get(endpoint)
            if directory is not None:
                directory.protect(filename(endpoint, session))
            over = self.store.saved(endpoint, slot, session, answer.tokens, answer.size)
            self.counts[endpoint, "save", "saved"] += 1
            self._delete(over, "budget" if answer.tokens > 0 else "failed")

        def failed(reason: Failure) -> Failure | None:
            if reason.check(CancelledError):
                return reason
            self._delete(self.store.save_failed(endpoint, session), "failed")
            self.counts[endpoint, "save", "failed"] += 1
            _log.warn(
                "slot save failed for session {session} on {endpoint} slot {slot}: {why}",
                session=session,
                endpoint=endpoint,
                slot=slot,
                why=reason.getErrorMessage(),
            )
            return None

        return client.save_slot(slot, plan.save_file).addCallbacks(saved, failed)

    def _restore(
        self,
        ignored: None,
        client: Client,
        endpoint: str,
        slot: int,
        session: str,
        plan: SlotPlan,
    ) -> Deferred[SlotFile | None]:
        """Restore C{session}'s file when C{plan} says so; a failure is logged, then C{None}."""
        if plan.restore_file is None:
            return succeed(None)

        def restored(answer: SlotFile) -> SlotFile | None:
            if answer.tokens == 0:
                self._delete(self.store.restore_failed(endpoint, slot, session), "failed")
                self.counts[endpoint, "restore", "empty"] += 1
                _log.warn(
                    "slot restore loaded nothing for session {session} on {endpoint} slot "
                    "{slot}, sending the request as it is",
                    session=session,
                    endpoint=endpoint,
                    slot=slot,
                )
                return None
            self._delete(self.store.restored(endpoint, slot, session), "restored")
            return answer

        def failed(reason: Failure) -> Failure | None:
            if reason.check(CancelledError):
                return reason
            self._delete(self.store.restore_failed(endpoint, slot, session), "failed")
            self.counts[endpoint, "restore", "failed"] += 1
            _log.warn(
                "slot restore failed for session {session} on {endpoint} slot {slot}, "
                "sending the request as it is: {why}",
                session=session,
                endpoint=endpoint,
                slot=slot,
                why=reason.getErrorMessage(),
            )
            return None

        restoring: Deferred[SlotFile | None] = client.restore_slot(
            slot, plan.restore_file
        ).addCallbacks(restored, failed)
        return restoring
