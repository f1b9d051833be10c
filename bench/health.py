"""Benchmark of endpoint health: a dead llama-server behind a live inferproxy.

Run from the checkout root with ``python bench/health.py``; ``--help`` lists the options.

Two real llama.cpp servers with the tiny model (bench/_client_e2e.py's `start_server`),
each behind a ``python -m twisted inferproxy``, and one ``python -m twisted loopd`` over
both as endpoints ``live`` and ``dead`` (the inferproxies' accept limits raised, as
bench/client.py's, and loopd's pacing told so; self-test off; the default ``[health]`` pace:
a probe every 5 s while up, every 1 s while down, and the default retry schedule, 2 + 8 +
30 s). After a warm-up the ``dead`` server is killed; its inferproxy stays up, so loopd's
connections to it are accepted and closed at once, as when a model server crashes.

Measured, each over a fresh connection (an anonymous session of its own), timed from
before the connection to the end of the body:

 1. Detection. Right after the kill one request names ``dead``: the time until loopd's
    ``GET /v1/queue`` says ``dead`` is down, from the start of that request (the first
    failure). Goal: within 1 s. Without traffic the probe alone would find it within one
    up interval (5 s); the request that meets it first finds it at its first attempt (that
    request itself, with nowhere else to go, goes on with the client's retries in case
    the server comes back; the benchmark closes it).
 2. Later turns, in rounds with their anchor, the order rotating from round to round: a
    non-streaming ``auto`` turn, a ``mesh`` turn (its pool is the live endpoint alone, which
    serves it as a request by name) and a request naming ``dead``; the anchor, measured in
    the same rounds, is a request naming ``live``, the healthy endpoint alone. Goals:
    ``auto`` and ``mesh`` at most 10 ms over the anchor's median; the request naming
    ``dead`` a 503 within 100 ms (median), with ``Retry-After``.

Before the change that brought endpoint health, a request meeting the dead endpoint took
36-47 s (the client's retries) and every mesh turn 3 s (issue 13).

The exit status is 0 when every measurement ran (goals met or not), else 1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

from _client_e2e import PROXY_CMD, UnixHTTPConnection, start_server, write_model
from _report import W, non_negative, percentile, positive, verdict
from _servers import (
    BenchError,
    Children,
    ignore_exit_signals,
    run_guarded,
    start_forwarder,
    wait_socket,
)

from loopd.llama.chat import CHAT_PATH

OVERHEAD_GOAL_MS = 10.0
"""An ``auto`` or ``mesh`` turn may take at most this many ms more than the anchor."""
NAMED_GOAL_MS = 100.0
"""A request naming the dead endpoint is answered 503 within this."""
DETECT_GOAL_S = 1.0
"""The dead endpoint is down within this of the first failure."""
PATHS = ("anchor", "auto", "mesh", "named")
"""The requests of a round: the live endpoint by name, auto, mesh, the dead one by name."""
MODELS = {"anchor": "live", "auto": "auto", "mesh": "mesh", "named": "dead"}
"""The model each request asks for."""
EXPECTED = {"anchor": 200, "auto": 200, "mesh": 200, "named": 503}
"""The status each request must get."""


@dataclass(frozen=True)
class Reply:
    """One request: its time in ns from before the connection, status, headers, body."""

    ns: int
    status: int
    headers: dict[str, str]
    body: bytes


def request(path: str, method: str, target: str, body: bytes | None, timeout: float) -> Reply:
    """One request over the Unix socket at path on a fresh connection; the whole answer."""
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
        conn.request(method, target, body, headers)
        response = conn.getresponse()
        data = response.read()
        end = clock()
        names = {k.lower(): v for k, v in response.getheaders()}
        return Reply(end - start, response.status, names, data)
    finally:
        conn.close()


def chat(path: str, model: str, timeout: float) -> Reply:
    """One non-streaming chat turn asking for model, thinking off."""
    document = {
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "reasoning_effort": "none",
    }
    return request(path, "POST", CHAT_PATH, json.dumps(document).encode(), timeout)


def state_of(path: str, endpoint: str, timeout: float) -> str:
    """The health state loopd's ``GET /v1/queue`` gives endpoint."""
    reply = request(path, "GET", "/v1/queue", None, timeout)
    return str(json.loads(reply.body)["endpoints"][endpoint]["state"])


def loopd_config(listen: str, sockets: dict[str, str]) -> str:
    """The loopd.toml: the gateway on listen, one endpoint per item of sockets."""
    lines = ["[server]", f"listen = {json.dumps('unix:' + listen)}"]
    for name, socket_path in sockets.items():
        lines += ["[[endpoint]]", f"name = {json.dumps(name)}"]
        lines += [f"socket = {json.dumps(socket_path)}", "selftest = false"]
        # PROXY_CMD's limits: loopd's pacing stays out of the measurement.
        lines += ["proxy_max_connections = 64", "proxy_burst = 1000000"]
        lines += ["proxy_refill_per_second = 1000000.0"]
    return "\n".join(lines) + "\n"


def start(children: Children, threads: int) -> tuple[str, subprocess.Popen[bytes]]:
    """Start both servers, their inferproxies and loopd; return loopd's socket, dead's server."""
    model = write_model(children)
    sockets: dict[str, str] = {}
    servers: dict[str, subprocess.Popen[bytes]] = {}
    for name in ("live", "dead"):
        port = start_server(children, model, threads)
        servers[name] = children.procs[-1][1]
        sockets[name] = start_forwarder(children, f"inferproxy-{name}", PROXY_CMD, port)
    listen = os.path.join(children.dir, "loopd.sock")
    config = os.path.join(children.dir, "loopd.toml")
    with open(config, "w", encoding="utf-8") as f:
        f.write(loopd_config(listen, sockets))
    argv = [sys.executable, "-m", "twisted", "--log-format=text", "loopd", "--config", config]
    proc = children.spawn("loopd", argv, log=True)
    wait_socket(children, proc, "loopd", listen)
    return listen, servers["dead"]


def detect(loopd: str, args: argparse.Namespace) -> float:
    """
    The first request after the kill names ``dead``; return the seconds from its start
    until ``/v1/queue`` says ``dead`` is down. That request is not waited for (with nowhere
    else to go it runs the client's retry schedule, in case the server comes back): its
    connection is closed once the answer is known, which cancels it.
    """
    document = {"model": "dead", "messages": [{"role": "user", "content": "Hi"}]}
    started = time.perf_counter()
    conn = UnixHTTPConnection(loopd)
    try:
        conn.request("POST", CHAT_PATH, json.dumps(document).encode(), {"Connection": "close"})
        while state_of(loopd, "dead", args.io_timeout) != "down":
            if time.perf_counter() - started > 60:
                raise BenchError("dead was not down within 60 s")
            time.sleep(0.001)
        return time.perf_counter() - started
    finally:
        conn.close()


def rounds(loopd: str, args: argparse.Namespace) -> dict[str, list[int]]:
    """The timed rounds of part 2: per path, its times in ns."""
    times: dict[str, list[int]] = {path: [] for path in PATHS}
    for number in range(args.warmup + args.turns):
        shift = number % len(PATHS)
        for path in PATHS[shift:] + PATHS[:shift]:
            reply = chat(loopd, MODELS[path], args.io_timeout)
            if reply.status != EXPECTED[path]:
                raise BenchError(f"{path}: HTTP {reply.status}: {reply.body[:300]!r}")
            if path == "named" and "retry-after" not in reply.headers:
                raise BenchError("named: a 503 without Retry-After")
            if path in ("auto", "mesh") and json.loads(reply.body)["model"] != "live":
                raise BenchError(f"{path}: answered by {json.loads(reply.body)['model']}")
            if number >= args.warmup:
                times[path].append(reply.ns)
            time.sleep(args.gap_ms / 1000)
    return times


def run(args: argparse.Namespace) -> None:
    """Start everything, kill the dead server, measure, print the report."""
    children = Children()
    try:
        print("  starting two llama.cpp servers, their inferproxies and loopd ...", file=sys.stderr)
        loopd, dead = start(children, args.threads)
        for model in ("live", "dead", "auto", "mesh"):
            reply = chat(loopd, model, args.io_timeout)
            if reply.status != 200:
                raise BenchError(f"warm-up {model}: HTTP {reply.status}: {reply.body[:300]!r}")
        children.stop(dead)
        print("  killed the dead endpoint's server; measuring ...", file=sys.stderr)
        detected = detect(loopd, args)
        times = rounds(loopd, args)
    finally:
        ignore_exit_signals()
        children.stop_all()
    report(detected, times, args)


def report(detected: float, times: dict[str, list[int]], args: argparse.Namespace) -> None:
    """Print every figure, the anchor's beside them, and the goals."""
    print(f"\n{args.turns} timed rounds after {args.warmup} untimed; ms, fresh connection each\n")
    print(f"{'':<{W}}{'median':>10}{'p90':>10}{'p99':>10}")
    labels = {
        "anchor": "anchor: named live endpoint",
        "auto": "auto turn",
        "mesh": "mesh turn",
        "named": "named dead endpoint (503)",
    }
    for path in PATHS:
        samples = times[path]
        row = [percentile(samples, q) for q in (0.5, 0.9, 0.99)]
        print(f"{labels[path]:<{W}}" + "".join(f"{value:>10.2f}" for value in row))
    anchor = percentile(times["anchor"], 0.5)
    print()
    goal = verdict(detected, "<=", DETECT_GOAL_S)
    print(f"{'detected, s after the first failure':<{W}}{detected:>10.3f}   {goal}")
    for path in ("auto", "mesh"):
        added = percentile(times[path], 0.5) - anchor
        ratio = percentile(times[path], 0.5) / anchor
        label = f"{path} added (median - anchor's), ms"
        print(f"{label:<{W}}{added:>10.2f}   {verdict(added, '<=', OVERHEAD_GOAL_MS)}")
        print(f"{path + ' / anchor (medians)':<{W}}{ratio:>10.2f}")
    named = percentile(times["named"], 0.5)
    print(
        f"{'named dead 503 median, ms':<{W}}{named:>10.2f}   {verdict(named, '<=', NAMED_GOAL_MS)}"
    )
    print(f"{'named dead / anchor (medians)':<{W}}{named / anchor:>10.2f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description="Benchmark loopd with a dead llama-server behind a live inferproxy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--turns", type=positive, default=50, help="timed rounds (one request per path)")
    add("--warmup", type=non_negative, default=3, help="untimed rounds first")
    add("--threads", type=positive, default=1, help="threads of each llama.cpp server")
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
