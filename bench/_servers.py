"""The server side of bench/proxy.py: upstream servers and child processes.

Run as ``python bench/_servers.py`` it is the upstream: a byte sink and an
echo on 127.0.0.1 (bench/proxy.py starts it in a process of its own, so the
servers never share a GIL with the measuring client). It listens on two
ephemeral TCP ports, prints ``ports <sink> <echo>`` on one line and serves
both from one single-threaded selectors loop until its stdin reaches end of
file or it is signalled.

The sink counts what it receives until the peer half-closes, then replies with
the decimal byte count and a newline and closes. The echo sends back whatever
it receives until the peer closes.

Imported, it gives bench/proxy.py the handling of its child processes: the
upstream servers and the forwarders (socat, inferproxy) under test.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

RECV_SIZE = 1 << 20
"""Bytes read per receive call: large, so the sink is never the bottleneck."""
READY_TIMEOUT = 30.0
"""Seconds a started process has to become ready."""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The checkout root, where the children run."""


class BenchError(Exception):
    """A measurement or a child process failed."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    """Turn SIGTERM or SIGHUP into SystemExit, so the children get stopped."""
    raise SystemExit(128 + signum)


def exit_on_signals() -> None:
    """Make SIGTERM and SIGHUP end the benchmark through its cleanup (SystemExit)."""
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)


def ignore_exit_signals() -> None:
    """Ignore SIGINT, SIGTERM and SIGHUP from now on, so that cleanup runs to its end."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def run_guarded(work: Callable[[], None], errors: tuple[type[BaseException], ...]) -> int:
    """Run a benchmark's body: 0 when it ran, 1 (with the error on stderr) for one of
    errors, 130 on Ctrl-C; SIGTERM and SIGHUP stop it through its cleanup."""
    exit_on_signals()
    try:
        work()
    except errors as e:
        print(f"ERROR: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


class _Conn:
    """One accepted connection: its role, byte count and unsent output."""

    __slots__ = ("sock", "echo", "count", "pending", "closing", "events")

    def __init__(self, sock: socket.socket, echo: bool) -> None:
        """Wrap an accepted non-blocking socket; echo selects the echo role."""
        self.sock = sock
        self.echo = echo
        self.count = 0
        self.pending = b""
        self.closing = False
        self.events = selectors.EVENT_READ


def _listen() -> socket.socket:
    """Return a non-blocking TCP listener on an ephemeral 127.0.0.1 port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class Servers:
    """The sink and echo listeners and their connections, in one event loop."""

    def __init__(self, sink: socket.socket, echo: socket.socket) -> None:
        """Register both listeners and stdin (whose end means: stop)."""
        self.sel = selectors.DefaultSelector()
        self.buf = bytearray(RECV_SIZE)
        self.view = memoryview(self.buf)
        self.running = True
        self.sel.register(sink, selectors.EVENT_READ, (sink, False))
        self.sel.register(echo, selectors.EVENT_READ, (echo, True))
        self.sel.register(sys.stdin.fileno(), selectors.EVENT_READ, None)

    def serve(self) -> None:
        """Run the loop until stdin closes."""
        while self.running:
            for key, _mask in self.sel.select():
                data = key.data
                if isinstance(data, _Conn):
                    if data.pending:
                        self._flush(data)
                    else:
                        self._readable(data)
                elif data is not None:
                    self._accept(data[0], data[1])
                elif not os.read(sys.stdin.fileno(), 4096):
                    self.running = False

    def _accept(self, listener: socket.socket, echo: bool) -> None:
        """Accept every pending connection on one listener."""
        while True:
            try:
                sock, _addr = listener.accept()
            except OSError:  # BlockingIOError once the backlog is empty
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, echo)
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def _readable(self, conn: _Conn) -> None:
        """Read once from a connection and act on its role."""
        try:
            n = conn.sock.recv_into(self.buf)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        if n == 0:
            if conn.echo:
                self._close(conn)
                return
            conn.pending = b"%d\n" % conn.count
            conn.closing = True
            self._flush(conn)
        elif conn.echo:
            conn.pending = bytes(self.view[:n])
            self._flush(conn)
        else:
            conn.count += n

    def _flush(self, conn: _Conn) -> None:
        """Send what is pending; while any is left, stop reading (backpressure)."""
        try:
            sent = conn.sock.send(conn.pending)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close(conn)
            return
        conn.pending = conn.pending[sent:]
        if conn.pending:
            self._want(conn, selectors.EVENT_WRITE)
        elif conn.closing:
            self._close(conn)
        else:
            self._want(conn, selectors.EVENT_READ)

    def _want(self, conn: _Conn, events: int) -> None:
        """Change the events a connection waits for, if they differ."""
        if conn.events != events:
            conn.events = events
            self.sel.modify(conn.sock, events, conn)

    def _close(self, conn: _Conn) -> None:
        """Forget and close a connection."""
        self.sel.unregister(conn.sock)
        conn.sock.close()


class Children:
    """The child processes and temp dir of one run; stop() ends them all."""

    def __init__(self) -> None:
        """Create the short temp dir for sockets and logs."""
        self.dir = tempfile.mkdtemp(prefix="lb", dir="/tmp")
        self.procs: list[tuple[str, subprocess.Popen[bytes], str | None]] = []

    def spawn(
        self,
        name: str,
        argv: list[str],
        log: bool,
        cwd: str = ROOT,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start argv in its own process group, in cwd (the checkout root) with env (this
        process's); log: output to a file, else a pipe."""
        logpath = os.path.join(self.dir, f"{name}.log") if log else None
        with open(logpath or os.devnull, "wb") as logfile:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=logfile if log else subprocess.PIPE,
                stderr=subprocess.STDOUT if log else None,
                start_new_session=True,
            )
        self.procs.append((name, proc, logpath))
        return proc

    def log_tail(self, proc: subprocess.Popen[bytes]) -> str:
        """Return the last lines a process logged, for an error message."""
        for _name, other, logpath in self.procs:
            if other is proc and logpath:
                with open(logpath, "rb") as f:
                    lines = f.read().decode(errors="replace").splitlines()
                return "\n".join(lines[-10:])
        return ""

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """Stop one child: close stdin, SIGTERM its group, SIGKILL if need be."""
        if proc.stdin:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        # socat's per-connection children share the group; sweep them too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.stdout:
            proc.stdout.close()

    def stop_all(self) -> None:
        """Stop every child still running and remove the temp dir."""
        for _name, proc, _log in reversed(self.procs):
            self.stop(proc)
        shutil.rmtree(self.dir, ignore_errors=True)


def start_upstream(children: Children) -> tuple[int, int]:
    """Start this file as the upstream servers; return their (sink, echo) ports."""
    argv = [sys.executable, os.path.abspath(__file__)]
    proc = children.spawn("servers", argv, log=False)
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(READY_TIMEOUT):
            raise BenchError("upstream servers did not start in time")
    words = proc.stdout.readline().split()
    if len(words) != 3 or words[0] != b"ports":
        raise BenchError(f"upstream servers said {b' '.join(words)!r}")
    return int(words[1]), int(words[2])


def start_forwarder(children: Children, name: str, template: str, port: int) -> str:
    """Start a Unix->TCP forwarder to 127.0.0.1:port; return its path once ready.

    template is a command line with {listen}, {upstream} and {python} fields.
    """
    listen = os.path.join(children.dir, f"{name}.sock")
    values = {
        "listen": listen,
        "upstream": f"127.0.0.1:{port}",
        "python": sys.executable,
    }
    argv = [arg.format(**values) for arg in shlex.split(template)]
    proc = children.spawn(name, argv, log=True)
    wait_socket(children, proc, name, listen)
    return listen


def wait_socket(children: Children, proc: Any, name: str, path: str) -> None:
    """Wait until a child accepts connections on the Unix socket at path."""
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        if proc.poll() is not None:
            tail = children.log_tail(proc)
            raise BenchError(f"{name} exited with {proc.returncode}:\n{tail}")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(path)
        except OSError:
            if time.monotonic() > deadline:
                raise BenchError(f"{name} not accepting after {READY_TIMEOUT}s") from None
            time.sleep(0.05)
        else:
            return


def main() -> int:
    """Listen, announce the ports on stdout, and serve until stdin closes."""
    sink = _listen()
    echo = _listen()
    print(f"ports {sink.getsockname()[1]} {echo.getsockname()[1]}", flush=True)
    Servers(sink, echo).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
