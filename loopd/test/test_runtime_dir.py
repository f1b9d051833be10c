"""
L{loopd.runtime_dir}: a socket's directory is created 0700, refused when someone other than
you and root controls it (its owner, its mode, a directory above it, a symlink on the way),
and repaired only when that is provably safe; in short temporary directories.

The cases with another user's files need root (C{chown}); they skip otherwise.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import stat
import sys
import tempfile
from functools import partial
from typing import Any

from twisted.internet.protocol import Factory
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from loopd import cli
from loopd.chatloop import stream_turn
from loopd.chatui import TurnView
from loopd.config import parse_config
from loopd.queue.client_connect import LeaseWire, connect_daemon
from loopd.queue.client_lease import QueueUnavailable
from loopd.queue.daemon import LlmQueueService
from loopd.queue.show import QueueStatusError, fetch_status
from loopd.runtime_dir import (
    DirectoryError,
    UnsafeDirectoryError,
    check_directory,
    describe_owner,
    prepare_directory,
)
from loopd.service import LoopdService, default_socket_path, queue_socket_path
from loopd.test.support.notifier import FakeNotifier
from loopd.test.support.second_user import (
    NOT_ROOT,
    OTHER_UID,
    as_other_user,
    give_away,
    is_root,
    shared_temp_dir,
)
from loopd.testing.reactor import MemoryLoopdReactor
from loopd.unixsocket import UnsafeSocketError, listen_unix


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
        The socket's own directory may not be writable by others even when sticky (anyone
        could take the socket's name first), and it is never tightened, even when it is
        yours and holds only your files: such a directory, like C{/tmp}, is shared on
        purpose.
        """
        directory = self.open_directory("run", mode=0o1777)
        with open(os.path.join(directory, "mine"), "w"):
            pass
        error = self.assertRaises(UnsafeDirectoryError, prepare_directory, directory)
        self.assert_one_line_naming(error, directory, "mode 1777", "a directory of your own")
        self.assertEqual(mode_of(directory), 0o1777)

    def test_tmp_itself_refused_untouched(self) -> None:
        """
        A socket straight in C{/tmp} is refused, and C{/tmp} keeps its mode (even for
        root, who owns it).
        """
        before = mode_of("/tmp")
        if before != 0o1777:
            raise self.skipTest(f"/tmp has mode {before:04o} here, not 1777")
        error = self.assertRaises(UnsafeDirectoryError, prepare_directory, "/tmp")
        self.assert_one_line_naming(error, "/tmp", "shared")
        self.assertEqual(mode_of("/tmp"), before)

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


TOML = '[[endpoint]]\nname = "remote"\nsocket = "/tmp/ld/remote.sock"\nkind = "openai"\n'


def record_run(ran: list[object], command: Any) -> int:
    """A runner for C{cli.main} that records the command instead of running it."""
    ran.append(command)
    return 0


def planted_socket(path: str) -> None:
    """Bind a socket at C{path} and close it (run as the second user: theirs, stale)."""
    planted = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    planted.bind(path)
    planted.close()


class DefaultDirectoryTakeoverTests(SynchronousTestCase):
    """
    The probe's attack with a real second user: before loopd starts, they take the default
    socket directory C{$TMPDIR/loopd-<uid>/} (C{XDG_RUNTIME_DIR} unset) as a directory of
    mode 0777, as a symlink to their own directory, or as their directory with their socket
    in it. The daemon refuses to listen there and every client refuses to connect, each
    with a message that names the path and its owner; nothing of theirs is touched.
    """

    def setUp(self) -> None:
        if not is_root():
            raise self.skipTest(NOT_ROOT)
        self.tmp = shared_temp_dir(self.addCleanup)
        self.patch(tempfile, "tempdir", self.tmp)
        environ = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        environ["XDG_CONFIG_HOME"] = os.path.join(self.tmp, "no-config")
        self.patch(os, "environ", environ)
        self.taken = os.path.join(self.tmp, f"loopd-{os.getuid()}")
        self.assertEqual(default_socket_path(), os.path.join(self.taken, "loopd.sock"))

    def open_directory(self) -> str:
        """They create the directory, mode 0777; what must be refused is it."""
        taken = self.taken

        def attack() -> None:
            os.mkdir(taken)
            os.chmod(taken, 0o777)

        as_other_user(attack)
        return taken

    def symlink(self) -> str:
        """They make the directory a symlink to a directory of theirs; refused: the link."""
        taken, theirs = self.taken, os.path.join(self.tmp, "theirs")

        def attack() -> None:
            os.mkdir(theirs, 0o755)
            os.symlink(theirs, taken)

        as_other_user(attack)
        return taken

    def own_directory_with_socket(self) -> str:
        """They create it as their own directory, with their socket at loopd.sock in it."""
        taken = self.taken

        def attack() -> None:
            os.mkdir(taken, 0o755)
            planted_socket(os.path.join(taken, "loopd.sock"))
            planted_socket(os.path.join(taken, "llm-queue.sock"))

        as_other_user(attack)
        return taken

    def attacks(self) -> list[str]:
        """Each attack in turn, on a clean temp dir; yields the path to be refused."""
        found = []
        for attack in (self.open_directory, self.symlink, self.own_directory_with_socket):
            for name in os.listdir(self.tmp):
                path = os.path.join(self.tmp, name)
                if os.path.islink(path) or not os.path.isdir(path):
                    os.unlink(path)
                else:
                    shutil.rmtree(path)
            found.append(attack())
        return found

    def theirs(self) -> list[tuple[str, int, int]]:
        """What is in the temp dir, with owners and modes, to show nothing was touched."""
        seen = []
        for top, directories, files in os.walk(self.tmp):
            for name in directories + files:
                info = os.lstat(os.path.join(top, name))
                seen.append((os.path.join(top, name), info.st_uid, info.st_mode))
        return sorted(seen)

    def assert_names(self, message: str, path: str) -> None:
        """The message names the taken path and the second user."""
        self.assertIn(path, message)
        self.assertIn(describe_owner(OTHER_UID), message)

    def test_daemon_refuses_to_listen(self) -> None:
        """
        C{twist loopd}: the start fails with L{UnsafeSocketError} naming the directory and
        its owner, says so on stderr, exits 1, and listens on nothing.
        """
        for taken in self.attacks():
            before = self.theirs()
            reactor = MemoryLoopdReactor()
            exits: list[int] = []
            stderr = io.StringIO()
            self.patch(sys, "stderr", stderr)
            service = LoopdService(reactor, parse_config(TOML), exit_process=exits.append)
            service.startService()
            error = self.failureResultOf(service.when_ready(), UnsafeSocketError).value
            self.assert_names(str(error), taken)
            self.assertIn("loopd: cannot start: unsafe socket directory", stderr.getvalue())
            self.assertEqual(reactor.unixServers, [])
            for call, args, kwargs in reactor.triggers["after"]["shutdown"]:
                call(*args, **kwargs)
            self.assertEqual(exits, [1])
            self.assertEqual(self.theirs(), before)

    def test_listen_refused_for_each_socket(self) -> None:
        """
        L{listen_unix} refuses both default sockets, the gateway's and the lease socket.
        """
        for taken in self.attacks():
            for path in (default_socket_path(), queue_socket_path(None)):
                error = self.assertRaises(
                    UnsafeSocketError, listen_unix, MemoryLoopdReactor(), path, Factory()
                )
                self.assert_names(str(error), taken)

    def test_chat_refuses_to_connect(self) -> None:
        """
        C{loopd chat} without a config exits 1 before connecting, saying why on stderr.
        """
        for taken in self.attacks():
            stderr = io.StringIO()
            self.patch(sys, "stderr", stderr)
            ran: list[object] = []
            status = cli.main(["chat"], run=partial(record_run, ran))
            self.assertEqual((status, ran), (1, []))
            self.assertIn("loopd chat: not connecting:", stderr.getvalue())
            self.assert_names(stderr.getvalue(), taken)

    def test_chat_turn_refuses_to_connect(self) -> None:
        """
        A chat turn checks again before each connection (the directory may be taken after
        the chat started): the turn fails with the reason and nothing is connected.
        """
        for taken in self.attacks():
            reactor = MemoryLoopdReactor()
            view = TurnView(tty=False)
            written: list[str] = []
            turn = stream_turn(
                reactor, default_socket_path(), {}, view, written.append, session_id="s"
            )
            self.assertIs(self.successResultOf(turn), view)
            assert view.error is not None
            self.assertIn("not connecting to loopd", view.error)
            self.assert_names(view.error, taken)
            self.assertEqual(reactor.unixClients, [])

    def test_queue_status_refuses_to_connect(self) -> None:
        """
        C{loopd queue status} on loopd's default lease socket fails with the reason.
        """
        for taken in self.attacks():
            reactor = MemoryLoopdReactor()
            failure = self.failureResultOf(
                fetch_status(reactor, queue_socket_path(None)), QueueStatusError
            )
            self.assert_names(failure.getErrorMessage(), taken)
            self.assertEqual(reactor.unixClients, [])

    def test_lease_client_refuses_to_connect(self) -> None:
        """
        The lease client fails with L{QueueUnavailable} (its cause the
        L{UnsafeSocketError}), neither connecting nor spawning a daemon.
        """
        for taken in self.attacks():
            reactor = MemoryLoopdReactor()
            spawned: list[None] = []
            connecting = connect_daemon(
                reactor,
                queue_socket_path(None),
                lambda: LeaseWire(lambda wire, message: None, lambda wire, reason: None),
                spawn=partial(spawned.append, None),
            )
            error = self.failureResultOf(connecting, QueueUnavailable).value
            self.assertIsInstance(error.__cause__, UnsafeSocketError)
            self.assert_names(str(error), taken)
            self.assertEqual((reactor.unixClients, spawned), ([], []))


class AgentDirTakeoverTests(SynchronousTestCase):
    """
    The lease daemon's agent dir (C{llm-queue.sock}) under the same rules, with a real
    second user.
    """

    def setUp(self) -> None:
        if not is_root():
            raise self.skipTest(NOT_ROOT)
        self.tmp = shared_temp_dir(self.addCleanup)

    def start(self, agent_dir: str) -> tuple[LlmQueueService, MemoryReactorClock, list[int], str]:
        """Start a daemon on a memory reactor in C{agent_dir}; the service, exits, stderr."""
        reactor = MemoryLoopdReactor()
        stderr = io.StringIO()
        exits: list[int] = []
        service = LlmQueueService(
            reactor,
            agent_dir,
            1000,
            None,
            stderr,
            exits.append,
            stdout=io.StringIO(),
            notifier_factory=lambda: FakeNotifier(None),
        )
        service.startService()
        self.addCleanup(service.stopService)
        return service, reactor, exits, stderr.getvalue()

    def test_foreign_agent_dir_refused(self) -> None:
        """
        An agent dir the second user made (0777) is refused: exit 1 with the reason, nothing
        listened on, nothing created in it.
        """
        agent = os.path.join(self.tmp, "agent")

        def attack() -> None:
            os.mkdir(agent)
            os.chmod(agent, 0o777)

        as_other_user(attack)
        service, reactor, exits, stderr = self.start(agent)
        self.assertEqual((exits, reactor.unixServers), ([1], []))
        self.assertIn(agent, stderr)
        self.assertIn(describe_owner(OTHER_UID), stderr)
        self.assertEqual(os.listdir(agent), [])

    def test_foreign_socket_in_own_agent_dir_refused(self) -> None:
        """
        The second user's socket at C{llm-queue.sock} in an agent dir of yours that was
        left open (0777) is refused and left in place: the daemon does not take it for
        stale, and the directory is not tightened over it.
        """
        agent = os.path.join(self.tmp, "agent")
        os.mkdir(agent)
        os.chmod(agent, 0o777)
        as_other_user(lambda: planted_socket(os.path.join(agent, "llm-queue.sock")))
        service, reactor, exits, stderr = self.start(agent)
        self.assertEqual((exits, reactor.unixServers), ([1], []))
        self.assertIn(os.path.join(agent, "llm-queue.sock"), stderr)
        self.assertIn(describe_owner(OTHER_UID), stderr)
        self.assertEqual(os.lstat(os.path.join(agent, "llm-queue.sock")).st_uid, OTHER_UID)
