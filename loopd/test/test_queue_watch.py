"""
L{loopd.queue.watch}: debouncing, the name filter, re-arming a failed or silently dead watch
and polling, on C{task.Clock} with a fake notifier; then real inotify on the real reactor.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase

from loopd.queue.watch import (
    IN_ATTRIB,
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_MOVE_SELF,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    WATCH_MASK,
    ConfigWatcher,
    NotifierUnavailableError,
)
from loopd.test.support.notifier import FakeNotifier
from loopd.test.support.peers import real_reactor

NAME = "llm-queue.json"


class Fixture:
    """
    A watcher on C{<temp dir>/conf/llm-queue.json} over a C{Clock} and fake notifiers.
    """

    def __init__(self, case: SynchronousTestCase, make_directory: bool = True) -> None:
        self.root = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        case.addCleanup(shutil.rmtree, self.root, True)
        self.directory = os.path.join(self.root, "conf")
        if make_directory:
            os.mkdir(self.directory)
        self.path = os.path.join(self.directory, NAME)
        self.clock = Clock()
        self.changes = 0
        self.notifiers: list[FakeNotifier] = []
        self.refusals: list[Exception | None] = []
        self.unavailable = False
        self.watcher = ConfigWatcher(
            self.clock, self.path, self.changed, notifier_factory=self.make_notifier
        )
        case.addCleanup(self.watcher.stop)

    def changed(self) -> None:
        self.changes += 1

    def make_notifier(self) -> FakeNotifier:
        if self.unavailable:
            raise NotifierUnavailableError("no inotify here")
        notifier = FakeNotifier(self.refusals.pop(0) if self.refusals else None)
        self.notifiers.append(notifier)
        return notifier

    @property
    def current(self) -> FakeNotifier:
        return self.notifiers[-1]

    def write(self, text: str) -> None:
        with open(self.path, "w", encoding="utf-8") as stream:
            stream.write(text)


class DebounceTests(SynchronousTestCase):
    """
    A burst of changes of the file makes one C{on_change}, C{debounce} after its last one.
    """

    def setUp(self) -> None:
        self.f = Fixture(self)
        self.f.watcher.start()

    def test_watches_directory(self) -> None:
        """The file's directory is watched with the file, move and self masks."""
        self.assertEqual(self.f.current.watched, [(self.f.directory, WATCH_MASK)])
        for bit in (IN_CLOSE_WRITE, IN_MOVED_TO, IN_MOVED_FROM, IN_CREATE, IN_DELETE, IN_ATTRIB):
            self.assertTrue(WATCH_MASK & bit)
        self.assertTrue(self.f.watcher.armed)

    def test_burst_coalesced(self) -> None:
        """Three changes 100 ms apart call C{on_change} once, 250 ms after the third."""
        for _ in range(3):
            self.f.current.send(NAME, IN_CLOSE_WRITE)
            self.f.clock.advance(0.1)
        self.f.clock.advance(0.149)
        self.assertEqual(self.f.changes, 0)
        self.f.clock.advance(0.001)
        self.assertEqual(self.f.changes, 1)
        self.f.clock.advance(5)
        self.assertEqual(self.f.changes, 1)

    def test_atomic_save(self) -> None:
        """An atomic save is one change: the temporary file's events are filtered out."""
        self.f.current.send(".llm-queue.json.tmp", IN_CREATE)
        self.f.current.send(".llm-queue.json.tmp", IN_CLOSE_WRITE)
        self.f.current.send(".llm-queue.json.tmp", IN_MOVED_FROM)
        self.f.current.send(NAME, IN_MOVED_TO)
        self.f.clock.advance(0.25)
        self.assertEqual(self.f.changes, 1)

    def test_other_files_ignored(self) -> None:
        """Changes of other entries in the directory call nothing."""
        for name in ("llm-queue.sock", "llm-queue.json.bak", "other"):
            self.f.current.send(name, IN_CLOSE_WRITE | IN_CREATE | IN_DELETE)
        self.f.clock.advance(10)
        self.assertEqual(self.f.changes, 0)

    def test_separate_bursts(self) -> None:
        """Two changes further apart than the debounce make two calls."""
        self.f.current.send(NAME, IN_CLOSE_WRITE)
        self.f.clock.advance(0.3)
        self.f.current.send(NAME, IN_DELETE)
        self.f.clock.advance(0.3)
        self.assertEqual(self.f.changes, 2)

    def test_stop(self) -> None:
        """Stopping drops a pending call, closes the notifier and ends the tick."""
        self.f.current.send(NAME, IN_CLOSE_WRITE)
        self.f.watcher.stop()
        self.assertTrue(self.f.current.closed)
        self.assertEqual(self.f.clock.getDelayedCalls(), [])
        self.f.clock.advance(10)
        self.assertEqual(self.f.changes, 0)

    def test_healthy_ticks_idle(self) -> None:
        """While the watch is alive the tick replaces nothing and calls nothing."""
        self.f.clock.pump([1.0] * 5)
        self.assertEqual(len(self.f.notifiers), 1)
        self.assertEqual(self.f.changes, 0)


class RearmTests(SynchronousTestCase):
    """
    A failed watch is logged and tried again on the tick; a dead one is replaced there. Each
    re-arm is followed by one C{on_change}.
    """

    def test_failed_watch_rearmed(self) -> None:
        """A refused watch is logged once with its context, retried, then one on_change."""
        f = Fixture(self)
        f.refusals = [OSError("watch limit reached"), OSError("watch limit reached")]
        with capturedLogs() as events:
            f.watcher.start()
            self.assertFalse(f.watcher.armed)
            f.clock.advance(1.0)
            self.assertFalse(f.watcher.armed)
            f.clock.advance(1.0)
        self.assertTrue(f.watcher.armed)
        self.assertTrue(f.notifiers[0].closed and f.notifiers[1].closed)
        failures = [e for e in events if "cannot watch" in e["log_format"]]
        self.assertEqual(len(failures), 1)
        self.assertEqual(failures[0]["directory"], f.directory)
        self.assertIn("watch limit reached", failures[0]["problem"])
        self.assertEqual(f.changes, 0)
        f.clock.advance(0.25)
        self.assertEqual(f.changes, 1)
        f.current.send(NAME, IN_CLOSE_WRITE)
        f.clock.advance(0.25)
        self.assertEqual(f.changes, 2)

    def test_missing_directory(self) -> None:
        """A missing directory is a failed watch, set on the tick once it exists."""
        f = Fixture(self, make_directory=False)
        f.watcher.start()
        self.assertFalse(f.watcher.armed)
        f.clock.advance(1.0)
        self.assertFalse(f.watcher.armed)
        os.mkdir(f.directory)
        f.write("{}")
        f.clock.advance(1.0)
        self.assertTrue(f.watcher.armed)
        self.assertEqual(f.current.watched, [(f.directory, WATCH_MASK)])
        f.clock.advance(0.25)
        self.assertEqual(f.changes, 1)

    def test_self_events_replace_watch(self) -> None:
        """After a self event the tick replaces the notifier and calls on_change once."""
        f = Fixture(self)
        f.watcher.start()
        for expected, mask in enumerate((IN_IGNORED, IN_DELETE_SELF, IN_MOVE_SELF), start=1):
            old = f.current
            old.send(None, mask)
            self.assertEqual(f.changes, expected - 1)
            f.clock.advance(1.0)
            self.assertTrue(old.closed)
            self.assertIsNot(f.current, old)
            self.assertTrue(f.watcher.armed)
            f.clock.advance(0.25)
            self.assertEqual(f.changes, expected)
            old.send(NAME, IN_CLOSE_WRITE)
            f.clock.advance(0.25)
            self.assertEqual(f.changes, expected)

    def test_directory_renamed_away(self) -> None:
        """A directory swapped without an event is noticed by identity and rewatched."""
        f = Fixture(self)
        f.watcher.start()
        old = f.current
        os.rename(f.directory, os.path.join(f.root, "moved"))
        os.mkdir(f.directory)
        f.clock.advance(1.0)
        self.assertTrue(old.closed)
        self.assertEqual(len(f.notifiers), 2)
        self.assertTrue(f.watcher.armed)
        f.clock.advance(0.25)
        self.assertEqual(f.changes, 1)

    def test_directory_gone(self) -> None:
        """A directory removed silently: on_change, then retries until it is back."""
        f = Fixture(self)
        f.watcher.start()
        os.rmdir(f.directory)
        f.clock.advance(1.0)
        self.assertFalse(f.watcher.armed)
        f.clock.advance(0.25)
        self.assertEqual(f.changes, 1)
        os.mkdir(f.directory)
        f.clock.advance(0.75)
        self.assertTrue(f.watcher.armed)
        f.clock.advance(0.25)
        self.assertEqual(f.changes, 2)


class PollingTests(SynchronousTestCase):
    """
    Without inotify the tick polls the file's inode, mtime and size.
    """

    def setUp(self) -> None:
        self.f = Fixture(self)
        self.f.unavailable = True
        self.f.write("{}")
        self.f.watcher.start()

    def test_mode(self) -> None:
        """The watcher says it polls, and sets no watch."""
        self.assertEqual(self.f.watcher.mode, "polling")
        self.assertFalse(self.f.watcher.armed)

    def test_change_seen_on_tick(self) -> None:
        """A write that changes the size is seen on the next tick, then debounced."""
        self.f.clock.advance(1.0)
        self.assertEqual(self.f.changes, 0)
        self.f.write('{"defaults": {}}')
        self.f.clock.advance(1.0)
        self.f.clock.advance(0.25)
        self.assertEqual(self.f.changes, 1)
        self.f.clock.pump([1.0] * 3)
        self.assertEqual(self.f.changes, 1)

    def test_replace_and_delete(self) -> None:
        """A rename over the file (a new inode) and a deletion are each a change."""
        temporary = self.f.path + ".tmp"
        with open(temporary, "w", encoding="utf-8") as stream:
            stream.write("{}")
        os.rename(temporary, self.f.path)
        self.f.clock.pump([1.0, 0.25])
        self.assertEqual(self.f.changes, 1)
        os.unlink(self.f.path)
        self.f.clock.pump([0.75, 0.25])
        self.assertEqual(self.f.changes, 2)


class RealINotifyTests(TestCase):
    """
    The watcher over Twisted's inotify on the real reactor.
    """

    timeout = 20

    def setUp(self) -> None:
        if not sys.platform.startswith("linux"):
            raise SkipTest("inotify is Linux only")
        self.root = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.directory = os.path.join(self.root, "conf")
        os.mkdir(self.directory)
        self.path = os.path.join(self.directory, NAME)
        self.calls = 0
        self.waiting: list[Deferred[int]] = []

    def changed(self) -> None:
        self.calls += 1
        waiting, self.waiting = self.waiting, []
        for d in waiting:
            d.callback(self.calls)

    def next_change(self) -> Deferred[int]:
        d: Deferred[int] = Deferred()
        self.waiting.append(d)
        return d

    def start(self, **timing: Any) -> ConfigWatcher:
        watcher = ConfigWatcher(real_reactor(), self.path, self.changed, **timing)
        watcher.start()
        self.addCleanup(watcher.stop)
        self.assertEqual(watcher.mode, "inotify")
        self.assertTrue(watcher.armed)
        return watcher

    def save_atomically(self, directory: str, text: str) -> None:
        temporary = os.path.join(directory, ".llm-queue.json.tmp")
        with open(temporary, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.rename(temporary, os.path.join(directory, NAME))

    @inlineCallbacks
    def test_atomic_save(self) -> Any:
        """A file written beside the config and renamed over it calls C{on_change} once."""
        self.start()
        self.save_atomically(self.directory, "{}")
        calls = yield self.next_change()
        self.assertEqual(calls, 1)

    @inlineCallbacks
    def test_directory_replaced(self) -> Any:
        """A directory renamed away and remade is rewatched; its edits are seen."""
        self.start(debounce=0.05, rearm=0.05)
        os.rename(self.directory, os.path.join(self.root, "moved"))
        os.mkdir(self.directory)
        calls = yield self.next_change()
        self.assertEqual(calls, 1)
        self.save_atomically(self.directory, "{}")
        calls = yield self.next_change()
        self.assertEqual(calls, 2)
