# -*- test-case-name: loopd.test.test_router_server -*-
"""
llama-server's router mode in a child process: one server, many models, each loaded on
demand. C{llama-server --models-dir DIR --models-max N} (no C{-m}) lists every model of
C{DIR}, starts a model's own server (a child of its own) the first time a request names it,
and unloads the least recently used one when more than C{N} would run.

L{RouterServer} runs the genuine binary (L{loopd.demo.llama_binary} builds it; the
C{xllamacpp} wheel that L{loopd.demo.real_server.RealServer} runs has no router mode) with
the API of C{RealServer}: L{RouterServer.start} fires with the port once C{GET /health} is
200 and C{GET /v1/models} answers, L{RouterServer.stop} and L{RouterServer.kill} end it, a
later start listens on the same port. It asks the server through query children
(L{loopd.demo.real_server.run_query}): loopd's own code opens no TCP connection.

B{How b11434 names the models of C{--models-dir}} (C{common/preset.cpp},
C{load_from_models_dir}): a file C{NAME.gguf} right in the directory is model C{NAME};
a subdirectory C{NAME/} holding one C{.gguf} (or the first shard C{*-00001-of-*.gguf}, with
an optional C{mmproj} projector and draft model beside it) is model C{NAME} too. Files whose
name holds C{mmproj} or starts with C{mtp-}, C{dspark-} or C{dflash-} are companions, never
models. L{write_models_dir} writes flat files. C{/v1/models} lists each with C{status.value}
C{"unloaded"}, C{"loading"} or C{"loaded"}. The router hands C{--ctx-size}, C{-np} and its
other model options on to every model's server. When the router gets SIGTERM it stops the
models' servers; when it is killed they see their standard input close and exit.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
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

from loopd.demo.orphan_guard import guarded_argv
from loopd.demo.real_server import (
    QueryResult,
    RealServerError,
    ServerExitedError,
    ServerStartTimeoutError,
    child_environment,
    run_query,
)
from loopd.demo.tiny_model import write_tiny_model

__all__ = ["RouterOptions", "RouterServer", "model_statuses", "write_models_dir"]

#: The log line of a llama-server that listens (its port: the first group).
LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")
#: Seconds between two readiness queries.
POLL_INTERVAL = 0.2
STDERR_TAIL_BYTES = 16384


@dataclass(frozen=True)
class RouterOptions:
    """
    What a router serves, and how.

    @ivar binary: the llama-server (b11434) to run.
    @ivar models_dir: the directory of its models (see the module docstring).
    @ivar models_max: how many models may be loaded at once (C{--models-max}; 0: no limit).
    @ivar port: the port (0: any free one).
    @ivar n_ctx: each model's whole context (C{--ctx-size}), None: llama.cpp's default (the
        model's trained context).
    @ivar parallel: each model's slots (C{-np}), None: llama.cpp's default.
    @ivar threads: each model's CPU threads (C{--threads}), None: llama.cpp's default.
    @ivar cache_ram_mib: the RAM prompt cache of each model, None: llama.cpp's default.
    @ivar slot_save_path: the directory of slot save/restore files, None: none.
    @ivar autoload: load a model when a request names it (else C{--no-models-autoload}: only
        C{POST /models/load} does).
    """

    binary: str
    models_dir: str
    models_max: int = 1
    port: int = 0
    n_ctx: int | None = 8192
    parallel: int | None = 2
    threads: int | None = 2
    cache_ram_mib: int | None = None
    slot_save_path: str | None = None
    autoload: bool = True

    def command(self) -> list[str]:
        """The argv of the router with these options."""
        argv = [self.binary, "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--models-dir", self.models_dir, "--models-max", str(self.models_max)]
        argv += ["--log-colors", "off"]
        argv += [] if self.n_ctx is None else ["--ctx-size", str(self.n_ctx)]
        argv += [] if self.parallel is None else ["-np", str(self.parallel)]
        argv += [] if self.threads is None else ["--threads", str(self.threads)]
        argv += [] if self.cache_ram_mib is None else ["--cache-ram", str(self.cache_ram_mib)]
        argv += [] if self.slot_save_path is None else ["--slot-save-path", self.slot_save_path]
        return argv + ([] if self.autoload else ["--no-models-autoload"])


def write_models_dir(directory: str, names: Sequence[str]) -> list[str]:
    """
    Write the project's tiny model once per name into C{directory} (made if missing), as
    C{NAME.gguf}: a models dir whose models are C{names}. A name ending in C{-think} gets the
    model that thinks until told to stop. Returns the paths written.

    @raise ValueError: a name the router would not list as a model (see the module docstring).
    """
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name in names:
        companion = "mmproj" in name or name.startswith(("mtp-", "dspark-", "dflash-"))
        if companion or not name or "/" in name or name.startswith(".") or ".gguf" in name:
            raise ValueError(f"{name!r} is not a model name a router lists")
        path = os.path.join(directory, f"{name}.gguf")
        write_tiny_model(path, think_forever=name.endswith("-think"))
        paths.append(path)
    return paths


def model_statuses(models: Any) -> dict[str, str]:
    """
    A router's C{/v1/models} answer (parsed) as C{{id: status}}: C{"unloaded"},
    C{"loading"}, C{"loaded"}, ... (C{""} when a model has no status).
    """
    found = {}
    for model in models["data"]:
        status = model.get("status")
        found[model["id"]] = status.get("value", "") if isinstance(status, dict) else ""
    return found


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


class _RouterProtocol(ProcessProtocol):
    """Watches a router child: its listening line, an output tail, its end."""

    def __init__(self, owner: RouterServer) -> None:
        """Report to C{owner}; no output seen yet."""
        self._owner = owner
        self._partial = b""
        self._listening = False
        self.output_tail = b""

    def _received(self, data: bytes) -> None:
        """
        Keep the tail; report the port of the first listening line (the router's own: the
        lines it forwards from its models' servers come later, after their ports).
        """
        self.output_tail = (self.output_tail + data)[-STDERR_TAIL_BYTES:]
        if self._listening:
            return
        self._partial += data
        *lines, self._partial = self._partial.split(b"\n")
        for raw in lines:
            found = LISTENING.search(raw.decode("utf-8", "replace"))
            if found is not None:
                self._listening = True
                self._partial = b""
                self._owner._child_listening(self, int(found.group(1)))
                return

    def outReceived(self, data: bytes) -> None:
        """Standard output: the router logs there too, depending on the build."""
        self._received(data)

    def errReceived(self, data: bytes) -> None:
        """Standard error: llama-server's log."""
        self._received(data)

    def processEnded(self, reason: Failure) -> None:
        """Tell the owner the child is gone."""
        self._owner._child_ended(self, reason)


class RouterServer:
    """
    One llama-server in router mode in a child process, driven from a Twisted reactor.

    L{start} fires with the port once C{/health} is 200 and C{/v1/models} answers; the port
    is kept, so a later L{start} (after L{stop} or L{kill}) listens on the same one.
    """

    def __init__(
        self,
        reactor: IReactorProcess,
        binary: str,
        models_dir: str,
        *,
        models_max: int = 1,
        port: int = 0,
        n_ctx: int | None = 8192,
        parallel: int | None = 2,
        threads: int | None = 2,
        cache_ram_mib: int | None = None,
        slot_save_path: str | None = None,
        autoload: bool = True,
        start_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        query_timeout: float = 30.0,
    ) -> None:
        """Describe the router (see L{RouterOptions}); nothing runs until L{start}."""
        self._reactor = reactor
        self._clock = IReactorTime(reactor)
        self.options = RouterOptions(
            binary,
            models_dir,
            models_max,
            port,
            n_ctx,
            parallel,
            threads,
            cache_ram_mib,
            slot_save_path,
            autoload,
        )
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.query_timeout = query_timeout
        self._process: IProcessTransport | None = None
        self._protocol: _RouterProtocol | None = None
        self._starting: Deferred[int] | None = None
        self._start_error: RealServerError | None = None
        self._start_timer: IDelayedCall | None = None
        self._poll_timer: IDelayedCall | None = None
        self._stop_timer: IDelayedCall | None = None
        self._waiters: list[Deferred[None]] = []
        self.last_end = ""

    @property
    def running(self) -> bool:
        """True while a child process exists (starting, ready or stopping)."""
        return self._process is not None

    @property
    def pid(self) -> int | None:
        """The router's process id, or None when none runs."""
        return None if self._process is None else self._process.pid

    @property
    def port(self) -> int:
        """The port: as asked (0: any) until the first start, then the one in use."""
        return self.options.port

    @property
    def base_url(self) -> str:
        """The router's HTTP root, e.g. C{http://127.0.0.1:40123}."""
        return f"http://127.0.0.1:{self.port}"

    def stderr_tail(self) -> str:
        """The last bytes the current (or last) router wrote (its log)."""
        tail = b"" if self._protocol is None else self._protocol.output_tail
        return tail.decode("utf-8", "replace")

    def start(self) -> Deferred[int]:
        """
        Start the router; fire with the port once it is ready, or fail with
        L{ServerExitedError} (it ended first) or L{ServerStartTimeoutError} (not ready within
        C{start_timeout}: killed).
        """
        if self._process is not None:
            return fail(RealServerError(f"router already running (pid {self.pid})"))
        # It dies with this process, even one killed with SIGKILL; its models' servers die
        # with it (their standard input closes).
        argv = guarded_argv(self.options.command())
        self._protocol = _RouterProtocol(self)
        self._start_error = None
        self._starting = Deferred(lambda _: self._cancel_start())
        self._process = self._reactor.spawnProcess(
            self._protocol, argv[0], argv, env=child_environment()
        )
        self._start_timer = self._clock.callLater(self.start_timeout, self._start_timed_out)
        return self._starting

    def stop(self) -> Deferred[None]:
        """SIGTERM the router (SIGKILL after C{stop_timeout}); fire once it is gone."""
        if self._process is not None and self._stop_timer is None:
            self._stop_timer = self._clock.callLater(
                self.stop_timeout, _signal, self._process, "KILL"
            )
        return self._end("TERM")

    def kill(self) -> Deferred[None]:
        """SIGKILL the router; fire once it is gone."""
        return self._end("KILL")

    def restart(self) -> Deferred[int]:
        """Stop the router (if any) and start a new one on the same port."""
        return self.stop().addCallback(lambda _: self.start())

    def query(self, path: str, body: Any = None) -> Deferred[QueryResult]:
        """GET C{path} (or POST C{body} as JSON) through a query child."""
        return run_query(self._reactor, self.base_url + path, body, timeout=self.query_timeout)

    def models(self) -> Deferred[dict[str, str]]:
        """The router's models and their status (L{model_statuses}), from C{/v1/models}."""
        return self.query("/v1/models").addCallback(lambda result: model_statuses(result.json()))

    def _cancel_start(self) -> None:
        """The canceller of L{start}'s Deferred: stop waiting and kill the child."""
        _cancel(self._start_timer)
        _cancel(self._poll_timer)
        self._starting = self._start_timer = self._poll_timer = None
        _signal(self._process, "KILL")

    def _start_timed_out(self) -> None:
        """Not ready in time: kill the child; L{start} fails once it has ended."""
        self._start_timer = None
        self._start_error = ServerStartTimeoutError(
            f"router not ready within {self.start_timeout} s; killed.\n"
            + self.stderr_tail()[-2000:]
        )
        _signal(self._process, "KILL")

    def _end(self, name: str) -> Deferred[None]:
        """Send signal C{name} to the child; fire once it has ended (at once when none runs)."""
        if self._process is None:
            return succeed(None)
        done: Deferred[None] = Deferred()
        self._waiters.append(done)
        _signal(self._process, name)
        return done

    def _child_listening(self, protocol: _RouterProtocol, port: int) -> None:
        """
        The router listens on C{port}: keep it (later starts reuse it) and ask until it is
        ready. Ignored when no start is pending or the line is an earlier child's.
        """
        if protocol is not self._protocol or self._starting is None:
            return
        self.options = replace(self.options, port=port)
        self._poll()

    def _poll(self) -> None:
        """Ask C{/health}, then C{/v1/models}; ready once both answer 200, else ask again."""
        self._poll_timer = None
        starting, protocol = self._starting, self._protocol
        if starting is None:
            return

        def asked(ready: bool) -> None:
            if self._starting is not starting or self._protocol is not protocol:
                return  # the start ended meanwhile (timeout, cancel, exit)
            if not ready:
                self._poll_timer = self._clock.callLater(POLL_INTERVAL, self._poll)
                return
            _cancel(self._start_timer)
            self._start_timer = self._starting = None
            starting.callback(self.port)

        self._ready(lambda: self._starting is starting).addCallback(asked)

    def _ready(self, pending: Callable[[], bool]) -> Deferred[bool]:
        """
        Whether C{/health} is 200 and C{/v1/models} lists models (False on any failure, and
        without asking C{/v1/models} when the start is no longer C{pending}).
        """

        def health(result: QueryResult) -> Any:
            if result.status != 200 or not pending():
                return False
            return self.query("/v1/models").addCallback(listed)

        def listed(result: QueryResult) -> bool:
            return result.status == 200 and isinstance(result.json().get("data"), list)

        asked = self.query("/health").addCallback(health)
        return asked.addErrback(lambda _: False)

    def _child_ended(self, protocol: _RouterProtocol, reason: Failure) -> None:
        """
        The current child ended: forget it and its timers, note how it ended (C{last_end}),
        fail a pending L{start} and fire every L{stop} or L{kill} waiter. The end of an
        earlier child is ignored.
        """
        if protocol is not self._protocol:
            return
        for timer in (self._start_timer, self._poll_timer, self._stop_timer):
            _cancel(timer)
        self._process = self._start_timer = self._poll_timer = self._stop_timer = None
        self.last_end = _describe_end(reason)
        starting, self._starting = self._starting, None
        waiters, self._waiters = self._waiters, []
        if starting is not None:
            error = self._start_error or ServerExitedError(
                f"router ended ({self.last_end}) before it was ready.\n"
                + self.stderr_tail()[-2000:]
            )
            starting.errback(error)
        for waiter in waiters:
            waiter.callback(None)
