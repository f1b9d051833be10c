"""Benchmark of loopd's pacing under an inferproxy's accept limits (issue 12, item 11).

Run from the checkout root with ``python bench/pacing.py`` (``tox -e bench``);
``--help`` lists the options. It needs the test extra (``xllamacpp``, ``gguf``,
``numpy``) for the real llama.cpp server.

One real llama.cpp server (2 slots) serves the project's tiny model (thinking off: a
short fixed answer). Two ``python -m twisted inferproxy`` children forward a Unix socket
each to it: ``limited`` with the seed's defaults (``--max-connections 8 --burst 10
--refill 2``) and ``open`` with no limits to speak of (the anchor). loopd's own llama
client (`loopd.llama.Client`, in this process on the real reactor) sends every chat with
``chat_with_retry``, as the gateway does, through three paths:

 - ``paced``: the limited proxy, the endpoint naming its limits (the defaults), so loopd
   paces its connections under them;
 - ``unpaced``: the limited proxy, the endpoint claiming limits far above the proxy's,
   so loopd does not pace and meets the proxy's refusals (a refusal is not retried);
 - ``agent-box``: a proxy with the limits the README gives for an agent box (``--burst
   100 --refill 20 --max-connections 32``), the endpoint naming them: an agent's turns
   never wait, a runaway client is held to 20 connections a second;
 - ``open``: the open proxy, the endpoint naming its huge limits (the anchor).

Part 1: ``--requests`` (100) chats one after another per path. Part 2: ``--sessions``
(50) chats started at once per path, spread over the 2 slots (the slot gate queues
them). Each prints per path the p50, p90 and p99 time per chat in ms, the total time,
the ratio of each to the open path's, and what the pacer counted: connections, waits
and the seconds they waited, refusals by limit, chats that failed and why. No goal:
with the defaults the limited paths cannot pass ~2 connections a second after the
burst, whatever loopd does; the figures say how far loopd stays from refusals.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

from _client_e2e import ANSWER, PROXY_CMD, run_reactor, start_server, write_model
from _report import W, percentile, positive
from _servers import BenchError, Children, ignore_exit_signals, run_guarded, start_forwarder
from twisted.internet.defer import gatherResults

from loopd.errors import InferError
from loopd.llama import ChatRequest, Client, User
from loopd.settings import Config, Endpoint, Limits

LIMITED_CMD = "{python} -m twisted inferproxy --listen {listen} --upstream {upstream}"
"""The limited inferproxy: the seed's defaults (8 connections, burst 10, refill 2/s)."""
AGENT_BOX_CMD = LIMITED_CMD + " --max-connections 32 --burst 100 --refill 20"
"""The inferproxy with the README's limits for an agent box."""
AGENT_BOX = {"proxy_max_connections": 32, "proxy_burst": 100, "proxy_refill_per_second": 20.0}
"""The endpoint fields that name the agent box's limits."""
PATHS = ("paced", "unpaced", "agent-box", "open")
"""Every path, in the order printed; ``open`` is the anchor."""
HUGE = {"proxy_max_connections": 64, "proxy_burst": 1_000_000, "proxy_refill_per_second": 1e6}
"""Endpoint fields that claim no limits: the open proxy's, or a pretence (``unpaced``)."""


@dataclass
class Run:
    """What one path measured in one part: times in ns, failures by kind, the counts."""

    times: list[int] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    total_ns: int = 0
    chats: int = 0
    connections: int = 0
    waits: int = 0
    waited_s: float = 0.0
    refusals: dict[str, int] = field(default_factory=dict)


def make_client(reactor: Any, path: str, socket: str, sessions: int) -> Client:
    """loopd's llama client of one path: the endpoint's limits as the path says."""
    known = {f.name for f in dataclasses.fields(Endpoint)}
    # An older checkout (run for the figures before pacing) has no such fields: left out.
    claimed = AGENT_BOX if path == "agent-box" else HUGE
    fields: dict[str, Any] = {k: v for k, v in claimed.items() if k in known and path != "paced"}
    endpoint = Endpoint(name="tiny", socket=socket, model="tiny", selftest=False, **fields)
    config = Config(endpoints=(endpoint,), limits=Limits(queue_depth=max(2, sessions)))
    return Client(reactor, config, endpoint)


async def one_chat(client: Client, slot: int, run: Run) -> None:
    """One chat with retries, timed from its start; a failure is counted by kind."""
    request = ChatRequest(slot=slot, messages=(User("Hi"),), thinking=False)
    start = time.perf_counter_ns()
    try:
        completion = await client.chat_with_retry(request, lambda event: None)
    except InferError as e:
        run.failures[type(e).__name__] += 1
        return
    run.times.append(time.perf_counter_ns() - start)
    if completion.content != ANSWER:
        raise BenchError(f"answer {completion.content!r}")


async def measure(
    reactor: Any, sockets: dict[str, str], requests: int, sessions: int
) -> dict[str, dict[str, Run]]:
    """Run both parts on every path, each on a fresh client; return the runs."""
    from twisted.internet.task import deferLater

    results: dict[str, dict[str, Run]] = {"sequential": {}, "concurrent": {}}
    for part, count in (("sequential", requests), ("concurrent", sessions)):
        for path in PATHS:
            print(f"  {part}: {count} chats, {path} ...", file=sys.stderr, flush=True)
            # Let the proxy's bucket fill again between runs, as after a quiet spell.
            await deferLater(reactor, 6.0)
            client = make_client(reactor, path, sockets[path], sessions)
            run = Run(chats=count)
            start = time.perf_counter_ns()
            if part == "sequential":
                for _ in range(count):
                    await one_chat(client, 0, run)
            else:
                chats = [one_chat(client, i % 2, run) for i in range(count)]
                await gatherResults([_deferred(c) for c in chats])
            run.total_ns = time.perf_counter_ns() - start
            pacer = getattr(client, "pacer", None)
            if pacer is not None:
                stats = pacer.stats
                run.connections, run.waits = stats.connections, stats.waits
                run.waited_s, run.refusals = stats.waited_seconds, dict(stats.refusals)
            results[part][path] = run
    return results


def _deferred(coroutine: Any) -> Any:
    """A coroutine as a Deferred."""
    from twisted.internet.defer import Deferred

    return Deferred.fromCoroutine(coroutine)


def print_part(part: str, runs: dict[str, Run], args: argparse.Namespace) -> None:
    """Print one part's table."""
    count = args.requests if part == "sequential" else args.sessions
    how = (
        "one after another"
        if part == "sequential"
        else "started at once over the 2 slots (the slot gate queues them)"
    )
    print(f"\n{part}: N = {count} chats per path, {how}")
    print(" " * W + "".join(f"{p:>12}" for p in PATHS))
    anchor = runs["open"]

    def row(label: str, cells: list[str]) -> None:
        print(f"{label:<{W}}" + "".join(f"{c:>12}" for c in cells))

    def quantile(run: Run, q: float) -> float:
        return percentile(run.times, q) if run.times else float("nan")

    for label, q in (("p50 ms", 0.5), ("p90 ms", 0.9), ("p99 ms", 0.99)):
        row(label, [f"{quantile(runs[p], q):.1f}" for p in PATHS])
        ratios = [quantile(runs[p], q) / quantile(anchor, q) for p in PATHS]
        row(f"  {label} / open", [f"{r:.1f}" for r in ratios])
    row("total s", [f"{runs[p].total_ns / 1e9:.1f}" for p in PATHS])
    row("  total / open", [f"{runs[p].total_ns / anchor.total_ns:.1f}" for p in PATHS])
    row("connections per chat", [f"{runs[p].connections / runs[p].chats:.2f}" for p in PATHS])
    row("connections that waited", [str(runs[p].waits) for p in PATHS])
    row("  seconds waited, in all", [f"{runs[p].waited_s:.1f}" for p in PATHS])
    for limit in ("accept-rate", "connections"):
        row(f"refusals ({limit})", [str(runs[p].refusals.get(limit, 0)) for p in PATHS])
    row("failed chats", [str(sum(runs[p].failures.values())) for p in PATHS])
    kinds = sorted({k for p in PATHS for k in runs[p].failures})
    for kind in kinds:
        row(f"  {kind}", [str(runs[p].failures.get(kind, 0)) for p in PATHS])


def run(args: argparse.Namespace) -> None:
    """Start the server and both proxies, measure, print."""
    children = Children()
    try:
        print("  starting the llama server and three inferproxies ...", file=sys.stderr, flush=True)
        port = start_server(children, write_model(children), args.threads)
        limited = start_forwarder(children, "limited", LIMITED_CMD, port)
        box = start_forwarder(children, "agent-box", AGENT_BOX_CMD, port)
        anchor = start_forwarder(children, "open", PROXY_CMD, port)
        sockets = {"paced": limited, "unpaced": limited, "agent-box": box, "open": anchor}
        results = run_reactor(
            lambda reactor: measure(reactor, sockets, args.requests, args.sessions)
        )
    finally:
        ignore_exit_signals()
        children.stop_all()
    header = (
        f"loopd's llama client (chat_with_retry, default retry policy) through inferproxy"
        f" to the tiny model on a real llama.cpp server (xllamacpp {version('xllamacpp')},"
        f" 2 slots, --threads {args.threads}). paced: the proxy's defaults (8 connections,"
        " burst 10, refill 2/s) and the endpoint naming them; unpaced: the same proxy, the"
        " endpoint claiming no limits; agent-box: --burst 100 --refill 20 --max-connections"
        " 32, the endpoint naming them; open: a proxy with no limits (the anchor). Each run"
        f" starts on a full bucket. {os.cpu_count()} CPUs, shared by the server, the"
        " proxies and this process."
    )
    print("\n" + textwrap.fill(header, 88))
    for part in ("sequential", "concurrent"):
        print_part(part, results[part], args)


def main() -> int:
    """Parse the options and run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=positive, default=100, help="sequential chats per path")
    parser.add_argument("--sessions", type=positive, default=50, help="concurrent chats per path")
    parser.add_argument("--threads", type=positive, default=1, help="llama-server threads")
    args = parser.parse_args()
    return run_guarded(lambda: run(args), (BenchError, OSError))


if __name__ == "__main__":
    sys.exit(main())
