"""Part 2 of bench/client.py: loopd's client through inferproxy against direct HTTP.

The tiny model (`loopd.demo.tiny_model`) is written to a temp dir and served by
a real llama.cpp server: the child command of `loopd.demo.real_server`, started
here with `subprocess` so that its log goes to a file and never through this process.
A ``python -m twisted inferproxy`` child forwards a Unix socket to it (started by
bench/_servers.py's `start_forwarder`, with limits raised so that nothing is refused).

Three paths: ``loopd``, loopd's `Client` over inferproxy's Unix socket; ``direct``, a
blocking `http.client` request straight to the server's TCP port (the anchor); and
``proxied``, the same `http.client` request over inferproxy's Unix socket, which tells
inferproxy's share of what loopd adds from the client's.

The Twisted side runs with the real (default) reactor in this process: `run_reactor`
starts it, drives `measure` to its end and stops it. The `http.client` requests are
blocking calls made from the same reactor thread between two loopd requests, while
the reactor has nothing else to do, so no path runs while another is timed.

Every path sends the same bytes: the body that `loopd.llama.request.chat_body` makes
for one user message "Hi" on slot 0 with thinking off. Each request is a fresh
connection. A sample is (time to the first content token, total time), both counted
from just before the connection is opened; the first content token is the first chunk
with a non-empty ``delta.content`` once decoded, and the end is the ``[DONE]`` event
(what completes a loopd call). Each round sends one request per path, the order
rotating from round to round, with a short pause after every request so that each
one finds the slot idle.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import socket
import struct
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from _servers import READY_TIMEOUT, BenchError, Children, start_forwarder
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.python.failure import Failure

from loopd.llama import ChatEvent, ChatRequest, Client, Content, InferError, User
from loopd.llama.chat import CHAT_PATH
from loopd.llama.request import chat_body, encode
from loopd.settings import Config, Endpoint

PATHS = ("loopd", "proxied", "direct")
"""Every path, in the order printed: loopd's client through inferproxy, http.client
through inferproxy (to tell inferproxy's share from the client's), http.client direct."""
PROXY_CMD = (
    "{python} -m twisted inferproxy --listen {listen} --upstream {upstream}"
    " --max-connections 64 --burst 1000000 --refill 1000000"
)
"""How inferproxy is started (from the checkout root)."""
ANSWER = "Hello from the tiny model!"
"""What the tiny model answers with thinking off."""

T = TypeVar("T")


@dataclass
class Samples:
    """The samples of one path, in ns: time to first token and total time."""

    ttft: list[int] = field(default_factory=list)
    total: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Setup:
    """Where the two paths lead: the server's TCP port and inferproxy's socket."""

    port: int
    socket: str


def write_model(children: Children) -> str:
    """Write the tiny model into the run's temp dir; return its path."""
    from loopd.demo.tiny_model import write_tiny_model

    path = os.path.join(children.dir, "tiny.gguf")
    write_tiny_model(path)
    return path


def start_server(
    children: Children,
    model: str,
    threads: int,
    parallel: int = 2,
    cache_ram_mib: int | None = None,
    **more: Any,
) -> int:
    """Start a real llama.cpp server on the model with parallel slots; return its port.

    cache_ram_mib sizes the server's RAM prompt cache (None: llama.cpp's default); more
    are further fields of `loopd.demo.real_server.ServerOptions`.
    """
    from loopd.demo.real_server import READY_PREFIX, ServerOptions

    options = ServerOptions(
        model, threads=threads, parallel=parallel, cache_ram_mib=cache_ram_mib, **more
    )
    argv = options.command(READY_TIMEOUT, exit_on_eof=True)
    proc = children.spawn("llama-server", argv, log=True)
    logpath = os.path.join(children.dir, "llama-server.log")
    deadline = time.monotonic() + READY_TIMEOUT + 5
    while time.monotonic() < deadline:
        with open(logpath, "rb") as f:
            for line in f.read().decode(errors="replace").splitlines():
                if line.startswith(READY_PREFIX):
                    return int(json.loads(line[len(READY_PREFIX) :])["port"])
        if proc.poll() is not None:
            tail = children.log_tail(proc)
            raise BenchError(f"llama server exited with {proc.returncode}:\n{tail}")
        time.sleep(0.1)
    raise BenchError("llama server not ready in time")


def start(children: Children, threads: int) -> Setup:
    """Write the model, start the server and inferproxy in front of it."""
    port = start_server(children, write_model(children), threads)
    return Setup(port, start_forwarder(children, "inferproxy", PROXY_CMD, port))


def the_request() -> tuple[Config, Endpoint, ChatRequest]:
    """Return the config, endpoint (no socket yet) and request both paths send."""
    # The limits PROXY_CMD starts inferproxy with: the client paces its connections to
    # them, and the defaults (2 a second after a burst of 10) would pace every request.
    endpoint = Endpoint(
        name="tiny",
        socket="",
        proxy_max_connections=64,
        proxy_burst=1000000,
        proxy_refill_per_second=1000000.0,
    )
    return (
        Config(endpoints=(endpoint,)),
        endpoint,
        ChatRequest(slot=0, messages=(User("Hi"),), thinking=False),
    )


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix socket: only connect() differs from TCP."""

    def __init__(self, path: str) -> None:
        """Connect to the socket at path when asked to."""
        super().__init__("localhost")
        self._path = path

    def connect(self) -> None:
        """Open the Unix socket."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def http_once(target: int | str, body: bytes, timeout: float) -> tuple[int, int]:
    """One request with http.client; return (ttft, total) in ns.

    target is the server's TCP port on 127.0.0.1 or a Unix socket path. Every chunk
    is decoded (json.loads) and its content kept, as a minimal client would.
    """
    clock = time.perf_counter_ns
    start = clock()
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
        # Kernel timeouts: settimeout() would add a poll() before every read.
        tv = struct.pack("ll", int(timeout), 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        headers = {"Content-Type": "application/json", "Connection": "close"}
        conn.request("POST", CHAT_PATH, body, headers)
        response = conn.getresponse()
        if response.status != 200:
            raise BenchError(f"http.client: HTTP {response.status}: {response.read()[:200]!r}")
        first = 0
        content: list[str] = []
        pending = b""
        while True:
            data = response.read1(65536)
            if not data:
                raise BenchError("http.client: body ended before [DONE]")
            *events, pending = (pending + data).split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: "):
                    continue
                if event == b"data: [DONE]":
                    end = clock()
                    if "".join(content) != ANSWER:
                        raise BenchError(f"http.client: answer {''.join(content)!r}")
                    return first - start, end - start
                choices = json.loads(event[6:]).get("choices") or [{}]
                text = (choices[0].get("delta") or {}).get("content")
                if text:
                    if not first:
                        first = clock()
                    content.append(text)
    finally:
        conn.close()


async def loopd_once(client: Client, request: ChatRequest) -> tuple[int, int]:
    """One request with loopd's client through inferproxy; return (ttft, total) in ns."""
    clock = time.perf_counter_ns
    first: list[int] = []

    def on_event(event: ChatEvent) -> None:
        if not first and isinstance(event, Content):
            first.append(clock())

    start = clock()
    try:
        completion = await client.chat(request, on_event)
    except InferError as e:
        raise BenchError(f"loopd: {type(e).__name__}: {e}") from None
    end = clock()
    if completion.content != ANSWER or not first:
        raise BenchError(f"loopd: answer {completion.content!r}")
    return first[0] - start, end - start


async def measure(
    reactor: Any, setup: Setup, requests: int, warmup: int, gap: float, timeout: float
) -> dict[str, Samples]:
    """Run warmup + requests rounds of one request per path; return the samples."""
    config, endpoint, request = the_request()
    body = encode(chat_body(request, config, endpoint))
    endpoint = dataclasses.replace(endpoint, socket=setup.socket)
    client = Client(reactor, Config(endpoints=(endpoint,)), endpoint)
    results = {path: Samples() for path in PATHS}
    for i in range(warmup + requests):
        shift = i % len(PATHS)
        for path in PATHS[shift:] + PATHS[:shift]:
            if path == "loopd":
                ttft, total = await loopd_once(client, request)
            else:
                target = setup.port if path == "direct" else setup.socket
                ttft, total = http_once(target, body, timeout)
            if i >= warmup:
                results[path].ttft.append(ttft)
                results[path].total.append(total)
            await deferLater(reactor, gap)
    return results


def run_reactor(work: Callable[[Any], Coroutine[Deferred[Any], Any, T]]) -> T:
    """Run the global reactor while work(reactor) runs; return its result or raise it."""
    from twisted.internet import reactor as _reactor

    reactor: Any = _reactor
    outcome: list[T | Failure] = []

    def begin() -> None:
        done = Deferred.fromCoroutine(work(reactor))
        done.addBoth(outcome.append)
        done.addBoth(lambda _: reactor.stop())

    reactor.callWhenRunning(begin)
    reactor.run()
    if not outcome:
        raise KeyboardInterrupt
    result = outcome[0]
    if isinstance(result, Failure):
        result.raiseException()
    return result
