"""
A real llama.cpp server, run from the `xllamacpp` wheel in a child process: what
`loopd demo`, the end-to-end tests and the fixture recorder run against.

`RealServer` spawns this file (CLI: ``python -m loopd.demo.real_server --model
PATH [--port N]``); the child serves on 127.0.0.1, checks its own ``/health`` and prints
a ready line, which is all the parent waits for (it opens no connection).  Tests can
`kill` it and `start` it again on the same port.  ``--query URL [--data JSON|-]``
fetches one URL in a child and prints the body (``--envelope``: ``{"status": N,
"body": TEXT}``); `run_query` wraps that for Twisted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import (
    IDelayedCall,
    IProcessTransport,
    IReactorProcess,
    IReactorTime,
)
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

READY_PREFIX = "LOOPD-REAL-SERVER-READY "
MODULE = "loopd.demo.real_server"
# Children run this file as a script, not with -m: importing the loopd package
# first costs time in every child.
SCRIPT = os.path.abspath(__file__)
STDERR_TAIL_BYTES = 16384


class RealServerError(Exception):
    """Base class of every failure of a real-server child process."""


class ServerStartTimeoutError(RealServerError):
    """The server printed no ready line in time; the child was killed."""


class ServerExitedError(RealServerError):
    """The server child exited before it was ready (bad model, port taken, ...)."""


class QueryFailedError(RealServerError):
    """A query child could not get an HTTP answer (connection refused, ...)."""


class QueryTimeoutError(RealServerError):
    """A query child did not finish in time; it was killed."""


@dataclass(frozen=True)
class QueryResult:
    """An HTTP answer fetched by a query child: status code and raw body."""

    status: int
    body: bytes

    def json(self) -> Any:
        """Return the body parsed as JSON."""
        return json.loads(self.body)


def child_environment() -> dict[str, str]:
    """Return the environment for a child: ours, with Python output unbuffered."""
    return dict(os.environ, PYTHONUNBUFFERED="1")


@dataclass(frozen=True)
class ServerOptions:
    """What a server child serves: model file, alias, port (0: any), context, slots."""

    model_path: str
    alias: str = "tiny"
    port: int = 0
    n_ctx: int = 8192
    parallel: int = 2
    threads: int = 2
    batch: int = 0  # n_batch and n_ubatch; 0: llama.cpp's default
    kv_unified: bool = False  # one KV pool of n_ctx cells shared by all slots
    cache_ram_mib: int | None = None  # the RAM prompt cache; None: llama.cpp's default
    slot_save_path: str | None = None  # --slot-save-path: slot save/restore to files there

    def command(self, ready_timeout: float = 60.0, exit_on_eof: bool = False) -> list[str]:
        """Return the argv (Python first) of a child that serves with these options."""
        argv = [sys.executable, SCRIPT, "--model", self.model_path]
        argv += ["--port", str(self.port), "--alias", self.alias]
        argv += ["--ctx", str(self.n_ctx), "--parallel", str(self.parallel)]
        argv += ["--threads", str(self.threads), "--ready-timeout", str(ready_timeout)]
        argv += ["--batch", str(self.batch)] if self.batch else []
        argv += ["--kv-unified"] if self.kv_unified else []
        argv += [] if self.cache_ram_mib is None else ["--cache-ram", str(self.cache_ram_mib)]
        argv += [] if self.slot_save_path is None else ["--slot-save-path", self.slot_save_path]
        return argv + (["--exit-on-eof"] if exit_on_eof else [])


def _signal(process: IProcessTransport | None, name: str) -> None:
    """Send a signal, ignoring a child that is already gone."""
    if process is not None:
        with suppress(ProcessExitedAlready):
            process.signalProcess(name)


def _cancel(timer: IDelayedCall | None) -> None:
    """Cancel a timer that may be absent or may have run already."""
    if timer is not None and timer.active():
        timer.cancel()


def _describe_end(reason: Failure) -> str:
    """Say how a child ended: exit code or signal."""
    code = getattr(reason.value, "exitCode", None)
    sig = getattr(reason.value, "signal", None)
    return f"signal {sig}" if sig is not None else f"exit code {code}"


class _ServerProtocol(ProcessProtocol):
    """Watches a server child: its ready line, a stderr tail, its end."""

    def __init__(self, owner: RealServer) -> None:
        """Report to `owner`; no output seen yet."""
        self._owner = owner
        self._partial = b""
        self.stderr_tail = b""

    def outReceived(self, data: bytes) -> None:
        """Split stdout into lines and report the ready or failure line."""
        self._partial += data
        *lines, self._partial = self._partial.split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8", "replace").rstrip("\r")
            if line.startswith(READY_PREFIX):
                self._owner._child_ready(json.loads(line[len(READY_PREFIX) :]))

    def errReceived(self, data: bytes) -> None:
        """Keep the last bytes of stderr for error messages."""
        self.stderr_tail = (self.stderr_tail + data)[-STDERR_TAIL_BYTES:]

    def processEnded(self, reason: Failure) -> None:
        """Tell the owner the child is gone."""
        self._owner._child_ended(self, reason)


class RealServer:
    """
    One llama.cpp server (xllamacpp) in a child process, driven from a Twisted reactor.

    `start` fires with the port once the child's own /health check passed; the port
    is kept, so a later `start` (after `stop` or `kill`) listens on the same one.
    """

    def __init__(
        self,
        reactor: IReactorProcess,
        model_path: str,
        *,
        alias: str = "tiny",
        port: int = 0,
        n_ctx: int = 8192,
        parallel: int = 2,
        threads: int = 2,
        batch: int = 0,
        kv_unified: bool = False,
        cache_ram_mib: int | None = None,
        slot_save_path: str | None = None,
        start_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        query_timeout: float = 30.0,
    ) -> None:
        """Describe the server; nothing runs until `start`."""
        self._reactor = reactor
        self._clock = IReactorTime(reactor)
        self.options = ServerOptions(
            model_path,
            alias,
            port,
            n_ctx,
            parallel,
            threads,
            batch,
            kv_unified,
            cache_ram_mib,
            slot_save_path,
        )
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.query_timeout = query_timeout
        self._process: IProcessTransport | None = None
        self._protocol: _ServerProtocol | None = None
        self._starting: Deferred[int] | None = None
        self._start_error: RealServerError | None = None
        self._start_timer: IDelayedCall | None = None
        self._stop_timer: IDelayedCall | None = None
        self._waiters: list[Deferred[None]] = []
        self.last_end = ""

    @property
    def running(self) -> bool:
        """True while a child process exists (starting, ready or stopping)."""
        return self._process is not None

    @property
    def pid(self) -> int | None:
        """The child's process id, or None when no child runs."""
        return None if self._process is None else self._process.pid

    @property
    def port(self) -> int:
        """The port: as asked (0: any) until the first start, then the one in use."""
        return self.options.port

    @property
    def base_url(self) -> str:
        """The server's HTTP root, e.g. ``http://127.0.0.1:40123``."""
        return f"http://127.0.0.1:{self.port}"

    def stderr_tail(self) -> str:
        """Return the last bytes the current (or last) child wrote to stderr."""
        tail = b"" if self._protocol is None else self._protocol.stderr_tail
        return tail.decode("utf-8", "replace")

    def start(self) -> Deferred[int]:
        """Start the child; fire with the port when ready, or fail typed."""
        if self._process is not None:
            return fail(RealServerError(f"server already running (pid {self.pid})"))
        # Imported here: the child runs this file as a script, without the loopd package.
        from loopd.demo.orphan_guard import guarded_argv

        # It dies with this process, even one killed with SIGKILL (stdin's EOF as well).
        argv = guarded_argv(self.options.command(self.start_timeout, exit_on_eof=True))
        self._protocol = _ServerProtocol(self)
        self._start_error = None
        self._starting = Deferred(lambda _: self._cancel_start())
        self._process = self._reactor.spawnProcess(
            self._protocol, argv[0], argv, env=child_environment()
        )
        self._start_timer = self._clock.callLater(self.start_timeout, self._start_timed_out)
        return self._starting

    def stop(self) -> Deferred[None]:
        """SIGTERM the child (SIGKILL after `stop_timeout`); fire once it is gone."""
        if self._process is not None and self._stop_timer is None:
            self._stop_timer = self._clock.callLater(
                self.stop_timeout, _signal, self._process, "KILL"
            )
        return self._end("TERM")

    def kill(self) -> Deferred[None]:
        """SIGKILL the child; fire once it is gone."""
        return self._end("KILL")

    def restart(self) -> Deferred[int]:
        """Stop the child (if any) and start a new one on the same port."""
        stopping = self.stop()
        return stopping.addCallback(lambda _: self.start())

    def query(self, path: str, body: Any = None) -> Deferred[QueryResult]:
        """GET `path` (or POST `body` as JSON) through a query child."""
        return run_query(self._reactor, self.base_url + path, body, timeout=self.query_timeout)

    def _cancel_start(self) -> None:
        """The canceller of `start`'s Deferred: stop the start timeout and kill the child."""
        _cancel(self._start_timer)
        self._starting = self._start_timer = None
        _signal(self._process, "KILL")

    def _start_timed_out(self) -> None:
        """
        No ready line in time: kill the child; `start` fails with `ServerStartTimeoutError`
        once the child has ended.
        """
        self._start_timer = None
        self._start_error = ServerStartTimeoutError(
            f"no ready line within {self.start_timeout} s; killed.\n" + self.stderr_tail()[-2000:]
        )
        _signal(self._process, "KILL")

    def _end(self, name: str) -> Deferred[None]:
        """Send signal `name` to the child; fire once it has ended (at once when none runs)."""
        if self._process is None:
            return succeed(None)
        done: Deferred[None] = Deferred()
        self._waiters.append(done)
        _signal(self._process, name)
        return done

    def _child_ready(self, info: dict[str, Any]) -> None:
        """
        The child's ready line: keep the port it serves on (later starts reuse it) and fire
        `start` with it. Ignored when no start is pending.
        """
        if self._starting is None:
            return
        _cancel(self._start_timer)
        self._start_timer = None
        self.options = replace(self.options, port=int(info["port"]))
        starting, self._starting = self._starting, None
        starting.callback(self.port)

    def _child_ended(self, protocol: _ServerProtocol, reason: Failure) -> None:
        """
        The current child ended: forget it and its timers, note how it ended (`last_end`),
        fail a pending `start` (with the timeout's error, or `ServerExitedError` and the stderr
        tail) and fire every `stop` or `kill` waiter. The end of an earlier child is ignored.
        """
        if protocol is not self._protocol:
            return
        _cancel(self._start_timer)
        _cancel(self._stop_timer)
        self._process = self._start_timer = self._stop_timer = None
        self.last_end = _describe_end(reason)
        starting, self._starting = self._starting, None
        waiters, self._waiters = self._waiters, []
        if starting is not None:
            error = self._start_error or ServerExitedError(
                f"server child ended ({self.last_end}) before it was ready.\n"
                + self.stderr_tail()[-2000:]
            )
            starting.errback(error)
        for waiter in waiters:
            waiter.callback(None)


class _QueryProtocol(ProcessProtocol):
    """Collects a query child's output and turns it into a result."""

    def __init__(self, clock: IReactorTime, timeout: float) -> None:
        """
        @param clock: runs the timeout.
        @param timeout: seconds the query child may run before it is killed.
        """
        self.finished: Deferred[QueryResult] = Deferred()
        self._clock = clock
        self._timeout = timeout
        self._timer: IDelayedCall | None = None
        self._timed_out = False
        self._out = b""
        self._err = b""

    def connectionMade(self) -> None:
        """Start the timeout once the child exists."""
        self._timer = self._clock.callLater(self._timeout, self._expire)

    def _expire(self) -> None:
        """The query child ran too long: kill it; `processEnded` fails with `QueryTimeoutError`."""
        self._timed_out = True
        _signal(self.transport, "KILL")

    def outReceived(self, data: bytes) -> None:
        """Collect stdout (the envelope)."""
        self._out += data

    def errReceived(self, data: bytes) -> None:
        """Keep the tail of stderr for error messages."""
        self._err = (self._err + data)[-STDERR_TAIL_BYTES:]

    def processEnded(self, reason: Failure) -> None:
        """Fire with the parsed envelope, or fail typed."""
        _cancel(self._timer)
        if self._timed_out:
            self.finished.errback(QueryTimeoutError(f"query child killed after {self._timeout} s"))
            return
        envelope: Any = {}
        with suppress(ValueError):
            envelope = json.loads(self._out)
        if "status" in envelope:
            self.finished.callback(QueryResult(int(envelope["status"]), envelope["body"].encode()))
            return
        message = envelope.get("error") or self._err.decode("utf-8", "replace")
        self.finished.errback(QueryFailedError(f"{message} ({_describe_end(reason)})"))


def run_query(
    reactor: IReactorProcess, url: str, body: Any = None, *, timeout: float = 30.0
) -> Deferred[QueryResult]:
    """
    Fetch `url` through a query child: GET, or POST `body` (JSON-encoded) when given.

    Fails with `QueryFailedError` when no HTTP answer came, and with
    `QueryTimeoutError` when the child outlived `timeout` seconds (reactor clock).
    """
    protocol = _QueryProtocol(IReactorTime(reactor), timeout)
    argv = [sys.executable, SCRIPT, "--query", url, "--data", "-", "--envelope"]
    argv += ["--timeout", str(timeout)]
    process = reactor.spawnProcess(protocol, argv[0], argv, env=child_environment())
    if body is not None:
        process.write(json.dumps(body).encode())
    process.closeStdin()
    return protocol.finished


# ---- child side: plain blocking Python, standard library plus xllamacpp ----


def http_request(
    url: str, body: bytes | None = None, *, timeout: float = 30.0
) -> tuple[int, bytes]:
    """Send one HTTP request (POST when `body` is given); return status and body."""
    parts = urllib.parse.urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    connection = http.client.HTTPConnection(parts.netloc, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request("GET" if body is None else "POST", target, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def wait_healthy(host: str, port: int, timeout: float) -> bool:
    """Poll ``/health`` until it answers ``{"status": "ok"}``; False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status, body = http_request(f"http://{host}:{port}/health", timeout=2.0)
            if status == 200 and json.loads(body).get("status") == "ok":
                return True
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return False


def _watch_stdin() -> None:
    """Wait for stdin to close (the parent went away), then ask ourselves to stop."""
    # os.read, not sys.stdin: a daemon thread blocked inside the buffered reader
    # aborts the interpreter at exit (it cannot take the reader's lock).
    while os.read(0, 4096):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT (or stdin EOF with --exit-on-eof)."""
    import xllamacpp  # type: ignore[import-untyped]

    stop_signals = {signal.SIGTERM, signal.SIGINT}
    # Block before the server starts its threads, so they inherit the mask and only
    # sigwait below sees the signals.
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.model_alias = {args.alias}
    params.hostnames = [args.host]
    params.port = args.port
    params.n_ctx = args.ctx
    params.n_parallel = args.parallel
    params.use_jinja = True
    params.endpoint_slots = True
    params.endpoint_metrics = True
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    if args.batch:
        params.n_batch = params.n_ubatch = args.batch
    params.kv_unified = args.kv_unified
    if args.cache_ram is not None:  # 0 also stops saving idle slots, which needs the cache
        params.cache_ram_mib, params.cache_idle_slots = args.cache_ram, args.cache_ram != 0
    if args.slot_save_path is not None:  # llama.cpp joins file names to it as they are
        params.slot_save_path = os.path.join(args.slot_save_path, "")
    try:
        server = xllamacpp.Server(params)
    except RuntimeError as e:
        print(f"real_server: {e}", file=sys.stderr)
        return 1
    port = int(str(server.listening_address).rsplit(":", 1)[1])
    if not wait_healthy(args.host, port, args.ready_timeout):
        print("real_server: /health never said ok", file=sys.stderr)
        return 1
    ready = {"port": port, "pid": os.getpid(), "url": f"http://{args.host}:{port}"}
    print(READY_PREFIX + json.dumps(ready), flush=True)
    if args.exit_on_eof:
        threading.Thread(target=_watch_stdin, daemon=True).start()
    signal.sigwait(stop_signals)
    del server  # joins llama.cpp's loop: a clean exit, exit code 0
    return 0


def query(args: argparse.Namespace) -> int:
    """Fetch one URL and print the body (or the envelope); exit 1 on HTTP errors."""
    raw = sys.stdin.buffer.read() if args.data == "-" else (args.data or "").encode()
    body = raw or None
    try:
        status, answer = http_request(args.query, body, timeout=args.timeout)
    except (OSError, ValueError, http.client.HTTPException) as e:
        if args.envelope:
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        print(f"query failed: {e}", file=sys.stderr)
        return 2
    if args.envelope:
        print(json.dumps({"status": status, "body": answer.decode("utf-8", "replace")}))
    else:
        sys.stdout.buffer.write(answer)
    return 0 if status < 400 else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: serve a model (``--model``) or fetch a URL (``--query``)."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--model", help="serve this GGUF file")
    mode.add_argument("--query", metavar="URL", help="fetch URL and print the body")
    add = parser.add_argument
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=0, help="0: any free port")
    add("--alias", default="tiny", help="the model name served")
    add("--ctx", type=int, default=8192, help="total context, split over slots")
    add("--parallel", type=int, default=2, help="slots")
    add("--threads", type=int, default=2)
    add("--batch", type=int, default=0, help="n_batch and n_ubatch (0: default)")
    add("--kv-unified", action="store_true", help="one KV pool shared by the slots")
    add("--cache-ram", type=int, help="RAM prompt cache in MiB (0: none; default: llama.cpp's)")
    add("--slot-save-path", help="directory of slot save/restore files (default: none)")
    add("--ready-timeout", type=float, default=60.0)
    add("--exit-on-eof", action="store_true", help="stop when stdin closes")
    add("--data", help="JSON body to POST ('-': read stdin)")
    add("--envelope", action="store_true", help='print {"status", "body"}')
    add("--timeout", type=float, default=30.0, help="seconds a query may take")
    args = parser.parse_args(argv)
    return serve(args) if args.model is not None else query(args)


if __name__ == "__main__":
    sys.exit(main())
