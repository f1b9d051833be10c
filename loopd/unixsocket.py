# -*- test-case-name: loopd.test.test_unixsocket -*-
"""
Listening on a Unix socket safely: stale files reclaimed, live ones refused, mode 0600 from
the first instant.

Twisted's C{listenUNIX} binds first and chmods afterwards, leaves a stale socket file in the
way (C{EADDRINUSE}) and never probes whether another process still serves the path. This
module does these four steps instead, once, for every loopd listener:

 1. A path longer than the platform's C{sun_path} is refused (never truncated).
 2. A missing parent directory is created with mode 0700. An existing one is left as it is:
    it may be shared, such as C{/tmp}.
 3. An existing path is probed: not a socket → refused; a socket that accepts a connection →
    another process serves it → L{SocketInUseError}; a socket that refuses → stale → unlinked.
 4. The bind happens under C{umask(0o177)}, so the socket file is 0600 from the moment it
    exists, and Twisted's chmod then confirms 0600.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import sys
from typing import Any

from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IReactorUNIX
from twisted.internet.protocol import Factory

__all__ = [
    "MAX_PATH_BYTES",
    "SocketInUseError",
    "SocketPathError",
    "UnixSocketError",
    "listen_unix",
    "reclaim_stale_socket",
]

#: The longest socket path the platform accepts, in bytes, without the terminating NUL.
MAX_PATH_BYTES = 107 if sys.platform.startswith("linux") else 103

_SOCKET_MODE = 0o600
_DIRECTORY_MODE = 0o700
# With this umask bind() creates the socket file as 0600 (0777 & ~0177).
_BIND_UMASK = 0o177


class UnixSocketError(Exception):
    """
    A Unix socket could not be listened on; the message is one line that says why.
    """


class SocketInUseError(UnixSocketError):
    """
    Another process is accepting connections on the path.
    """


class SocketPathError(UnixSocketError):
    """
    The path cannot hold a listening socket: too long, not a socket, or not writable.
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
    Remove C{path} if it is a socket file that nothing accepts on.

    @return: C{True} if a stale socket was removed, C{False} if nothing was there.
    @raise SocketInUseError: a process accepts connections on C{path}.
    @raise SocketPathError: C{path} exists and is not a socket.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise SocketPathError(f"{path} exists and is not a socket")
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


def _ensure_parent(path: str) -> None:
    """
    Create the directory of C{path} if it is missing. Only the directory itself gets mode
    0700 (under the umask); parents that C{os.makedirs} creates above it get the default
    mode.

    @raise SocketPathError: the directory cannot be created.
    """
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, mode=_DIRECTORY_MODE, exist_ok=True)
    except OSError as e:
        raise SocketPathError(f"cannot create directory {parent}: {e.strerror}") from None


def listen_unix(
    reactor: IReactorUNIX, path: str, factory: Factory[Any], backlog: int = 50
) -> IListeningPort:
    """
    Listen on the Unix socket C{path} with mode 0600, reclaiming a stale socket file.

    @param reactor: the reactor to listen with.
    @param path: the socket's filesystem path.
    @param factory: builds a protocol for each accepted connection.
    @param backlog: the listen backlog.
    @return: the listening port; stopping it removes the socket file.
    @raise UnixSocketError: (one of its subclasses) with a one-line reason.
    """
    _check_length(path)
    _ensure_parent(path)
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
