# -*- test-case-name: loopd.test.test_unixsocket -*-
"""
Listening on a Unix socket safely: in a directory nobody else controls, stale files
reclaimed, live ones refused, mode 0600 from the first instant, the platform's largest
backlog; and checking a socket before connecting to it.

Twisted's C{listenUNIX} binds first and chmods afterwards, leaves a stale socket file in the
way (C{EADDRINUSE}), never probes whether another process still serves the path, and uses a
backlog of 50. This module does these steps instead, once, for every loopd listener:

 1. A path longer than the platform's C{sun_path} is refused (never truncated).
 2. The socket's directory is made safe by L{loopd.runtime_dir.prepare_directory}: missing
    directories are created with mode 0700; a directory that someone other than you and
    root controls (owner, mode, a symlink on the way) is refused (L{UnsafeSocketError}).
 3. An existing path is examined: not a socket → refused; a socket owned by someone else →
    refused (L{UnsafeSocketError}), never probed nor removed; a socket of yours that accepts
    a connection → another process serves it → L{SocketInUseError}; one that refuses →
    stale → unlinked.
 4. The bind happens under C{umask(0o177)}, so the socket file is 0600 from the moment it
    exists, and Twisted's chmod then confirms 0600. The backlog is C{socket.SOMAXCONN}
    unless the caller names one (the kernel caps it at C{net.core.somaxconn}).

Before connecting, L{check_peer_socket} applies the same rules without changing anything,
so that a client never talks to a listener planted by another user.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import sys
from collections.abc import Callable
from typing import Any

from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IReactorUNIX
from twisted.internet.protocol import Factory

from loopd.runtime_dir import (
    DirectoryError,
    UnsafeDirectoryError,
    check_directory,
    describe,
    describe_owner,
    prepare_directory,
)

__all__ = [
    "MAX_PATH_BYTES",
    "SocketInUseError",
    "SocketPathError",
    "UnixSocketError",
    "UnsafeSocketError",
    "check_peer_socket",
    "listen_unix",
    "reclaim_stale_socket",
]

#: The longest socket path the platform accepts, in bytes, without the terminating NUL.
MAX_PATH_BYTES = 107 if sys.platform.startswith("linux") else 103

_SOCKET_MODE = 0o600
# As many symlinks as Linux follows in one path before ELOOP.
_MAX_LINKS = 40
# With this umask bind() creates the socket file as 0600 (0777 & ~0177).
_BIND_UMASK = 0o177


class UnixSocketError(Exception):
    """
    A Unix socket could not be listened on, or is not safe to connect to; the message is one
    line that says why.
    """


class SocketInUseError(UnixSocketError):
    """
    Another process is accepting connections on the path.
    """


class SocketPathError(UnixSocketError):
    """
    The path cannot hold a listening socket: too long, not a socket, or not writable.
    """


class UnsafeSocketError(SocketPathError):
    """
    Someone other than you and root controls the socket's directory (or one above it), or
    owns the socket file; the message names the path, its owner and what to do.
    """


def _check_length(path: str) -> None:
    """
    @raise SocketPathError: C{path} is longer than L{MAX_PATH_BYTES} once encoded.
    """
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise SocketPathError(
            f"socket path is {len(os.fsencode(path))} bytes, longer than the "
            f"platform's limit of {MAX_PATH_BYTES}: {path}"
        )


def reclaim_stale_socket(path: str) -> bool:
    """
    Remove C{path} if it is a socket file of yours that nothing accepts on.

    @return: C{True} if a stale socket was removed, C{False} if nothing was there.
    @raise SocketInUseError: a process accepts connections on C{path}.
    @raise UnsafeSocketError: C{path} is a socket owned by someone else (never probed).
    @raise SocketPathError: C{path} exists and is not a socket.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(info.st_mode):
        raise SocketPathError(
            f"{path} exists and is not a socket: it is {describe(info)}; move it away "
            "or choose another socket path"
        )
    if info.st_uid != os.geteuid():
        raise UnsafeSocketError(
            f"{path} is {describe(info)}, not yours (you are {describe_owner(os.geteuid())}); "
            "remove it (as its owner or root) or choose another socket path"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except BlockingIOError:
        # The listener's backlog is full: it is alive, merely busy.
        raise SocketInUseError(f"{path} is in use by another process") from None
    finally:
        probe.close()
    raise SocketInUseError(f"{path} is in use by another process")


def _directory_of(path: str) -> str:
    """The directory that holds C{path}, as the kernel resolves it (C{..} not folded)."""
    return os.path.dirname(path) or "."


def _directory_errors(check: Callable[[str], None], directory: str) -> None:
    """
    Run C{check} on C{directory}, raising its failure as this module's errors.
    """
    try:
        check(directory)
    except UnsafeDirectoryError as e:
        raise UnsafeSocketError(str(e)) from None
    except DirectoryError as e:
        raise SocketPathError(str(e)) from None


def check_peer_socket(path: str) -> None:
    """
    Check, before connecting, that the socket at C{path} is one that only you or root could
    have put there: its directory and every one above it pass
    L{loopd.runtime_dir.check_directory}, and the file, if there is one, is a socket owned by
    you or root (a symlink owned by you or root is followed and its target checked). A
    missing path passes: the connection attempt then says that nothing is there.

    @raise UnsafeSocketError: someone else controls the directory or owns the socket.
    @raise SocketPathError: the file is not a socket, or a directory on the way is not one.
    """
    trusted = {os.geteuid(), 0}
    for _ in range(_MAX_LINKS + 1):
        _directory_errors(check_directory, _directory_of(path))
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise SocketPathError(f"cannot check {path}: {e.strerror}") from None
        if info.st_uid not in trusted:
            raise UnsafeSocketError(
                f"{path} is {describe(info)}, not yours (you are {describe_owner(os.geteuid())}) "
                "nor root's: another user may be listening there; not connecting (remove "
                "it as its owner or root, or pass another socket)"
            )
        if stat.S_ISSOCK(info.st_mode):
            return
        if not stat.S_ISLNK(info.st_mode):
            raise SocketPathError(f"{path} is {describe(info)}, not a socket")
        path = os.path.join(_directory_of(path), os.readlink(path))
    raise SocketPathError(f"cannot check {path}: too many symlinks")


def listen_unix(
    reactor: IReactorUNIX,
    path: str,
    factory: Factory[Any],
    backlog: int = socket.SOMAXCONN,
) -> IListeningPort:
    """
    Listen on the Unix socket C{path} with mode 0600, in a directory nobody else controls,
    reclaiming a stale socket file of yours.

    @param reactor: the reactor to listen with.
    @param path: the socket's filesystem path.
    @param factory: builds a protocol for each accepted connection.
    @param backlog: the listen backlog; by default the platform's largest.
    @return: the listening port; stopping it removes the socket file.
    @raise UnixSocketError: (one of its subclasses) with a one-line reason.
    """
    _check_length(path)
    _directory_errors(prepare_directory, _directory_of(path))
    reclaim_stale_socket(path)
    previous = os.umask(_BIND_UMASK)
    try:
        return reactor.listenUNIX(path, factory, backlog=backlog, mode=_SOCKET_MODE, wantPID=False)
    except CannotListenError as e:
        reason = e.socketError
        if isinstance(reason, OSError) and reason.errno == errno.EADDRINUSE:
            raise SocketInUseError(f"{path} is in use by another process") from None
        detail = getattr(reason, "strerror", None) or str(reason)
        raise SocketPathError(f"cannot listen on {path}: {detail}") from None
    finally:
        os.umask(previous)
