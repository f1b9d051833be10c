"""
Record real llama.cpp transcripts for fixtures/: the recorder the project ships.

Run ``python -m loopd.test.support.record_fixtures [--out fixtures/transcripts]``.  It
writes the two tiny models into a temp dir, starts a real llama.cpp server (`RealServer`)
for each setup in `SERVERS` with an in-process inferproxy in front of it on a Unix socket,
and performs every exchange through that socket with a blocking ``AF_UNIX`` socket and
HTTP/1.1 bytes written here (``Connection: close``): only inferproxy speaks TCP.  The
exchanges run in the reactor's thread pool while the reactor runs the proxy.

Saved: per streaming case ``<name>.sse`` (the de-chunked body exactly as received) and
``<name>.request.json`` (the body sent); ``reasoning-end.control.json`` (the control
reply), ``chunked-response.http`` (the raw response of ``thinking``) and
``recording.json`` (builds, options, model digests, date).  Ids, times and timings are
real; prompts, seeds and the order of the cases are fixed, so the texts are too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.metadata import version
from typing import Any

from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.threads import deferToThreadPool

from loopd.demo.real_server import RealServer
from loopd.demo.tiny_model import write_tiny_model
from loopd.inferproxy import InferProxyFactory, InferProxyService, ProxyLimits, upstream_endpoint
from loopd.sse import SSEDecoder, SSEEvent

CHAT = "/v1/chat/completions"
CONTROL = "/v1/chat/completions/control"
SEED = 7
TIMEOUT = 120.0  # seconds a socket may stay silent
#: Reasoning deltas read before the ``reasoning_end`` control call is sent.
REASONING_END_AFTER = 5
#: Attempts at the racy two-slot error case before giving up.
ERROR_ATTEMPTS = 3
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Current weather for a city.", "parameters": CITY}
WEATHER_TOOL = {"type": "function", "function": WEATHER}
# " Hello from the tiny model!" is seven tokens of the tiny vocabulary: about 3000 in all.
LONG_PROMPT = "Read this, then answer:" + " Hello from the tiny model!" * 430
OnBody = Callable[[bytes], None] | None


class RecordError(Exception):
    """A recording went wrong: a bad HTTP response or a transcript not as expected."""


@dataclass(frozen=True)
class ServerSpec:
    """One server setup: which model it serves and the llama.cpp options it runs with."""

    alias: str
    think_forever: bool
    n_ctx: int = 8192
    parallel: int = 2
    batch: int = 0
    kv_unified: bool = False


SERVERS = {
    # n_batch 512: a ~3000-token prompt is processed in six steps, one progress event each.
    "tiny": ServerSpec("tiny", False, batch=512),
    "tiny-think": ServerSpec("tiny-think", True),
    # Two slots share one 256-cell KV pool: generating on both exhausts it mid-stream.
    "tiny-think-pool": ServerSpec("tiny-think", True, n_ctx=256, kv_unified=True),
}


def request_bytes(method: str, target: str, body: bytes | None = None) -> bytes:
    """Return one HTTP/1.1 request, ``Connection: close``, with a JSON body if given."""
    lines = [f"{method} {target} HTTP/1.1", "Host: localhost", "Connection: close"]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + (body or b"")


class ResponseReader:
    """
    An incremental HTTP/1.1 response parser: the head, then a chunked, sized or
    read-to-close body.  `feed` returns the body bytes each piece completes.
    """

    def __init__(self) -> None:
        """Start before the status line."""
        self.raw = bytearray()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.complete = False
        self._pending = b""
        self._state = "head"
        self._left = -1  # bytes still due in the current chunk or sized body

    @property
    def chunked(self) -> bool:
        """Whether the body came with chunked transfer encoding."""
        return "chunked" in self.headers.get("transfer-encoding", "").lower()

    def feed(self, data: bytes) -> bytes:
        """Take the next bytes received, split anywhere; return the new body bytes."""
        self.raw += data
        before = len(self.body)
        self._pending += data
        while self._step():
            pass
        return bytes(self.body[before:])

    def finish(self) -> None:
        """Mark the end of the connection; raise `RecordError` if the response is cut."""
        if self._state == "to-close":
            self.complete = True
        if not self.complete:
            raise RecordError(f"connection closed in state {self._state!r}")

    def _step(self) -> bool:
        """Advance the state machine once; False when more bytes are needed."""
        if self._state == "head":
            end = self._pending.find(b"\r\n\r\n")
            if end < 0:
                return False
            head, self._pending = self._pending[:end], self._pending[end + 4 :]
            self._parse_head(head.decode("latin-1"))
            return True
        if self._state in ("sized", "data", "to-close"):
            take = self._pending if self._left < 0 else self._pending[: self._left]
            self.body += take
            self._pending = self._pending[len(take) :]
            if self._left >= 0:
                self._left -= len(take)
                if self._left == 0:
                    self._state = "data-end" if self._state == "data" else "done"
                    self.complete = self._state == "done"
                    return True
            return False
        if self._state == "done":
            return False
        end = self._pending.find(b"\r\n")
        if end < 0:
            return False
        line, self._pending = self._pending[:end], self._pending[end + 2 :]
        if self._state == "size":
            size = int(line.split(b";", 1)[0].strip(), 16)
            self._state, self._left = ("data", size) if size else ("trailer", -1)
        elif self._state == "data-end":
            if line:
                raise RecordError(f"chunk data not followed by CRLF: {line[:20]!r}")
            self._state = "size"
        elif not line:  # the blank line that ends the trailer
            self._state, self.complete = "done", True
        return True

    def _parse_head(self, head: str) -> None:
        status_line, *lines = head.split("\r\n")
        self.status = int(status_line.split(" ", 2)[1])
        for line in lines:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        if self.chunked:
            self._state = "size"
        elif "content-length" in self.headers:
            self._left = int(self.headers["content-length"])
            self._state = "sized" if self._left else "done"
            self.complete = not self._left
        else:
            self._state = "to-close"


def exchange(
    path: str, method: str, target: str, body: bytes | None = None, on_body: OnBody = None
) -> ResponseReader:
    """Send one request on a new Unix connection and read the response until close."""
    reader = ResponseReader()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT)
        sock.connect(path)
        # No half-close after the request: llama-server takes EOF as a cancel.
        sock.sendall(request_bytes(method, target, body))
        while data := sock.recv(65536):
            fresh = reader.feed(data)
            if fresh and on_body is not None:
                on_body(fresh)
    reader.finish()
    return reader


@dataclass
class Transcript:
    """The chunks of a chat stream, folded: what a test expects of a recording."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    reasoning: str = ""
    content: str = ""
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    finish_reason: str | None = None
    progress: list[dict[str, int]] = field(default_factory=list)
    error: dict[str, Any] | None = None
    #: The kinds of delta in stream order, repeats merged: e.g. ["reasoning", "content"].
    phases: list[str] = field(default_factory=list)

    def add(self, chunk: dict[str, Any]) -> None:
        """Fold one chunk (a decoded ``data:`` payload) in."""
        self.chunks.append(chunk)
        if "error" in chunk:
            self.error = chunk["error"]
        if "prompt_progress" in chunk:
            self.progress.append(chunk["prompt_progress"])
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            self._phase("reasoning", delta.get("reasoning_content"))
            self._phase("content", delta.get("content"))
            self.reasoning += delta.get("reasoning_content") or ""
            self.content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                self._phase("tool_call", call)
                slot = self.tool_calls.setdefault(
                    call["index"], {"id": "", "name": "", "arguments": ""}
                )
                slot["id"] = call.get("id") or slot["id"]
                function = call.get("function", {})
                slot["name"] += function.get("name") or ""
                slot["arguments"] += function.get("arguments") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def _phase(self, kind: str, value: object) -> None:
        if value and (not self.phases or self.phases[-1] != kind):
            self.phases.append(kind)


def read_transcript(body: bytes) -> Transcript:
    """Decode an SSE body with loopd's decoder and fold its chunks."""
    decoder = SSEDecoder()
    transcript = Transcript()
    for item in decoder.feed(body) + decoder.finish():
        if isinstance(item, SSEEvent):
            if item.done:
                transcript.done = True
            else:
                transcript.add(json.loads(item.data))
    if decoder.discarded_at_eof:
        raise RecordError("the body ends inside an event")
    return transcript


def chat_body(alias: str, content: str, *, thinking: bool = True, **extra: Any) -> dict[str, Any]:
    """A chat request with the fields loopd sends, plus `extra`."""
    body: dict[str, Any] = {
        "model": alias,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "cache_prompt": True,
        "return_progress": True,
        "timings_per_token": True,
        "id_slot": 0,
        "max_tokens": 256,
        "seed": SEED,
    }
    if thinking:
        body["reasoning_control"] = True
    else:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    body.update(extra)
    return body


def encode(body: dict[str, Any]) -> bytes:
    """The bytes sent for a JSON body: compact, as a client would send it."""
    return json.dumps(body, separators=(",", ":")).encode()


def expect(t: Transcript, *phases: str, done: bool = True) -> Transcript:
    """Return `t`, or raise `RecordError` unless it has these phases and ends as asked."""
    if t.phases != list(phases) or t.done != done or (t.error is None) != done:
        raise RecordError(f"unexpected transcript: {summary(t)}")
    return t


def summary(t: Transcript) -> dict[str, Any]:
    """A short description of a transcript, for recording.json and messages."""
    kept = {name: getattr(t, name) for name in ("phases", "content", "finish_reason", "error")}
    counts = {"chunks": len(t.chunks), "progress_events": len(t.progress), "done": t.done}
    return {**counts, **kept, "tool_calls": list(t.tool_calls.values())}


class Recorder:
    """Performs the exchanges against one proxied server and writes the files (blocking)."""

    def __init__(self, socket_path: str, out: str, server: str, cases: dict[str, Any]) -> None:
        """Talk through `socket_path`, write into `out`, note each case in `cases`."""
        self.socket_path = socket_path
        self.out = out
        self.server = server
        self.cases = cases

    def write(self, name: str, data: bytes) -> None:
        """Write one fixture file."""
        with open(os.path.join(self.out, name), "wb") as f:
            f.write(data)

    def get_json(self, target: str) -> Any:
        """GET `target` and return the JSON body of a 200 answer."""
        reader = exchange(self.socket_path, "GET", target)
        if reader.status != 200:
            raise RecordError(f"GET {target}: HTTP {reader.status}")
        return json.loads(reader.body)

    def stream(self, body: dict[str, Any], on_body: OnBody = None) -> ResponseReader:
        """POST a chat request; fail unless it is answered 200 with a chunked event stream."""
        reader = exchange(self.socket_path, "POST", CHAT, encode(body), on_body)
        kind = reader.headers.get("content-type", "")
        if reader.status != 200 or not reader.chunked or "event-stream" not in kind:
            raise RecordError(f"stream: HTTP {reader.status} {kind}: {bytes(reader.body[:300])!r}")
        return reader

    def save(self, name: str, body: dict[str, Any], reader: ResponseReader) -> Transcript:
        """Write ``<name>.sse`` and ``<name>.request.json``; return the transcript."""
        self.write(f"{name}.sse", bytes(reader.body))
        self.write(f"{name}.request.json", encode(body))
        transcript = read_transcript(bytes(reader.body))
        self.cases[name] = {"server": self.server, **summary(transcript)}
        return transcript

    def record_tiny(self, alias: str) -> None:
        """Plain, thinking (and its raw response), tool call, progress."""
        body = chat_body(alias, "Hi", thinking=False)
        expect(self.save("plain", body, self.stream(body)), "content")
        body = chat_body(alias, "Hi")
        reader = self.stream(body)
        expect(self.save("thinking", body, reader), "reasoning", "content")
        self.write("chunked-response.http", bytes(reader.raw))
        body = chat_body(alias, "What is the weather in Paris?", tools=[WEATHER_TOOL])
        expect(self.save("tool-call", body, self.stream(body)), "reasoning", "tool_call")
        # Slot 1 has seen no prompt yet, so all of this one is processed.
        body = chat_body(alias, LONG_PROMPT, id_slot=1)
        transcript = self.save("progress", body, self.stream(body))
        expect(transcript, "reasoning", "content")
        if len(transcript.progress) < 2:
            raise RecordError(f"progress: only {len(transcript.progress)} progress events")

    def record_reasoning_end(self, alias: str) -> None:
        """A thought that never ends by itself, ended by the control endpoint mid-stream."""
        body = chat_body(alias, "Hi", max_tokens=2000)
        decoder = SSEDecoder()
        seen = [0, 0]  # events, reasoning deltas
        replies: list[ResponseReader] = []
        control: dict[str, Any] = {"id": None, "action": "reasoning_end"}

        def watch(data: bytes) -> None:
            for item in decoder.feed(data):
                if not isinstance(item, SSEEvent) or item.done or replies:
                    continue
                chunk = json.loads(item.data)
                deltas = [c.get("delta", {}) for c in chunk.get("choices", [])]
                seen[0] += 1
                seen[1] += sum(1 for d in deltas if d.get("reasoning_content"))
                if seen[1] >= REASONING_END_AFTER:
                    # A second connection, while this one is still streaming.
                    control["id"] = chunk["id"]
                    replies.append(exchange(self.socket_path, "POST", CONTROL, encode(control)))

        transcript = self.save("reasoning-end", body, self.stream(body, watch))
        if not replies or replies[0].status != 200:
            raise RecordError("reasoning-end: no control call or no 200 reply")
        self.write("reasoning-end.control.json", bytes(replies[0].body))
        self.cases["reasoning-end"]["control"] = {"request": control, "after_events": seen[0]}
        if json.loads(replies[0].body) != {"success": True}:
            raise RecordError(f"reasoning-end: the control call said {bytes(replies[0].body)!r}")
        expect(transcript, "reasoning", "content")


def _in_thread(reactor: Any, f: Callable[..., Any], *args: Any) -> Deferred[Any]:
    """Run blocking `f` in the reactor's thread pool."""
    return deferToThreadPool(reactor, reactor.getThreadPool(), f, *args)


async def _record_error(reactor: Any, recorder: Recorder, alias: str) -> int:
    """
    Two never-ending thoughts on the two slots of a shared KV pool at once until the pool
    runs out: both end in a ``data: {"error": ...}`` event; slot 0's is saved.  A run in
    which one finished alone (``length``) is retried.  Returns the attempt that worked.
    """
    for attempt in range(1, ERROR_ATTEMPTS + 1):
        bodies = [chat_body(alias, "Hi", id_slot=slot, max_tokens=2000) for slot in (0, 1)]
        readers = await gatherResults([_in_thread(reactor, recorder.stream, b) for b in bodies])
        transcript = read_transcript(bytes(readers[0].body))
        if transcript.error is not None and transcript.reasoning and not transcript.done:
            expect(recorder.save("error", bodies[0], readers[0]), "reasoning", done=False)
            return attempt
    raise RecordError(f"error: no mid-stream error event in {ERROR_ATTEMPTS} attempts")


async def _serve(
    reactor: Any, key: str, model: str, sock: str, meta: dict[str, Any], out: str
) -> None:
    """Start one server and a proxy in front of it, record its cases, stop both."""
    spec = SERVERS[key]
    options = {name: value for name, value in vars(spec).items() if name != "think_forever"}
    server = RealServer(reactor, model, **options)
    port = await server.start()
    try:
        upstream = upstream_endpoint(reactor, "127.0.0.1", port, 10.0)
        limits = ProxyLimits(max_connections=16, burst=50, refill_per_second=50.0)
        service = InferProxyService(
            reactor, sock, InferProxyFactory(upstream, reactor, limits, f"127.0.0.1:{port}")
        )
        service.startService()
        try:
            recorder = Recorder(sock, out, key, meta["cases"])
            props = await _in_thread(reactor, recorder.get_json, "/props")
            meta["servers"][key] = {
                "options": {**vars(spec), "threads": server.options.threads},
                **{name: props[name] for name in ("build_info", "total_slots")},
                "n_ctx_per_slot": props["default_generation_settings"]["n_ctx"],
            }
            if key == "tiny":
                await _in_thread(reactor, recorder.record_tiny, spec.alias)
            elif key == "tiny-think":
                await _in_thread(reactor, recorder.record_reasoning_end, spec.alias)
            else:
                meta["cases"]["error"]["attempt"] = await _record_error(
                    reactor, recorder, spec.alias
                )
        finally:
            stopping = service.stopService()
            if stopping is not None:
                await stopping
    finally:
        await server.stop()


async def record(reactor: Any, out: str) -> dict[str, Any]:
    """
    Record every case into `out` and write ``recording.json``; return its content.

    @param reactor: a reactor with processes, Unix sockets, TCP (for the proxy), time
        and a thread pool.
    """
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ld", dir="/tmp")
    meta: dict[str, Any] = {
        "recorded_at": datetime.fromtimestamp(reactor.seconds(), timezone.utc).isoformat(),
        "recorder": "python -m loopd.test.support.record_fixtures",
        "xllamacpp": version("xllamacpp"),
        "gguf": version("gguf"),
        "models": {},
        "servers": {},
        "cases": {},
    }
    try:
        for name, think_forever in (("tiny", False), ("tiny-think", True)):
            path = os.path.join(work, f"{name}.gguf")
            digest = write_tiny_model(path, think_forever=think_forever)
            meta["models"][name] = {"sha256": digest, "bytes": os.path.getsize(path)}
        for key, spec in SERVERS.items():
            model = os.path.join(work, f"{spec.alias}.gguf")
            await _serve(reactor, key, model, os.path.join(work, "proxy.sock"), meta, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(os.path.join(out, "recording.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
    return meta


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: record into ``--out`` (default ``fixtures/transcripts``); exits."""
    from twisted.internet.task import react

    parser = argparse.ArgumentParser(prog="python -m loopd.test.support.record_fixtures")
    parser.add_argument("--out", default=os.path.join("fixtures", "transcripts"))
    args = parser.parse_args(argv)

    async def run(reactor: Any) -> None:
        meta = await record(reactor, args.out)
        for name, case in meta["cases"].items():
            print(f"{name}: {json.dumps(case)[:200]}")
        print(f"wrote {len(os.listdir(args.out))} files to {args.out}")

    react(lambda reactor: Deferred.fromCoroutine(run(reactor)))


if __name__ == "__main__":
    main(sys.argv[1:])
