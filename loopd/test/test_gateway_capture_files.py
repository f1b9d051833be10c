"""
Tests for L{loopd.gateway.capture_files}: the capture directory is refused unless it is
yours, mode 0700 and no symlink (and made when missing under a parent that exists); the
files are 0600, named by time and counter, never written through a symlink or over a file;
their total stays within the budget and one line; and a failure to write is said once and
loses only its lines. Real files in a temporary directory.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.capture_files import (
    CaptureFiles,
    capture_file_names,
    is_capture_file,
    open_capture_directory,
)
from loopd.runtime_dir import DirectoryError, UnsafeDirectoryError
from loopd.test.support.second_user import NOT_ROOT, give_away, is_root

#: 2026-12-07 10:15:00 UTC.
WALL = 1796638500.0
FIRST = "loopd-capture-20261207T101500Z-000001.jsonl"
SECOND = "loopd-capture-20261207T101500Z-000002.jsonl"


class CaptureDirCase(SynchronousTestCase):
    """A temporary directory of the test's own (0700) to put capture directories in."""

    def setUp(self) -> None:
        self.tmp = os.path.abspath(self.mktemp())
        os.makedirs(self.tmp, 0o700)

    def make(self, mode: int = 0o700, name: str = "capture") -> str:
        """A directory C{name} with C{mode}."""
        path = os.path.join(self.tmp, name)
        os.mkdir(path)
        os.chmod(path, mode)
        return path

    def files(self, path: str, max_bytes: int = 1 << 20, **kwargs: Any) -> CaptureFiles:
        """The capture files of C{path}, named by L{WALL}, closed after the test."""
        files = CaptureFiles(path, max_bytes, wall_clock=lambda: WALL, **kwargs)
        self.addCleanup(files.close)
        return files

    def refused(self, path: str, error: type[Exception] = UnsafeDirectoryError) -> str:
        """The one-line message of the refusal of C{path}, which names it."""
        message = str(self.assertRaises(error, open_capture_directory, path))
        self.assertNotIn("\n", message)
        self.assertIn(path, message)
        return message


class DirectoryTests(CaptureDirCase):
    """Which directories are taken, made or refused, and what the refusal says."""

    def test_private_directory(self) -> None:
        """A directory of yours, mode 0700, is opened and left as it is."""
        path = self.make()
        os.close(open_capture_directory(path))
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o700)

    def test_missing_is_made(self) -> None:
        """A missing directory whose parent exists is made, mode 0700 whatever the umask."""
        path = os.path.join(self.tmp, "new")
        old = os.umask(0)
        self.addCleanup(os.umask, old)
        os.close(open_capture_directory(path))
        info = os.lstat(path)
        self.assertTrue(stat.S_ISDIR(info.st_mode))
        self.assertEqual(stat.S_IMODE(info.st_mode), 0o700)

    def test_parent_missing(self) -> None:
        """Nothing is made two levels deep: the message says how to make it."""
        path = os.path.join(self.tmp, "no", "capture")
        message = self.refused(path, DirectoryError)
        self.assertIn(f"mkdir -m 700 -p {path}", message)
        self.assertFalse(os.path.exists(os.path.dirname(path)))

    def test_readable_by_others(self) -> None:
        """0755 and 0750 are refused, saying chmod 700; nothing is changed."""
        for mode, name in ((0o755, "a"), (0o750, "b")):
            path = self.make(mode, name)
            self.assertIn(f"chmod 700 {path}", self.refused(path))
            self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), mode)

    def test_symlink(self) -> None:
        """A symlink to a good directory is refused: the message names where it points."""
        target = self.make()
        link = os.path.join(self.tmp, "link")
        os.symlink(target, link)
        message = self.refused(link)
        self.assertIn(f"set [capture] dir to {target} itself", message)

    def test_not_a_directory(self) -> None:
        """A file where the directory should be is refused."""
        path = os.path.join(self.tmp, "file")
        with open(path, "w"):
            pass
        self.refused(path, DirectoryError)

    def test_unsafe_parent(self) -> None:
        """
        Under a parent others may write in, the directory made is refused and removed again.
        """
        parent = self.make(0o777, "open")
        path = os.path.join(parent, "capture")
        self.assertIn("writable by others", self.refused(path))
        self.assertFalse(os.path.exists(path))

    def test_other_users(self) -> None:
        """Another user's directory, mode 0700, is refused (as root: root is trusted)."""
        if not is_root():
            raise self.skipTest(NOT_ROOT)
        path = self.make()
        give_away(path)
        self.assertIn("not owned by you", self.refused(path))


class FileTests(CaptureDirCase):
    """The files: their names, modes, and what they never touch."""

    def test_names_and_mode(self) -> None:
        """
        The first file is named by the time of its first line and counter 1, mode 0600
        whatever the umask, and holds the lines.
        """
        old = os.umask(0)
        self.addCleanup(os.umask, old)
        path = self.make()
        files = self.files(path)
        self.assertIsNone(files.current)
        self.assertEqual(os.listdir(path), [])
        self.assertTrue(files.write(b'{"a":1}\n'))
        self.assertTrue(files.write(b'{"a":2}\n'))
        self.assertEqual((os.listdir(path), files.current), ([FIRST], FIRST))
        self.assertEqual(stat.S_IMODE(os.stat(os.path.join(path, FIRST)).st_mode), 0o600)
        with open(os.path.join(path, FIRST), "rb") as f:
            self.assertEqual(f.read(), b'{"a":1}\n{"a":2}\n')

    def test_is_capture_file(self) -> None:
        """Only the capture's own names count, sorted in the order they were written."""
        self.assertTrue(is_capture_file(FIRST))
        for name in ("loopd-capture.jsonl", FIRST + ".bak", "notes.txt", FIRST[:-1]):
            self.assertFalse(is_capture_file(name), name)
        self.assertEqual(capture_file_names([SECOND, "x", FIRST]), [FIRST, SECOND])

    def test_never_over_a_file_or_through_a_symlink(self) -> None:
        """
        A file or a symlink already at the next name is left alone: the counter moves on.
        """
        path = self.make()
        elsewhere = os.path.join(self.tmp, "elsewhere")
        with open(os.path.join(path, FIRST), "wb") as f:
            f.write(b"earlier\n")
        os.symlink(elsewhere, os.path.join(path, SECOND))
        files = self.files(path)
        files.write(b"{}\n")
        self.assertEqual(files.current, "loopd-capture-20261207T101500Z-000003.jsonl")
        self.assertFalse(os.path.exists(elsewhere))
        with open(os.path.join(path, FIRST), "rb") as f:
            self.assertEqual(f.read(), b"earlier\n")

    def test_earlier_files_count(self) -> None:
        """
        An earlier run's capture files count in the budget and the oldest go first; other
        files are never touched.
        """
        path = self.make()
        old = "loopd-capture-20261206T000000Z-000001.jsonl"
        newer = "loopd-capture-20261206T000001Z-000001.jsonl"
        for name in (old, newer, "notes.txt"):
            with open(os.path.join(path, name), "wb") as f:
                f.write(b"x" * 40)
        files = self.files(path, max_bytes=100)
        self.assertEqual(files.total, 80)
        files.write(b"y" * 29 + b"\n")
        self.assertEqual(sorted(os.listdir(path)), sorted([newer, FIRST, "notes.txt"]))
        self.assertEqual(files.total, 70)

    def test_deleted_under_loopd(self) -> None:
        """A file deleted while open is noticed: the next line begins a new file."""
        path = self.make()
        files = self.files(path)
        files.write(b"1\n")
        os.unlink(os.path.join(path, FIRST))
        files.write(b"2\n")
        self.assertEqual(os.listdir(path), [SECOND])
        self.assertEqual(files.files, {SECOND: 2})


class BudgetTests(CaptureDirCase):
    """The files stay within the budget and one line."""

    def on_disk(self, path: str) -> dict[str, int]:
        """Each capture file's size on disk, by name."""
        return {
            name: os.stat(os.path.join(path, name)).st_size
            for name in capture_file_names(os.listdir(path))
        }

    def test_rotation(self) -> None:
        """A file ends before it passes an eighth of the budget; the oldest go past it."""
        path = self.make()
        files = self.files(path, max_bytes=80)
        self.assertEqual(files.file_bytes, 10)
        for _ in range(3):
            files.write(b"abcd\n")
        self.assertEqual(list(self.on_disk(path).values()), [10, 5])
        for _ in range(20):
            files.write(b"abcd\n")
        sizes = self.on_disk(path)
        self.assertEqual(list(sizes.values()), [10] * 7 + [5])
        self.assertEqual(sizes, files.files)

    def test_line_over_the_budget(self) -> None:
        """A line longer than the whole budget is written, alone, and the next replaces it."""
        path = self.make()
        files = self.files(path, max_bytes=16)
        files.write(b"a\n")
        files.write(b"x" * 40 + b"\n")
        self.assertEqual(list(self.on_disk(path).values()), [41])
        files.write(b"b\n")
        self.assertEqual(list(self.on_disk(path).values()), [2])

    @settings(max_examples=60, deadline=None)
    @given(
        st.integers(1, 600),
        st.lists(st.integers(1, 120), min_size=1, max_size=40),
        st.integers(0, 3),
    )
    def test_within_budget(self, max_bytes: int, lengths: list[int], earlier: int) -> None:
        """
        Whatever the budget, the lines and an earlier run's files, after each line the
        capture files total at most the budget and that line, the line is whole at the
        end of the newest file, and every file is 0600.
        """
        path = os.path.abspath(self.mktemp())
        os.mkdir(path, 0o700)
        self.addCleanup(shutil.rmtree, path)
        for number in range(earlier):
            name = f"loopd-capture-20261206T00000{number}Z-000001.jsonl"
            with open(os.path.join(path, name), "wb") as f:
                f.write(b"e" * 50)
            os.chmod(os.path.join(path, name), 0o600)
        files = self.files(path, max_bytes=max_bytes)
        for number, length in enumerate(lengths):
            line = (str(number % 10) * (length - 1)).encode() + b"\n"
            self.assertTrue(files.write(line))
            sizes = self.on_disk(path)
            self.assertLessEqual(sum(sizes.values()), max_bytes + len(line))
            newest = max(sizes)
            self.assertEqual(newest, files.current)
            with open(os.path.join(path, newest), "rb") as f:
                self.assertTrue(f.read().endswith(line))
            for name in sizes:
                info = os.stat(os.path.join(path, name))
                self.assertEqual(stat.S_IMODE(info.st_mode), 0o600)
        files.close()


class CloseTests(CaptureDirCase):
    """Closed at loopd's stop, the capture writes and opens nothing again."""

    def test_closed_for_good(self) -> None:
        """A line after close is refused; no file is made or opened for it."""
        path = self.make()
        files = self.files(path)
        self.assertTrue(files.write(b"{}\n"))
        files.close()
        before = {name: os.stat(os.path.join(path, name)).st_size for name in os.listdir(path)}
        self.assertFalse(files.write(b"{}\n"))
        after = {name: os.stat(os.path.join(path, name)).st_size for name in os.listdir(path)}
        self.assertEqual(after, before)


class FailureTests(CaptureDirCase):
    """A failure to write loses its lines, is said once, and the capture comes back."""

    def setUp(self) -> None:
        super().setUp()
        capturing = capturedLogs()
        self.events = capturing.__enter__()
        self.addCleanup(capturing.__exit__, None, None, None)

    def said(self) -> list[str]:
        """What the capture's files said so far, as text."""
        return [
            formatEvent(event)
            for event in self.events
            if event.get("log_namespace") == "loopd.gateway.capture"
        ]

    def test_disk_full(self) -> None:
        """
        A full disk loses the lines while it lasts, said once; then lines go on in the same
        file, and the count of the lost ones is said.
        """
        path = self.make()
        full = [False]

        def write(fd: int, data: bytes) -> int:
            if full[0]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return os.write(fd, data)

        files = self.files(path, write=write)
        files.write(b"1\n")
        full[0] = True
        self.assertFalse(files.write(b"2\n"))
        self.assertFalse(files.write(b"3\n"))
        self.assertEqual(len(self.said()), 1)
        self.assertIn(f"cannot write to {path}: No space left on device", self.said()[0])
        full[0] = False
        self.assertTrue(files.write(b"4\n"))
        self.assertEqual(
            self.said()[1:], [f"capture: writing to {path} again; 2 requests were not captured"]
        )
        self.assertEqual(os.listdir(path), [FIRST])
        with open(os.path.join(path, FIRST), "rb") as f:
            self.assertEqual(f.read(), b"1\n4\n")

    def test_line_cut_short(self) -> None:
        """A line cut short by a full disk ends its file: the next line begins a new one."""
        path = self.make()
        full = [False]

        def write(fd: int, data: bytes) -> int:
            if full[0]:
                full[0] = False
                os.write(fd, data[:2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return os.write(fd, data)

        files = self.files(path, write=write)
        files.write(b"1\n")
        full[0] = True
        files.write(b"22222\n")
        files.write(b"3\n")
        with open(os.path.join(path, FIRST), "rb") as f:
            self.assertEqual(f.read(), b"1\n22")
        with open(os.path.join(path, SECOND), "rb") as f:
            self.assertEqual(f.read(), b"3\n")

    def test_short_writes(self) -> None:
        """A write that takes part of the line is followed by the rest."""
        path = self.make()
        files = self.files(path, write=lambda fd, data: os.write(fd, data[:3]))
        files.write(b"0123456789\n")
        with open(os.path.join(path, FIRST), "rb") as f:
            self.assertEqual(f.read(), b"0123456789\n")

    def test_directory_removed(self) -> None:
        """
        The directory removed: lines are lost, said once; made again (0700), it is checked
        and opened again, and the lines go there.
        """
        path = self.make()
        files = self.files(path)
        files.write(b"1\n")
        shutil.rmtree(path)
        self.assertFalse(files.write(b"2\n"))
        self.assertFalse(files.write(b"3\n"))
        self.assertEqual(len(self.said()), 1)
        self.assertIn(f"cannot write to {path}", self.said()[0])
        os.mkdir(path, 0o700)
        self.assertTrue(files.write(b"4\n"))
        self.assertEqual(len(os.listdir(path)), 1)
        self.assertIn("2 requests were not captured", self.said()[-1])

    def test_directory_loosened(self) -> None:
        """Made again but open to others, the directory is refused: still said once."""
        path = self.make()
        files = self.files(path)
        files.write(b"1\n")
        shutil.rmtree(path)
        os.mkdir(path)
        os.chmod(path, 0o755)
        self.assertFalse(files.write(b"2\n"))
        self.assertFalse(files.write(b"3\n"))
        self.assertEqual(len(self.said()), 1)
        self.assertEqual(os.listdir(path), [])
