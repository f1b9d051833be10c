"""
Tests for L{loopd.gateway.slot_dir}: the slot directory is refused unless it is yours and
closed to group and others, loopd's files in it are made 0600 and deleted, files an earlier
run left are cleared at start, and nothing that is not loopd's is touched; and
C{twist loopd} refuses to start on an unsafe one. Real files in a temporary directory.
"""

from __future__ import annotations

import io
import os
import stat
import sys

from twisted.trial.unittest import SynchronousTestCase

from loopd.config import parse_config
from loopd.gateway.slot_dir import SlotDirectory, is_loopd_file, open_slot_directories
from loopd.gateway.slot_store import filename
from loopd.runtime_dir import DirectoryError, UnsafeDirectoryError
from loopd.service import LoopdService
from loopd.test.support.second_user import NOT_ROOT, OTHER_UID, give_away, is_root
from loopd.testing.reactor import MemoryLoopdReactor

#: A loopd file name and one that is not loopd's.
OURS = filename("tiny", "a")
THEIRS = "session-of-someone-else.bin"


class SlotDirCase(SynchronousTestCase):
    """A temporary directory of the tests' own to put slot directories in."""

    def setUp(self) -> None:
        self.tmp = os.path.abspath(self.mktemp())
        os.makedirs(self.tmp, 0o700)

    def make(self, mode: int = 0o700, name: str = "slots") -> str:
        """A directory C{name} with C{mode}."""
        path = os.path.join(self.tmp, name)
        os.mkdir(path)
        os.chmod(path, mode)
        return path

    def write(self, directory: str, name: str, size: int = 10) -> str:
        """A file C{name} of C{size} bytes, mode 0644, as llama-server writes one."""
        path = os.path.join(directory, name)
        with open(path, "wb") as file:
            file.write(bytes(size))
        os.chmod(path, 0o644)
        return path


class CheckTests(SlotDirCase):
    """Which directories are refused, and what the message says."""

    def refused(self, path: str, error: type[Exception] = UnsafeDirectoryError) -> str:
        """The one-line message of the refusal of C{path}, which names it."""
        message = str(self.assertRaises(error, SlotDirectory("tiny", path).check))
        self.assertNotIn("\n", message)
        self.assertIn(path, message)
        self.assertIn("slot directory of endpoint tiny", message)
        return message

    def test_private_directory_passes(self) -> None:
        """Yours, mode 0700: accepted and left as it is."""
        path = self.make(0o700)
        SlotDirectory("tiny", path).check()
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o700)

    def test_open_to_others_refused(self) -> None:
        """0755, 0750 and 0701 let someone else read or reach the files: refused, not changed."""
        for mode in (0o755, 0o750, 0o701):
            path = self.make(mode, f"m{mode:o}")
            message = self.refused(path)
            self.assertIn(f"mode {mode:04o}", message)
            self.assertIn(f"chmod 700 {path}", message)
            self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), mode)

    def test_missing_refused(self) -> None:
        """A directory that does not exist: refused, saying how to make it."""
        path = os.path.join(self.tmp, "none")
        message = self.refused(path, DirectoryError)
        self.assertIn(f"mkdir -m 700 {path}", message)
        self.assertFalse(os.path.exists(path))

    def test_a_file_refused(self) -> None:
        """A file where the directory should be."""
        path = self.write(self.tmp, "slots")
        self.refused(path, DirectoryError)

    def test_symlink_to_an_open_directory_refused(self) -> None:
        """A link of yours is followed, and where it leads is checked."""
        target = self.make(0o755, "open")
        link = os.path.join(self.tmp, "link")
        os.symlink(target, link)
        self.refused(link)
        SlotDirectory("tiny", self.make(0o700, "closed")).check()
        os.unlink(link)
        os.symlink(os.path.join(self.tmp, "closed"), link)
        SlotDirectory("tiny", link).check()

    def test_open_parent_refused(self) -> None:
        """A private directory inside one that others may write to (not sticky)."""
        parent = self.make(0o777, "shared")
        os.chmod(parent, 0o777)
        path = os.path.join(parent, "slots")
        os.mkdir(path, 0o700)
        self.refused(path)

    def test_someone_elses_refused(self) -> None:
        """Another user's directory, even mode 0700, is not yours: refused."""
        if not is_root():
            raise self.skipTest(NOT_ROOT)
        path = self.make(0o700)
        give_away(path)
        message = self.refused(path)
        self.assertIn(f"uid {OTHER_UID}", message)
        self.assertEqual(os.lstat(path).st_uid, OTHER_UID)


class FileTests(SlotDirCase):
    """Making files private, deleting them, clearing what an earlier run left."""

    def test_protect(self) -> None:
        """A file the server wrote 0644 becomes 0600; a missing one is not an error."""
        directory = self.make()
        path = self.write(directory, OURS)
        slots = SlotDirectory("tiny", directory)
        slots.protect(OURS)
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        slots.protect(filename("tiny", "gone"))

    def test_delete(self) -> None:
        """Deleted once; a second time is nothing."""
        directory = self.make()
        self.write(directory, OURS)
        slots = SlotDirectory("tiny", directory)
        self.assertEqual((slots.delete(OURS), slots.delete(OURS)), (True, False))
        self.assertEqual(os.listdir(directory), [])

    def test_only_loopd_names(self) -> None:
        """A name not of loopd's form, or with a path in it, is never touched."""
        slots = SlotDirectory("tiny", self.make())
        for name in (THEIRS, "../" + OURS, OURS + ".tmp", "loopd-XYZ.bin"):
            self.assertFalse(is_loopd_file(name))
            self.assertRaises(ValueError, slots.delete, name)
            self.assertRaises(ValueError, slots.protect, name)

    def test_clear_stale(self) -> None:
        """At start, loopd's files of an earlier run go; the others stay."""
        directory = self.make()
        for session in ("a", "b"):
            self.write(directory, filename("tiny", session), 100)
        self.write(directory, THEIRS)
        self.assertEqual(SlotDirectory("tiny", directory).clear_stale(), (2, 200))
        self.assertEqual(os.listdir(directory), [THEIRS])


def config_text(slot_dir: str) -> str:
    """A config whose one endpoint saves slots to C{slot_dir}."""
    return (
        "[[endpoint]]\n"
        'name = "tiny"\n'
        'socket = "/nonexistent/loopd-test/tiny.sock"\n'
        "selftest = false\n"
        "slot_save = true\n"
        f'slot_dir = "{slot_dir}"\n'
    )


class StartTests(SlotDirCase):
    """The check and the clearing when loopd starts."""

    def test_open_slot_directories(self) -> None:
        """Each slot_save endpoint's directory is checked and cleared; others are not asked."""
        directory = self.make()
        self.write(directory, OURS)
        config = parse_config(config_text(directory))
        opened = open_slot_directories(config.endpoints)
        self.assertEqual([d.path for d in opened], [directory])
        self.assertEqual(os.listdir(directory), [])

    def test_daemon_refuses_to_start(self) -> None:
        """
        C{twist loopd} with a slot directory others may read: the start fails before the
        self-test, says why on stderr, exits 1, listens on nothing, and deletes nothing.
        """
        directory = self.make(0o755)
        self.write(directory, OURS)
        reactor = MemoryLoopdReactor()
        exits: list[int] = []
        stderr = io.StringIO()
        self.patch(sys, "stderr", stderr)
        service = LoopdService(
            reactor, parse_config(config_text(directory)), exit_process=exits.append
        )
        service.startService()
        self.failureResultOf(service.when_ready(), UnsafeDirectoryError)
        self.assertIn(
            f"loopd: cannot start: unsafe slot directory of endpoint tiny {directory}",
            stderr.getvalue(),
        )
        self.assertEqual(reactor.unixServers, [])
        for call, args, kwargs in reactor.triggers["after"]["shutdown"]:
            call(*args, **kwargs)
        self.assertEqual(exits, [1])
        self.assertEqual(os.listdir(directory), [OURS])
