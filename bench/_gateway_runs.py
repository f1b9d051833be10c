"""The two measurements of bench/gateway.py, both with `_gateway_stack.stream_chat`.

Part 1 (`measure_long`): one request at a time, a 200-token answer (the think-forever
model reasoning until ``max_tokens``), in rounds of one loopd request and one direct
request, the order alternating, a short pause after each so the slot is idle again.
loopd gets the OpenAI body; the server gets the body loopd's client would send upstream
for it (`loopd.llama.request.chat_body`, slot 0).

Part 2 (`measure_sessions`): ``sessions`` threads, each its own conversation of
``turns`` short turns (thinking off), all started together. Through loopd each thread
sends its own ``X-Session-Id``; direct, each sends the upstream body with ``id_slot``
-1 and lets the server choose. The two paths run one after the other, never at once.

Part 3 (`measure_cpu`): ``requests`` of part 1's streams through loopd, one at a time;
the CPU seconds the server, inferproxy and loopd each spent meanwhile, read from /proc
before and after (`_gateway_stack.cpu_seconds`), and the tokens streamed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from _gateway_stack import MODEL, Result, Stack, cpu_seconds, stream_chat
from _servers import BenchError

from loopd.llama import Assistant, ChatMessage, ChatRequest, User
from loopd.llama.request import chat_body, encode
from loopd.settings import Config, Endpoint

LONG_QUESTION = "Think it over at length, please."
"""Part 1's one user message."""
SHORT_ANSWER = "Hello from the tiny model!"
"""What the tiny model answers with thinking off."""
SHORT_MAX_TOKENS = 32
"""Part 2's max_tokens: above the short answer's length, so it ends by itself."""


@dataclass
class Samples:
    """Every result of one path."""

    results: list[Result] = field(default_factory=list)
    wall_ns: int = 0


def upstream_body(request: ChatRequest) -> bytes:
    """Return the body loopd's client would send the server for request."""
    endpoint = Endpoint(name=MODEL, socket="")
    return encode(chat_body(request, Config(endpoints=(endpoint,)), endpoint))


def _openai(messages: list[dict[str, str]], max_tokens: int, thinking: bool) -> bytes:
    """Return an OpenAI streaming chat body for loopd."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
    }
    if not thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return json.dumps(body).encode()


def long_bodies(tokens: int) -> tuple[bytes, bytes]:
    """Return part 1's (loopd, direct) bodies for a tokens-long reasoning answer."""
    request = ChatRequest(slot=0, messages=(User(LONG_QUESTION),), thinking=True, max_tokens=tokens)
    loopd = _openai([{"role": "user", "content": LONG_QUESTION}], tokens, True)
    return loopd, upstream_body(request)


def measure_long(
    stack: Stack, requests: int, warmup: int, tokens: int, gap: float, timeout: float
) -> dict[str, Samples]:
    """Run warmup + requests rounds of one request per path; return the timed ones."""
    loopd_body, direct_body = long_bodies(tokens)
    out = {"loopd": Samples(), "direct": Samples()}
    for i in range(warmup + requests):
        order = ("loopd", "direct") if i % 2 == 0 else ("direct", "loopd")
        for path in order:
            if path == "loopd":
                result = stream_chat(stack.loopd_socket, loopd_body, timeout, "bench-long")
            else:
                result = stream_chat(stack.port, direct_body, timeout)
            if result.tokens != tokens:
                raise BenchError(f"{path}: {result.tokens} tokens generated, not {tokens}")
            if i >= warmup:
                out[path].results.append(result)
            time.sleep(gap)
    return out


@dataclass(frozen=True)
class CpuUse:
    """Part 3: the CPU seconds each process spent on the streams, and their tokens."""

    seconds: dict[str, float]
    tokens: int


CPU_PROCESSES = ("llama-server", "inferproxy", "loopd")
"""Part 3's processes, the anchor first."""


def measure_cpu(stack: Stack, requests: int, tokens: int, timeout: float) -> CpuUse:
    """Stream requests tokens-long answers through loopd; return each process's CPU."""
    loopd_body, _ = long_bodies(tokens)
    before = {name: cpu_seconds(stack.pids[name]) for name in CPU_PROCESSES}
    streamed = 0
    for _ in range(requests):
        result = stream_chat(stack.loopd_socket, loopd_body, timeout, "bench-cpu")
        if result.tokens != tokens:
            raise BenchError(f"loopd: {result.tokens} tokens generated, not {tokens}")
        streamed += result.tokens
    after = {name: cpu_seconds(stack.pids[name]) for name in CPU_PROCESSES}
    return CpuUse({name: after[name] - before[name] for name in CPU_PROCESSES}, streamed)


def _turn_text(session: int, turn: int) -> str:
    """Return the user message of one turn of one session."""
    return f"Session {session}, turn {turn}: hello again, who are you?"


def _session(
    path: str, stack: Stack, index: int, turns: int, timeout: float, out: list[Result]
) -> None:
    """Run one session's turns in order, appending each result to out."""
    history: list[ChatMessage] = []
    wire: list[dict[str, str]] = []
    for turn in range(turns):
        text = _turn_text(index, turn)
        history.append(User(text))
        wire.append({"role": "user", "content": text})
        if path.startswith("loopd"):
            body = _openai(wire, SHORT_MAX_TOKENS, False)
            end = path == "loopd+end" and turn == turns - 1
            result = stream_chat(stack.loopd_socket, body, timeout, f"{path}-{index}", end)
        else:
            request = ChatRequest(
                slot=-1, messages=tuple(history), thinking=False, max_tokens=SHORT_MAX_TOKENS
            )
            result = stream_chat(stack.port, upstream_body(request), timeout)
        if result.text != SHORT_ANSWER:
            raise BenchError(f"{path} session {index}: answer {result.text!r}")
        out.append(result)
        history.append(Assistant(result.text))
        wire.append({"role": "assistant", "content": result.text})


def run_concurrently(count: int, work: Callable[[int], None], label: str) -> int:
    """Run work(0..count-1) in threads released at once; return the wall time in ns.

    The first failure of any thread is raised as a BenchError naming label.
    """
    errors: list[BaseException] = []
    gate = threading.Barrier(count + 1)

    def run(index: int) -> None:
        gate.wait()
        try:
            work(index)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    gate.wait()
    start = time.perf_counter_ns()
    for thread in threads:
        thread.join()
    wall = time.perf_counter_ns() - start
    if errors:
        raise BenchError(f"{label}: {len(errors)} session(s) failed, first: {errors[0]!r}")
    return wall


def measure_sessions(path: str, stack: Stack, sessions: int, turns: int, timeout: float) -> Samples:
    """Run sessions threads of turns each on one path; return every result and the wall."""
    results: list[list[Result]] = [[] for _ in range(sessions)]
    wall = run_concurrently(
        sessions, lambda i: _session(path, stack, i, turns, timeout, results[i]), path
    )
    return Samples([r for rs in results for r in rs], wall)
