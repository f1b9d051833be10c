"""Benchmark of the lease daemon (``twist llmqueue``): grant latency, cycles, memory.

Run from the checkout root with ``python bench/queue.py``; ``--help`` lists the
options. The daemon under test is the real one, ``python -m twisted llmqueue
--agent-dir DIR --sweep-ms 1000``, started afresh for each part (and for each queue
layout of part 2) with an agent dir of its own whose ``llm-queue.json`` sets
``daemonIdleExitMs`` to 10^9, so it stays up between measurements
(bench/_queue_stack.py; ``--daemon-cmd`` replaces the command). The clients are this
process: blocking sockets for parts 1 and 3, one selectors loop for part 2.

Part 1, grant latency (bench/_queue_runs.py): two sessions on two connections
ping-pong the one slot of a queue; a hand-off is timed from the holder's ``release``
until the waiter's connection has read its ``granted``. ``--handoffs`` (10,000) timed
ones after ``--warmup`` (200). The anchor, measured in the same run and interleaved
one to one with the hand-offs: the round trip of a line of the same length through a
raw Unix-socket JSON-line echo (bench/_queue_echo.py, one line in, the same line
out). It prints p50, p90 and p99 of both and their ratio (goal: hand-off p50 at most
3x the echo's).

Part 2, cycles (bench/_queue_runs.py): 1, 10 and 100 clients (``--clients``), each a
session looping acquire -> granted -> release -> ok, for ``--cycles-seconds`` (5) each
after a 0.5 s warm-up, in three queue layouts: a queue of its own per client
(maxStreams 1: no client ever waits, and the queue count grows with the clients), one
queue with maxStreams equal to the most clients (no client ever waits, all in one
queue), and one queue with maxStreams 1 (every cycle is a hand-off to a queued waiter,
so it is bound by part 1's latency). The first two measure the protocol and the
scheduler rather than serialisation; the goal (at least 20,000 cycles/s with 100
clients) is judged on them. It also prints the CPU the daemon and the client used, to
show which one is the limit.

Part 3, memory (bench/_queue_memory.py): the daemon's resident memory (VmRSS) idle,
with one holder and ``--connections`` (100) more connections, and with ``--waiters``
(10,000) acquires queued from those connections; the growth per waiter; how long the
queueing took, ``--drain`` (200) hand-offs at that depth (p50, p99) and dropping them
all by closing the connections.

Part 4, sessions taking turns (bench/_lease_turns.py, the reason the scheduler exists):
``--sessions`` (4) agent sessions, each ``--turns`` (4) turns with a long system prompt
and ``--think`` (0.2) s between its turns, all at once on a real llama.cpp server with ONE
slot, straight to it and through ``twist loopd`` (grace 3 s). It prints the prompt tokens
the server evaluated (``timings.prompt_n``) on each path and how many fewer through loopd
(goal: at least 50 % fewer), once with the server's RAM prompt cache off and once as
llama.cpp ships it (8 GiB, which holds every session of the tiny model: a real model's KV
does not fit so many). Part 4 runs unpinned.

``--pin`` places the processes: by default (``split``) this process on one CPU and the
daemon and the echo on another, so that every round trip, anchor or hand-off, crosses
CPUs alike and the client never competes with the daemon for a CPU; ``same`` puts all
on one CPU (each request then also pays for the client's CPU time), ``none`` leaves it
to the kernel. It matters on this 2-vCPU VM: a round trip that wakes a process on the
other, idle vCPU costs about 90 us more than one on the same vCPU, and left to the
kernel the light echo tends to share the client's CPU while the daemon does not, which
would count the difference against the daemon.

``--part`` runs one part only. The exit status is 0 when every measurement ran (goals
met or not), else 1.

The code is in bench/_queue_main.py and the ``_queue_*`` modules. This file's name is
the standard library's too, and every script in bench/ has bench/ first on
``sys.path``: imported as ``queue`` (Twisted's thread pool does that in
bench/gateway.py), it hands the importer the standard library's module instead.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _hand_over_stdlib_queue() -> None:
    """Put the standard library's ``queue`` in sys.modules in place of this file.

    Every script in bench/ runs with bench/ first on ``sys.path``, so ``import queue``
    (Twisted's thread pool does it) finds this file. An import returns whatever
    sys.modules holds once the module has run, so the importer gets the real one.
    """
    here = os.path.dirname(os.path.realpath(__file__))
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("queue", path)
    if spec is None or spec.loader is None:
        raise ImportError("the standard library's queue module was not found", name="queue")
    module = importlib.util.module_from_spec(spec)
    sys.modules["queue"] = module
    spec.loader.exec_module(module)


if __name__ == "__main__":
    from _queue_main import main

    sys.exit(main())
elif __name__ == "queue":
    _hand_over_stdlib_queue()
