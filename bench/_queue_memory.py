"""Part 3 of bench/queue.py: the daemon's memory with many queued waiters.

On a daemon of its own (nothing else has run on it): after one ``status`` round trip
it reads the idle daemon's resident memory. One connection takes the only slot of the
queue ``memory`` (the defaults: maxStreams 1), ``connections`` more connections each
send a bare ``renew`` (so they are open and counted), and it reads the memory again.
Then every connection sends its share of ``waiters`` acquires (sessions ``w0``,
``w1``, ... dealt round the connections) and a bare ``renew``; once every ``ok`` is
back, every acquire is queued, and it reads the memory a third time. The growth
between the last two readings, divided by the waiter count, is the cost of a waiter.

Two timings come with it, because a deep queue is where per-waiter scans show: how
long the queueing took, and ``drain`` hand-offs at that depth, each timed from the
holder's ``release`` until the next waiter (the first in the ``status`` reply's
enqueue order) reads its ``granted`` on its connection, which then holds the slot and
releases it in turn. Last, every connection is closed, and a fresh connection's
``acquire`` on the same queue is timed until it is granted: that is when the daemon has
dropped every waiter and released the slot.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from _queue_runs import no_gc
from _queue_stack import BARRIER, OK, Daemon, LineSocket, check_granted, message, rss_bytes
from _servers import BenchError

MEMORY_QUEUE = "memory"
"""Part 3's queue: not in the config, so it has the defaults (one slot)."""


@dataclass
class Memory:
    """Part 3's figures: memory in bytes and times in ns."""

    waiters: int
    connections: int
    idle: int = 0
    connected: int = 0
    queued: int = 0
    queue_ns: int = 0
    drain: list[int] = field(default_factory=list)
    disconnect_ns: int = 0

    @property
    def per_waiter(self) -> float:
        """The memory growth per queued waiter, in bytes."""
        return (self.queued - self.connected) / self.waiters


def _waiting_order(daemon: Daemon, timeout: float, expected: int) -> list[str]:
    """Return the session keys waiting on the queue, in enqueue order, from ``status``."""
    probe = LineSocket(daemon.socket, timeout)
    try:
        probe.send(message("status"))
        reply = json.loads(probe.read_line())
    finally:
        probe.close()
    for queue in reply.get("queues", []):
        if queue.get("queueKey") == MEMORY_QUEUE:
            order = [entry["sessionKey"] for entry in queue["waiting"]]
            if len(order) != expected:
                raise BenchError(f"status lists {len(order)} waiters, not {expected}")
            return order
    raise BenchError(f"status lists no queue {MEMORY_QUEUE!r}")


def measure_memory(
    daemon: Daemon, waiters: int, connections: int, drain: int, timeout: float
) -> Memory:
    """Queue waiters on connections behind one holder; return the memory and timings."""
    out = Memory(waiters, connections)
    pid = daemon.proc.pid
    clock = time.perf_counter_ns
    probe = LineSocket(daemon.socket, timeout)
    probe.send(message("status"))
    probe.read_line()
    probe.close()
    out.idle = rss_bytes(pid)
    holder = LineSocket(daemon.socket, timeout)
    conns: list[LineSocket] = []
    try:
        holder.send(message("acquire", MEMORY_QUEUE, "holder"))
        holder.expect_granted("holder")
        conns.extend(LineSocket(daemon.socket, timeout) for _ in range(connections))
        for conn in conns:
            conn.send(BARRIER)
        for conn in conns:
            conn.expect(OK)
        out.connected = rss_bytes(pid)
        start = clock()
        for n, conn in enumerate(conns):
            keys = range(n, waiters, connections)
            conn.send(b"".join(message("acquire", MEMORY_QUEUE, f"w{k}") for k in keys) + BARRIER)
        for conn in conns:
            conn.expect(OK)
        out.queue_ns = clock() - start
        out.queued = rss_bytes(pid)
        order = _waiting_order(daemon, timeout, waiters)
        owner = {f"w{k}": conns[k % connections] for k in range(waiters)}
        current, key = holder, "holder"
        with no_gc():
            for nxt in order[:drain]:
                start = clock()
                current.send(message("release", MEMORY_QUEUE, key))
                line = owner[nxt].read_line()
                out.drain.append(clock() - start)
                check_granted(line, nxt)
                current.expect(OK)
                current, key = owner[nxt], nxt
        start = clock()
    finally:
        holder.close()
        for conn in conns:
            conn.close()
    last = LineSocket(daemon.socket, timeout)
    try:
        last.send(message("acquire", MEMORY_QUEUE, "last"))
        last.expect_granted("last")
        out.disconnect_ns = clock() - start
    finally:
        last.close()
    return out
