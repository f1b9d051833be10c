"""Part 4 of bench/queue.py: why the lease scheduler exists.

Four agent sessions take turns on a real llama.cpp server with ONE slot. Each session is
a conversation with its own long system prompt; it sends a turn, waits for the answer,
"runs a tool" for ``think`` seconds, and sends the next turn with the whole history. All
sessions start at once.

Straight to the server, the sessions interleave on the slot: each turn usually finds
another session's prompt in the KV cache and the server re-processes the whole prompt.
Through ``twist loopd`` each request takes a lease on the endpoint's queue and keeps it for
the grace (3 s) after its answer, so a session's next turn, ``think`` seconds later, finds
the slot still its own and its prefix cached: the server processes only the new tokens.

The count is the server's own ``timings.prompt_n`` (prompt tokens it evaluated) of every
answer, summed per path; both paths send the same conversations (each path with its own
session texts, so neither inherits the other's cache). Non-streaming requests: both the
server and loopd return ``timings``.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import textwrap
import time
from dataclasses import dataclass
from typing import Any

from _client_e2e import PROXY_CMD, UnixHTTPConnection, start_server
from _gateway_runs import SHORT_MAX_TOKENS, run_concurrently, upstream_body
from _gateway_stack import MODEL, loopd_config
from _servers import BenchError, Children, start_forwarder, wait_socket

from loopd.llama.chat import CHAT_PATH
from loopd.llama.types import Assistant, ChatMessage, ChatRequest, System, User

SYSTEM_WORDS = 400
"""Words of each session's system prompt: the prefix a switch costs."""


@dataclass(frozen=True)
class TurnsResult:
    """One path's run: prompt tokens the server evaluated, answers, wall time in s."""

    prompt_n: int
    cache_n: int
    answers: int
    wall: float


def _system_text(path: str, session: int) -> str:
    """A long system prompt of its own for each session of each path."""
    words = [f"{path}{session}w{i % 97}" for i in range(SYSTEM_WORDS)]
    return f"You are agent {session} on the {path} path. Notes: " + " ".join(words)


def _post(target: int | str, body: bytes, session: str | None, timeout: float) -> Any:
    """One non-streaming chat over TCP (an int port) or a Unix socket; the JSON answer."""
    if isinstance(target, str):
        conn: http.client.HTTPConnection = UnixHTTPConnection(target)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", target, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if session is not None:
        headers["X-Session-Id"] = session
    try:
        conn.request("POST", CHAT_PATH, body, headers)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise BenchError(f"HTTP {response.status}: {data[:300]!r}")
    return json.loads(data)


def _body(path: str, history: list[ChatMessage]) -> bytes:
    """The request body of one turn on one path (the server's own, or OpenAI's)."""
    if path == "direct":
        request = ChatRequest(
            slot=-1, messages=tuple(history), thinking=False, max_tokens=SHORT_MAX_TOKENS
        )
        body = json.loads(upstream_body(request))
        body["stream"] = False
        body.pop("stream_options", None)
        return json.dumps(body).encode()
    wire: list[dict[str, str]] = []
    for message in history:
        role = {System: "system", User: "user", Assistant: "assistant"}[type(message)]
        wire.append({"role": role, "content": getattr(message, "content", "")})
    return json.dumps(
        {
            "model": MODEL,
            "messages": wire,
            "max_tokens": SHORT_MAX_TOKENS,
            "reasoning_effort": "none",
            "stream": False,
        }
    ).encode()


def _session(
    path: str, target: int | str, index: int, turns: int, think: float, out: list[Any]
) -> None:
    """Run one session's turns, appending each answer's timings to out."""
    history: list[ChatMessage] = [System(_system_text(path, index))]
    for turn in range(turns):
        history.append(User(f"Session {index}, turn {turn}: what next?"))
        session = f"agent-{index}" if path == "loopd" else None
        answer = _post(target, _body(path, history), session, 120.0)
        out.append(answer["timings"])
        text = answer["choices"][0]["message"].get("content") or ""
        history.append(Assistant(text))
        time.sleep(think)


def run_path(path: str, target: int | str, sessions: int, turns: int, think: float) -> TurnsResult:
    """All sessions at once on one path; the summed timings."""
    timings: list[Any] = []
    wall = run_concurrently(
        sessions, lambda i: _session(path, target, i, turns, think, timings), path
    )
    prompt = sum(int(t.get("prompt_n", 0)) for t in timings)
    cached = sum(int(t.get("cache_n", 0)) for t in timings)
    return TurnsResult(prompt, cached, len(timings), wall / 1e9)


def start_one_slot(children: Children, threads: int, cache_ram_mib: int | None) -> tuple[int, str]:
    """A one-slot server, inferproxy and loopd (grace 3 s); the port and loopd's socket."""
    from loopd.demo.tiny_model import write_tiny_model

    tag = "default" if cache_ram_mib is None else f"ram{cache_ram_mib}"
    model = os.path.join(children.dir, "tiny.gguf")
    write_tiny_model(model)
    port = start_server(children, model, threads, parallel=1, cache_ram_mib=cache_ram_mib)
    infer = start_forwarder(children, f"inferproxy-{tag}", PROXY_CMD, port)
    listen = os.path.join(children.dir, f"loopd-{tag}.sock")
    config = os.path.join(children.dir, f"loopd-{tag}.toml")
    with open(config, "w", encoding="utf-8") as f:
        f.write(loopd_config(listen, infer))
        f.write("\n[queue]\nserve = false\ngrace_ms = 3000\n")
    argv = [sys.executable, "-m", "twisted", "--log-format=text", "loopd", "--config", config]
    proc = children.spawn(f"loopd-{tag}", argv, log=True)
    wait_socket(children, proc, "loopd", listen)
    return port, listen


def measure_turns(
    children: Children,
    threads: int,
    sessions: int,
    turns: int,
    think: float,
    cache_ram_mib: int | None = None,
) -> dict[str, TurnsResult]:
    """Both paths on one fresh one-slot stack, direct first.

    cache_ram_mib: the server's RAM prompt cache (None: llama.cpp's default, 8 GiB).
    """
    port, listen = start_one_slot(children, threads, cache_ram_mib)
    return {
        "direct": run_path("direct", port, sessions, turns, think),
        "loopd": run_path("loopd", listen, sessions, turns, think),
    }


FEWER_GOAL = 0.5
"""Through loopd the server should evaluate at least this share fewer prompt tokens."""

CACHE_SETTINGS: tuple[tuple[str, int | None], ...] = (
    ("none (--cache-ram 0)", 0),
    ("llama.cpp's default (8 GiB)", None),
)
"""The server's RAM prompt cache in each run: off, then as llama.cpp ships it."""


def measure_all(
    threads: int, sessions: int, turns: int, think: float
) -> list[tuple[str, dict[str, TurnsResult]]]:
    """Both RAM-cache settings, each on a fresh stack that is stopped afterwards."""
    results = []
    for label, cache_ram_mib in CACHE_SETTINGS:
        children = Children()
        try:
            results.append(
                (label, measure_turns(children, threads, sessions, turns, think, cache_ram_mib))
            )
        finally:
            children.stop_all()
    return results


def print_turns(
    results: list[tuple[str, dict[str, TurnsResult]]], sessions: int, turns: int, think: float
) -> None:
    """Print part 4: prompt tokens evaluated per path and setting, the saving, the goal."""
    header = (
        f"Part 4, {sessions} agent sessions x {turns} turns, all at once, on a ONE-slot"
        f" llama.cpp server ({SYSTEM_WORDS}-word system prompts, {think:g} s between a"
        " session's turns): prompt tokens the server evaluated (its timings.prompt_n),"
        " straight to it (the anchor) and through twist loopd (grace 3 s)"
    )
    print("\n" + textwrap.fill(header, 88) + "\n")
    head = ("server's RAM prompt cache", "direct", "loopd", "fewer", "wall direct", "wall loopd")
    print(f"{head[0]:<30}{head[1]:>9}{head[2]:>9}{head[3]:>8}{head[4]:>13}{head[5]:>12}")
    for label, run in results:
        direct, loopd = run["direct"], run["loopd"]
        fewer = 1 - loopd.prompt_n / direct.prompt_n if direct.prompt_n else 0.0
        print(
            f"{label:<30}{direct.prompt_n:>9}{loopd.prompt_n:>9}{fewer:>8.0%}"
            f"{direct.wall:>12.1f}s{loopd.wall:>11.1f}s"
            f"   goal >= {FEWER_GOAL:.0%} fewer: {'met' if fewer >= FEWER_GOAL else 'MISSED'}"
        )
