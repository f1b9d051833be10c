"""The anchor of bench/queue.py: a raw Unix-socket JSON-line echo.

Run as ``python bench/_queue_echo.py PATH`` it listens on the Unix socket PATH
(mode 0600) and, from one single-threaded selectors loop, sends every complete
line it receives (one JSON object and its newline) back unchanged to the peer that
sent it, without parsing it, until its stdin reaches end of file or it is signalled.
It is what a newline-JSON server costs at the least: the same socket family, the same
framing and one process hop, with no protocol, JSON decoding or scheduling.

Imported, `start_echo` starts it as a child of bench/queue.py.
"""

from __future__ import annotations

import os
import selectors
import socket
import sys

from _servers import Children, wait_socket

RECV_SIZE = 65536
"""Bytes read per receive call."""


def _serve(listener: socket.socket) -> None:
    """Echo complete lines on every accepted connection until stdin closes."""
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "listener")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    pending: dict[socket.socket, bytes] = {}
    while True:
        for key, _mask in sel.select():
            conn = key.data
            if conn == "listener":
                conn, _addr = listener.accept()
                sel.register(conn, selectors.EVENT_READ, conn)
                pending[conn] = b""
            elif conn == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    return
            else:
                try:
                    data = conn.recv(RECV_SIZE)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(conn)
                    conn.close()
                    del pending[conn]
                    continue
                buffered = pending[conn] + data
                end = buffered.rfind(b"\n") + 1
                pending[conn] = buffered[end:]
                if end:
                    # A blocking send: the peer waits for its echo before it sends again.
                    conn.sendall(buffered[:end])


def start_echo(children: Children) -> str:
    """Start this file as a child of the run; return its socket path once it accepts."""
    path = os.path.join(children.dir, "echo.sock")
    argv = [sys.executable, os.path.abspath(__file__), path]
    proc = children.spawn("echo", argv, log=True)
    wait_socket(children, proc, "echo", path)
    return path


def main() -> int:
    """Listen on the path in argv[1] and echo lines until stdin closes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)
    try:
        listener.bind(sys.argv[1])
    finally:
        os.umask(previous)
    listener.listen(128)
    try:
        _serve(listener)
    finally:
        listener.close()
        os.unlink(sys.argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
