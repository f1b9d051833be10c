"""The body of bench/queue.py (its docstring says what it measures): the options, the
order of the parts, and the report.

It lives apart from bench/queue.py because a script in bench/ has bench/ first on
``sys.path``, so ``bench/queue.py`` is what ``import queue`` finds there; that file
does nothing but hand ``main`` over, or the standard library's ``queue`` to an importer.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from _lease_turns import TurnsResult, measure_all, print_turns
from _queue_echo import start_echo
from _queue_memory import Memory, measure_memory
from _queue_runs import (
    Cycles,
    Handoffs,
    Mode,
    measure_cycles,
    measure_handoffs,
    modes,
)
from _queue_stack import DAEMON_CMD, PLACEMENTS, Daemon, Placement, start_daemon
from _report import W, non_negative, percentile, positive, verdict
from _servers import BenchError, Children, ignore_exit_signals, run_guarded

RATIO_GOAL = 3.0
"""The hand-off p50 may be at most this many times the echo round trip's p50."""
CYCLES_GOAL = 20_000.0
"""Cycles per second the two layouts without waiting should reach with 100 clients."""
GOAL_CLIENTS = 100
"""The client count the cycles goal is set for."""
CYCLES_WARMUP = 0.5
"""Untimed seconds before each part 2 window."""
MIB = 1 << 20
"""Bytes in a MiB."""


def _us(samples: list[int], q: float) -> float:
    """Return the q-quantile of ns samples in microseconds."""
    return percentile(samples, q) * 1000.0


def _context(args: argparse.Namespace) -> str:
    """Return the CPU count, the placement and the load average, for the headers."""
    load = ", ".join(f"{x:.2f}" for x in args.load_before)
    where = args.placement.describe()
    return f"{os.cpu_count()} CPUs, {where} (load average before the run: {load})"


def print_handoffs(out: Handoffs, args: argparse.Namespace) -> None:
    """Print part 1's percentiles, the ratios and the goal."""
    header = (
        f"Part 1, grant latency: {args.handoffs} hand-offs of one slot between two"
        f" connections (after {args.warmup} untimed), each timed from the holder's release"
        " to the waiter reading its granted line; the anchor, interleaved one to one: a"
        " raw Unix-socket JSON-line echo round trip of a line of the same length. "
        + _context(args)
        + "."
    )
    print("\n" + textwrap.fill(header, 88))
    print("\n" + " " * W + f"{'hand-off':>10}{'echo':>10}{'ratio':>10}")
    for label, q in (("p50 us", 0.5), ("p90 us", 0.9), ("p99 us", 0.99)):
        grant, echo = _us(out.grant, q), _us(out.echo, q)
        print(f"{label:<{W}}{grant:>10.1f}{echo:>10.1f}{grant / echo:>10.2f}")
    ratio = percentile(out.grant, 0.5) / percentile(out.echo, 0.5)
    print(f"\n{'p50 hand-off / p50 echo':<{W}}{ratio:>10.2f}   {verdict(ratio, '<=', RATIO_GOAL)}")


def print_cycles(results: dict[str, dict[int, Cycles]], args: argparse.Namespace) -> None:
    """Print part 2's cycles and CPU use per queue layout and client count, and the goal."""
    header = (
        "Part 2, cycles: clients each looping acquire -> granted -> release -> ok, one"
        f" selectors loop in this process; {args.cycles_seconds:g} s timed per client count"
        f" after {CYCLES_WARMUP:g} s; a fresh daemon per layout. CPU is a percentage of"
        " one CPU over the timed window. " + _context(args) + "."
    )
    print("\n" + textwrap.fill(header, 88))
    counts = args.clients
    print(f"\n{'clients':<{W}}" + "".join(f"{n:>10}" for n in counts))
    for title, get, fmt in (
        ("cycles/s", lambda c: c.per_second, ".0f"),
        ("daemon CPU %", lambda c: c.daemon_cpu, ".0f"),
        ("client CPU %", lambda c: c.client_cpu, ".0f"),
    ):
        print(title)
        for name, row in results.items():
            cells = "".join(f"{format(get(row[n]), fmt):>10}" for n in counts)
            print(f"  {name:<{W - 2}}{cells}")
    if GOAL_CLIENTS not in counts:
        return
    print()
    for name, row in list(results.items())[:2]:
        value = row[GOAL_CLIENTS].per_second
        label = f"{GOAL_CLIENTS} clients, {name.split(' (')[0]}"
        print(f"{label:<{W}}{value:>10.0f}   {verdict(value, '>=', CYCLES_GOAL)}")


def print_memory(out: Memory, handoffs: Handoffs | None, args: argparse.Namespace) -> None:
    """Print part 3's memory readings, the growth per waiter and the timings."""
    header = (
        f"Part 3, memory: the resident memory (VmRSS) of a fresh daemon, idle, then with one"
        f" holder and {out.connections} more connections, then with {out.waiters} acquires"
        f" queued from those connections behind the holder; {len(out.drain)} hand-offs at"
        " that depth; then every connection closed. " + _context(args) + "."
    )
    print("\n" + textwrap.fill(header, 88))
    print()
    rows: list[tuple[str, str]] = [
        ("idle daemon, MiB", f"{out.idle / MIB:.1f}"),
        (f"holder + {out.connections} connections, MiB", f"{out.connected / MIB:.1f}"),
        (f"with {out.waiters} waiters, MiB", f"{out.queued / MIB:.1f}"),
        ("growth per waiter, bytes", f"{out.per_waiter:.0f}"),
        (f"queueing {out.waiters} acquires, ms", f"{out.queue_ns / 1e6:.1f}"),
        ("acquires queued per second", f"{out.waiters / (out.queue_ns / 1e9):.0f}"),
    ]
    if out.drain:
        rows += [
            (f"hand-off at depth {out.waiters}, p50 us", f"{_us(out.drain, 0.5):.1f}"),
            (f"hand-off at depth {out.waiters}, p99 us", f"{_us(out.drain, 0.99):.1f}"),
        ]
        if handoffs is not None:
            ratio = percentile(out.drain, 0.5) / percentile(handoffs.grant, 0.5)
            rows.append(("  p50 / part 1's p50 (depth 1)", f"{ratio:.2f}"))
    rows.append(
        (f"closing {out.connections + 1} connections, ms", f"{out.disconnect_ns / 1e6:.1f}")
    )
    for label, value in rows:
        print(f"{label:<{W}}{value:>10}")


def run(args: argparse.Namespace) -> None:
    """Start the children each part needs, run the parts asked for, print their reports."""
    args.load_before = os.getloadavg()
    children = Children()
    handoffs: Handoffs | None = None
    cycles: dict[str, dict[int, Cycles]] | None = None
    memory: Memory | None = None
    turns: list[tuple[str, dict[str, TurnsResult]]] | None = None
    try:
        if args.part in ("all", "latency"):
            print(f"  part 1: {args.warmup} + {args.handoffs} hand-offs ...", file=sys.stderr)
            daemon = _daemon(children, "latency", args)
            with args.placement.spawning():
                echo = start_echo(children)
            handoffs = measure_handoffs(
                daemon.socket, echo, args.handoffs, args.warmup, args.io_timeout
            )
            children.stop(daemon.proc)
        if args.part in ("all", "cycles"):
            cycles = {}
            for n, mode in enumerate(modes(max(args.clients))):
                cycles[mode.name] = _cycles(children, f"cycles{n}", mode, args)
        if args.part in ("all", "memory"):
            print(f"  part 3: {args.waiters} waiters ...", file=sys.stderr)
            daemon = _daemon(children, "memory", args)
            memory = measure_memory(
                daemon, args.waiters, args.connections, args.drain, args.io_timeout
            )
        if args.part in ("all", "turns"):
            # llama.cpp, inferproxy and loopd get every CPU, not the client's one.
            args.placement.release_client()
            print("  part 4: sessions taking turns on a one-slot server ...", file=sys.stderr)
            turns = measure_all(args.threads, args.sessions, args.turns, args.think)
    finally:
        ignore_exit_signals()
        children.stop_all()
    if args.part != "turns":
        print(f"\nThe daemon under test: {args.daemon_cmd}")
    if handoffs is not None:
        print_handoffs(handoffs, args)
    if cycles is not None:
        print_cycles(cycles, args)
    if memory is not None:
        print_memory(memory, handoffs, args)
    if turns is not None:
        print_turns(turns, args.sessions, args.turns, args.think)


def _daemon(
    children: Children,
    name: str,
    args: argparse.Namespace,
    queues: dict[str, dict[str, object]] | None = None,
) -> Daemon:
    """Start a fresh daemon on the servers' CPUs."""
    with args.placement.spawning():
        return start_daemon(children, name, args.daemon_cmd, queues)


def _cycles(
    children: Children, name: str, mode: Mode, args: argparse.Namespace
) -> dict[int, Cycles]:
    """Run part 2 for one queue layout on a fresh daemon; return the figures per count."""
    daemon = _daemon(children, name, args, mode.queues)
    row = {}
    for clients in args.clients:
        print(f"  part 2: {mode.name}, {clients} clients ...", file=sys.stderr)
        row[clients] = measure_cycles(
            daemon, mode, clients, args.cycles_seconds, CYCLES_WARMUP, args.io_timeout
        )
    children.stop(daemon.proc)
    return row


def _client_counts(text: str) -> list[int]:
    """Parse ``--clients``: comma-separated positive integers."""
    return [positive(part) for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description="Benchmark the lease daemon: grant latency, cycles per second, memory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    parts = ("all", "latency", "cycles", "memory", "turns")
    add("--part", choices=parts, default="all", help="what to run")
    add("--handoffs", type=positive, default=10_000, help="part 1: timed hand-offs")
    add("--warmup", type=non_negative, default=200, help="part 1: untimed hand-offs first")
    add("--clients", type=_client_counts, default="1,10,100", help="part 2: client counts")
    add("--cycles-seconds", type=float, default=5.0, help="part 2: timed seconds per count")
    add("--waiters", type=positive, default=10_000, help="part 3: queued acquires")
    add("--connections", type=positive, default=100, help="part 3: connections they come on")
    add("--drain", type=non_negative, default=200, help="part 3: hand-offs timed at depth")
    add("--sessions", type=positive, default=4, help="part 4: agent sessions")
    add("--turns", type=positive, default=4, help="part 4: turns per session")
    add("--think", type=float, default=0.2, help="part 4: seconds between a session's turns")
    add("--threads", type=positive, default=2, help="part 4: llama.cpp threads")
    add("--daemon-cmd", default=DAEMON_CMD, help="daemon command template")
    add(
        "--pin",
        choices=PLACEMENTS,
        default="split",
        help="CPUs: client and servers on two (split), all on one (same), or the kernel's (none)",
    )
    add("--io-timeout", type=float, default=30.0, help="longest wait for a reply, s")
    args = parser.parse_args(argv)
    if not args.clients:
        parser.error("--clients: give at least one count")
    if args.cycles_seconds <= 0:
        parser.error("--cycles-seconds must be positive")
    args.drain = min(args.drain, args.waiters)
    try:
        args.placement = Placement.choose(args.pin)
    except BenchError as e:
        parser.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    args = parse_args(argv)
    args.placement.pin_client()
    return run_guarded(lambda: run(args), (BenchError, OSError, ValueError))
