"""Benchmark of loopd's gateway: the latency it adds and how it serves many sessions.

Run from the checkout root with ``python bench/gateway.py`` (``tox -e bench``);
``--help`` lists the options. It needs the test extra (``xllamacpp``, ``gguf``,
``numpy``) for the real llama.cpp server.

One real llama.cpp server with 2 slots serves the project's tiny model in its
"think forever" form; ``python -m twisted inferproxy`` forwards a Unix socket to it
and ``python -m twisted loopd`` serves the gateway on loopd.sock in front of that
(bench/_gateway_stack.py). Both paths use the same client, a blocking ``http.client``
request that decodes every SSE event (over a Unix socket to loopd, over TCP straight
to the server, the anchor measured in the same run). The first token is the first
reasoning or content delta; the end is ``[DONE]``.

Part 1, latency: ``--requests`` (200) streamed requests per path whose answer is
``--tokens`` (200) tokens of reasoning, after ``--warmup`` (10) untimed ones, one at a
time in rounds of both paths. It prints the median and p90 of the time to the first
token and of the total time, what loopd adds to the direct medians and the ratio (goals,
issue 15: at most 1 ms to the first token, 2 ms to the whole stream).

Part 2, sessions: ``--sessions`` (16) threads, each a conversation of ``--turns`` (5)
short turns, all at once on the 2 slots; through loopd each has its own
``X-Session-Id`` and each request takes a lease kept after it for the grace (up to
``grace_ms``, ``--grace-ms``, loopd's 3 s by default; a waiting session cuts it at the
holder's expected re-prefill time, DESIGN decision 37), once as a plain OpenAI client
does and once with ``X-Session-End: true`` on each session's last turn
(``loopd+end``); direct each lets the server choose the slot. It prints the throughput
(turns/s, generated tokens/s), the p95 time to first token, the cached prompt tokens,
each loopd path's ratio to direct, and the plain loopd path's goals (issue 13: at least
0.9x direct's turns/s, at most 2x its p95 first token).

Part 3, CPU: ``--requests`` more of part 1's loopd streams, one at a time; the CPU
seconds (user and system, from /proc, so Linux only) the server, inferproxy and loopd
each spent on them, per 1,000 streamed tokens, with the server's own as the anchor and
each process's ratio to it.

Part 4, observability (issue 28; run alone, ``--part observe``, not part of ``all``): the
CPU loopd spends per 1,000 streamed tokens with the status page open (``GET /v1/status``
every 2 s) and OpenTelemetry on, against loopd as it was before issue 28 (``--before``, a
git revision) in the same run: ``--rounds`` rounds of ``--requests`` streams alternating
between the two processes (bench/_observe_runs.py). Goal: at most 2 % more.

``--part`` runs only one part. The exit status is 0 when every measurement ran (goals
met or not), else 1.
"""

from __future__ import annotations

import argparse
import http.client
import math
import os
import sys
import textwrap
from collections.abc import Callable
from importlib.metadata import version

from _gateway_runs import (
    CPU_PROCESSES,
    CpuUse,
    Samples,
    measure_cpu,
    measure_long,
    measure_sessions,
)
from _gateway_stack import QUEUE_DEPTH, Stack, start, start_backend
from _observe_runs import ObserveUse, extract, measure_observe, start_pair
from _report import W, non_negative, percentile, positive, verdict
from _servers import BenchError, Children, ignore_exit_signals, run_guarded

PATHS = ("loopd", "direct")
"""Both paths, in the order printed."""
ADDED_GOALS_MS = {"first token": 1.0, "total": 2.0}
"""loopd may add at most this many ms to the direct path's medians."""
TURNS_GOAL = 0.9
"""Part 2: loopd's turns/s at least this share of direct's."""
FIRST_TOKEN_P95_GOAL = 2.0
"""Part 2: loopd's p95 first token at most this multiple of direct's."""
OBSERVE_GOAL = 1.02
"""Part 4: loopd's CPU per 1,000 tokens with the page and telemetry on, at most this
multiple of loopd's before issue 28."""
BEFORE = "4309a90"
"""Part 4's anchor: the last commit before issue 28 (observability)."""
TELEMETRY = '[telemetry]\nenabled = true\nsocket = "{socket}"\n'
"""Part 4: the lines that turn OpenTelemetry on in the "after" loopd ({socket}: the
receiver's)."""


LONG_ROWS: tuple[tuple[str, Callable[[Samples], float]], ...] = (
    ("first token, median ms", lambda s: percentile([r.ttft for r in s.results], 0.5)),
    ("first token, p90 ms", lambda s: percentile([r.ttft for r in s.results], 0.9)),
    ("total, median ms", lambda s: percentile([r.total for r in s.results], 0.5)),
    ("total, p90 ms", lambda s: percentile([r.total for r in s.results], 0.9)),
)
"""The part 1 table: a label and a figure per row."""


def print_long(results: dict[str, Samples], args: argparse.Namespace) -> None:
    """Print part 1's figures, what loopd adds, and the goal."""
    header = (
        f"Part 1, latency: the tiny think-forever model on a real llama.cpp server"
        f" (xllamacpp {version('xllamacpp')}, 2 slots, --threads {args.threads}); one"
        f" streamed chat at a time answering {args.tokens} tokens of reasoning"
        f" (max_tokens), {args.requests} per path after {args.warmup} warm-up ones, in"
        " rounds of both paths in turn. loopd: http.client -> loopd.sock -> loopd ->"
        " inferproxy -> TCP; direct: http.client -> TCP with the body loopd sends"
        f" upstream (the anchor, same run). {os.cpu_count()} CPUs, shared by the server,"
        " inferproxy, loopd and this process."
    )
    print("\n" + textwrap.fill(header, 88))
    print("\n" + " " * W + "".join(f"{p:>10}" for p in PATHS) + f"{'added':>10}{'ratio':>8}")
    for label, get in LONG_ROWS:
        cells = {path: get(results[path]) for path in PATHS}
        row = "".join(f"{cells[path]:>10.3f}" for path in PATHS)
        ratio = cells["loopd"] / cells["direct"]
        print(f"{label:<{W}}{row}{cells['loopd'] - cells['direct']:>10.3f}{ratio:>8.2f}")
    print()
    for what, index in (("first token", 0), ("total", 2)):
        get = LONG_ROWS[index][1]
        added = get(results["loopd"]) - get(results["direct"])
        goal = verdict(added, "<=", ADDED_GOALS_MS[what])
        print(f"{f'added, {what} median ms':<{W}}{added:>10.3f}   {goal}")


SESSION_ROWS: tuple[tuple[str, str, Callable[[Samples], float]], ...] = (
    ("turns/s", ".1f", lambda s: len(s.results) / (s.wall_ns / 1e9)),
    ("generated tokens/s", ".0f", lambda s: sum(r.tokens for r in s.results) / (s.wall_ns / 1e9)),
    ("first token, median ms", ".2f", lambda s: percentile([r.ttft for r in s.results], 0.5)),
    ("first token, p95 ms", ".2f", lambda s: percentile([r.ttft for r in s.results], 0.95)),
    ("turn total, p95 ms", ".2f", lambda s: percentile([r.total for r in s.results], 0.95)),
    ("wall time, s", ".2f", lambda s: s.wall_ns / 1e9),
    ("cached prompt tokens (sum)", ".0f", lambda s: float(sum(r.cached for r in s.results))),
)
"""The part 2 table: a label, a format and a figure per row."""


SESSION_PATHS = ("loopd", "loopd+end", "direct")
"""Part 2's paths: loopd as any OpenAI client meets it, and told when a session ends."""


def print_sessions(results: dict[str, Samples], args: argparse.Namespace) -> None:
    """Print part 2's figures, each loopd path's ratio to direct, and the goals."""
    grace = "loopd's default" if args.grace_ms is None else f"grace_ms {args.grace_ms}"
    header = (
        f"Part 2, sessions: {args.sessions} sessions at once, each {args.turns} turns of a"
        " conversation it extends (thinking off, a 26-character answer), on the same"
        " 2-slot server. loopd: each session its own X-Session-Id (slot affinity,"
        f" queue_depth {QUEUE_DEPTH}), each request a lease with the grace ({grace});"
        " loopd+end: the same, with X-Session-End: true on a session's last turn (no grace"
        " after it); direct: id_slot -1, the server chooses. The paths run one after the"
        " other; cached tokens from the usage (loopd) or timings.cache_n (direct)."
    )
    print("\n" + textwrap.fill(header, 88))
    ratios = f"{'loopd/dir':>11}{'+end/dir':>10}"
    print("\n" + " " * W + "".join(f"{p:>10}" for p in SESSION_PATHS) + ratios)
    for label, fmt, get in SESSION_ROWS:
        cells = {path: get(results[path]) for path in SESSION_PATHS}
        row = "".join(f"{cells[path]:>10{fmt}}" for path in SESSION_PATHS)
        direct = cells["direct"]
        ratio = " " + "".join(
            f"{(cells[p] / direct if direct else math.nan):>10.2f}" for p in SESSION_PATHS[:2]
        )
        print(f"{label:<{W}}{row}{ratio}")
    print()
    turns, p95 = SESSION_ROWS[0][2], SESSION_ROWS[3][2]
    turns_ratio = turns(results["loopd"]) / turns(results["direct"])
    p95_ratio = p95(results["loopd"]) / p95(results["direct"])
    turns_verdict = verdict(turns_ratio, ">=", TURNS_GOAL)
    print(f"{'loopd/direct turns/s':<{W}}{turns_ratio:>10.2f}   {turns_verdict}")
    print(
        f"{'loopd/direct first token p95':<{W}}{p95_ratio:>10.2f}"
        f"   {verdict(p95_ratio, '<=', FIRST_TOKEN_P95_GOAL)}"
    )


def print_cpu(use: CpuUse, args: argparse.Namespace) -> None:
    """Print part 3: CPU seconds per 1,000 streamed tokens, and each ratio to the server's."""
    header = (
        f"Part 3, CPU: {args.requests} more streams through loopd, one at a time, each"
        f" {args.tokens} tokens of reasoning ({use.tokens} tokens in all); the CPU seconds"
        " (user + system, /proc) each process spent meanwhile. The server's is the anchor."
    )
    print("\n" + textwrap.fill(header, 88))
    print("\n" + " " * W + f"{'s/1k tok':>10}{'/server':>10}")
    anchor = use.seconds[CPU_PROCESSES[0]]
    for name in CPU_PROCESSES:
        seconds = use.seconds[name]
        ratio = seconds / anchor if anchor else math.nan
        per_1k = 1000 * seconds / use.tokens
        print(f"{name + ', CPU s per 1,000 tokens':<{W}}{per_1k:>10.4f}{ratio:>10.2f}")


def print_observe(use: ObserveUse, args: argparse.Namespace) -> None:
    """Print part 4: each loopd's CPU per 1,000 tokens, the ratio and the goal."""
    header = (
        f"Part 4, observability: {args.rounds} rounds of {args.requests} streams of"
        f" {args.tokens} tokens, alternating between loopd at {args.before} (before issue"
        " 28, the anchor) and this checkout's loopd with OpenTelemetry exporting to a local"
        " receiver and the status page's poll of /v1/status every 2 s; each process's CPU"
        f" (user + system, /proc) over its own rounds. The page polled {use.polls} times;"
        f" the receiver took {use.exports} exports ({use.export_bytes:,} bytes)."
    )
    print("\n" + textwrap.fill(header, 88))
    print("\n" + " " * W + f"{'s/1k tok':>10}{'/before':>10}")
    anchor = use.seconds["before"] / use.tokens["before"]
    for name in ("before", "after"):
        per_token = use.seconds[name] / use.tokens[name]
        label = f"loopd {name}, CPU s per 1,000 tokens"
        print(f"{label:<{W}}{1000 * per_token:>10.4f}{per_token / anchor:>10.3f}")
    ratio = (use.seconds["after"] / use.tokens["after"]) / anchor
    print(f"\n{'after/before':<{W}}{ratio:>10.3f}   {verdict(ratio, '<=', OBSERVE_GOAL)}")


def run_observe(args: argparse.Namespace) -> None:
    """Part 4: start the server, the inferproxy and both loopds; measure; print."""
    children = Children()
    try:
        print("  part 4: starting the llama server, inferproxy and two loopds ...", file=sys.stderr)
        _port, infer = start_backend(children, args.threads)
        before = extract(args.before, children.dir)
        sockets, receiver = start_pair(children, infer, before, TELEMETRY)
        pids = {name: child.pid for name, child, _log in children.procs}
        pids = {"before": pids["loopd-before"], "after": pids["loopd-after"]}
        use = measure_observe(
            children,
            sockets,
            pids,
            receiver,
            args.rounds,
            args.requests,
            args.tokens,
            args.io_timeout,
        )
    finally:
        ignore_exit_signals()
        children.stop_all()
    print_observe(use, args)


def run(args: argparse.Namespace) -> None:
    """Start the stack, run the parts asked for, print their reports."""
    if args.part == "observe":
        run_observe(args)
        return
    children = Children()
    try:
        print("  starting the llama server, inferproxy and loopd ...", file=sys.stderr)
        stack: Stack = start(children, args.threads, args.grace_ms)
        long_results = session_results = cpu_use = None
        if args.part in ("all", "latency"):
            print(
                f"  part 1: {args.warmup} + {args.requests} requests per path ...",
                file=sys.stderr,
                flush=True,
            )
            gap = args.gap_ms / 1000.0
            long_results = measure_long(
                stack, args.requests, args.warmup, args.tokens, gap, args.io_timeout
            )
        if args.part in ("all", "cpu"):
            print(f"  part 3: {args.requests} streams through loopd ...", file=sys.stderr)
            cpu_use = measure_cpu(stack, args.requests, args.tokens, args.io_timeout)
        if args.part in ("all", "sessions"):
            print(f"  part 2: {args.sessions} sessions per path ...", file=sys.stderr)
            session_results = {}
            for path in ("direct", "loopd", "loopd+end"):
                session_results[path] = measure_sessions(
                    path, stack, args.sessions, args.turns, args.io_timeout
                )
    finally:
        ignore_exit_signals()
        children.stop_all()
    if long_results is not None:
        print_long(long_results, args)
    if session_results is not None:
        print_sessions(session_results, args)
    if cpu_use is not None:
        print_cpu(cpu_use, args)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description="Benchmark the latency loopd's gateway adds and its many-session service.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--part",
        choices=("all", "latency", "sessions", "cpu", "observe"),
        default="all",
        help="what to run (observe: part 4, only when asked)",
    )
    add("--requests", type=positive, default=200, help="part 1: timed requests per path")
    add("--warmup", type=non_negative, default=10, help="part 1: untimed requests first")
    add("--tokens", type=positive, default=200, help="part 1: tokens per answer")
    add("--gap-ms", type=float, default=5.0, help="part 1: pause after every request, ms")
    add("--sessions", type=positive, default=16, help="part 2: concurrent sessions")
    add("--turns", type=positive, default=5, help="part 2: turns per session")
    add(
        "--threads", type=positive, default=1, help="llama server threads (1: leaves CPU for loopd)"
    )
    add("--grace-ms", type=non_negative, help="loopd's [queue] grace_ms (default: loopd's)")
    add("--io-timeout", type=float, default=120.0, help="longest wait on a socket, s")
    add("--rounds", type=positive, default=10, help="part 4: rounds per loopd")
    add("--before", default=BEFORE, help="part 4: the git revision of loopd before issue 28")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    args = parse_args(argv)
    return run_guarded(lambda: run(args), (BenchError, OSError, http.client.HTTPException))


if __name__ == "__main__":
    sys.exit(main())
