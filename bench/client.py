"""Benchmark of loopd's llama client: decoding speed and the latency it adds.

Run from the checkout root with ``python bench/client.py`` (``tox -e bench``);
``--help`` lists the options. It needs the ``openai``, ``httpx-sse`` and ``httpx``
packages, and for part 2 the test extra (``xllamacpp``, ``gguf``, ``numpy``).

Part 1, decoding (bench/_client_decode.py), no server: a recorded llama-server
transcript (``--transcript``, default fixtures/transcripts/thinking.sse) is stretched
to ``--chunks`` (10000) ``data:`` chunks plus ``[DONE]``, and the same bytes are fed
to three decoders: loopd's ``SSEDecoder`` + ``Assembler``, the ``openai`` SDK's
streaming ``Stream`` (SSE decoding, JSON and a ``ChatCompletionChunk`` per chunk) and
``httpx-sse`` (+ ``json.loads`` per event). They are fed twice over: in pieces of
random sizes from 1 to 4 KiB cut anywhere, as a socket would deliver them, and one
event per piece. Every decoder runs ``--reps`` (9) times per feeding, in rounds that
take the decoders in a rotating order; the figure is the median chunks per second
(garbage collection on, collected before each run). Anchors: the SDK (goal: loopd at
least 2x as fast) and httpx-sse (no goal).

Part 2, end to end (bench/_client_e2e.py): the project's tiny model on a real
llama.cpp server, and ``python -m twisted inferproxy`` in front of it. ``--requests``
(200) streaming chat requests per path, after ``--warmup`` (10) untimed ones, in
rounds of one request per path: loopd's ``Client`` over inferproxy's Unix socket (the
real reactor, in this process), against a blocking ``http.client`` request straight
to the server's TCP port (the anchor); a third path, the same ``http.client`` request
over inferproxy's socket, shows inferproxy's share. It prints the median and p90 of
the time to the first content token and of the total time, what loopd's client adds
to the medians of ``http.client`` through the same inferproxy (the anchor of the goal,
at most 1 ms each; issue 15) with the ratio of the two, and what both add to direct.

``--part`` runs only one part. The exit status is 0 when every measurement ran (goals
met or not), else 1 (a decoder that decodes the stream wrongly, a request that fails).
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import sys
import textwrap
from collections.abc import Callable
from importlib.metadata import version

from _client_decode import DECODERS, build_stream, measure_mode, split_events, split_network
from _client_e2e import PATHS, Samples, Setup, measure, run_reactor, start
from _report import W, non_negative, percentile, positive, verdict
from _servers import ROOT, BenchError, Children, ignore_exit_signals, run_guarded

MODES = ("network", "event")
"""How the stream is fed: 1-4 KiB pieces cut anywhere, or one event per piece."""
SDK_GOAL = 2.0
"""loopd's decoding must be at least this many times as fast as the SDK's."""
ADDED_GOAL_MS = 1.0
"""loopd may add at most this many ms to the direct path's medians."""


def run_decode(args: argparse.Namespace) -> None:
    """Run part 1 and print its report; a failed run raises BenchError."""
    stream = build_stream(args.transcript, args.chunks)
    feeds = {
        "network": split_network(stream.body, args.seed),
        "event": split_events(stream.body),
    }
    rates: dict[str, dict[str, list[float]]] = {}
    for mode in MODES:
        print(f"  decoding, {mode} pieces ...", file=sys.stderr, flush=True)
        rates[mode] = {name: [] for name in DECODERS}
        for name, rate in measure_mode(feeds[mode], stream.expected, args.reps):
            rates[mode][name].append(rate)
    header = (
        f"Part 1, decoding: {stream.expected.chunks} chunks + [DONE]"
        f" ({len(stream.body) / 1e6:.2f} MB) stretched from"
        f" {os.path.relpath(args.transcript, ROOT)}; 'network': "
        f"{len(feeds['network'])} pieces of 1-4 KiB cut anywhere, 'event': one event per"
        f" piece. Median chunks/s of {args.reps} runs per decoder, in rounds of every"
        f" decoder in turn; {os.cpu_count()} CPUs. openai {version('openai')},"
        f" httpx-sse {version('httpx-sse')}: anchors from this run."
    )
    print("\n" + textwrap.fill(header, 88))
    print("\n" + " " * W + "".join(f"{name:>12}" for name in DECODERS))
    medians: dict[str, dict[str, float]] = {}
    for mode in MODES:
        medians[mode] = {name: statistics.median(rates[mode][name]) for name in DECODERS}
        row = "".join(f"{medians[mode][name]:>12.0f}" for name in DECODERS)
        print(f"{f'{mode}: chunks/s (median)':<{W}}{row}")
        low = "".join(f"{min(rates[mode][name]):>12.0f}" for name in DECODERS)
        print(f"{f'{mode}: chunks/s (slowest run)':<{W}}{low}")
    print()
    for mode in MODES:
        loopd = medians[mode]["loopd"]
        sdk = loopd / medians[mode]["openai"]
        print(f"{f'{mode}: loopd/openai':<{W}}{sdk:>12.2f}   {verdict(sdk, '>=', SDK_GOAL)}")
        other = loopd / medians[mode]["httpx-sse"]
        print(f"{f'{mode}: loopd/httpx-sse':<{W}}{other:>12.2f}   (no goal)")


def run_e2e(args: argparse.Namespace) -> None:
    """Run part 2 and print its report; a failed request raises."""
    children = Children()
    try:
        print("  starting the llama server and inferproxy ...", file=sys.stderr, flush=True)
        setup: Setup = start(children, args.threads)
        print(
            f"  {args.warmup} + {args.requests} requests per path ...",
            file=sys.stderr,
            flush=True,
        )
        gap = args.gap_ms / 1000.0
        results = run_reactor(
            lambda reactor: measure(
                reactor, setup, args.requests, args.warmup, gap, args.io_timeout
            )
        )
    finally:
        ignore_exit_signals()
        children.stop_all()
    print_e2e(results, args)


E2E_ROWS: tuple[tuple[str, Callable[[Samples], float]], ...] = (
    ("first content token, median ms", lambda s: percentile(s.ttft, 0.5)),
    ("first content token, p90 ms", lambda s: percentile(s.ttft, 0.9)),
    ("total, median ms", lambda s: percentile(s.total, 0.5)),
    ("total, p90 ms", lambda s: percentile(s.total, 0.9)),
)
"""The part 2 table: a label and a figure per row."""


def print_e2e(results: dict[str, Samples], args: argparse.Namespace) -> None:
    """Print part 2's figures, what loopd adds, and the goals."""
    header = (
        f"Part 2, end to end: the tiny model on a real llama.cpp server (xllamacpp"
        f" {version('xllamacpp')}, {args.threads} threads); one streaming chat request"
        f' ("Hi", thinking off, {len("Hello from the tiny model!")}-character answer) at'
        f" a time, {args.requests} per path after {args.warmup} warm-up ones, in rounds of"
        f" every path in turn. loopd: Client -> Unix socket -> inferproxy -> TCP;"
        " proxied: http.client -> Unix socket -> inferproxy -> TCP; direct: http.client"
        f" -> TCP (the anchor, same run). {os.cpu_count()} CPUs, shared by"
        " the server, inferproxy and this process."
    )
    print("\n" + textwrap.fill(header, 88))
    print("\n" + " " * W + "".join(f"{p:>10}" for p in PATHS) + f"{'added':>10}")
    for label, get in E2E_ROWS:
        cells = {path: get(results[path]) for path in PATHS}
        row = "".join(f"{cells[path]:>10.3f}" for path in PATHS)
        print(f"{label:<{W}}{row}{cells['loopd'] - cells['direct']:>10.3f}")
    print()
    for what, index in (("first token", 0), ("total", 2)):
        get = E2E_ROWS[index][1]
        loopd, proxied = get(results["loopd"]), get(results["proxied"])
        added = loopd - proxied
        share = proxied - get(results["direct"])
        print(
            f"{f'client - proxied, {what} median ms':<{W}}{added:>10.3f}"
            f"   {verdict(added, '<=', ADDED_GOAL_MS)}   (ratio {loopd / proxied:.2f};"
            f" inferproxy over direct {share:.3f})"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description="Benchmark loopd's SSE decoding and its client's added latency.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--part", choices=("all", "decode", "e2e"), default="all", help="what to run")
    add(
        "--transcript",
        default=os.path.join(ROOT, "fixtures", "transcripts", "thinking.sse"),
        help="recorded SSE body the stream is made from",
    )
    add("--chunks", type=positive, default=10000, help="data chunks in the stream")
    add("--reps", type=positive, default=9, help="timed runs per decoder and feeding")
    add("--seed", type=int, default=1, help="seed of the network piece sizes")
    add("--requests", type=positive, default=200, help="timed requests per path")
    add("--warmup", type=non_negative, default=10, help="untimed requests per path first")
    add("--gap-ms", type=float, default=5.0, help="pause after every request, ms")
    add("--threads", type=positive, default=2, help="llama server threads")
    add("--io-timeout", type=float, default=60.0, help="longest wait on a socket, s")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    args = parse_args(argv)

    def work() -> None:
        if args.part in ("all", "decode"):
            run_decode(args)
        if args.part in ("all", "e2e"):
            run_e2e(args)

    return run_guarded(work, (BenchError, OSError, http.client.HTTPException))


if __name__ == "__main__":
    sys.exit(main())
