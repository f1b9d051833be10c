"""The daemon under test in bench/queue.py, what /proc says about it, and a line client.

`start_daemon` gives the daemon an agent dir of its own in the run's temp dir, writes
its ``llm-queue.json`` (``daemonIdleExitMs`` 10^9, so it never idle-exits between the
measurements, plus the queue entries a part needs) and starts it from the command
template (by default ``python -m twisted llmqueue --agent-dir DIR --sweep-ms 1000``,
the real daemon) as a child of the run, then waits until its socket accepts.

`rss_bytes` and `cpu_ns` read the daemon's resident memory (``VmRSS`` in
``/proc/<pid>/status``) and the CPU time it used (user + system, ``/proc/<pid>/stat``).

`Placement` pins this process and the servers it starts (daemon, echo) to CPUs: the
same one, two different ones, or none (the kernel's choice).

`LineSocket` is the blocking client of parts 1 and 3: newline-delimited JSON over a Unix
socket, one line sent or read at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from _servers import BenchError, Children, wait_socket

from loopd.queue.paths import config_path, socket_path

DAEMON_CMD = "{python} -m twisted llmqueue --agent-dir {agent_dir} --sweep-ms 1000"
"""How the daemon under test is started (from the checkout root)."""
IDLE_EXIT_MS = 1_000_000_000
"""``defaults.daemonIdleExitMs``: long enough that the daemon stays up for the whole run."""
RECV_SIZE = 65536
"""Bytes read per receive call."""


@dataclass(frozen=True)
class Daemon:
    """A running daemon: its process and its socket path."""

    proc: subprocess.Popen[bytes]
    socket: str


def start_daemon(
    children: Children,
    name: str,
    template: str,
    queues: Mapping[str, Mapping[str, object]] | None = None,
) -> Daemon:
    """Start a daemon with its own agent dir and config; return it once it accepts.

    name names its agent dir and log file; queues become the config's ``queues``.
    """
    agent_dir = os.path.join(children.dir, name)
    os.mkdir(agent_dir, 0o700)
    config = {"defaults": {"daemonIdleExitMs": IDLE_EXIT_MS}, "queues": dict(queues or {})}
    with open(config_path(agent_dir), "w", encoding="utf-8") as f:
        json.dump(config, f)
    values = {"python": sys.executable, "agent_dir": agent_dir}
    argv = [arg.format(**values) for arg in shlex.split(template)]
    proc = children.spawn(name, argv, log=True)
    path = socket_path(agent_dir)
    wait_socket(children, proc, name, path)
    return Daemon(proc, path)


PLACEMENTS = ("split", "same", "none")
"""``--pin``: client and servers on two CPUs, all on one CPU, or left to the kernel."""


_START_AFFINITY = frozenset(os.sched_getaffinity(0))
"""The CPUs this process could use when it started, before any pinning."""


@dataclass(frozen=True)
class Placement:
    """The CPUs of this process (the client) and of the servers; None: any CPU."""

    name: str
    client: frozenset[int] | None
    servers: frozenset[int] | None

    @classmethod
    def choose(cls, name: str) -> Placement:
        """Return the placement name describes, on the CPUs this process may use."""
        allowed = sorted(os.sched_getaffinity(0))
        if name == "none":
            return cls(name, None, None)
        if name == "split":
            if len(allowed) < 2:
                raise BenchError("--pin split needs two CPUs")
            return cls(name, frozenset(allowed[:1]), frozenset(allowed[1:2]))
        return cls(name, frozenset(allowed[:1]), frozenset(allowed[:1]))

    def describe(self) -> str:
        """Say where the processes run, for the headers."""
        if self.client is None or self.servers is None:
            return "placed by the kernel"
        if self.client == self.servers:
            return f"all pinned to CPU {min(self.client)}"
        return f"client pinned to CPU {min(self.client)}, servers to CPU {min(self.servers)}"

    def release_client(self) -> None:
        """Let this process, and the children it starts next, use every CPU again."""
        if self.client is not None:
            os.sched_setaffinity(0, _START_AFFINITY)

    def pin_client(self) -> None:
        """Pin this process to its CPUs."""
        if self.client is not None:
            os.sched_setaffinity(0, self.client)

    @contextlib.contextmanager
    def spawning(self) -> Iterator[None]:
        """Run the block on the servers' CPUs, so the children it starts inherit them."""
        if self.servers is None or self.servers == self.client:
            yield
            return
        previous = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.servers)
        try:
            yield
        finally:
            os.sched_setaffinity(0, previous)


def rss_bytes(pid: int) -> int:
    """Return the resident set size of process pid, in bytes (VmRSS)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise BenchError(f"no VmRSS for process {pid}")


def cpu_ns(pid: int) -> int:
    """Return the user + system CPU time process pid has used so far, in ns."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        # The fields after the command name, which is in parentheses and may hold spaces.
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def message(op: str, queue_key: str | None = None, session_key: str | None = None) -> bytes:
    """Return one request line: op with its queueKey and sessionKey when given."""
    body: dict[str, str] = {"op": op}
    if queue_key is not None:
        body["queueKey"] = queue_key
    if session_key is not None:
        body["sessionKey"] = session_key
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


BARRIER = message("renew")
"""A bare heartbeat: its ``ok`` reply says every earlier request of the connection ran."""
OK = b'{"op":"ok"}'
"""The reply to ``release`` and to a bare ``renew``."""


def check_granted(line: bytes, session_key: str) -> None:
    """Fail unless line is the ``granted`` reply of session_key."""
    if not line.startswith(b'{"op":"granted"') or json.loads(line)["sessionKey"] != session_key:
        raise BenchError(f"expected the grant of {session_key!r}, got {line[:200]!r}")


class LineSocket:
    """A blocking newline-JSON connection to a Unix socket."""

    def __init__(self, path: str, timeout: float) -> None:
        """Connect to path; a read waits at most timeout seconds for its line."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        # A kernel timeout: settimeout() would add a poll() before every read.
        timeval = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        """Send one or more whole lines."""
        self.sock.sendall(data)

    def read_line(self) -> bytes:
        """Return the next line, without its newline."""
        while True:
            end = self.buffer.find(b"\n")
            if end >= 0:
                line, self.buffer = self.buffer[:end], self.buffer[end + 1 :]
                return line
            try:
                data = self.sock.recv(RECV_SIZE)
            except BlockingIOError:  # SO_RCVTIMEO ran out
                raise BenchError("no reply within the I/O timeout") from None
            if not data:
                raise BenchError("the daemon closed the connection")
            self.buffer += data

    def expect(self, want: bytes) -> None:
        """Read the next line and fail unless it is want."""
        line = self.read_line()
        if line != want:
            raise BenchError(f"expected {want!r}, got {line[:200]!r}")

    def expect_granted(self, session_key: str) -> None:
        """Read the next line and fail unless it grants session_key."""
        check_granted(self.read_line(), session_key)

    def close(self) -> None:
        """Close the connection."""
        self.sock.close()
