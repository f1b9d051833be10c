"""Part 1 of bench/client.py: decoder throughput over one recorded stream, no server.

`build_stream` stretches a transcript recorded from a real llama-server (by default
fixtures/transcripts/thinking.sse) to a stream of exactly ``n`` ``data:`` chunks plus
``data: [DONE]``: the recorded chunks before the first delta are kept as they are, the
recorded reasoning deltas and then the recorded content deltas are repeated in turn, each
copy with ``timings.predicted_n`` renumbered, and the recorded finish chunk closes it.
Every chunk is re-encoded compactly, as llama-server writes them.

`split_network` and `split_events` cut the stream into the pieces a reader would get
from the network (random sizes of 1-4 KiB, cut anywhere) or one event per piece.

Three decoders consume the same pieces; each has a set-up (untimed: the SDK's request
goes through its own client stack to an ``httpx2.MockTransport`` that answers with the
pieces) and a run (timed) that hands every chunk to a consumer that keeps it in a list:

- ``loopd``: `loopd.sse.SSEDecoder` + `loopd.llama.assemble.parse_chunk` and
  `Assembler.feed` per event, as `loopd.llama.chat.ChatCall` does, then ``completion()``;
- ``openai``: the ``openai`` SDK's ``Stream`` returned by
  ``client.chat.completions.create(stream=True)``: its SSE decoder, ``json.loads`` of each
  event and the construction of a ``ChatCompletionChunk`` per chunk (the SDK's default,
  non-strict model building);
- ``httpx-sse``: ``httpx_sse.EventSource`` over an ``httpx.Response`` of the pieces, plus
  ``json.loads`` of each event's data.

After each run, `Outcome` (chunk count, reasoning and content text) is checked against
what the stream holds, untimed.
"""

from __future__ import annotations

import gc
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import httpx2
import openai
from _servers import BenchError
from httpx_sse import EventSource
from openai.types.chat import ChatCompletionChunk

from loopd.llama.assemble import Assembler, parse_chunk
from loopd.llama.types import ChatEvent
from loopd.sse import SSEDecoder, SSEEvent

DECODERS = ("loopd", "openai", "httpx-sse")
"""Every decoder, in the order printed."""
SSE_HEADERS = {"content-type": "text/event-stream"}
"""The response headers the HTTP libraries are given."""


@dataclass(frozen=True)
class Outcome:
    """What a decoder got out of the stream: chunks, and the text they carried."""

    chunks: int
    reasoning: str
    content: str


@dataclass(frozen=True)
class Stream:
    """A benchmark stream: its bytes and what a correct decoder gets from them."""

    body: bytes
    expected: Outcome


def _events(raw: bytes) -> list[dict[str, Any]]:
    """Return the JSON chunks of a recorded SSE body, ``[DONE]`` left out."""
    chunks = []
    for block in raw.decode().replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(
            line[len("data: ") :] for line in block.split("\n") if line.startswith("data: ")
        )
        if data and data != "[DONE]":
            chunks.append(json.loads(data))
    return chunks


def _delta(chunk: dict[str, Any]) -> dict[str, Any]:
    """Return the delta of a chunk's only choice ({} when it has none)."""
    choices = chunk.get("choices") or [{}]
    delta: dict[str, Any] = choices[0].get("delta") or {}
    return delta


def _encode(chunk: dict[str, Any]) -> bytes:
    """Frame one chunk as an SSE event, compact JSON like llama-server's."""
    text = json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)
    return b"data: " + text.encode() + b"\n\n"


def build_stream(path: str, n: int) -> Stream:
    """Stretch the transcript at path to n chunks plus ``[DONE]`` (see module doc)."""
    with open(path, "rb") as f:
        recorded = _events(f.read())
    kinds: dict[str, list[dict[str, Any]]] = {"reasoning_content": [], "content": []}
    head: list[dict[str, Any]] = []
    finish: dict[str, Any] | None = None
    for chunk in recorded:
        delta = _delta(chunk)
        choice = (chunk.get("choices") or [{}])[0]
        if choice.get("finish_reason") is not None:
            finish = chunk
        elif delta.get("reasoning_content"):
            kinds["reasoning_content"].append(chunk)
        elif delta.get("content"):
            kinds["content"].append(chunk)
        elif not (kinds["reasoning_content"] or kinds["content"]):
            head.append(chunk)
    if finish is None or not kinds["content"] or n < len(head) + 2:
        raise BenchError(f"{path}: needs content deltas and a finish chunk, n >= {len(head) + 2}")
    if not kinds["reasoning_content"]:
        kinds["reasoning_content"] = kinds["content"]
    body = [_encode(chunk) for chunk in head]
    text: dict[str, list[str]] = {"reasoning_content": [], "content": []}
    predicted = max((c.get("timings") or {}).get("predicted_n", 0) for c in head) if head else 0
    middle = n - len(head) - 1
    plan = [("reasoning_content", middle // 2), ("content", middle - middle // 2)]
    for key, count in plan:
        templates = kinds[key]
        for i in range(count):
            chunk = json.loads(json.dumps(templates[i % len(templates)]))
            predicted += 1
            if isinstance(chunk.get("timings"), dict):
                chunk["timings"]["predicted_n"] = predicted
            text[key].append(_delta(chunk)[key])
            body.append(_encode(chunk))
    last = json.loads(json.dumps(finish))
    if isinstance(last.get("timings"), dict):
        last["timings"]["predicted_n"] = predicted + 1
    body.append(_encode(last))
    body.append(b"data: [DONE]\n\n")
    expected = Outcome(n, "".join(text["reasoning_content"]), "".join(text["content"]))
    return Stream(b"".join(body), expected)


def split_network(body: bytes, seed: int, low: int = 1024, high: int = 4096) -> list[bytes]:
    """Cut body into pieces of random sizes in [low, high], anywhere (seeded)."""
    rng = random.Random(seed)
    pieces = []
    at = 0
    while at < len(body):
        size = rng.randint(low, high)
        pieces.append(body[at : at + size])
        at += size
    return pieces


def split_events(body: bytes) -> list[bytes]:
    """Cut body into one piece per event, each with its blank line."""
    return [event + b"\n\n" for event in body.split(b"\n\n") if event]


Run = Callable[[], Callable[[], Outcome]]
"""A decoder: its set-up returns the timed run, which returns its `Outcome`."""


def loopd_decoder(pieces: list[bytes]) -> Run:
    """Return loopd's decoder: SSEDecoder, then parse_chunk and Assembler.feed."""

    def setup() -> Callable[[], Outcome]:
        decoder = SSEDecoder()
        assembler = Assembler()
        received: list[ChatEvent] = []

        def run() -> Outcome:
            emit = received.extend
            chunks = 0
            for piece in pieces:
                for item in decoder.feed(piece):
                    if isinstance(item, SSEEvent) and not item.done:
                        emit(assembler.feed(parse_chunk(item.data), item.data))
                        chunks += 1
            decoder.finish()
            completion = assembler.completion()
            return Outcome(chunks, completion.reasoning_content or "", completion.content or "")

        return run

    return setup


def openai_decoder(pieces: list[bytes]) -> Run:
    """Return the openai SDK's streaming decoder, fed by a mock transport."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers=SSE_HEADERS, content=iter(pieces))

    client = openai.OpenAI(
        api_key="bench",
        base_url="http://llama.invalid/v1",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(answer)),
    )

    def setup() -> Callable[[], Outcome]:
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], stream=True
        )

        def run() -> Outcome:
            received: list[ChatCompletionChunk] = []
            emit = received.append
            for chunk in stream:
                emit(chunk)
            return _sdk_outcome(received)

        return run

    return setup


def _sdk_outcome(chunks: list[ChatCompletionChunk]) -> Outcome:
    """Collect the text of the SDK's chunks (reasoning is an extra field to it)."""
    reasoning, content = [], []
    for chunk in chunks:
        if chunk.choices:
            delta = chunk.choices[0].delta
            content.append(delta.content or "")
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
    return Outcome(len(chunks), "".join(reasoning), "".join(content))


def httpx_sse_decoder(pieces: list[bytes]) -> Run:
    """Return httpx-sse's EventSource over an httpx.Response, plus json.loads."""

    def setup() -> Callable[[], Outcome]:
        response = httpx.Response(200, headers=SSE_HEADERS, content=iter(pieces))
        source = EventSource(response)

        def run() -> Outcome:
            received: list[Any] = []
            emit = received.append
            loads = json.loads
            for event in source.iter_sse():
                if event.data == "[DONE]":
                    break
                emit(loads(event.data))
            return _dict_outcome(received)

        return run

    return setup


def _dict_outcome(chunks: list[Any]) -> Outcome:
    """Collect the text of decoded JSON chunks."""
    reasoning = "".join(_delta(c).get("reasoning_content") or "" for c in chunks)
    content = "".join(_delta(c).get("content") or "" for c in chunks)
    return Outcome(len(chunks), reasoning, content)


FACTORIES: dict[str, Callable[[list[bytes]], Run]] = {
    "loopd": loopd_decoder,
    "openai": openai_decoder,
    "httpx-sse": httpx_sse_decoder,
}
"""How each decoder is built from the pieces it will be fed."""


def time_once(setup: Run, expected: Outcome) -> float:
    """Set up, run once timed (GC on, collected first) and check; return chunks/s."""
    run = setup()
    gc.collect()
    start = time.perf_counter_ns()
    outcome = run()
    elapsed = time.perf_counter_ns() - start
    if outcome != expected:
        got = f"{outcome.chunks} chunks, {len(outcome.reasoning)}+{len(outcome.content)} chars"
        want = f"{expected.chunks} chunks, "
        want += f"{len(expected.reasoning)}+{len(expected.content)} chars"
        raise BenchError(f"decoded {got}, expected {want}")
    return expected.chunks / (elapsed / 1e9)


def measure_mode(pieces: list[bytes], expected: Outcome, reps: int) -> Iterator[tuple[str, float]]:
    """Yield (decoder, chunks/s) for reps rounds, each round every decoder in turn.

    One untimed warm-up run per decoder comes first; the order rotates each round
    so that no decoder always runs first or last.
    """
    setups = {name: FACTORIES[name](pieces) for name in DECODERS}
    for name in DECODERS:
        time_once(setups[name], expected)
    for rep in range(reps):
        shift = rep % len(DECODERS)
        for name in DECODERS[shift:] + DECODERS[:shift]:
            yield name, time_once(setups[name], expected)
