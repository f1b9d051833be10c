# -*- test-case-name: loopd.test.test_service -*-
"""
The C{twist loopd} service: a llama client per endpoint, the startup self-test, then the
gateway on its listener. Nothing listens before every endpoint with C{selftest = true}
has passed; a failure ends the process with a non-zero status and the failing check.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort
from twisted.logger import Logger, LoggingFile
from twisted.python.failure import Failure

from loopd.gateway.site import Gateway
from loopd.llama import Client
from loopd.selftest import SelftestFailed, require_selftests
from loopd.settings import Config
from loopd.unixsocket import listen_unix

__all__ = ["LoopdService", "default_socket_path", "listen_path"]

_log = Logger(namespace="loopd.service")


def default_socket_path(environ: dict[str, str] | None = None) -> str:
    """
    Where the gateway listens when the config names no listener: C{loopd.sock} in
    C{$XDG_RUNTIME_DIR/loopd/}, else in a per-user directory under the system temp dir.
    """
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "loopd", "loopd.sock")
    return os.path.join(tempfile.gettempdir(), f"loopd-{os.getuid()}", "loopd.sock")


def listen_path(config: Config) -> str | None:
    """
    The Unix socket path the gateway listens on, or C{None} for another kind of
    listener (a strports description such as C{tcp:8080:interface=127.0.0.1}).
    """
    listen = config.server.listen
    if listen is None:
        return default_socket_path()
    if listen.startswith("unix:"):
        # The path ends at the first unescaped colon (strports options follow it).
        path = re.split(r"(?<!\\):", listen[len("unix:") :], maxsplit=1)[0]
        return os.path.expanduser(path.replace("\\:", ":"))
    return None


class LoopdService(Service):
    """
    Runs the self-tests, then serves the gateway; stopping ends the streams under way with
    an error event and removes the socket.
    """

    def __init__(
        self,
        reactor: Any,
        config: Config,
        *,
        exit_process: Callable[[int], None] = os._exit,
    ) -> None:
        """
        @param exit_process: ends the process after a failed start (after the reactor
            stopped); replaced in tests.
        """
        self._reactor = reactor
        self.config = config
        self.clients = {e.name: Client(reactor, config, e) for e in config.endpoints}
        self.gateway: Gateway | None = None
        self._port: IListeningPort | None = None
        self._exit_process = exit_process
        self._ready_waiters: list[Deferred[None]] = []
        self._started: Failure | None | bool = False

    def when_ready(self) -> Deferred[None]:
        """
        A Deferred that fires when the gateway listens, or fails with why it never will.
        """
        d: Deferred[None] = Deferred()
        if self._started is True:
            d.callback(None)
        elif isinstance(self._started, Failure):
            d.errback(self._started)
        else:
            self._ready_waiters.append(d)
        return d

    def _fire_ready(self, outcome: Failure | None) -> None:
        self._started = True if outcome is None else outcome
        waiters, self._ready_waiters = self._ready_waiters, []
        for d in waiters:
            if outcome is None:
                d.callback(None)
            else:
                d.errback(outcome)

    def startService(self) -> None:
        """
        Start the self-tests; the gateway listens once they pass.
        """
        super().startService()
        starting = self._start()
        starting.addErrback(self._start_failed)

    @inlineCallbacks
    def _start(self) -> Any:
        reports = yield require_selftests(self._reactor, self.config, self.clients)
        for report in reports:
            for line in report.lines():
                _log.info("selftest {endpoint}: {line}", endpoint=report.endpoint, line=line)
        slot_counts = {}
        for name, client in self.clients.items():
            if client.endpoint.kind == "llama-server":
                try:
                    props = yield client.props()
                    slot_counts[name] = int(props.get("total_slots") or 1)
                except Exception as e:  # noqa: BLE001 - the slot count is a hint only
                    _log.warn(
                        "{endpoint}: /props unavailable ({error}); assuming 1 slot",
                        endpoint=name,
                        error=e,
                    )
        self.gateway = Gateway(self._reactor, self.config, self.clients, slot_counts=slot_counts)
        self._port = yield self._listen(self.gateway)
        _log.info(
            "loopd serving {listener} for {endpoints}",
            listener=self.config.server.listen or listen_path(self.config),
            endpoints=", ".join(self.clients),
        )
        self._fire_ready(None)

    def _listen(self, gateway: Gateway) -> Deferred[IListeningPort]:
        path = listen_path(self.config)
        site = gateway.site()
        if path is not None:
            return succeed(listen_unix(self._reactor, path, site))
        assert self.config.server.listen is not None
        listening: Deferred[IListeningPort] = serverFromString(
            self._reactor, self.config.server.listen
        ).listen(site)
        return listening

    def _start_failed(self, reason: Failure) -> None:
        if isinstance(reason.value, SelftestFailed):
            message = f"loopd: {reason.value}"
        else:
            message = f"loopd: cannot start: {reason.getErrorMessage()}"
        stderr = sys.stderr
        if isinstance(stderr, LoggingFile) and sys.__stderr__ is not None:
            # twist sends sys.stderr to the log (stdout); the reason belongs on stderr.
            stderr = sys.__stderr__
        stderr.write(message + "\n")
        stderr.flush()
        _log.error("{message}", message=message)
        self._fire_ready(reason)
        self._reactor.addSystemEventTrigger("after", "shutdown", self._exit_process, 1)
        if self._reactor.running:
            self._reactor.stop()
        else:
            self._reactor.callWhenRunning(self._reactor.stop)

    def stopService(self) -> Deferred[None] | None:
        """
        End the exchanges under way with an error, stop listening (removing the socket).
        """
        super().stopService()
        if self.gateway is not None:
            self.gateway.stop()
        port, self._port = self._port, None
        if port is None:
            return None
        stopped: Any = port.stopListening()
        return stopped if isinstance(stopped, Deferred) else None
