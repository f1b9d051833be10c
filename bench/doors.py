"""Benchmark of loopd's front doors (issue 14): /v1/messages and /v1/responses.

Run from the checkout root with ``python bench/doors.py`` (``tox -e bench``); ``--help``
lists the options. It needs the test extra (``xllamacpp``, ``gguf``, ``numpy``) for
the real llama.cpp server.

The stack is bench/gateway.py's (bench/_gateway_stack.py): one real llama.cpp server
with 2 slots serving the project's tiny model in its "think forever" form, ``python -m
twisted inferproxy`` in front of it and ``python -m twisted loopd`` on loopd.sock in
front of that, started once. Four doors to the same answer (bench/_doors_client.py):

  - ``chat``: loopd's ``/v1/chat/completions`` (anchor 1);
  - ``messages``: loopd's ``/v1/messages`` (Anthropic Messages);
  - ``responses``: loopd's ``/v1/responses`` (OpenAI Responses);
  - ``server``: llama-server's own ``/v1/messages`` over TCP (anchor 2).

Every request is the same short user message, streamed, thinking on with no cap of its
own, and ``--tokens`` (200) as its token bound: the think-forever model reasons until
the bound, so each answer is exactly that many reasoning tokens, one delta each but the
opening ``<think>`` (checked on every request). Thinking on is the only way to a long
answer: with thinking off the model answers a short fixed text, and llama-server's own
``/v1/messages`` ignores Anthropic's ``thinking`` field (it thinks even with
``disabled``). The client is blocking ``http.client`` on a fresh connection that
decodes every SSE event with ``json.loads``; the first token is the first reasoning or
text delta, the end the door's last event (``[DONE]``, ``message_stop``,
``response.completed`` or ``response.incomplete``), both timed from before the
connection is opened.

Every loopd request is anonymous (no session id: a one-shot client's request, its
session ends with its connection), so no door holds a lease or a grace after its answer
and none waits on another's. loopd places each as it places any anonymous request, the
server's own door lets the server choose the slot, and every door finds its prompt
cached but its last token (the table's cached tokens show it). A fixed session id per
door would be three sessions on two slots, each waiting out another's lease.

``--warmup`` (10) untimed rounds, then ``--requests`` (200) timed rounds of one request
per door, the order rotating each round so that drift hits every door alike, a short
pause (``--gap-ms``) after each so the slot is idle again. It prints, per door, the
median and p95 of the first token and of the total, then for each loopd door what it
adds to each anchor's medians, the ratio, and the goals: at most 0.5 ms more than
loopd's chat completions, at most 3 ms more than llama-server's own ``/v1/messages``.
The exit status is 0 when every measurement ran (goals met or not), else 1.
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys
import textwrap
import time
from collections.abc import Callable
from importlib.metadata import version

from _doors_client import DOORS, Door, Result, check, stream_door
from _gateway_stack import Stack, start
from _report import W, non_negative, percentile, positive, verdict
from _servers import BenchError, Children, ignore_exit_signals, run_guarded

CHAT_GOAL_MS = 0.5
"""A loopd door may add at most this many ms to loopd chat completions' medians."""
SERVER_GOAL_MS = 3.0
"""A loopd door may add at most this many ms to llama-server's own /v1/messages' medians."""
ANCHORS = (("chat", CHAT_GOAL_MS), ("server", SERVER_GOAL_MS))
"""Each anchor door and the goal of what the loopd doors add to its medians."""
MEASURED = ("messages", "responses")
"""The doors the goals are about."""


def measure(stack: Stack, args: argparse.Namespace) -> dict[str, list[Result]]:
    """Run warmup + requests rounds of one request per door; return the timed results."""
    bodies = {door.name: door.body(args.tokens) for door in DOORS}
    out: dict[str, list[Result]] = {door.name: [] for door in DOORS}
    gap = args.gap_ms / 1000.0
    for i in range(args.warmup + args.requests):
        shift = i % len(DOORS)
        for door in DOORS[shift:] + DOORS[:shift]:
            target = stack.port if door.direct else stack.loopd_socket
            result = stream_door(door, target, bodies[door.name], args.io_timeout)
            check(door, result, args.tokens)
            if i >= args.warmup:
                out[door.name].append(result)
            time.sleep(gap)
    return out


def _median(counts: list[int]) -> float:
    """The nearest-rank median of counts."""
    return float(sorted(counts)[(len(counts) - 1) // 2])


ROWS: tuple[tuple[str, str, Callable[[list[Result]], float]], ...] = (
    ("first token, median ms", ".3f", lambda rs: percentile([r.ttft for r in rs], 0.5)),
    ("first token, p95 ms", ".3f", lambda rs: percentile([r.ttft for r in rs], 0.95)),
    ("total, median ms", ".3f", lambda rs: percentile([r.total for r in rs], 0.5)),
    ("total, p95 ms", ".3f", lambda rs: percentile([r.total for r in rs], 0.95)),
    ("cached prompt tokens, median", ".0f", lambda rs: _median([r.cached for r in rs])),
    ("deltas streamed, median", ".0f", lambda rs: _median([r.deltas for r in rs])),
)
"""The table: a label, a format and a figure per row."""
MEDIANS = (("first token", ROWS[0][2]), ("total", ROWS[2][2]))
"""The medians the goals are about."""


def _door(name: str) -> Door:
    """The door of that name."""
    return next(door for door in DOORS if door.name == name)


def print_report(results: dict[str, list[Result]], args: argparse.Namespace) -> None:
    """Print every door's figures, what each loopd door adds to each anchor, the goals."""
    header = (
        f"Front doors: the tiny think-forever model on a real llama.cpp server (xllamacpp"
        f" {version('xllamacpp')}, 2 slots, --threads {args.threads}); one streamed request"
        f" at a time answering {args.tokens} tokens of reasoning (the token bound), the same"
        f" short prompt on every door, {args.requests} per door after {args.warmup} warm-up"
        " rounds, in rounds of every door in a rotating order. loopd doors: http.client ->"
        " loopd.sock -> loopd -> inferproxy -> TCP, each request anonymous; server:"
        " http.client -> TCP -> llama-server's own /v1/messages (same run)."
        f" {os.cpu_count()} CPUs, shared by the server, inferproxy, loopd and this process."
    )
    print("\n" + textwrap.fill(header, 88))
    print()
    for door in DOORS:
        print(f"  {door.name:<10} {door.label}")
    print("\n" + " " * W + "".join(f"{door.name:>11}" for door in DOORS))
    for label, fmt, get in ROWS:
        row = "".join(f"{get(results[door.name]):>11{fmt}}" for door in DOORS)
        print(f"{label:<{W}}{row}")
    print(f"\n{'medians, door over anchor':<{W}}{'added ms':>10}{'ratio':>8}")
    for name in (*MEASURED, "chat"):
        for anchor, goal in ANCHORS:
            if anchor == name:
                continue
            for what, get in MEDIANS:
                value, base = get(results[name]), get(results[anchor])
                added = value - base
                ratio = value / base if base else float("nan")
                judged = f"   {verdict(added, '<=', goal)}" if name in MEASURED else ""
                label = f"{name} over {anchor}, {what}"
                print(f"{label:<{W}}{added:>10.3f}{ratio:>8.3f}{judged}")
    print(f"\n(chat over server is anchor 1 against anchor 2, no goal: {_door('chat').label}")
    print(f" against {_door('server').label}.)")


def run(args: argparse.Namespace) -> None:
    """Start the stack, measure every door, print the report."""
    children = Children()
    try:
        print("  starting the llama server, inferproxy and loopd ...", file=sys.stderr)
        stack = start(children, args.threads)
        print(
            f"  {args.warmup} + {args.requests} rounds of {len(DOORS)} doors ...",
            file=sys.stderr,
            flush=True,
        )
        results = measure(stack, args)
    finally:
        ignore_exit_signals()
        children.stop_all()
    print_report(results, args)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description="Benchmark loopd's /v1/messages and /v1/responses against its chat"
        " completions and llama-server's own /v1/messages.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--requests", type=positive, default=200, help="timed requests per door")
    add("--warmup", type=non_negative, default=10, help="untimed rounds first")
    add("--tokens", type=positive, default=200, help="tokens per answer")
    add("--gap-ms", type=float, default=5.0, help="pause after every request, ms")
    add(
        "--threads", type=positive, default=1, help="llama server threads (1: leaves CPU for loopd)"
    )
    add("--io-timeout", type=float, default=120.0, help="longest wait on a socket, s")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    args = parse_args(argv)
    return run_guarded(lambda: run(args), (BenchError, OSError, http.client.HTTPException))


if __name__ == "__main__":
    sys.exit(main())
