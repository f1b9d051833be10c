"""The processes of bench/gateway.py and its blocking streaming client.

`start` writes the tiny model in its "think forever" form (it reasons until
``max_tokens`` when thinking is on, and answers a short fixed text when it is off),
serves it from a real llama.cpp server with two slots, puts ``python -m twisted
inferproxy`` in front of it and ``python -m twisted loopd`` with a generated loopd.toml
in front of that (self-test off, the queue deep enough for 16 sessions).

`stream_chat` is the one client both paths use: a blocking `http.client` request, over
TCP to the server or over a Unix socket to loopd, that decodes every SSE event with
``json.loads`` and notes the time of the first reasoning or content delta, the end
(``[DONE]``), the generated tokens and the cached prompt tokens.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from _client_e2e import PROXY_CMD, UnixHTTPConnection, start_server
from _servers import BenchError, Children, start_forwarder, wait_socket

from loopd.llama.chat import CHAT_PATH

MODEL = "tiny"
"""The endpoint's name in loopd.toml: the ``model`` loopd's clients ask for."""
QUEUE_DEPTH = 64
"""loopd's ``[limits] queue_depth``: above the number of sessions, so none is refused."""


@dataclass(frozen=True)
class Stack:
    """Where the two paths lead: the server's TCP port and loopd's Unix socket; and the
    process ids of the children by their names, llama-server, inferproxy and loopd (for
    their CPU time)."""

    port: int
    loopd_socket: str
    pids: dict[str, int]


@dataclass(frozen=True)
class Result:
    """One streamed answer: times in ns from before the connection, and its counts."""

    ttft: int
    total: int
    tokens: int
    cached: int
    text: str


def loopd_config(listen: str, endpoint_socket: str, grace_ms: int | None = None) -> str:
    """Return the loopd.toml text: one endpoint, no self-test, a deep queue, the
    inferproxy's limits, and [queue] grace_ms when given (else loopd's default)."""
    return "\n".join(
        [
            "[server]",
            f"listen = {json.dumps('unix:' + listen.replace(':', chr(92) + ':'))}",
            "",
            "[limits]",
            f"queue_depth = {QUEUE_DEPTH}",
            "",
            "[[endpoint]]",
            f"name = {json.dumps(MODEL)}",
            f"socket = {json.dumps(endpoint_socket)}",
            "selftest = false",
            # The limits PROXY_CMD starts the inferproxy with: loopd paces its connections
            # to them, and the defaults (2 a second after a burst of 10) would be the
            # bottleneck of every loopd path here.
            "proxy_max_connections = 64",
            "proxy_burst = 1000000",
            "proxy_refill_per_second = 1000000",
            "",
            *([] if grace_ms is None else ["[queue]", f"grace_ms = {grace_ms}", ""]),
        ]
    )


def start_backend(children: Children, threads: int) -> tuple[int, str]:
    """Start the server (2 slots) and the inferproxy in front of it; return the server's
    port and the inferproxy's socket."""
    from loopd.demo.tiny_model import write_tiny_model

    model = os.path.join(children.dir, "tiny-think.gguf")
    write_tiny_model(model, think_forever=True)
    port = start_server(children, model, threads)
    return port, start_forwarder(children, "inferproxy", PROXY_CMD, port)


def start(children: Children, threads: int, grace_ms: int | None = None) -> Stack:
    """Start the server (2 slots), inferproxy and loopd (with grace_ms when given); return
    where they listen."""
    port, infer = start_backend(children, threads)
    listen = os.path.join(children.dir, "loopd.sock")
    config = os.path.join(children.dir, "loopd.toml")
    with open(config, "w", encoding="utf-8") as f:
        f.write(loopd_config(listen, infer, grace_ms))
    argv = [sys.executable, "-m", "twisted", "--log-format=text", "loopd", "--config", config]
    proc = children.spawn("loopd", argv, log=True)
    wait_socket(children, proc, "loopd", listen)
    return Stack(port, listen, {name: child.pid for name, child, _log in children.procs})


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system, all threads) process pid has used so far, from
    /proc/<pid>/stat (Linux)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        # The command name (field 2) is in parentheses and may hold spaces.
        fields = f.read().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def _counts(chunk: dict[str, Any]) -> tuple[int, int] | None:
    """Return (generated, cached) tokens from a chunk's usage or timings, if it has any."""
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details") or {}
        return int(usage.get("completion_tokens", 0)), int(details.get("cached_tokens", 0))
    timings = chunk.get("timings")
    if isinstance(timings, dict):
        return int(timings.get("predicted_n", 0)), int(timings.get("cache_n", 0))
    return None


def stream_chat(
    target: int | str,
    body: bytes,
    timeout: float,
    session: str | None = None,
    end: bool = False,
) -> Result:
    """One streamed chat; target is the server's TCP port or loopd's socket path.

    session, when set, goes out as ``X-Session-Id``; end sends ``X-Session-End: true``.
    The usage chunk (loopd) or the last chunk's timings (the server) give the token
    counts.
    """
    clock = time.perf_counter_ns
    start = clock()
    headers = {}
    if session is not None:
        headers["X-Session-Id"] = session
    if end:
        headers["X-Session-End"] = "true"
    first = 0
    counts = (0, 0)
    text: list[str] = []
    for event in sse_events(target, body, timeout, headers):
        if not event.startswith(b"data: "):
            continue  # loopd's ": loopd {...}" comments
        if event == b"data: [DONE]":
            return Result(first - start, clock() - start, *counts, "".join(text))
        chunk = json.loads(event[6:])
        if "error" in chunk:
            raise BenchError(f"error event: {chunk['error']}")
        found = _counts(chunk)
        if found is not None:
            counts = found
        choices = chunk.get("choices") or [{}]
        delta = choices[0].get("delta") or {}
        piece = delta.get("reasoning_content") or delta.get("content")
        if piece:
            if not first:
                first = clock()
            if delta.get("content"):
                text.append(delta["content"])
    raise BenchError("the body ended before [DONE]")


def sse_events(
    target: int | str,
    body: bytes,
    timeout: float,
    headers: dict[str, str],
    path: str = CHAT_PATH,
) -> Iterator[bytes]:
    """POST a body to path (chat completions by default) on a fresh connection and yield
    each SSE event of a 200 answer.

    target is a server's TCP port or loopd's socket path; headers go out besides the
    content type and ``Connection: close``. The connection opens at the first ``next()``
    and closes when the generator ends or is closed.
    """
    if isinstance(target, str):
        conn: http.client.HTTPConnection = UnixHTTPConnection(target)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", target)
    try:
        conn.connect()
        sock = conn.sock
        assert sock is not None
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A kernel timeout: settimeout() would add a poll() before every read.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(timeout), 0))
        sent = {"Content-Type": "application/json", "Connection": "close", **headers}
        conn.request("POST", path, body, sent)
        response = conn.getresponse()
        if response.status != 200:
            raise BenchError(f"HTTP {response.status}: {response.read()[:300]!r}")
        pending = b""
        while data := response.read1(65536):
            *events, pending = (pending + data).split(b"\n\n")
            yield from events
    finally:
        conn.close()
