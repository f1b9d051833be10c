"""
L{loopd.unixsocket}: stale sockets reclaimed, live ones refused, mode 0600 from the start,
directories and sockets of other users refused, the largest backlog, and the check before
connecting; over real Unix sockets in a short temporary directory.

The cases with another user's files need root (C{chown}); they skip otherwise.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from typing import Any

from twisted.internet.defer import maybeDeferred
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import SynchronousTestCase, TestCase

from loopd.config import parse_config
from loopd.runtime_dir import describe_owner
from loopd.service import LoopdService
from loopd.test.support.peers import real_reactor
from loopd.test.support.second_user import NOT_ROOT, OTHER_UID, give_away, is_root
from loopd.testing.reactor import MemoryLoopdReactor
from loopd.unixsocket import (
    MAX_PATH_BYTES,
    SocketInUseError,
    SocketPathError,
    UnsafeSocketError,
    check_peer_socket,
    listen_unix,
    reclaim_stale_socket,
)

#: More simultaneous connects than Twisted's default backlog of 50 lets wait.
CONNECTS = 200


class UmaskRecordingReactor:
    """
    Delegates C{listenUNIX} to the real reactor, recording the umask in force at the call.
    """

    def __init__(self) -> None:
        self.umasks: list[int] = []

    def listenUNIX(self, *args: Any, **kwargs: Any) -> Any:
        current = os.umask(0)
        os.umask(current)
        self.umasks.append(current)
        return real_reactor().listenUNIX(*args, **kwargs)


class ListenUnixTests(TestCase):
    """
    L{listen_unix} prepares the path and listens with mode 0600.
    """

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.path = os.path.join(self.directory, "s.sock")

    def listen(self, path: str | None = None, reactor: Any = None) -> Any:
        port = listen_unix(
            reactor or real_reactor(), path or self.path, Factory.forProtocol(Protocol)
        )
        self.addCleanup(port.stopListening)
        return port

    def leave_stale_socket(self) -> None:
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(self.path)
        dead.close()

    def test_mode_0600(self) -> None:
        """
        The socket file is a socket with mode 0600.
        """
        self.listen()
        mode = os.stat(self.path).st_mode
        self.assertTrue(stat.S_ISSOCK(mode))
        self.assertEqual(stat.S_IMODE(mode), 0o600)

    def test_bound_under_umask(self) -> None:
        """
        The bind happens under umask 0177, so the file is never more open than 0600, and the
        process's umask is restored afterwards.
        """
        before = os.umask(0o022)
        self.addCleanup(os.umask, before)
        recorder = UmaskRecordingReactor()
        self.listen(reactor=recorder)
        self.assertEqual(recorder.umasks, [0o177])
        self.assertEqual(os.umask(0o022), 0o022)

    def test_missing_directory_created_0700(self) -> None:
        """
        A missing parent directory, and every missing one above it, is created with mode
        0700 whatever the umask.
        """
        previous = os.umask(0o002)
        self.addCleanup(os.umask, previous)
        path = os.path.join(self.directory, "a", "run", "s.sock")
        self.listen(path)
        for directory in (os.path.dirname(path), os.path.join(self.directory, "a")):
            self.assertEqual(stat.S_IMODE(os.stat(directory).st_mode), 0o700, directory)

    def test_stale_socket_replaced(self) -> None:
        """
        A socket file that nothing accepts on is removed and the new listener takes its place.
        """
        self.leave_stale_socket()
        self.listen()
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(client.close)
        client.connect(self.path)

    def test_live_socket_refused(self) -> None:
        """
        A socket another listener serves is left alone and the second listen is refused with
        a one-line reason.
        """
        self.listen()
        error = self.assertRaises(SocketInUseError, self.listen)
        self.assertIn(self.path, str(error))
        self.assertNotIn("\n", str(error))
        self.assertTrue(os.path.exists(self.path))

    def test_not_a_socket_refused(self) -> None:
        """
        A regular file at the path is refused and left untouched.
        """
        with open(self.path, "w") as f:
            f.write("keep me")
        error = self.assertRaises(SocketPathError, self.listen)
        for part in (self.path, "not a socket", "regular file", describe_owner(os.geteuid())):
            self.assertIn(part, str(error))
        self.assertIn("move it away", str(error))
        with open(self.path) as f:
            self.assertEqual(f.read(), "keep me")

    def test_path_too_long(self) -> None:
        """
        A path longer than the platform allows is refused, never truncated, and nothing is
        created.
        """
        path = os.path.join(self.directory, "d" * MAX_PATH_BYTES, "s.sock")
        error = self.assertRaises(SocketPathError, self.listen, path)
        self.assertIn(str(MAX_PATH_BYTES), str(error))
        self.assertEqual(os.listdir(self.directory), [])

    def test_unwritable_directory(self) -> None:
        """
        A directory that cannot be created gives a one-line reason.
        """
        blocker = os.path.join(self.directory, "file")
        open(blocker, "w").close()
        error = self.assertRaises(SocketPathError, self.listen, os.path.join(blocker, "s.sock"))
        self.assertIn("cannot create directory", str(error))

    def test_reclaim_reports(self) -> None:
        """
        L{reclaim_stale_socket} says whether it removed anything.
        """
        self.assertFalse(reclaim_stale_socket(self.path))
        self.leave_stale_socket()
        self.assertTrue(reclaim_stale_socket(self.path))
        self.assertFalse(os.path.exists(self.path))

    def test_stop_removes_socket(self) -> Any:
        """
        Stopping the port removes the socket file.
        """
        port = listen_unix(real_reactor(), self.path, Factory.forProtocol(Protocol))
        d = maybeDeferred(port.stopListening)
        d.addCallback(lambda _: self.assertFalse(os.path.exists(self.path)))
        return d

    def test_backlog_is_the_platform_maximum(self) -> None:
        """
        The listen backlog is C{socket.SOMAXCONN}: 200 simultaneous connects to a listener
        that has not accepted yet all succeed, where Twisted's default of 50 refuses every
        one past the 51st with C{EAGAIN}.
        """
        port = self.listen()
        failed = []
        for _ in range(CONNECTS):
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.addCleanup(client.close)
            client.setblocking(False)
            try:
                client.connect(self.path)
            except BlockingIOError:
                failed.append(client)
        self.assertEqual(len(failed), 0)
        self.assertEqual(port.backlog, socket.SOMAXCONN)

    def test_backlog_named(self) -> None:
        """
        A caller may name the backlog.
        """
        port: Any = listen_unix(real_reactor(), self.path, Factory.forProtocol(Protocol), backlog=7)
        self.addCleanup(port.stopListening)
        self.assertEqual(port.backlog, 7)


class OwnershipTests(TestCase):
    """
    L{listen_unix} refuses a directory or a socket file that another user controls, and
    touches neither.
    """

    def setUp(self) -> None:
        if not is_root():
            raise self.skipTest(NOT_ROOT)
        self.directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def listen(self, path: str) -> Any:
        return listen_unix(real_reactor(), path, Factory.forProtocol(Protocol))

    def test_foreign_socket_refused(self) -> None:
        """
        A socket file another user owns is refused without being probed or removed: the
        message names it, its owner and what to do.
        """
        path = os.path.join(self.directory, "s.sock")
        planted = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        planted.bind(path)
        planted.close()
        give_away(path)
        error = self.assertRaises(UnsafeSocketError, self.listen, path)
        for part in (path, "socket", describe_owner(OTHER_UID), "remove it"):
            self.assertIn(part, str(error))
        self.assertEqual(os.lstat(path).st_uid, OTHER_UID)

    def test_foreign_directory_refused(self) -> None:
        """
        A socket directory another user owns is refused, and nothing is created in it.
        """
        run = os.path.join(self.directory, "run")
        os.mkdir(run, 0o700)
        give_away(run)
        error = self.assertRaises(UnsafeSocketError, self.listen, os.path.join(run, "s.sock"))
        self.assertIn(describe_owner(OTHER_UID), str(error))
        self.assertEqual(os.listdir(run), [])

    def test_symlinked_directory_refused(self) -> None:
        """
        A socket directory that is another user's symlink is refused.
        """
        target = os.path.join(self.directory, "target")
        os.mkdir(target, 0o700)
        link = os.path.join(self.directory, "run")
        os.symlink(target, link)
        give_away(link)
        error = self.assertRaises(UnsafeSocketError, self.listen, os.path.join(link, "s.sock"))
        self.assertIn("symlink", str(error))
        self.assertEqual(os.listdir(target), [])

    def test_open_directory_with_foreign_file_refused(self) -> None:
        """
        A socket directory with mode 0777 that holds another user's file is refused and
        left as it is.
        """
        run = os.path.join(self.directory, "run")
        os.mkdir(run)
        os.chmod(run, 0o777)
        planted = os.path.join(run, "s.sock")
        with open(planted, "w"):
            pass
        give_away(planted)
        error = self.assertRaises(UnsafeSocketError, self.listen, planted)
        self.assertIn("0777", str(error))
        self.assertEqual(stat.S_IMODE(os.stat(run).st_mode), 0o777)
        self.assertEqual(os.listdir(run), ["s.sock"])


class CheckPeerSocketTests(TestCase):
    """
    L{check_peer_socket}: a client connects only to a socket that you or root put in a
    directory nobody else controls.
    """

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.path = os.path.join(self.directory, "s.sock")

    def bind(self, path: str) -> None:
        """Leave a (stale) socket file of yours at C{path}."""
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(path)
        dead.close()

    def test_own_socket_passes(self) -> None:
        """
        Your socket in your 0700 directory passes; so does a symlink of yours to it.
        """
        self.bind(self.path)
        check_peer_socket(self.path)
        link = os.path.join(self.directory, "link.sock")
        os.symlink("s.sock", link)
        check_peer_socket(link)

    def test_missing_passes(self) -> None:
        """
        A missing socket (or directory) passes: the connection then says nothing is there.
        """
        check_peer_socket(self.path)
        check_peer_socket(os.path.join(self.directory, "none", "s.sock"))
        self.assertEqual(os.listdir(self.directory), [])

    def test_not_a_socket_refused(self) -> None:
        """
        A regular file is refused, naming it and what it is.
        """
        with open(self.path, "w"):
            pass
        error = self.assertRaises(SocketPathError, check_peer_socket, self.path)
        self.assertIn(self.path, str(error))
        self.assertIn("regular file", str(error))

    def test_open_directory_refused(self) -> None:
        """
        A socket in a directory others may write to is refused, and nothing is changed.
        """
        os.chmod(self.directory, 0o777)
        self.bind(self.path)
        error = self.assertRaises(UnsafeSocketError, check_peer_socket, self.path)
        self.assertIn("chmod 700", str(error))
        self.assertEqual(stat.S_IMODE(os.stat(self.directory).st_mode), 0o777)

    def test_foreign_socket_refused(self) -> None:
        """
        A socket another user owns is refused: they may be listening there.
        """
        if not is_root():
            raise self.skipTest(NOT_ROOT)
        self.bind(self.path)
        give_away(self.path)
        error = self.assertRaises(UnsafeSocketError, check_peer_socket, self.path)
        self.assertIn(describe_owner(OTHER_UID), str(error))
        self.assertIn("not connecting", str(error))


class ServiceBacklogTests(SynchronousTestCase):
    """
    C{twist loopd} listens on the gateway's socket and the lease socket with C{[server]
    backlog}, by default C{socket.SOMAXCONN}.
    """

    def backlogs(self, toml: str) -> dict[str, int]:
        """Start the service of C{toml} on a memory reactor; each socket's backlog."""
        runtime = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, runtime, True)
        self.patch(os, "environ", {**os.environ, "XDG_RUNTIME_DIR": runtime})
        reactor = MemoryLoopdReactor()
        endpoint = '[[endpoint]]\nname = "remote"\nsocket = "/tmp/ld/r.sock"\nkind = "openai"\n'
        service = LoopdService(reactor, parse_config(toml + endpoint))
        service.startService()
        self.successResultOf(service.when_ready())
        self.addCleanup(service.stopService)
        return {os.path.basename(path): backlog for path, _, backlog, _, _ in reactor.unixServers}

    def test_default(self) -> None:
        """Without the key both sockets get the platform's largest backlog."""
        self.assertEqual(
            self.backlogs(""), {"loopd.sock": socket.SOMAXCONN, "llm-queue.sock": socket.SOMAXCONN}
        )

    def test_configured(self) -> None:
        """C{[server] backlog} applies to both sockets."""
        self.assertEqual(
            self.backlogs("[server]\nbacklog = 200\n"), {"loopd.sock": 200, "llm-queue.sock": 200}
        )
