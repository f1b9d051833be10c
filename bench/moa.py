"""Benchmark of loopd's ``model: "mesh"`` turn: the time it adds to its workers' own.

Run from the checkout root with ``python bench/moa.py``; ``--help`` lists the options.

The workers are fake OpenAI endpoints (bench/_moa_fakes.py), each its own process on a
Unix socket, answering every request after a fixed delay with a fixed text. A real
``python -m twisted loopd`` serves them as endpoints of kind ``openai`` with the self-test
off; a fresh loopd (its own loopd.toml) runs each measurement. The client is a blocking
``http.client`` request over a Unix socket on a fresh connection, timed from before the
connection to the end of the body: a non-streaming ``model: "mesh"`` turn to loopd, and as
the anchor, measured in the same run in rounds with it (the order alternating), a streaming
request straight to one fake's socket, as loopd's client sends upstream.

Part 1, consensus: three fakes answering in 50 ms ("Paris"), 80 ms ("Paris is the capital
of France", which agrees) and 3 s (something else). The turn should end when the 80 ms one
agrees; the anchor is a direct request to it (the fastest agreeing majority). Goal: the
median turn at most 10 ms above the anchor's median.

Part 2, one of two workers dead: the 80 ms fake and (a) ``broken``, a fake that answers
HTTP 500 at once, or (b) ``gone``, a socket path where nobody listens (connection
refused). The anchor is the direct request to the 80 ms fake. Goal: at most 10 ms more
(the reference design waits the full 60 s worker timeout). In (b) loopd leaves an endpoint
whose connection failed out of the mesh pool for 30 s, so the turns after that are
served by the single model: the first mesh turn (gone's warm-up asks the healthy model
directly, so it is the first to meet the dead endpoint) is its own row, and each turn's
``x-moa-*`` headers tell which turns were mesh turns and how many workers answered.

Every mesh turn of a case carries one ``X-Session-Id``, as successive turns of one
conversation do; ``--anonymous`` sends none (each turn, a fresh connection, is then an
anonymous session of its own).

``--part`` runs only some parts. The exit status is 0 when every measurement ran (goals
met or not), else 1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field

from _client_e2e import UnixHTTPConnection
from _moa_fakes import refusing_socket, start_fake
from _report import W, non_negative, percentile, positive, verdict
from _servers import BenchError, Children, ignore_exit_signals, run_guarded, wait_socket

from loopd.llama.chat import CHAT_PATH
from loopd.moa.fanout import WORKER_TIMEOUT

OVERHEAD_GOAL_MS = 10.0
"""The mesh turn may take at most this many ms more than its anchor (every goal)."""
QUESTION = "What is the capital of France?"
"""The one user message of every request."""
FAKES = {
    "alpha": (50.0, "Paris"),
    "bravo": (80.0, "Paris is the capital of France"),
    "charlie": (3000.0, "Berlin, obviously"),
}
"""Part 1's fakes: name -> (delay ms, reply). alpha and bravo agree, charlie does not."""
HEALTHY = "bravo"
"""Every anchor: the 80 ms fake (part 1's agreeing majority is complete when it answers)."""
CASES = ("consensus", "broken", "gone")
"""The three measurements, in the order run and printed."""


@dataclass(frozen=True)
class Reply:
    """One request: its time in ns from before the connection, status, headers, body."""

    ns: int
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class Samples:
    """Every reply of one case, per path, in the order sent; the first ``warmup`` untimed."""

    warmup: int
    mesh: list[Reply] = field(default_factory=list)
    anchor: list[Reply] = field(default_factory=list)

    def timed(self, path: str) -> list[int]:
        """The timed requests' times of path (``mesh`` or ``anchor``), in ns."""
        replies = self.mesh if path == "mesh" else self.anchor
        return [r.ns for r in replies[self.warmup :]]


def post(path: str, body: bytes, timeout: float, session: str | None = None) -> Reply:
    """POST body to the chat path over the Unix socket at path; read the whole answer.

    session, when set, goes out as ``X-Session-Id``.
    """
    clock = time.perf_counter_ns
    start = clock()
    conn = UnixHTTPConnection(path)
    try:
        conn.connect()
        sock = conn.sock
        assert sock is not None
        # A kernel timeout: settimeout() would add a poll() before every read.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(timeout), 0))
        headers = {"Content-Type": "application/json", "Connection": "close"}
        if session is not None:
            headers["X-Session-Id"] = session
        conn.request("POST", CHAT_PATH, body, headers)
        response = conn.getresponse()
        data = response.read()
        end = clock()
        names = {k.lower(): v for k, v in response.getheaders()}
        return Reply(end - start, response.status, names, data)
    finally:
        conn.close()


def mesh_body() -> bytes:
    """The client's request to loopd: a non-streaming mesh turn."""
    messages = [{"role": "user", "content": QUESTION}]
    return json.dumps({"model": "mesh", "messages": messages}).encode()


def anchor_body() -> bytes:
    """The anchor's request to the fake: streaming with usage, as loopd's client asks."""
    document = {
        "model": HEALTHY,
        "messages": [{"role": "user", "content": QUESTION}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(document).encode()


def single_body() -> bytes:
    """A warm-up request to loopd that only the healthy endpoint serves."""
    messages = [{"role": "user", "content": QUESTION}]
    return json.dumps({"model": HEALTHY, "messages": messages}).encode()


def check_answer(reply: Reply) -> None:
    """Raise BenchError unless loopd answered 200 with a non-empty message."""
    if reply.status != 200:
        raise BenchError(f"loopd: HTTP {reply.status}: {reply.body[:300]!r}")
    document = json.loads(reply.body)
    content = document["choices"][0]["message"].get("content")
    if not content:
        raise BenchError(f"an answer without content: {reply.body[:300]!r}")


def check_anchor(reply: Reply) -> None:
    """Raise BenchError unless the direct request got the whole stream."""
    if reply.status != 200 or not reply.body.endswith(b"data: [DONE]\n\n"):
        raise BenchError(f"direct: HTTP {reply.status}: {reply.body[:300]!r}")


def loopd_config(listen: str, endpoints: dict[str, str]) -> str:
    """Return a loopd.toml: endpoints (name -> socket) of kind openai, self-test off."""
    escaped = "unix:" + listen.replace(":", "\\:")
    lines = ["[server]", f"listen = {json.dumps(escaped)}", ""]
    for name, path in endpoints.items():
        lines += [
            "[[endpoint]]",
            f"name = {json.dumps(name)}",
            f"socket = {json.dumps(path)}",
            'kind = "openai"',
            "selftest = false",
            "",
        ]
    return "\n".join(lines)


def start_loopd(
    children: Children, case: str, endpoints: dict[str, str]
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a loopd serving endpoints; return its process and socket path once ready."""
    listen = os.path.join(children.dir, f"loopd-{case}.sock")
    config = os.path.join(children.dir, f"loopd-{case}.toml")
    with open(config, "w", encoding="utf-8") as f:
        f.write(loopd_config(listen, endpoints))
    argv = [sys.executable, "-m", "twisted", "--log-format=text", "loopd", "--config", config]
    proc = children.spawn(f"loopd-{case}", argv, log=True)
    wait_socket(children, proc, f"loopd-{case}", listen)
    return proc, listen


def measure(
    loopd: str, direct: str, warm: bytes, args: argparse.Namespace, session: str | None
) -> Samples:
    """Run warm-up + timed rounds of a loopd request and a direct one, order alternating.

    The warm-up rounds send warm to loopd, the timed ones a mesh turn; session (None: an
    anonymous session per turn) is every loopd request's X-Session-Id.
    """
    out = Samples(args.warmup)
    mesh, anchor = mesh_body(), anchor_body()
    gap = args.gap_ms / 1000.0
    for i in range(args.warmup + args.turns):
        for path in ("mesh", "anchor") if i % 2 == 0 else ("anchor", "mesh"):
            if path == "mesh":
                body = warm if i < args.warmup else mesh
                reply = post(loopd, body, args.io_timeout, session)
                check_answer(reply)
                out.mesh.append(reply)
            else:
                reply = post(direct, anchor, args.io_timeout)
                check_anchor(reply)
                out.anchor.append(reply)
            time.sleep(gap)
    return out


def run_case(
    children: Children, case: str, sockets: dict[str, str], args: argparse.Namespace
) -> Samples:
    """Start case's loopd, measure it, stop it."""
    if case == "consensus":
        endpoints = {name: sockets[name] for name in FAKES}
    else:
        endpoints = {HEALTHY: sockets[HEALTHY], case: sockets[case]}
    proc, listen = start_loopd(children, case, endpoints)
    # gone's warm-up must not meet the dead endpoint: its first mesh turn is a row of its own.
    warm = single_body() if case == "gone" else mesh_body()
    print(f"  {case}: {args.warmup} + {args.turns} rounds ...", file=sys.stderr, flush=True)
    session = None if args.anonymous else f"bench-moa-{case}"
    try:
        return measure(listen, sockets[HEALTHY], warm, args, session)
    finally:
        children.stop(proc)


def _single(samples: Samples) -> int:
    """How many timed turns the single model served (no x-moa-turn header)."""
    return sum("x-moa-turn" not in r.headers for r in samples.mesh[samples.warmup :])


def _labels(samples: Samples) -> str:
    """Say how the timed mesh turns went, from their x-moa-* headers."""
    timed = samples.mesh[samples.warmup :]
    counts = Counter(r.headers.get("x-moa-turn", "single model") for r in timed)
    workers = Counter(
        f"{r.headers['x-moa-workers-ok']}/{r.headers['x-moa-workers']}"
        for r in timed
        if "x-moa-workers" in r.headers
    )
    turns = ", ".join(f"{label} {n}" for label, n in counts.most_common())
    ok = ", ".join(f"{pair} {n}" for pair, n in workers.most_common())
    return f"{turns}; workers ok/asked {ok or '-'}"


def _row(label: str, mesh: float, anchor: float) -> str:
    """One table row: the mesh figure, its anchor, what the mesh adds, the ratio."""
    ratio = mesh / anchor if anchor else math.nan
    return f"{label:<{W}}{mesh:>10.2f}{anchor:>10.2f}{mesh - anchor:>10.2f}{ratio:>8.2f}"


def print_report(results: dict[str, Samples], args: argparse.Namespace) -> None:
    """Print the table, how the turns went, and a verdict per goal."""
    delays = ", ".join(f"{name} {FAKES[name][0]:g} ms" for name in FAKES)
    sessions = (
        "no X-Session-Id (an anonymous session per turn)"
        if args.anonymous
        else "one X-Session-Id per case"
    )
    header = (
        f"loopd's mesh turn against its fastest agreeing majority. Fake OpenAI endpoints"
        f" ({delays}; alpha and bravo agree, charlie does not; broken answers HTTP 500"
        " at once; gone is a socket path nobody listens on), each a process of its own,"
        " behind a real loopd (kind openai, self-test off; a fresh loopd per case:"
        " consensus alpha+bravo+charlie, broken bravo+broken, gone bravo+gone). mesh:"
        " http.client -> loopd.sock -> loopd -> the fakes, a non-streaming turn,"
        f" {sessions}; anchor: http.client -> {HEALTHY}'s socket, a streaming request"
        f" as loopd's client sends (same run, rounds of both, order alternating)."
        f" {args.turns} timed rounds per case after {args.warmup} warm-up ones (gone's"
        f" warm-up asks model {HEALTHY} through loopd, so its first mesh turn is the first"
        f" to meet the dead endpoint). {os.cpu_count()} CPUs shared by every process."
    )
    print("\n" + textwrap.fill(header, 88))
    print("\n" + " " * W + f"{'mesh':>10}{'anchor':>10}{'added':>10}{'ratio':>8}")
    added: dict[str, float] = {}
    for case in CASES:
        samples = results.get(case)
        if samples is None:
            continue
        mesh, anchor = samples.timed("mesh"), samples.timed("anchor")
        median = percentile(anchor, 0.5)
        if case == "gone":
            first = mesh[0] / 1e6
            print(_row(f"{case}: first mesh turn ms", first, median))
            added[f"{case}, first turn"] = first - median
        for label, q in (("median", 0.5), ("p90", 0.9)):
            print(_row(f"{case}: turn, {label} ms", percentile(mesh, q), percentile(anchor, q)))
        added[f"{case}, median"] = percentile(mesh, 0.5) - median
    print()
    for case in CASES:
        if case in results:
            print(f"{case + ' turns:':<17}{_labels(results[case])}")
    if "gone" in results:
        note = (
            "Note (gone): loopd leaves an endpoint out of the mesh pool while it is down"
            " (from a call that fails to connect until its /health probe answers), so once"
            " that has happened gone's later"
            " turns are served by the single model (no x-moa-* headers): here"
            f" {_single(results['gone'])} of {args.turns} timed turns were. The reference"
            f" design waits the full {WORKER_TIMEOUT:g} s worker timeout."
        )
        print("\n" + textwrap.fill(note, 88))
    print()
    for label, value in added.items():
        text = f"added, {label} ms"
        print(f"{text:<{W}}{value:>10.2f}   {verdict(value, '<=', OVERHEAD_GOAL_MS)}")


def run(args: argparse.Namespace) -> None:
    """Start the fakes, run the cases asked for, print the report."""
    cases = {"all": CASES, "consensus": CASES[:1], "dead": CASES[1:]}[args.part]
    children = Children()
    results: dict[str, Samples] = {}
    try:
        print("  starting the fake endpoints ...", file=sys.stderr)
        sockets = {name: start_fake(children, name, *FAKES[name]) for name in FAKES}
        sockets["broken"] = start_fake(children, "broken", 0.0, "", status=500)
        sockets["gone"] = refusing_socket(children, "gone")
        for case in cases:
            results[case] = run_case(children, case, sockets, args)
    finally:
        ignore_exit_signals()
        children.stop_all()
    print_report(results, args)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description="Benchmark the time loopd's mesh turn adds to its fastest agreeing workers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--part", choices=("all", "consensus", "dead"), default="all", help="what to run")
    add("--turns", type=positive, default=50, help="timed rounds (a mesh turn, an anchor) per case")
    add("--warmup", type=non_negative, default=3, help="untimed rounds before each case's")
    add(
        "--anonymous",
        action="store_true",
        help="send no X-Session-Id: every turn its own anonymous session (one per connection)",
    )
    add("--gap-ms", type=float, default=5.0, help="pause after every request, ms")
    add("--io-timeout", type=float, default=120.0, help="longest wait on a socket, s")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    args = parse_args(argv)
    return run_guarded(
        lambda: run(args), (BenchError, OSError, http.client.HTTPException, ValueError, KeyError)
    )


if __name__ == "__main__":
    sys.exit(main())
