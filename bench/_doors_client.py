"""The doors of bench/doors.py: each one's request body and how its stream is read.

A `Door` is one path to the same answer: loopd's chat completions, loopd's
``/v1/messages``, loopd's ``/v1/responses`` (all over loopd's Unix socket) and
llama-server's own ``/v1/messages`` over TCP. Every body asks for the same thing: the
one short user message `QUESTION`, streamed, thinking on (the think-forever model then
reasons until the token bound, so every answer is exactly ``tokens`` reasoning tokens),
no thinking cap of the request's own: chat ``reasoning_effort: "high"``, Anthropic
``thinking: {"type": "adaptive"}`` (llama-server's own ``/v1/messages`` ignores the
field and thinks by default, so it gets the very same body), Responses ``reasoning:
{"effort": "high"}`` with ``store: false`` (as Codex CLI sends it; nothing piles up in
loopd's response store over a run).

`stream_door` sends one request with `_gateway_stack.sse_events` (blocking
``http.client``, a fresh connection, every event decoded with ``json.loads``) and notes
the time of the first reasoning or text delta and of the door's last event (``[DONE]``,
``message_stop``, ``response.completed`` / ``response.incomplete``), both from before
the connection, with the generated and cached prompt tokens the door's usage reports
and the number of deltas streamed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from _gateway_stack import MODEL, sse_events
from _servers import BenchError

from loopd.llama.chat import CHAT_PATH

QUESTION = "Think it over at length, please."
"""The one user message of every request (the same short prompt on every door)."""
MESSAGES_PATH = "/v1/messages"
RESPONSES_PATH = "/v1/responses"


@dataclass(frozen=True)
class Result:
    """One streamed answer: times in ns from before the connection, and its counts."""

    ttft: int
    total: int
    tokens: int
    cached: int
    deltas: int


@dataclass
class _Reading:
    """What one stream has shown so far."""

    first: int = 0
    deltas: int = 0
    tokens: int = 0
    cached: int = 0
    done: bool = False

    def delta(self, piece: object) -> None:
        """Note a reasoning or text delta (an empty one does not count)."""
        if piece:
            if not self.first:
                self.first = time.perf_counter_ns()
            self.deltas += 1


def _chat_body(tokens: int) -> bytes:
    """The OpenAI chat completions body."""
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTION}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": tokens,
            "reasoning_effort": "high",
        }
    ).encode()


def _messages_body(tokens: int) -> bytes:
    """The Anthropic Messages body (loopd's door and llama-server's alike)."""
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTION}],
            "stream": True,
            "max_tokens": tokens,
            "thinking": {"type": "adaptive"},
        }
    ).encode()


def _responses_body(tokens: int) -> bytes:
    """The OpenAI Responses body."""
    return json.dumps(
        {
            "model": MODEL,
            "input": QUESTION,
            "stream": True,
            "max_output_tokens": tokens,
            "reasoning": {"effort": "high"},
            "store": False,
        }
    ).encode()


def _read_chat(data: bytes, seen: _Reading) -> None:
    """One chat completions event: a chunk, or ``[DONE]``."""
    if data == b"[DONE]":
        seen.done = True
        return
    chunk = json.loads(data)
    if "error" in chunk:
        raise BenchError(f"error event: {chunk['error']}")
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        seen.tokens = int(usage.get("completion_tokens", 0))
        seen.cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        seen.delta(delta.get("reasoning_content") or delta.get("content"))


def _read_messages(data: bytes, seen: _Reading) -> None:
    """One Anthropic Messages event (its ``data:`` carries its ``type``)."""
    event = json.loads(data)
    kind = event.get("type")
    if kind == "content_block_delta":
        delta = event.get("delta") or {}
        seen.delta(delta.get("thinking") or delta.get("text"))
    elif kind in ("message_start", "message_delta"):
        message = event.get("message") or {}
        usage = event.get("usage") or message.get("usage") or {}
        if "output_tokens" in usage:
            seen.tokens = int(usage["output_tokens"])
        if "cache_read_input_tokens" in usage:
            seen.cached = int(usage["cache_read_input_tokens"])
    elif kind == "message_stop":
        seen.done = True
    elif kind == "error":
        raise BenchError(f"error event: {event.get('error')}")


def _read_responses(data: bytes, seen: _Reading) -> None:
    """One Responses event (its ``data:`` carries its ``type``)."""
    event = json.loads(data)
    kind = event.get("type")
    if kind in ("response.reasoning_text.delta", "response.output_text.delta"):
        seen.delta(event.get("delta"))
    elif kind in ("response.completed", "response.incomplete"):
        usage = (event.get("response") or {}).get("usage") or {}
        seen.tokens = int(usage.get("output_tokens", 0))
        seen.cached = int((usage.get("input_tokens_details") or {}).get("cached_tokens", 0))
        seen.done = True
    elif kind in ("error", "response.failed"):
        raise BenchError(f"{kind} event: {str(event)[:300]}")


@dataclass(frozen=True)
class Door:
    """One path: a short name, a label, where it leads, its body and its event reader."""

    name: str
    label: str
    path: str
    body: Callable[[int], bytes]
    read: Callable[[bytes, _Reading], None]
    direct: bool = False
    """Straight to llama-server over TCP, else through loopd's Unix socket."""


DOORS = (
    Door("chat", "loopd /v1/chat/completions", CHAT_PATH, _chat_body, _read_chat),
    Door("messages", "loopd /v1/messages", MESSAGES_PATH, _messages_body, _read_messages),
    Door("responses", "loopd /v1/responses", RESPONSES_PATH, _responses_body, _read_responses),
    Door(
        "server",
        "llama-server /v1/messages",
        MESSAGES_PATH,
        _messages_body,
        _read_messages,
        direct=True,
    ),
)
"""Every door, in the order printed: anchor 1 (chat) first, anchor 2 (server) last."""


def stream_door(door: Door, target: int | str, body: bytes, timeout: float) -> Result:
    """One streamed request through door to target (a TCP port or a Unix socket path)."""
    start = time.perf_counter_ns()
    seen = _Reading()
    for event in sse_events(target, body, timeout, {}, door.path):
        data = _data(event)
        if data is None:
            continue  # loopd's ": loopd {...}" comments
        door.read(data, seen)
        if seen.done:
            end = time.perf_counter_ns()
            if not seen.first:
                raise BenchError(f"{door.label}: no reasoning or text delta")
            return Result(seen.first - start, end - start, seen.tokens, seen.cached, seen.deltas)
    raise BenchError(f"{door.label}: the body ended before its last event")


def _data(event: bytes) -> bytes | None:
    """The ``data:`` of one SSE event (its ``event:`` line aside), or None for a comment."""
    for line in event.split(b"\n"):
        if line.startswith(b"data: "):
            return line[6:]
        if line.startswith(b"data:"):
            return line[5:]
    return None


def check(door: Door, result: Result, tokens: int) -> None:
    """Raise a BenchError unless the answer was tokens tokens, streamed one per delta.

    The first token the model generates, ``<think>``, opens the reasoning and streams
    no delta of its own, so tokens - 1 deltas are whole too.
    """
    if result.tokens != tokens or result.deltas not in (tokens - 1, tokens):
        raise BenchError(
            f"{door.label}: {result.tokens} tokens generated in {result.deltas} deltas,"
            f" not {tokens}"
        )
