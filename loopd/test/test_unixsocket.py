"""
L{loopd.unixsocket}: stale sockets reclaimed, live ones refused, mode 0600 from the start,
over real Unix sockets in a short temporary directory.
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
from twisted.trial.unittest import TestCase

from loopd.test.support.peers import real_reactor
from loopd.unixsocket import (
    MAX_PATH_BYTES,
    SocketInUseError,
    SocketPathError,
    listen_unix,
    reclaim_stale_socket,
)


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
        A missing parent directory is created with mode 0700.
        """
        path = os.path.join(self.directory, "run", "s.sock")
        self.listen(path)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode), 0o700)

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
        self.assertIn("not a socket", str(error))
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
