# -*- test-case-name: loopd.test.test_queue_watch -*-
"""
Watching llm-queue.json for edits, kept alive (seed, "Hot-reload").

The watch is on the file's I{directory}, filtered on the file's name, so an atomic save (write
a temporary file, rename it over the config) is seen like an edit in place. A burst of changes
calls C{on_change} once, C{debounce} seconds after the last of them.

A watch can fail (the directory is missing, inotify refuses) or die without a word (the
directory is renamed away: inotify then watches the renamed directory, or nothing). Every
C{rearm} seconds a tick looks at the watch: a failed one is tried again, and a dead one — an
C{IN_IGNORED}, C{IN_DELETE_SELF} or C{IN_MOVE_SELF} was seen, or the directory at the path is
no longer the one watched, by C{(st_dev, st_ino)} — is replaced. Either way C{on_change} is
called once afterwards, since edits may have been missed while nothing watched.

Where inotify is unavailable the tick polls the file's C{(st_ino, st_mtime_ns, st_size)}
instead. The notifier is injected, so the decisions are tested on C{task.Clock} without
inotify.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

from twisted.internet.interfaces import IDelayedCall, IReactorFDSet, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.filepath import FilePath

__all__ = [
    "FILE_EVENTS",
    "SELF_EVENTS",
    "WATCH_MASK",
    "ConfigWatcher",
    "EventCallback",
    "INotifyNotifier",
    "Notifier",
    "NotifierFactory",
    "NotifierUnavailableError",
]

_log = Logger()

# inotify(7) event bits. They are the kernel's ABI, repeated here so that deciding what an
# event means needs no inotify module.
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_UNMOUNT = 0x00002000
IN_IGNORED = 0x00008000

#: Events on a directory entry that may have changed the config file.
FILE_EVENTS = IN_CLOSE_WRITE | IN_MOVED_TO | IN_MOVED_FROM | IN_CREATE | IN_DELETE | IN_ATTRIB
#: Events on the watched directory itself after which the watch no longer sees the path.
SELF_EVENTS = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED | IN_UNMOUNT
#: The mask a directory is watched with (IN_IGNORED and IN_UNMOUNT always arrive).
WATCH_MASK = FILE_EVENTS | IN_DELETE_SELF | IN_MOVE_SELF

_SELF_NAMES = (
    (IN_DELETE_SELF, "directory deleted"),
    (IN_MOVE_SELF, "directory moved"),
    (IN_UNMOUNT, "filesystem unmounted"),
    (IN_IGNORED, "watch removed"),
)

EventCallback = Callable[[str | None, int], None]
"""Receives an event: the entry's name (C{None} for the directory itself) and the mask."""


class NotifierUnavailableError(Exception):
    """
    Filesystem notification cannot be used on this system: poll instead.
    """


class Notifier(Protocol):
    """
    One filesystem notifier holding one directory watch; L{INotifyNotifier} in production.
    """

    def watch(self, directory: str, mask: int, callback: EventCallback) -> None:
        """
        Watch C{directory} for the events in C{mask}, reporting each to C{callback}.

        @raise Exception: the watch could not be set (the directory is missing, ...).
        """

    def close(self) -> None:
        """
        Stop watching and release the notifier; safe to call more than once.
        """


NotifierFactory = Callable[[], Notifier]
"""Returns a fresh notifier, or raises L{NotifierUnavailableError}."""


class INotifyNotifier:
    """
    A L{Notifier} over Twisted's C{INotify}: one inotify descriptor read by the reactor.
    """

    def __init__(self, reactor: IReactorFDSet) -> None:
        """
        Open an inotify descriptor and start reading it on C{reactor}.

        @raise NotifierUnavailableError: inotify does not exist here or cannot be opened.
        """
        try:
            from twisted.internet import inotify
        except ImportError as e:
            raise NotifierUnavailableError(f"inotify is not available: {e}") from None
        try:
            self._inotify = inotify.INotify(reactor)
        except (inotify.INotifyError, OSError) as e:
            raise NotifierUnavailableError(f"inotify cannot be opened: {e}") from None
        self._inotify.startReading()

    def watch(self, directory: str, mask: int, callback: EventCallback) -> None:
        """
        Watch C{directory}; events name the entry they concern, or C{None} for the
        directory itself.
        """
        watched = FilePath(directory)
        own = watched.asBytesMode().path

        def relay(ignored: object, path: FilePath[bytes], events: int) -> None:
            """
            Pass an inotify event on as C{callback(name, events)}, C{name} being C{None} for the
            directory itself.
            """
            callback(None if path.path == own else os.fsdecode(path.basename()), events)

        self._inotify.watch(watched, mask=mask, callbacks=[relay])

    def close(self) -> None:
        """
        Close the inotify descriptor, unless Twisted already did (it does after an
        C{IN_DELETE_SELF}).
        """
        if self._inotify.connected and not self._inotify.disconnecting:
            self._inotify.loseConnection()


def _identity(directory: str) -> tuple[int, int]:
    """
    Return the C{(st_dev, st_ino)} of C{directory}; raise C{OSError} when it is missing.
    """
    info = os.stat(directory)
    return info.st_dev, info.st_ino


def _signature(path: str) -> tuple[int, int, int] | None:
    """
    Return what polling compares of C{path}, C{(st_ino, st_mtime_ns, st_size)}, or C{None}
    when it cannot be read.
    """
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_size


def _self_reason(mask: int) -> str:
    """
    Name the event on the watched directory that ended the watch.
    """
    return next((name for bit, name in _SELF_NAMES if mask & bit), "watch ended")


class ConfigWatcher:
    """
    Calls C{on_change()} after the file at C{path} changes, through atomic saves and
    directory replacements. L{start} begins watching; L{stop} ends it.

    @ivar mode: C{"inotify"}, or C{"polling"} once notification proved unavailable.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        path: str,
        on_change: Callable[[], None],
        debounce: float = 0.25,
        rearm: float = 1.0,
        notifier_factory: NotifierFactory | None = None,
    ) -> None:
        """
        @param reactor: runs the debounce timer and the re-arm tick; without a
            C{notifier_factory} it also reads inotify, so it must provide C{IReactorFDSet}.
        @param path: the file to watch.
        @param on_change: called once per burst of changes.
        @param debounce: seconds from the last change of a burst to C{on_change}.
        @param rearm: seconds between checks of the watch (and polls, when polling).
        @param notifier_factory: makes a notifier per watch; inotify when C{None}.
        """
        self._reactor = reactor
        self.path = os.path.abspath(path)
        self._directory, self._name = os.path.split(self.path)
        self._on_change = on_change
        self._debounce = debounce
        self._rearm = rearm
        self._factory: NotifierFactory = notifier_factory or (
            lambda: INotifyNotifier(IReactorFDSet(reactor))
        )
        self._tick = LoopingCall(self._check)
        self._tick.clock = reactor
        self.mode = "inotify"
        self._notifier: Notifier | None = None
        self._identity: tuple[int, int] | None = None
        self._died: str | None = None
        self._reported: str | None = None
        self._signature: tuple[int, int, int] | None = None
        self._pending: IDelayedCall | None = None

    @property
    def armed(self) -> bool:
        """
        Whether a notifier watches the directory now (never while polling).
        """
        return self._notifier is not None

    def start(self) -> None:
        """
        Watch the directory now (a failure is retried on the tick) and start the tick.
        """
        self._arm(initial=True)
        self._tick.start(self._rearm, now=False)

    def stop(self) -> None:
        """
        Stop the tick, drop a pending C{on_change} and close the watch.
        """
        if self._tick.running:
            self._tick.stop()
        if self._pending is not None and self._pending.active():
            self._pending.cancel()
        self._pending = None
        self._close()

    # -- changes -----------------------------------------------------------------------

    def _event(self, notifier: Notifier, name: str | None, mask: int) -> None:
        """
        Handle one notification of C{notifier}: a change of the file starts or extends
        the debounce; the end of the directory's watch marks it dead for the next tick.
        """
        if notifier is not self._notifier:
            return
        if name is None:
            if mask & SELF_EVENTS:
                self._died = _self_reason(mask)
            return
        if name == self._name and mask & FILE_EVENTS:
            self._schedule()

    def _schedule(self) -> None:
        """
        Call C{on_change} C{debounce} seconds from now, moving a pending call there.
        """
        if self._pending is not None and self._pending.active():
            self._pending.reset(self._debounce)
        else:
            self._pending = self._reactor.callLater(self._debounce, self._fire)

    def _fire(self) -> None:
        """
        The end of a burst: tell the owner.
        """
        self._pending = None
        self._on_change()

    # -- the watch's life ---------------------------------------------------------------

    def _check(self) -> None:
        """
        The re-arm tick: poll when polling, re-arm a failed watch, replace a dead one.
        """
        if self.mode == "polling":
            signature = _signature(self.path)
            if signature != self._signature:
                self._signature = signature
                self._schedule()
            return
        if self._notifier is None:
            if self._arm(initial=False):
                _log.info("llmqueue: watching {directory} again", directory=self._directory)
                self._schedule()
            return
        reason = self._died or self._replaced()
        if reason is not None:
            _log.warn(
                "llmqueue: the watch on {directory} died ({reason}); re-arming",
                directory=self._directory,
                reason=reason,
            )
            self._close()
            self._arm(initial=False)
            self._schedule()

    def _replaced(self) -> str | None:
        """
        Say why the directory at the path is not the one watched, or C{None} if it is.
        """
        try:
            identity = _identity(self._directory)
        except OSError as e:
            return f"directory gone: {e.strerror or e}"
        return None if identity == self._identity else "directory replaced"

    def _arm(self, initial: bool) -> bool:
        """
        Watch the directory with a fresh notifier; report a failure once per streak.
        Switch to polling if notification is unavailable.

        @return: whether a watch is now set.
        """
        try:
            notifier = self._factory()
        except NotifierUnavailableError as e:
            _log.warn("llmqueue: {reason}; polling {path}", reason=str(e), path=self.path)
            self.mode = "polling"
            self._signature = _signature(self.path)
            if not initial:
                self._schedule()
            return False
        try:
            # The identity is read before the watch is set: a directory swapped in between
            # then differs at the next tick, instead of being taken for the watched one.
            identity = _identity(self._directory)
            notifier.watch(
                self._directory,
                WATCH_MASK,
                lambda name, mask: self._event(notifier, name, mask),
            )
        except Exception as e:
            notifier.close()
            self._report(f"{type(e).__name__}: {e}")
            return False
        self._notifier, self._identity, self._died, self._reported = notifier, identity, None, None
        return True

    def _report(self, problem: str) -> None:
        """
        Log a failed watch with its context, unless the same failure was just logged.
        """
        if problem != self._reported:
            self._reported = problem
            _log.warn(
                "llmqueue: cannot watch {directory} for {name} ({problem}); "
                "retrying every {rearm}s",
                directory=self._directory,
                name=self._name,
                problem=problem,
                rearm=self._rearm,
            )

    def _close(self) -> None:
        """
        Close the current notifier, if any.
        """
        notifier, self._notifier = self._notifier, None
        if notifier is not None:
            notifier.close()
