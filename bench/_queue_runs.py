"""Parts 1 and 2 of bench/queue.py: grant latency and acquire/release cycles.

Part 1 (`measure_handoffs`): two blocking connections, sessions ``a`` and ``b``, share
the one slot of the queue ``handoff`` (the defaults: maxStreams 1). The holder sends
``release`` and the clock runs until the waiter's connection has read its ``granted``
line; then the old holder reads its ``ok``, acquires again and sends a bare ``renew``
whose ``ok`` proves its ``acquire`` is queued before the next hand-off starts, and the
two swap roles. Each hand-off is preceded by one round trip of a line of the same
length through the echo (bench/_queue_echo.py, the anchor), so that load from
elsewhere on the machine falls on both alike. The garbage collector is off while it
runs.

Part 2 (`measure_cycles`): ``clients`` non-blocking connections driven by one selectors
loop, each a session looping ``acquire`` -> ``granted`` -> ``release`` -> ``ok`` on the
queue `Mode.queue_of` gives it. After an untimed warm-up it counts the cycles that
complete in the timed window, and the CPU time the daemon and this process used in it.
"""

from __future__ import annotations

import contextlib
import gc
import selectors
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from _queue_stack import BARRIER, OK, RECV_SIZE, Daemon, LineSocket, check_granted, cpu_ns, message
from _servers import BenchError

HANDOFF_QUEUE = "handoff"
"""Part 1's queue: not in the config, so it has the defaults (one slot)."""
GRANTED = b'{"op":"granted"'
"""How a ``granted`` reply starts (the daemon writes compact JSON, ``op`` first)."""


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Keep the cyclic garbage collector out of a timed loop."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@dataclass
class Handoffs:
    """Part 1's samples in ns: hand-offs (release -> granted) and echo round trips."""

    grant: list[int] = field(default_factory=list)
    echo: list[int] = field(default_factory=list)


def measure_handoffs(
    daemon: str, echo: str, handoffs: int, warmup: int, timeout: float
) -> Handoffs:
    """Run warmup + handoffs rounds of one echo and one hand-off; return the timed ones."""
    out = Handoffs()
    sides = [(LineSocket(daemon, timeout), key) for key in ("a", "b")]
    anchor = LineSocket(echo, timeout)
    try:
        acquire = {key: message("acquire", HANDOFF_QUEUE, key) + BARRIER for _s, key in sides}
        release = {key: message("release", HANDOFF_QUEUE, key) for _s, key in sides}
        (holder, held), (waiter, waiting) = sides
        holder.send(message("acquire", HANDOFF_QUEUE, held))
        holder.expect_granted(held)
        waiter.send(acquire[waiting])
        waiter.expect(OK)
        ping = release[held]
        clock = time.perf_counter_ns
        with no_gc():
            for i in range(warmup + handoffs):
                start = clock()
                anchor.send(ping)
                line = anchor.read_line()
                echo_ns = clock() - start
                if line + b"\n" != ping:
                    raise BenchError(f"the echo sent back {line[:200]!r}")
                start = clock()
                holder.send(release[held])
                line = waiter.read_line()
                grant_ns = clock() - start
                check_granted(line, waiting)
                holder.expect(OK)
                holder.send(acquire[held])
                holder.expect(OK)
                if i >= warmup:
                    out.grant.append(grant_ns)
                    out.echo.append(echo_ns)
                (holder, held), (waiter, waiting) = (waiter, waiting), (holder, held)
    finally:
        for sock, _key in sides:
            sock.close()
        anchor.close()
    return out


@dataclass(frozen=True)
class Mode:
    """A queue layout of part 2's clients: its label, config and key per client."""

    name: str
    queues: dict[str, dict[str, object]]
    queue_of: Callable[[int], str]


def modes(most_clients: int) -> tuple[Mode, ...]:
    """Return part 2's three queue layouts, for at most most_clients clients."""
    return (
        Mode("a queue per client (maxStreams 1)", {}, lambda i: f"own-{i}"),
        Mode(
            f"one queue, maxStreams {most_clients}",
            {"wide": {"maxStreams": most_clients}},
            lambda i: "wide",
        ),
        Mode("one queue, maxStreams 1", {}, lambda i: "serial"),
    )


@dataclass(frozen=True)
class Cycles:
    """Part 2's figures for one client count: cycles and CPU times in the timed window."""

    cycles: int
    wall_ns: int
    daemon_cpu_ns: int
    client_cpu_ns: int

    @property
    def per_second(self) -> float:
        """Completed cycles per second."""
        return self.cycles / (self.wall_ns / 1e9)

    @property
    def daemon_cpu(self) -> float:
        """The daemon's CPU use as a percentage of one CPU."""
        return 100.0 * self.daemon_cpu_ns / self.wall_ns

    @property
    def client_cpu(self) -> float:
        """This process's CPU use as a percentage of one CPU."""
        return 100.0 * self.client_cpu_ns / self.wall_ns


class _Cycler:
    """One part 2 client: its socket, its two requests and its partial input."""

    __slots__ = ("sock", "acquire", "release", "mine", "buffer")

    def __init__(self, sock: socket.socket, queue_key: str, session_key: str) -> None:
        """Wrap a connected non-blocking socket for session_key on queue_key."""
        self.sock = sock
        self.acquire = message("acquire", queue_key, session_key)
        self.release = message("release", queue_key, session_key)
        self.mine = f'"sessionKey":"{session_key}"'.encode()
        self.buffer = b""

    def send(self, line: bytes) -> None:
        """Send one request; with one request in flight the socket never fills."""
        if self.sock.send(line) != len(line):
            raise BenchError("a request did not fit the socket buffer")


def _handle(cycler: _Cycler) -> int:
    """Read what one client received, answer it, and return the cycles it completed."""
    data = cycler.sock.recv(RECV_SIZE)
    if not data:
        raise BenchError("the daemon closed a connection")
    *lines, cycler.buffer = (cycler.buffer + data).split(b"\n")
    done = 0
    for line in lines:
        if line == OK:
            done += 1
            cycler.send(cycler.acquire)
        elif line.startswith(GRANTED) and cycler.mine in line:
            cycler.send(cycler.release)
        else:
            raise BenchError(f"unexpected reply {line[:200]!r}")
    return done


def measure_cycles(
    daemon: Daemon, mode: Mode, clients: int, seconds: float, warmup: float, timeout: float
) -> Cycles:
    """Run clients cycling sessions for warmup + seconds; return the timed window's figures."""
    sel = selectors.DefaultSelector()
    cyclers: list[_Cycler] = []
    clock = time.perf_counter_ns
    pid = daemon.proc.pid
    try:
        for i in range(clients):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(daemon.socket)
            sock.setblocking(False)
            cyclers.append(_Cycler(sock, mode.queue_of(i), f"s{i}"))
            sel.register(sock, selectors.EVENT_READ, cyclers[-1])
        for cycler in cyclers:
            cycler.send(cycler.acquire)
        mark = clock() + int(warmup * 1e9)
        end = mark + int(seconds * 1e9)
        done = 0
        start: tuple[int, int, int, int] | None = None
        with no_gc():
            while True:
                events = sel.select(timeout)
                if not events:
                    raise BenchError("no reply within the I/O timeout")
                for key, _mask in events:
                    done += _handle(key.data)
                now = clock()
                if start is None:
                    if now >= mark:
                        start = (done, now, cpu_ns(pid), time.process_time_ns())
                elif now >= end:
                    break
        return Cycles(
            done - start[0],
            now - start[1],
            cpu_ns(pid) - start[2],
            time.process_time_ns() - start[3],
        )
    finally:
        sel.close()
        for cycler in cyclers:
            cycler.sock.close()
