"""Part 4 of bench/gateway.py: what issue 28's observability costs loopd's hot path.

Two ``twist loopd`` processes stand in front of the same inferproxy and server: "before",
loopd as it was at ``--before`` (a git revision, extracted with ``git archive`` into the
run's directory and run from there), and "after", the checkout's loopd with OpenTelemetry
on (exporting OTLP to a receiver in this process, on a Unix socket) while a poller plays
the status page: ``GET /v1/status`` every 2 s, as the page does. Rounds of ``--requests``
streams alternate between the two (the order flips every round, so drift hits both); each
process's CPU seconds (/proc) are counted over its own rounds only, and reported per 1,000
streamed tokens, "before" the anchor.
"""

from __future__ import annotations

import http.client
import http.server
import os
import socketserver
import subprocess
import sys
import threading
from dataclasses import dataclass

from _client_e2e import UnixHTTPConnection
from _gateway_runs import long_bodies
from _gateway_stack import cpu_seconds, loopd_config, stream_chat
from _servers import ROOT, BenchError, Children, wait_socket

PAGE_POLL_S = 2.0
"""How often the page asks for /v1/status (the page's own interval)."""


@dataclass
class ObserveUse:
    """Part 4: each loopd's CPU seconds over its rounds, its tokens, and what the page and
    the receiver saw."""

    seconds: dict[str, float]
    tokens: dict[str, int]
    polls: int
    exports: int
    export_bytes: int


class _Receiver(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """An OTLP/HTTP receiver on a Unix socket that counts and drops what it gets."""

    daemon_threads = True

    def __init__(self, path: str) -> None:
        self.exports = 0
        self.export_bytes = 0
        super().__init__(path, _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    """Take a POST /v1/traces, answer an empty ExportTraceServiceResponse."""

    server: _Receiver

    def address_string(self) -> str:
        return "unix"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.server.exports += 1
        self.server.export_bytes += len(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""


def extract(revision: str, into: str) -> str:
    """The loopd package and its twist plugins at revision, in a directory of into."""
    tree = os.path.join(into, "before")
    os.makedirs(tree)
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", revision, "loopd", "twisted"],
        check=False,
        capture_output=True,
    )
    if archive.returncode:
        raise BenchError(f"git archive {revision}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    return tree


def start_pair(
    children: Children, infer: str, before: str, telemetry: str
) -> tuple[dict[str, str], _Receiver]:
    """Start loopd "before" (from the tree before) and "after" (this checkout, telemetry
    config lines appended, exporting to a receiver started here); return their sockets by
    name and the receiver."""
    receiver_path = os.path.join(children.dir, "otlp.sock")
    receiver = _Receiver(receiver_path)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    sockets = {}
    for name, cwd, more in (
        ("before", before, ""),
        ("after", ROOT, telemetry.format(socket=receiver_path)),
    ):
        # A directory each: beside its socket each loopd serves its lease socket.
        home = os.path.join(children.dir, f"loopd-{name}")
        os.mkdir(home, 0o700)
        listen = os.path.join(home, "loopd.sock")
        config = os.path.join(children.dir, f"loopd-{name}.toml")
        with open(config, "w", encoding="utf-8") as f:
            f.write(loopd_config(listen, infer) + "\n" + more)
        env = {**os.environ, "PYTHONPATH": cwd}
        argv = [sys.executable, "-m", "twisted", "--log-format=text", "loopd", "--config", config]
        proc = children.spawn(f"loopd-{name}", argv, log=True, cwd=cwd, env=env)
        wait_socket(children, proc, f"loopd-{name}", listen)
        sockets[name] = listen
    # Each runs the code it should: /v1/status came with issue 28.
    for name, expected in (("before", 404), ("after", 200)):
        if _status_code(sockets[name]) != expected:
            raise BenchError(f"loopd {name}: GET /v1/status is not {expected}: wrong code?")
    return sockets, receiver


def _status_code(path: str) -> int:
    """The status of GET /v1/status on loopd's socket path."""
    conn = UnixHTTPConnection(path)
    try:
        conn.request("GET", "/v1/status")
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def _poll(path: str, stop: threading.Event, count: list[int]) -> None:
    """GET /v1/status every PAGE_POLL_S until stop is set."""
    while not stop.wait(PAGE_POLL_S):
        conn = UnixHTTPConnection(path)
        try:
            conn.request("GET", "/v1/status")
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise BenchError(f"/v1/status answered {response.status}")
            count[0] += 1
        except (OSError, http.client.HTTPException):
            return
        finally:
            conn.close()


def measure_observe(
    children: Children,
    sockets: dict[str, str],
    pids: dict[str, int],
    receiver: _Receiver,
    rounds: int,
    requests: int,
    tokens: int,
    timeout: float,
) -> ObserveUse:
    """Alternate rounds of requests streams between "before" and "after" (the page
    polling "after" throughout); return each one's CPU over its own rounds."""
    body, _ = long_bodies(tokens)
    seconds = {"before": 0.0, "after": 0.0}
    streamed = {"before": 0, "after": 0}
    polls = [0]
    stop = threading.Event()
    poller = threading.Thread(target=_poll, args=(sockets["after"], stop, polls), daemon=True)
    poller.start()
    try:
        for path in ("before", "after"):  # warm both up, untimed
            for _ in range(3):
                stream_chat(sockets[path], body, timeout, "bench-observe")
        for index in range(rounds):
            order = ("before", "after") if index % 2 == 0 else ("after", "before")
            for path in order:
                start = cpu_seconds(pids[path])
                for _ in range(requests):
                    result = stream_chat(sockets[path], body, timeout, "bench-observe")
                    if result.tokens != tokens:
                        raise BenchError(f"{path}: {result.tokens} tokens, not {tokens}")
                    streamed[path] += result.tokens
                seconds[path] += cpu_seconds(pids[path]) - start
    finally:
        stop.set()
        poller.join(PAGE_POLL_S * 2)
    return ObserveUse(seconds, streamed, polls[0], receiver.exports, receiver.export_bytes)
