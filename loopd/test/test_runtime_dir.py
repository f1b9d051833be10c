"""
L{loopd.runtime_dir}: a socket's directory is created 0700, refused when someone other than
you and root controls it (its owner, its mode, a directory above it, a symlink on the way),
and repaired only when that is provably safe; in short temporary directories.

The cases with another user's files need root (C{chown}); they skip otherwise.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from loopd.runtime_dir import (
    DirectoryError,
    UnsafeDirectoryError,
    check_directory,
    describe_owner,
    prepare_directory,
)
from loopd.test.support.second_user import NOT_ROOT, OTHER_UID, give_away, is_root


def mode_of(path: str) -> int:
    """The permission bits of C{path} itself (a symlink's own, not its target's)."""
    return stat.S_IMODE(os.lstat(path).st_mode)


class DirectoryCase(SynchronousTestCase):
    """
    A short temporary directory of the tests' user, mode 0700, under C{/tmp}.
    """

    def setUp(self) -> None:
        self.base = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.base, True)

    def path(self, *parts: str) -> str:
        """A path under the temporary directory."""
        return os.path.join(self.base, *parts)

    def open_directory(self, *parts: str, mode: int = 0o777) -> str:
        """A new directory with C{mode} exactly (the umask does not apply)."""
        path = self.path(*parts)
        os.mkdir(path)
        os.chmod(path, mode)
        return path

    def require_root(self) -> None:
        """Skip unless the tests may act as another user."""
        if not is_root():
            raise self.skipTest(NOT_ROOT)

    def assert_one_line_naming(self, error: Exception, *parts: str) -> None:
        """The error's message is one line that holds every one of C{parts}."""
        message = str(error)
        self.assertNotIn("\n", message)
        for part in parts:
            self.assertIn(part, message)


class PrepareDirectoryTests(DirectoryCase):
    """
    L{prepare_directory}, before listening: creates, checks, repairs only what is provably
    safe to repair.
    """

    def test_missing_directories_made_0700(self) -> None:
        """
        Every missing directory, intermediate ones included, is created with mode 0700 even
        under a umask of 0.
        """
        previous = os.umask(0)
        self.addCleanup(os.umask, previous)
        prepare_directory(self.path("a", "b", "c"))
        for parts in (("a",), ("a", "b"), ("a", "b", "c")):
            self.assertEqual(mode_of(self.path(*parts)), 0o700, parts)

    def test_safe_directory_kept(self) -> None:
        """
        A directory of yours that others may not write to is used as it is (0755 too).
        """
        directory = self.open_directory("run", mode=0o755)
        prepare_directory(directory)
        self.assertEqual(mode_of(directory), 0o755)

    def test_open_directory_of_yours_repaired(self) -> None:
        """
        The socket's own directory, yours, mode 0777, holding only your files, is tightened
        to 0700 and the repair is logged; its files stay.
        """
        directory = self.open_directory("run")
        with open(os.path.join(directory, "mine"), "w"):
            pass
        with capturedLogs() as events:
            prepare_directory(directory)
        self.assertEqual(mode_of(directory), 0o700)
        self.assertEqual(os.listdir(directory), ["mine"])
        ours = [e for e in events if e.get("log_namespace") == "loopd.runtime_dir"]
        (logged,) = [formatEvent(e) for e in ours]
        self.assertIn(directory, logged)
        self.assertIn("0777", logged)

    def test_open_directory_with_foreign_entry_refused(self) -> None:
        """
        A directory of yours, mode 0777, that holds another user's file is refused, naming
        that file and its owner, and left as it is: it cannot be known what else they did.
        """
        self.require_root()
        directory = self.open_directory("run")
        planted = os.path.join(directory, "loopd.sock")
        with open(planted, "w"):
            pass
        give_away(planted)
        error = self.assertRaises(UnsafeDirectoryError, prepare_directory, directory)
        self.assert_one_line_naming(error, directory, planted, describe_owner(OTHER_UID))
        self.assertEqual(mode_of(directory), 0o777)
        self.assertTrue(os.path.exists(planted))

    def test_foreign_directory_refused(self) -> None:
        """
        A directory another user owns is refused even with mode 0700: its owner can change
        it at any time. The message names it, its owner and what to do.
        """
        self.require_root()
        directory = self.open_directory("loopd-0", mode=0o700)
        give_away(directory)
        error = self.assertRaises(UnsafeDirectoryError, prepare_directory, directory)
        self.assert_one_line_naming(
            error, directory, describe_owner(OTHER_UID), "mode 0700", "remove it"
        )
        self.assertEqual(os.lstat(directory).st_uid, OTHER_UID)

    def test_foreign_symlink_refused(self) -> None:
        """
        A symlink another user owns is refused, even when it points to a good directory of
        yours: they may point it elsewhere at any moment.
        """
        self.require_root()
        target = self.open_directory("target", mode=0o700)
        link = self.path("loopd-0")
        os.symlink(target, link)
        give_away(link)
        error = self.assertRaises(UnsafeDirectoryError, prepare_directory, link)
        self.assert_one_line_naming(error, link, "symlink", describe_owner(OTHER_UID), target)

    def test_symlink_to_foreign_directory_refused(self) -> None:
        """
        A symlink of yours is followed, and where it leads is checked by the same rules.
        """
        self.require_root()
        target = self.open_directory("theirs", mode=0o755)
        give_away(target)
        link = self.path("loopd-0")
        os.symlink("theirs", link)
        error = self.assertRaises(UnsafeDirectoryError, prepare_directory, link)
        self.assert_one_line_naming(error, link, describe_owner(OTHER_UID))

    def test_own_symlink_followed(self) -> None:
        """
        A symlink of yours to a good directory of yours is used, relative or absolute, and
        a missing directory below it is created.
        """
        target = self.open_directory("target", mode=0o700)
        os.symlink("target", self.path("relative"))
        os.symlink(target, self.path("absolute"))
        prepare_directory(self.path("relative", "a"))
        prepare_directory(self.path("absolute", "b"))
        self.assertEqual(sorted(os.listdir(target)), ["a", "b"])

    def test_open_directory_above_refused(self) -> None:
        """
        A directory above the socket's own that others may write to, and not sticky, is
        refused: whoever can rename entries there can swap the whole branch.
        """
        above = self.open_directory("shared")
        os.mkdir(os.path.join(above, "run"), 0o700)
        directory = os.path.join(above, "run")
        error = self.assertRaises(UnsafeDirectoryError, prepare_directory, directory)
        self.assert_one_line_naming(error, directory, above, "not sticky", "chmod go-w")
        self.assertEqual(mode_of(above), 0o777)

    def test_sticky_directory_above_allowed(self) -> None:
        """
        A sticky directory above, such as C{/tmp}, is fine: there only an entry's owner may
        rename or remove it.
        """
        above = self.open_directory("shared", mode=0o1777)
        prepare_directory(os.path.join(above, "run"))
        self.assertEqual(mode_of(os.path.join(above, "run")), 0o700)

    def test_sticky_own_directory_refused(self) -> None:
        """
        The socket's own directory may not be writable by others even when sticky: anyone
        could take the socket's name first.
        """
        self.require_root()
        directory = self.open_directory("run", mode=0o1777)
        planted = os.path.join(directory, "theirs")
        os.mkdir(planted)
        give_away(planted)
        error = self.assertRaises(UnsafeDirectoryError, prepare_directory, directory)
        self.assert_one_line_naming(error, directory, planted)

    def test_not_a_directory(self) -> None:
        """
        A file in the way is a L{DirectoryError} (not a safety matter) that names it.
        """
        blocker = self.path("file")
        with open(blocker, "w"):
            pass
        error = self.assertRaises(DirectoryError, prepare_directory, self.path("file", "run"))
        self.assertNotIsInstance(error, UnsafeDirectoryError)
        self.assert_one_line_naming(error, blocker, "regular file", "not a directory")


class CheckDirectoryTests(DirectoryCase):
    """
    L{check_directory}, before connecting: the same rules, nothing created or changed.
    """

    def test_missing_passes_and_nothing_created(self) -> None:
        """
        A missing directory passes (the connection will say nothing is there) and is not
        created.
        """
        check_directory(self.path("a", "b"))
        self.assertEqual(os.listdir(self.base), [])

    def test_safe_directory_passes(self) -> None:
        """
        A directory of yours, mode 0700, passes.
        """
        check_directory(self.open_directory("run", mode=0o700))

    def test_open_directory_refused_not_repaired(self) -> None:
        """
        A directory of yours with mode 0777 is refused, with what to do, and left as it is.
        """
        directory = self.open_directory("run")
        error = self.assertRaises(UnsafeDirectoryError, check_directory, directory)
        self.assert_one_line_naming(error, directory, "mode 0777", "chmod 700")
        self.assertEqual(mode_of(directory), 0o777)

    def test_foreign_directory_refused(self) -> None:
        """
        A directory another user owns is refused.
        """
        self.require_root()
        directory = self.open_directory("run", mode=0o755)
        give_away(directory)
        error = self.assertRaises(UnsafeDirectoryError, check_directory, directory)
        self.assert_one_line_naming(error, directory, describe_owner(OTHER_UID))

    def test_relative_path(self) -> None:
        """
        A relative path is checked from the working directory, C{..} included.
        """
        self.open_directory("run", mode=0o777)
        cwd = os.getcwd()
        self.addCleanup(os.chdir, cwd)
        os.chdir(self.open_directory("here", mode=0o700))
        check_directory(os.path.join("..", "here"))
        self.assertRaises(UnsafeDirectoryError, check_directory, os.path.join("..", "run"))
