# -*- test-case-name: loopd.test.test_gateway_slot_store -*-
"""
Where each session's KV cache is, for an endpoint whose server saves slots to files
(C{[[endpoint]] slot_save = true}, the server started with C{--slot-save-path}; DESIGN §3
decision 39): which session each slot holds, which sessions have a file, and so what to do
before a request runs on a slot (L{SlotStore.plan}).

 - B{Save on switch-away.} Before a session is pinned to a slot that holds another session's
   conversation (one the caller still wants kept, and that ran since it was last saved or
   restored), that slot is saved to the other session's file.
 - B{Restore on return.} When a session with a file comes to a slot that does not hold it,
   its file is restored into the slot before its request.
 - B{Verify.} The restore worked when the request then reused more than the cache-loss
   threshold (its C{cache_n}, L{restore_worked}); a restore that failed or did nothing leaves
   a plain request, and the file is not tried again until the session is saved anew.

A file's name is C{loopd-} and 32 hex digits of the SHA-256 of the endpoint's name and the
session's key (L{filename}): nothing a client sent reaches the server's file system, and
two sessions never share a file. One file per session and endpoint, overwritten at each
save.

B{Files are deleted once of no use} (a slot file holds the session's prompt): a restored
file (the slot holds it now, to be saved anew when the session is switched away again), a
file whose save or restore failed, the files of a session that is over (L{SlotStore.forget}),
and, beyond C{max_files} sessions or an endpoint's byte budget, the least recently saved
(a file over the budget alone is not kept). The methods that change the table return the
files to delete, as C{(endpoint, file name)}; L{loopd.gateway.slot_swap} deletes them
(L{loopd.gateway.slot_dir}).

Pure: no reactor, no I/O (L{loopd.gateway.slot_swap} does the requests).
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from loopd.gateway.sessions import DEFAULT_MAX_SESSIONS

__all__ = ["SlotPlan", "SlotStore", "filename", "restore_worked"]


def filename(endpoint: str, session: str) -> str:
    """The file of C{session}'s slot on C{endpoint}: C{loopd-<32 hex digits>.bin}."""
    digest = hashlib.sha256(f"{endpoint}\n{session}".encode()).hexdigest()
    return f"loopd-{digest[:32]}.bin"


def restore_worked(cache_n: int, threshold: int) -> bool:
    """
    Whether a restore did something: the request after it reused more than C{threshold}
    tokens (the config's C{cache_loss_tokens}).
    """
    return cache_n > threshold


@dataclass(frozen=True)
class SlotPlan:
    """
    What to do on a slot before a session's request runs there.

    @ivar save: the session whose conversation the slot holds, to be saved to C{save_file}
        first; C{None}: nothing to save.
    @ivar save_file: that session's file.
    @ivar restore_file: the requesting session's file, to be restored into the slot;
        C{None}: nothing to restore.
    """

    save: str | None = None
    save_file: str | None = None
    restore_file: str | None = None


@dataclass(frozen=True)
class _Resident:
    """Whose conversation a slot holds, and whether it ran since its file was written."""

    session: str
    dirty: bool


class SlotStore:
    """
    The table of one gateway: per endpoint, which session each slot holds (as far as
    loopd's own requests tell) and which sessions have a saved file, of what size.
    """

    def __init__(
        self, max_files: int = DEFAULT_MAX_SESSIONS, budgets: Mapping[str, int] | None = None
    ) -> None:
        """
        @param max_files: how many saved sessions to remember, at least 1.
        @param budgets: each endpoint's byte budget for its files; an endpoint not named
            has none.
        """
        if max_files < 1:
            raise ValueError(f"max_files must be >= 1, got {max_files}")
        self._max = max_files
        self._budgets = dict(budgets or {})
        self._residents: dict[tuple[str, int], _Resident] = {}
        self._files: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._bytes: Counter[str] = Counter()

    def resident(self, endpoint: str, slot: int) -> str | None:
        """The session whose conversation C{endpoint}'s C{slot} holds, if loopd knows one."""
        held = self._residents.get((endpoint, slot))
        return None if held is None else held.session

    def has_file(self, endpoint: str, session: str) -> bool:
        """Whether C{session} has a saved file on C{endpoint}."""
        return (endpoint, session) in self._files

    def kept_bytes(self, endpoint: str) -> int:
        """The bytes of C{endpoint}'s files in the table, as the server said it wrote them."""
        return self._bytes[endpoint]

    def kept_files(self, endpoint: str) -> int:
        """How many files of C{endpoint} the table holds."""
        return sum(1 for e, _ in self._files if e == endpoint)

    def plan(self, endpoint: str, slot: int, session: str, keep: Callable[[str], bool]) -> SlotPlan:
        """
        What to do on C{slot} before C{session}'s request runs there (module docstring).
        The table is not changed.

        @param keep: whether a session's conversation is still worth saving (a session
            the gateway still knows; not an anonymous one whose connection closed).
        """
        held = self._residents.get((endpoint, slot))
        save = None
        if held is not None and held.session != session and held.dirty and keep(held.session):
            save = held.session
        restore = None
        if (held is None or held.session != session) and self.has_file(endpoint, session):
            restore = filename(endpoint, session)
        return SlotPlan(save, None if save is None else filename(endpoint, save), restore)

    def saved(
        self, endpoint: str, slot: int, session: str, tokens: int, size: int = 0
    ) -> list[tuple[str, str]]:
        """
        C{session}'s conversation on C{slot} was saved to its file: C{tokens} of it, C{size}
        bytes. A save of nothing leaves the session without a file; either way the slot's
        conversation is not saved again until it runs again.

        @return: the files to delete: this one when it holds nothing, and those beyond
            the table's bounds (this one too, when it is over the budget alone).
        """
        held = self._residents.get((endpoint, slot))
        if held is not None and held.session == session:
            self._residents[(endpoint, slot)] = _Resident(session, dirty=False)
        self._drop(endpoint, session)
        if tokens <= 0:
            return [(endpoint, filename(endpoint, session))]
        self._files[(endpoint, session)] = size
        self._bytes[endpoint] += size
        return self._trim(endpoint)

    def save_failed(self, endpoint: str, session: str) -> list[tuple[str, str]]:
        """
        A save of C{session} failed: its file, if any, is not current; it is not restored.

        @return: the file to delete (whatever the server wrote of it).
        """
        self._drop(endpoint, session)
        return [(endpoint, filename(endpoint, session))]

    def restored(self, endpoint: str, slot: int, session: str) -> list[tuple[str, str]]:
        """
        C{session}'s file was loaded into C{slot}: the slot holds it, and the file is of no
        more use (the slot is saved anew when the session is switched away again).

        @return: the file to delete.
        """
        self._residents[(endpoint, slot)] = _Resident(session, dirty=True)
        self._drop(endpoint, session)
        return [(endpoint, filename(endpoint, session))]

    def restore_failed(self, endpoint: str, slot: int, session: str) -> list[tuple[str, str]]:
        """
        A restore of C{session} into C{slot} failed or did nothing: its file is not tried
        again until it is saved anew, and what the slot holds is no longer known.

        @return: the file to delete.
        """
        self._drop(endpoint, session)
        self._residents.pop((endpoint, slot), None)
        return [(endpoint, filename(endpoint, session))]

    def completed(self, endpoint: str, slot: int, session: str) -> None:
        """C{session}'s request ran on C{slot}: the slot holds its conversation, unsaved."""
        self._residents[(endpoint, slot)] = _Resident(session, dirty=True)

    def residents(self, endpoint: str) -> list[tuple[int, str, bool]]:
        """
        What each of C{endpoint}'s slots holds, as loopd knows it: C{(slot, session,
        dirty)}, C{dirty} when it ran since its file was last written.
        """
        return [
            (slot, held.session, held.dirty)
            for (e, slot), held in self._residents.items()
            if e == endpoint
        ]

    def emptied(self, endpoint: str) -> None:
        """
        Every slot of C{endpoint} lost what it held (its model was unloaded): sessions with
        a file are restored when they come back.
        """
        for key in [key for key in self._residents if key[0] == endpoint]:
            del self._residents[key]

    def forget(self, session: str) -> list[tuple[str, str]]:
        """
        C{session} is over: its files go, and no slot is saved for it any more.

        @return: the files to delete, as C{(endpoint, file name)}.
        """
        ended = [key for key in self._files if key[1] == session]
        for endpoint, _ in ended:
            self._drop(endpoint, session)
        for key, held in list(self._residents.items()):
            if held.session == session:
                self._residents[key] = _Resident(session, dirty=False)
        return [(endpoint, filename(endpoint, session)) for endpoint, _ in ended]

    def _drop(self, endpoint: str, session: str) -> None:
        """Take C{session}'s file on C{endpoint} out of the table, if it is there."""
        size = self._files.pop((endpoint, session), None)
        if size is not None:
            self._bytes[endpoint] -= size

    def _trim(self, endpoint: str) -> list[tuple[str, str]]:
        """
        The least recently saved files beyond C{max_files}, and C{endpoint}'s beyond its
        byte budget, out of the table; their endpoints and names.
        """
        doomed: list[tuple[str, str]] = []
        while len(self._files) > self._max:
            (other, session), _ = next(iter(self._files.items()))
            self._drop(other, session)
            doomed.append((other, filename(other, session)))
        budget = self._budgets.get(endpoint)
        if budget is not None:
            for other, session in list(self._files):
                if self._bytes[endpoint] <= budget:
                    break
                if other == endpoint:
                    self._drop(other, session)
                    doomed.append((other, filename(other, session)))
        return doomed
