"""Benchmark of how loopd places requests: anonymous clients, and ``auto`` over two endpoints.

Run from the checkout root with ``python bench/routing.py`` (``tox -e bench``);
``--help`` lists the options. It needs the test extra (``xllamacpp``, ``gguf``) for the
real llama.cpp servers.

Two real llama.cpp servers with 2 slots each serve the project's tiny model, each behind
its own ``python -m twisted inferproxy``; ``python -m twisted loopd`` has both as
endpoints ``tiny-a`` and ``tiny-b`` (loopd.toml states each inferproxy's limits, so that loopd's
pacing lets through what the proxy accepts). Every request is a streamed chat with thinking off
(the model's short fixed answer), on a fresh connection, from a blocking ``http.client``.

Part 1, anonymous: ``--requests`` (100) requests one after the other with no session id,
as curl or an SDK making a client per request sends them, naming ``tiny-a``; the anchor
is the same requests straight to that server's TCP port, measured in the same run. It
prints the median and p99 of the total time per path, the ratio, and how many loopd
requests waited (a ``queued`` or ``waiting`` event) although nothing else ran. Goal: p99 at most 2x
direct's and no request waiting.

Part 2, ``auto``: ``--sessions`` (4: as many as the two servers have slots) sessions at
once, each ``--turns`` (6) turns of a conversation it extends, with its own
``X-Session-Id`` and model ``auto``, or with ``--model tiny`` the endpoint group ``tiny``
that both endpoints belong to (DESIGN decision 42: routed among its members as ``auto``
is). It prints how many sessions changed endpoint after their first turn, the share of
each later turn's prompt that was cached (the lowest, and the sums), and how many
requests waited (a ``queued`` or ``waiting`` event). The anchor: the same sessions sent
straight to the servers, session i to server i % 2 (``id_slot`` -1, the server's own
choice). Goals: no session moves, every later turn
finds some of its prompt cached, no request waits.

The exit status is 0 when every measurement ran (goals met or not), else 1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any

from _client_e2e import PROXY_CMD, start_server
from _gateway_runs import SHORT_ANSWER, SHORT_MAX_TOKENS, run_concurrently, upstream_body
from _gateway_stack import sse_events
from _report import W, percentile, positive, verdict
from _servers import (
    BenchError,
    Children,
    ignore_exit_signals,
    run_guarded,
    start_forwarder,
    wait_socket,
)

from loopd.llama import Assistant, ChatMessage, ChatRequest, User

ENDPOINTS = ("tiny-a", "tiny-b")
"""The two endpoints' names in loopd.toml."""
GROUP = "tiny"
"""The endpoint group both endpoints belong to in loopd.toml."""
ANONYMOUS_P99_GOAL = 2.0
"""Part 1: loopd's p99 at most this many times direct's."""
PROXY_LIMITS = (
    "proxy_max_connections = 64",
    "proxy_burst = 1000000",
    "proxy_refill_per_second = 1e6",
)
"""What loopd.toml says of each inferproxy's limits: those PROXY_CMD starts it with, so that
loopd's pacing does not hold back what the proxy would accept."""


@dataclass(frozen=True)
class Stack:
    """Where the paths lead: each server's TCP port, and loopd's Unix socket."""

    ports: tuple[int, ...]
    loopd_socket: str


@dataclass
class Answer:
    """One streamed answer: its total time in ns, its endpoint, its token counts, its waits."""

    total: int = 0
    model: str = ""
    prompt: int = 0
    cached: int = 0
    queued: int = 0
    text: list[str] = field(default_factory=list)


def loopd_config(listen: str, sockets: tuple[str, ...]) -> str:
    """The loopd.toml text: the two endpoints, in group L{GROUP}, no self-test."""
    lines = ["[server]", f"listen = {json.dumps('unix:' + listen.replace(':', chr(92) + ':'))}"]
    for name, path in zip(ENDPOINTS, sockets, strict=True):
        lines += ["", "[[endpoint]]", f"name = {json.dumps(name)}"]
        lines += [f"socket = {json.dumps(path)}", "selftest = false", *PROXY_LIMITS]
        lines += [f"group = {json.dumps(GROUP)}"]
    return "\n".join(lines) + "\n"


def start(children: Children, threads: int) -> Stack:
    """Start both servers, their inferproxies and loopd; return where they listen."""
    from loopd.demo.tiny_model import write_tiny_model

    model = os.path.join(children.dir, "tiny.gguf")
    write_tiny_model(model)
    ports = tuple(start_server(children, model, threads) for _ in ENDPOINTS)
    sockets = tuple(
        start_forwarder(children, f"inferproxy-{name}", PROXY_CMD, port)
        for name, port in zip(ENDPOINTS, ports, strict=True)
    )
    listen = os.path.join(children.dir, "loopd.sock")
    config = os.path.join(children.dir, "loopd.toml")
    with open(config, "w", encoding="utf-8") as f:
        f.write(loopd_config(listen, sockets))
    argv = [sys.executable, "-m", "twisted", "--log-format=text", "loopd", "--config", config]
    proc = children.spawn("loopd", argv, log=True)
    wait_socket(children, proc, "loopd", listen)
    return Stack(ports, listen)


def loopd_body(model: str, wire: list[dict[str, str]]) -> bytes:
    """An OpenAI streaming chat body for loopd, thinking off, usage asked for."""
    body: dict[str, Any] = {
        "model": model,
        "messages": wire,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": SHORT_MAX_TOKENS,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    return json.dumps(body).encode()


def direct_body(history: list[ChatMessage]) -> bytes:
    """The body loopd's client would send a server for history, the server choosing the slot."""
    return upstream_body(
        ChatRequest(slot=-1, messages=tuple(history), thinking=False, max_tokens=SHORT_MAX_TOKENS)
    )


def _take_event(event: bytes, answer: Answer) -> bool:
    """Note one SSE event in answer; return whether it was the end (``[DONE]``)."""
    if event.startswith(b": loopd "):
        if json.loads(event[len(b": loopd ") :]).get("event") in ("queued", "waiting"):
            answer.queued += 1
        return False
    if not event.startswith(b"data: "):
        return False
    if event == b"data: [DONE]":
        return True
    chunk = json.loads(event[6:])
    if "error" in chunk:
        raise BenchError(f"error event: {chunk['error']}")
    answer.model = chunk.get("model") or answer.model
    usage = chunk.get("usage")
    timings = chunk.get("timings")
    if isinstance(usage, dict):
        answer.prompt = int(usage.get("prompt_tokens", 0))
        answer.cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    elif isinstance(timings, dict):
        answer.cached = int(timings.get("cache_n", 0))
        answer.prompt = answer.cached + int(timings.get("prompt_n", 0))
    for choice in chunk.get("choices") or ():
        content = (choice.get("delta") or {}).get("content")
        if content:
            answer.text.append(content)
    return False


def stream(target: int | str, body: bytes, timeout: float, session: str | None) -> Answer:
    """One streamed chat on a fresh connection: to a server's TCP port or loopd's socket."""
    start_ns = time.perf_counter_ns()
    headers = {} if session is None else {"X-Session-Id": session}
    answer = Answer()
    for event in sse_events(target, body, timeout, headers):
        if _take_event(event, answer):
            answer.total = time.perf_counter_ns() - start_ns
            if "".join(answer.text) != SHORT_ANSWER:
                raise BenchError(f"answer {''.join(answer.text)!r}")
            return answer
    raise BenchError("the body ended before [DONE]")


def measure_anonymous(stack: Stack, requests: int, timeout: float) -> dict[str, list[Answer]]:
    """Part 1: requests sequential anonymous chats per path, alternating the paths."""
    question = [{"role": "user", "content": "Hello, who are you?"}]
    loopd = loopd_body(ENDPOINTS[0], question)
    direct = direct_body([User(question[0]["content"])])
    out: dict[str, list[Answer]] = {"loopd": [], "direct": []}
    for i in range(requests):
        for path in ("loopd", "direct") if i % 2 == 0 else ("direct", "loopd"):
            if path == "loopd":
                out[path].append(stream(stack.loopd_socket, loopd, timeout, None))
            else:
                out[path].append(stream(stack.ports[0], direct, timeout, None))
    return out


def _conversation(
    path: str, stack: Stack, model: str, index: int, turns: int, timeout: float, out: list[Answer]
) -> None:
    """One session's turns in order, through loopd's ``model`` or straight to a server."""
    history: list[ChatMessage] = []
    wire: list[dict[str, str]] = []
    for turn in range(turns):
        text = f"Session {index}, turn {turn}: tell me once more who you are, please."
        history.append(User(text))
        wire.append({"role": "user", "content": text})
        if path == "loopd":
            answer = stream(
                stack.loopd_socket, loopd_body(model, wire), timeout, f"routing-{index}"
            )
        else:
            port = stack.ports[index % len(stack.ports)]
            answer = stream(port, direct_body(history), timeout, None)
            answer.model = ENDPOINTS[index % len(stack.ports)]
        out.append(answer)
        history.append(Assistant(SHORT_ANSWER))
        wire.append({"role": "assistant", "content": SHORT_ANSWER})


def measure_auto(
    stack: Stack, model: str, sessions: int, turns: int, timeout: float
) -> dict[str, list[list[Answer]]]:
    """Part 2: sessions conversations at once per path; each session's answers in order."""
    out: dict[str, list[list[Answer]]] = {}
    for path in ("direct", "loopd"):
        answers: list[list[Answer]] = [[] for _ in range(sessions)]
        out[path] = answers

        def converse(index: int, path: str = path, answers: list[list[Answer]] = answers) -> None:
            _conversation(path, stack, model, index, turns, timeout, answers[index])

        run_concurrently(sessions, converse, path)
    return out


def print_anonymous(results: dict[str, list[Answer]], args: argparse.Namespace) -> None:
    """Print part 1's figures, the ratio and the goals."""
    header = (
        f"Part 1, anonymous: {args.requests} streamed chats per path one after the other,"
        " no session id, each on a fresh connection (curl, or an SDK making a client per"
        " request), thinking off. loopd: http.client -> loopd.sock -> loopd -> inferproxy"
        " -> a 2-slot server; direct: http.client -> that server's TCP port (the anchor,"
        f" same run, paths alternating). {os.cpu_count()} CPUs shared by everything."
    )
    print("\n" + textwrap.fill(header, 88))
    print("\n" + " " * W + f"{'loopd':>10}{'direct':>10}{'ratio':>10}")
    for label, q in (("total, median ms", 0.5), ("total, p99 ms", 0.99)):
        loopd = percentile([a.total for a in results["loopd"]], q)
        direct = percentile([a.total for a in results["direct"]], q)
        print(f"{label:<{W}}{loopd:>10.2f}{direct:>10.2f}{loopd / direct:>10.2f}")
    p99 = percentile([a.total for a in results["loopd"]], 0.99)
    ratio = p99 / percentile([a.total for a in results["direct"]], 0.99)
    waited = sum(1 for a in results["loopd"] if a.queued)
    print(f"\n{'p99 ratio':<{W}}{ratio:>10.2f}   {verdict(ratio, '<=', ANONYMOUS_P99_GOAL)}")
    print(f"{'loopd requests that waited':<{W}}{waited:>10d}   {verdict(waited, '<=', 0)}")


def _later_turns(sessions: list[list[Answer]]) -> list[Answer]:
    """Every answer after its session's first."""
    return [a for answers in sessions for a in answers[1:]]


def print_auto(results: dict[str, list[list[Answer]]], args: argparse.Namespace) -> None:
    """Print part 2's figures per path and the goals."""
    header = (
        f"Part 2, {args.model}: {args.sessions} sessions at once, {args.turns} turns each of a"
        f" conversation it extends, thinking off. loopd: model {args.model} over endpoints"
        " tiny-a and tiny-b (two 2-slot servers, each behind its inferproxy, both in group"
        f" {GROUP}), each session its own"
        " X-Session-Id; direct: session i straight to server i % 2, id_slot -1 (the anchor,"
        " same run)."
    )
    print("\n" + textwrap.fill(header, 88))
    print("\n" + " " * W + f"{'loopd':>10}{'direct':>10}")
    rows: dict[str, dict[str, float]] = {}
    for path, sessions in results.items():
        later = _later_turns(sessions)
        shares = [a.cached / a.prompt if a.prompt else 0.0 for a in later]
        rows[path] = {
            "sessions that moved": sum(1 for s in sessions if len({a.model for a in s}) > 1),
            "later turns, lowest cached share": min(shares) if shares else 0.0,
            "later turns with nothing cached": sum(1 for a in later if not a.cached),
            "later turns, cached tokens": sum(a.cached for a in later),
            "later turns, prompt tokens": sum(a.prompt for a in later),
            "requests that waited": sum(1 for s in sessions for a in s if a.queued),
        }
    for label in rows["loopd"]:
        cells = f"{rows['loopd'][label]:>10.2f}{rows['direct'][label]:>10.2f}"
        print(f"{label:<{W}}{cells}")
    loopd = rows["loopd"]
    homes = [s[0].model for s in results["loopd"] if s]
    spread = ", ".join(f"{name} {homes.count(name)}" for name in ENDPOINTS)
    print(f"{'loopd sessions per endpoint':<{W}}{spread}")
    print()
    print(f"{'sessions that moved':<{W}}{loopd['sessions that moved']:>10.0f}", end="")
    print(f"   {verdict(loopd['sessions that moved'], '<=', 0)}")
    uncached = loopd["later turns with nothing cached"]
    print(
        f"{'later turns with nothing cached':<{W}}{uncached:>10.0f}   {verdict(uncached, '<=', 0)}"
    )
    waited = loopd["requests that waited"]
    print(f"{'requests that waited':<{W}}{waited:>10.0f}   {verdict(waited, '<=', 0)}")


def run(args: argparse.Namespace) -> None:
    """Start the stack, run the parts asked for, print their reports."""
    children = Children()
    anonymous = auto = None
    try:
        print("  starting two llama servers, two inferproxies and loopd ...", file=sys.stderr)
        stack = start(children, args.threads)
        if args.part in ("all", "anonymous"):
            print(f"  part 1: {args.requests} requests per path ...", file=sys.stderr)
            anonymous = measure_anonymous(stack, args.requests, args.io_timeout)
        if args.part in ("all", "auto"):
            print(f"  part 2: {args.sessions} sessions per path ...", file=sys.stderr)
            auto = measure_auto(stack, args.model, args.sessions, args.turns, args.io_timeout)
    finally:
        ignore_exit_signals()
        children.stop_all()
    if anonymous is not None:
        print_anonymous(anonymous, args)
    if auto is not None:
        print_auto(auto, args)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description="Benchmark how loopd places anonymous requests and auto sessions.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--part", choices=("all", "anonymous", "auto"), default="all", help="what to run")
    add("--requests", type=positive, default=100, help="part 1: requests per path")
    add("--sessions", type=positive, default=4, help="part 2: concurrent sessions")
    add("--turns", type=positive, default=6, help="part 2: turns per session")
    add("--model", choices=("auto", GROUP), default="auto", help="part 2: the model asked for")
    add("--threads", type=positive, default=1, help="threads of each llama server")
    add("--io-timeout", type=float, default=120.0, help="longest wait on a socket, s")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    args = parse_args(argv)
    return run_guarded(lambda: run(args), (BenchError, OSError, http.client.HTTPException))


if __name__ == "__main__":
    sys.exit(main())
