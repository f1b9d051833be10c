"""Benchmark of inferproxy (Unix socket -> TCP forwarder) against socat and direct TCP.

Run from the checkout root with ``python bench/proxy.py`` (``tox -e bench``);
``--help`` lists the options. socat must be on PATH.

Three paths lead to the same upstream servers on 127.0.0.1 (a byte sink and an
echo, run by bench/_servers.py in a process of their own): a direct TCP
connection, ``socat UNIX-LISTEN:<path>,fork,mode=600 TCP:127.0.0.1:<port>``,
and ``python -m twisted inferproxy``. For each path, in one run, it measures:

- throughput: MB/s (10^6 bytes per second) moving ``--bytes`` (default 1 GiB)
  in 256 KiB sends to the sink, timed from the first send until the sink has
  acknowledged the byte count after the client's half-close;
- round-trip latency: ``--pings`` (10000) ping-pongs of 100 bytes on one
  connection to the echo, median and p99 in microseconds;
- set-up time: ``--connects`` (1000) fresh connections, each timed from
  before connect until a 1-byte echo comes back, median and p99 in us.

The run has ``--rounds`` rounds (3), each measuring the paths in turn, so
that load from elsewhere on the machine falls on all of them alike: every
round moves ``--bytes`` per path (throughput is the median of the rounds),
while the pings and connects are spread over the rounds and pooled. Each
measurement is preceded by a short untimed warm-up. It prints every
figure for the three paths, the ratios of inferproxy to its socat anchor from
the same run, and the goals (throughput ratio >= 0.5, added round-trip
latency ratio <= 1, issue 15) with PASS or MISS. ``--proxy-cmd`` replaces the command
that starts inferproxy, so socat can stand in for it. ``--cpu N`` pins every
process to one CPU: steadier figures that weigh CPU cost per message, where
the default leaves placement (and its wake-up costs) to the scheduler. The
exit status is 0 when every measurement ran (goals met or not), else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import shutil
import socket
import statistics
import struct
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from _servers import (
    BenchError,
    Children,
    exit_on_signals,
    ignore_exit_signals,
    start_forwarder,
    start_upstream,
)

CHUNK = 256 * 1024
"""Bytes per send in the throughput test."""
PING_SIZE = 100
"""Bytes per ping in the latency test."""
PATHS = ("direct", "socat", "inferproxy")
"""Every path, in the order measured and printed."""
DEFAULT_PROXY_CMD = (
    "{python} -m twisted inferproxy --listen {listen} --upstream {upstream}"
    " --max-connections 64 --burst 1000000 --refill 1000000"
)
"""How inferproxy is started (from the checkout root)."""
SOCAT_CMD = "socat UNIX-LISTEN:{listen},fork,mode=600 TCP:{upstream}"
"""The anchor: socat forwarding the same way."""


T = TypeVar("T")


@dataclass(frozen=True)
class Target:
    """Where a client connects: a TCP (host, port) or a Unix socket path."""

    address: str | tuple[str, int]

    def connect(self, timeout: float) -> socket.socket:
        """Return a connected blocking socket (TCP_NODELAY on TCP)."""
        if isinstance(self.address, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Kernel timeouts rather than settimeout(): settimeout() would add a
        # poll() before every call and so to every figure measured.
        tv = struct.pack("ll", int(timeout), int((timeout % 1) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        try:
            sock.connect(self.address)
        except BaseException:
            sock.close()
            raise
        return sock


def percentile(samples: list[int], q: float) -> float | None:
    """Return the nearest-rank q-quantile (0 < q <= 1) of ns samples in us."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1] / 1000.0


@dataclass
class Figures:
    """What one path gave over every round: samples, figures and errors."""

    mbps_rounds: list[float] = field(default_factory=list)
    rtt: list[int] = field(default_factory=list)
    setup: list[int] = field(default_factory=list)
    refused: int = 0
    rtt_added: float | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def mbps(self) -> float | None:
        """Median throughput of the rounds, MB/s."""
        return statistics.median(self.mbps_rounds) if self.mbps_rounds else None

    @property
    def complete(self) -> bool:
        """Whether every figure was measured."""
        return bool(self.mbps_rounds and self.rtt and self.setup)


def parse_size(text: str) -> int:
    """Parse a positive byte count with an optional K, M or G (binary) suffix."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    value = int(float(text[:-1] if scale > 1 else text) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def positive(text: str) -> int:
    """Parse a positive integer option."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill view from sock; fail if the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise BenchError("connection closed by peer")
        got += n


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Keep the cyclic garbage collector out of a timed loop."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def transfer(target: Target, nbytes: int, timeout: float) -> float:
    """Send nbytes to the sink, wait for its count, and return MB/s."""
    block = memoryview(bytes(CHUNK))
    sock = target.connect(timeout)
    try:
        start = time.perf_counter_ns()
        left = nbytes
        while left >= CHUNK:
            sock.sendall(block)
            left -= CHUNK
        if left:
            sock.sendall(block[:left])
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while not reply.endswith(b"\n"):
            more = sock.recv(64)
            if not more:
                break
            reply += more
        elapsed = time.perf_counter_ns() - start
    finally:
        sock.close()
    if reply.strip() != str(nbytes).encode():
        raise BenchError(f"sink counted {reply!r}, expected {nbytes}")
    return nbytes / (elapsed / 1e9) / 1e6


def measure_throughput(target: Target, nbytes: int, timeout: float) -> float:
    """Warm up with a small transfer, then time one of nbytes; return MB/s."""
    transfer(target, min(nbytes, 32 << 20), timeout)
    with no_gc():
        return transfer(target, nbytes, timeout)


def measure_rtt(sock: socket.socket, pings: int) -> list[int]:
    """Return the round-trip times in ns of pings 100-byte ping-pongs on sock."""
    payload = bytes(range(PING_SIZE))
    view = memoryview(bytearray(PING_SIZE))
    samples: list[int] = []
    clock = time.perf_counter_ns
    with no_gc():
        for _ in range(pings):
            start = clock()
            sock.sendall(payload)
            recv_exact(sock, view)
            samples.append(clock() - start)
    if view.tobytes() != payload:
        raise BenchError("echo returned different bytes")
    return samples


def measure_setup(target: Target, connects: int, timeout: float) -> tuple[list[int], int]:
    """Time connect plus a 1-byte echo over fresh connections.

    Returns the times in ns of the connections that got their echo back, and
    how many were closed (refused) before it.
    """
    samples: list[int] = []
    refused = 0
    view = memoryview(bytearray(1))
    clock = time.perf_counter_ns
    warmup = min(20, connects)
    with no_gc():
        for i in range(connects + warmup):
            start = clock()
            sock = target.connect(timeout)
            try:
                sock.sendall(b"x")
                recv_exact(sock, view)
                end = clock()
            except (BenchError, ConnectionResetError, BrokenPipeError):
                refused += i >= warmup
                continue
            finally:
                sock.close()
            if i >= warmup:
                samples.append(end - start)
    return samples, refused


def attempt(figs: Figures, label: str, measure: Callable[[], T]) -> T | None:
    """Run one measurement; on failure record the error in figs, return None."""
    print(f"  {label} ...", file=sys.stderr, flush=True)
    try:
        return measure()
    except (BenchError, OSError) as e:
        figs.errors.append(f"{label}: {e}")
        return None


@dataclass
class Path:
    """One path under test: its targets, its ping connection and its figures."""

    name: str
    sink: Target
    echo: Target
    figs: Figures = field(default_factory=Figures)
    pinger: socket.socket | None = None


def open_path(children: Children, name: str, ports: tuple[int, int], proxy_cmd: str) -> Path:
    """Return a path to the (sink, echo) ports, starting its forwarders."""
    if name == "direct":
        return Path(name, Target(("127.0.0.1", ports[0])), Target(("127.0.0.1", ports[1])))
    template = SOCAT_CMD if name == "socat" else proxy_cmd
    sink = start_forwarder(children, f"{name}-sink", template, ports[0])
    echo = start_forwarder(children, f"{name}-echo", template, ports[1])
    return Path(name, Target(sink), Target(echo))


def ping(path: Path, pings: int, timeout: float) -> list[int]:
    """Ping on the path's one ping connection, opening and warming it first.

    After a failure the connection is dropped, so the next round starts afresh.
    """
    try:
        if path.pinger is None:
            path.pinger = path.echo.connect(timeout)
            measure_rtt(path.pinger, 200)
        return measure_rtt(path.pinger, pings)
    except BaseException:
        if path.pinger is not None:
            path.pinger.close()
            path.pinger = None
        raise


def share(total: int, rounds: int, n: int) -> int:
    """Return round n's (0-based) share of total spread over rounds."""
    return total // rounds + (n < total % rounds)


def measure_path(path: Path, args: argparse.Namespace, n: int) -> None:
    """Run round n of the three measurements on one path, adding to its figures."""
    figs, timeout = path.figs, args.io_timeout
    label = f"round {n + 1}/{args.rounds} {path.name}"
    mbps = attempt(
        figs,
        f"{label} throughput",
        lambda: measure_throughput(path.sink, args.bytes, timeout),
    )
    if mbps is not None:
        figs.mbps_rounds.append(mbps)
    pings = share(args.pings, args.rounds, n)
    rtt = attempt(figs, f"{label} round trip", lambda: ping(path, pings, timeout))
    figs.rtt += rtt or []
    connects = share(args.connects, args.rounds, n)
    setup = attempt(figs, f"{label} set-up", lambda: measure_setup(path.echo, connects, timeout))
    if setup is not None:
        figs.setup += setup[0]
        figs.refused += setup[1]


def _ratio(num: float | None, den: float | None) -> float | None:
    """Return num/den, or None when either is missing or den is not positive."""
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _verdict(value: float | None, op: str, goal: float) -> str:
    """Say whether a ratio meets its goal (op is ">=" or "<=", "" for none)."""
    if not op:
        return "(no goal)"
    if value is None:
        return f"goal {op} {goal:g}  n/a"
    met = value >= goal if op == ">=" else value <= goal
    return f"goal {op} {goal:g}  {'PASS' if met else 'MISS'}"


ROWS: tuple[tuple[str, Callable[[Figures], float | None]], ...] = (
    ("throughput MB/s (median of rounds)", lambda f: f.mbps),
    ("throughput MB/s, slowest round", lambda f: min(f.mbps_rounds, default=None)),
    ("throughput MB/s, fastest round", lambda f: max(f.mbps_rounds, default=None)),
    ("round trip median us", lambda f: percentile(f.rtt, 0.5)),
    ("round trip p99 us", lambda f: percentile(f.rtt, 0.99)),
    ("round trip added (median - direct) us", lambda f: f.rtt_added),
    ("set-up median us", lambda f: percentile(f.setup, 0.5)),
    ("set-up p99 us", lambda f: percentile(f.setup, 0.99)),
)
"""The table: a label and a figure per row."""


def print_report(results: dict[str, Figures], args: argparse.Namespace) -> None:
    """Print every figure per path, the ratios against socat and the goals."""
    direct = percentile(results.get("direct", Figures()).rtt, 0.5)
    for figs in results.values():
        median = percentile(figs.rtt, 0.5)
        if median is not None and direct is not None:
            figs.rtt_added = median - direct
    cpus = f"{os.cpu_count()} CPUs"
    if args.cpu is not None:
        cpus = f"all pinned to CPU {args.cpu} of {cpus}"
    header = (
        f"inferproxy benchmark: {cpus}, shared by the client, the upstream servers"
        " and the forwarder: the figures are CPU-bound and noisy. "
        f"{args.rounds} rounds, each path in turn. Per path: {args.bytes / 2**20:g}"
        f" MiB in {CHUNK >> 10} KiB sends per round; {args.pings} pings of"
        f" {PING_SIZE} B on one connection and {args.connects} connects (+ 1-byte"
        " echo), spread over the rounds. direct and socat: anchors from this run."
    )
    print("\n" + textwrap.fill(header, 88))
    if args.proxy_cmd != DEFAULT_PROXY_CMD:
        print(f"inferproxy column started with: {args.proxy_cmd}")
    w = 40
    print("\n" + " " * w + "".join(f"{p:>12}" for p in results))
    for label, get in ROWS:
        cells = [get(figs) for figs in results.values()]
        print(f"{label:<{w}}" + "".join(f"{_fmt(c, '.1f'):>12}" for c in cells))
    refused = "".join(f"{figs.refused:>12}" for figs in results.values())
    print(f"{'set-up connections refused':<{w}}{refused}")
    ip, so = results.get("inferproxy"), results.get("socat")
    if ip is None or so is None:
        return
    print()
    for label, num, den, op, goal in (
        ("throughput inferproxy/socat", ip.mbps, so.mbps, ">=", 0.5),
        ("added round trip inferproxy/socat", ip.rtt_added, so.rtt_added, "<=", 1.0),
        (
            "set-up median inferproxy/socat",
            percentile(ip.setup, 0.5),
            percentile(so.setup, 0.5),
            "",
            0.0,
        ),
    ):
        value = _ratio(num, den)
        print(f"{label:<{w}}{_fmt(value, '.2f'):>12}   {_verdict(value, op, goal)}")


def _fmt(value: float | None, spec: str) -> str:
    """Format a figure, or a dash when it is missing."""
    return "-" if value is None else format(value, spec)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description="Benchmark inferproxy against socat and direct TCP.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--bytes", type=parse_size, default=1 << 30, help="bytes per transfer (K/M/G)")
    add("--pings", type=positive, default=10000, help="ping-pongs per path")
    add("--connects", type=positive, default=1000, help="connections per path")
    add("--rounds", type=positive, default=3, help="rounds, each path in turn")
    add("--only", default=",".join(PATHS), help="comma-separated paths to measure")
    add("--proxy-cmd", default=DEFAULT_PROXY_CMD, help="inferproxy command template")
    add("--io-timeout", type=float, default=60.0, help="longest wait on a socket, s")
    add("--cpu", type=int, help="pin the client and every child to this one CPU")
    args = parser.parse_args(argv)
    only = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(only) - set(PATHS))
    if unknown or not only:
        parser.error(f"--only: unknown path(s) {unknown}; choose from {PATHS}")
    args.only = [p for p in PATHS if p in only]
    if args.cpu is not None and args.cpu not in os.sched_getaffinity(0):
        parser.error(f"--cpu: choose from {sorted(os.sched_getaffinity(0))}")
    if min(args.pings, args.connects) < args.rounds:
        parser.error("--pings and --connects must be at least --rounds")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    args = parse_args(argv)
    if "socat" in args.only and shutil.which("socat") is None:
        print("socat is not on PATH", file=sys.stderr)
        return 1
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})  # inherited by every child
    exit_on_signals()
    children = Children()
    results = {name: Figures() for name in args.only}
    paths: list[Path] = []
    try:
        ports = start_upstream(children)
        for name in args.only:
            try:
                paths.append(open_path(children, name, ports, args.proxy_cmd))
                paths[-1].figs = results[name]
            except BenchError as e:
                results[name].errors.append(str(e))
        for n in range(args.rounds):
            for path in paths:
                measure_path(path, args, n)
    except BenchError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        ignore_exit_signals()
        for path in paths:
            if path.pinger is not None:
                path.pinger.close()
        children.stop_all()
    print_report(results, args)
    for name, figs in results.items():
        for error in figs.errors:
            print(f"ERROR {name}: {error}")
    return 0 if all(figs.complete for figs in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
