# -*- test-case-name: test.test_tap_loopd,test.test_gateway_e2e -*-
"""
The C{twist loopd} service: a llama client per endpoint, the startup self-test, then the
lease queue (and its socket, unless C{[queue] serve} is false) and the gateway on its
listener. Nothing listens before every endpoint with C{selftest = true} has passed; a
failure ends the process with a non-zero status and the failing check.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, gatherResults, inlineCallbacks, succeed
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint
from twisted.internet.interfaces import IListeningPort
from twisted.logger import Logger, LoggingFile
from twisted.python.failure import Failure

from loopd.access_token import load_or_create_token, token_path
from loopd.gateway.capture import CaptureWatcher
from loopd.gateway.capture_files import CaptureFiles
from loopd.gateway.leases import GatewayLeases
from loopd.gateway.site import Gateway
from loopd.gateway.slot_dir import open_slot_directories
from loopd.gateway.swap_gate import RouterStart, router_starts
from loopd.gateway.token_guard import TokenGuard
from loopd.llama import Client
from loopd.llama.discovery import discover_routers, router_capacity
from loopd.queue.eventlog import EventLog
from loopd.queue.host import QueueHost
from loopd.queue.protocol import LeaseFactory
from loopd.queue.watch import ConfigWatcher
from loopd.reactor import IServiceReactor
from loopd.selftest import SelftestFailed, require_selftests
from loopd.settings import Config
from loopd.tcp_address import TcpAddress, parse_tcp_address
from loopd.unixsocket import listen_unix

if TYPE_CHECKING:
    from loopd.gateway.telemetry import GatewayTelemetry

__all__ = [
    "LoopdService",
    "TelemetryUnavailableError",
    "default_socket_path",
    "listen_path",
    "load_telemetry",
    "queue_socket_path",
]

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


def listen_path(config: Config) -> str:
    """
    The Unix socket path the gateway listens on: C{[server] listen}'s C{unix:PATH} (the
    config allows no other kind), else L{default_socket_path}.
    """
    listen = config.server.listen
    if listen is None:
        return default_socket_path()
    # The path ends at the first unescaped colon (strports options follow it).
    path = re.split(r"(?<!\\):", listen[len("unix:") :], maxsplit=1)[0]
    return os.path.expanduser(path.replace("\\:", ":"))


def queue_socket_path(config: Config | None) -> str:
    """
    Where the lease protocol is served: C{[queue] socket}, else C{llm-queue.sock} beside the
    gateway's socket (or in the default socket directory when the gateway is not on one,
    or when there is no config).
    """
    if config is not None and config.queue.socket is not None:
        return config.queue.socket
    beside = listen_path(config) if config is not None else default_socket_path()
    return os.path.join(os.path.dirname(beside), "llm-queue.sock")


class TelemetryUnavailableError(Exception):
    """
    C{[telemetry] enabled = true}, but OpenTelemetry (the C{telemetry} extra) is not
    installed; the message says how to install it, in one line.
    """


def load_telemetry() -> type[GatewayTelemetry]:
    """
    The gateway's telemetry (L{loopd.gateway.telemetry}), imported now: OpenTelemetry is an
    extra, imported only when C{[telemetry]} is on.

    @raise TelemetryUnavailableError: OpenTelemetry's SDK or its OTLP encoder is missing.
    """
    try:
        from loopd.gateway.telemetry import GatewayTelemetry
    except ImportError as e:
        missing = e.name or ""
        if not missing.startswith(("opentelemetry", "google")):
            raise
        raise TelemetryUnavailableError(
            f"[telemetry] enabled = true, but OpenTelemetry is not installed (no module "
            f"named {missing!r}): pip install 'loopd[telemetry]'"
        ) from None
    return GatewayTelemetry


class LoopdService(Service):
    """
    Runs the self-tests, then serves the gateway; stopping ends the streams under way with
    an error event and removes the socket.
    """

    def __init__(
        self,
        reactor: IServiceReactor,
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
        #: The clients of the C{llama-server-router} endpoints, once their models are known.
        self.routers: dict[str, Client] = {}
        #: What loopd knew of each router at start (capacity, loaded models, bound).
        self.router_starts: dict[str, RouterStart] = {}
        self._capacities: dict[str, int] = {}
        # Each router model's slot count, from the arguments its router starts it with.
        self._router_slots: dict[str, int] = {}
        self.gateway: Gateway | None = None
        #: The gateway's OpenTelemetry export, when C{[telemetry]} is on and loopd serves.
        self.telemetry: GatewayTelemetry | None = None
        self._port: IListeningPort | None = None
        self._tcp_port: IListeningPort | None = None
        self.tcp_url: str | None = None
        self.token_file: str | None = None
        self._queue_port: IListeningPort | None = None
        self.queue: QueueHost | None = None
        self._watcher: ConfigWatcher | None = None
        #: The request capture's files, once opened (C{[capture] dir}).
        self.capture: CaptureFiles | None = None
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
        """
        Record how the start ended (C{None}: the gateway listens) and fire every
        L{when_ready} waiter with it; later waiters get it at once.
        """
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
        """
        The start: serve each router's models as endpoints (L{_expand_routers}); after the
        self-tests pass, log their lines, ask each llama-server endpoint's C{/props} for its
        slot count (one slot, with a warning, when it does not answer; a router's model has
        its count from the router's list), note which router models are loaded, start
        the lease queue, build the gateway and listen. Fails with L{SelftestFailed} or whatever
        stopped the start; L{_start_failed} handles both.
        """
        tcp, token = self._prepare_tcp()
        telemetry = load_telemetry() if self.config.telemetry.enabled else None
        open_slot_directories(self.config.endpoints)
        self._open_capture()
        yield self._expand_routers()
        reports = yield require_selftests(self._reactor, self.config, self.clients)
        for report in reports:
            for line in report.lines():
                _log.info("selftest {endpoint}: {line}", endpoint=report.endpoint, line=line)
        slot_counts = dict(self._router_slots)
        props_by_name: dict[str, object] = {}
        yield self._router_loaded()
        for name, client in self.clients.items():
            # A router's model is not asked: /props would load it (and evict another).
            if client.endpoint.kind == "llama-server" and client.endpoint.router is None:
                try:
                    props = yield client.props()
                    slot_counts[name] = int(props.get("total_slots") or 1)
                    props_by_name[name] = props
                except Exception as e:  # noqa: BLE001 - the slot count is a hint only
                    _log.warn(
                        "{endpoint}: /props unavailable ({error}); assuming 1 slot",
                        endpoint=name,
                        error=e,
                    )
        leases = self._start_queue(slot_counts)
        self.gateway = Gateway(
            self._reactor,
            self.config,
            self.clients,
            slot_counts=slot_counts,
            leases=leases,
            props=props_by_name,
            routers=self.routers,
            router_starts=self.router_starts,
        )
        self._watch_capture(self.gateway)
        self.gateway.start()
        if telemetry is not None:
            self._start_telemetry(telemetry, self.gateway)
        self._port = yield self._listen(self.gateway)
        listeners = [listen_path(self.config)]
        if tcp is not None and token is not None:
            self._tcp_port = yield self._listen_tcp(self.gateway, tcp, token)
            bound: Any = self._tcp_port.getHost()
            self.tcp_url = tcp.url(bound.port)
            self.gateway.page_url = tcp.browser_url(bound.port)
            _log.info(
                "TCP listener on {url}: every request needs the token in {token_file}",
                url=self.tcp_url,
                token_file=self.token_file,
            )
            listeners.append(self.tcp_url)
        _log.info(
            "loopd serving {listener} for {endpoints}",
            listener=" and ".join(listeners),
            endpoints=", ".join(self.clients),
        )
        self._fire_ready(None)

    def _start_telemetry(self, telemetry: type[GatewayTelemetry], gateway: Gateway) -> None:
        """
        Make a trace of every request of C{gateway} from now on, exported to the collector
        C{[telemetry]} names (L{loopd.gateway.telemetry}).
        """
        settings = self.config.telemetry
        self.telemetry = telemetry(self._reactor, settings, self.config.endpoints)
        gateway.activity.watch(self.telemetry.watcher)
        self.telemetry.start()
        _log.info(
            "telemetry: a trace of every request goes to the OTLP collector at {socket}",
            socket=settings.socket,
        )

    @inlineCallbacks
    def _expand_routers(self) -> Any:
        """
        Serve each C{llama-server-router} endpoint's models as endpoints of their own
        (L{discover_routers}), and learn each router's capacity (its C{models_max}, else
        its C{/props}) and each model's slot count. Fails with L{RouterError} when a router
        never answers or cannot serve its config's models.
        """
        found = yield discover_routers(self._reactor, self.config, self.clients)
        if not found.routers:
            return
        self.config, self.clients, self.routers = found.config, found.clients, found.routers
        capacities = {}
        for name, client in found.routers.items():
            capacity = client.endpoint.models_max
            if capacity is None:
                capacity = yield router_capacity(client, len(found.listed[name]))
            capacities[name] = capacity
        self._capacities = capacities
        self._router_slots = {
            m.id: m.slots for models in found.listed.values() for m in models if m.slots is not None
        }
        for endpoint in self.config.endpoints:
            if endpoint.router is not None:
                _log.info(
                    "router {router}: serving model {model}",
                    router=endpoint.router,
                    model=endpoint.name,
                )

    @inlineCallbacks
    def _router_loaded(self) -> Any:
        """
        Which models each router has loaded now (after the self-test, which loads each
        model it checks): the swap gates start from it (L{router_starts}).
        """
        loaded = {}
        for name, client in self.routers.items():
            try:
                models = yield client.router_models()
            except Exception as e:  # noqa: BLE001 - the gate learns from the requests too
                _log.warn("router {router}: /v1/models: {error}", router=name, error=e)
                models = ()
            loaded[name] = [m.id for m in models if m.loaded]
        self.router_starts = router_starts(self.config.endpoints, self._capacities, loaded)

    def _open_capture(self) -> None:
        """
        Before anything starts: check and open the capture directory when C{[capture]}
        names one (L{loopd.gateway.capture_files}).

        @raise loopd.runtime_dir.DirectoryError: the directory is unsafe or unusable.
        """
        settings = self.config.capture
        if settings.dir is not None:
            self.capture = CaptureFiles(settings.dir, settings.max_bytes)

    def _watch_capture(self, gateway: Gateway) -> None:
        """Capture each request of C{gateway} to the files opened at start, if any."""
        if self.capture is None:
            return
        prompts = self.config.capture.prompts
        paths = {door.name: path for path, door in gateway.doors.by_path}
        gateway.activity.watch(CaptureWatcher(self.capture, prompts, paths))
        _log.info(
            "capturing every request to {path} (at most {budget} bytes; {what})",
            path=self.capture.path,
            budget=self.capture.max_bytes,
            what="prompts and answers included" if prompts else "no prompt or answer text",
        )

    def _start_queue(self, slot_counts: dict[str, int]) -> GatewayLeases:
        """
        Build the lease scheduler (each endpoint a queue with as many streams as slots),
        start its sweep, and serve the lease protocol on its socket unless told not to.
        """
        settings = self.config.queue
        counts = {
            e.name: slot_counts.get(e.name) or e.expect.total_slots or 1
            for e in self.config.endpoints
        }
        leases = GatewayLeases(self._reactor, settings.grace_ms)
        self.queue = host = QueueHost(
            self._reactor,
            leases.on_grant,
            config_path=settings.config,
            models_json=settings.models_json,
            slot_counts=counts,
            sweep_ms=settings.sweep_ms,
            on_event=EventLog(lambda: host.log_path(), time.time).write,
        )
        _say_problems(host.problems)
        leases.bind(host.scheduler)
        host.start()
        if settings.config is not None:
            self._watcher = ConfigWatcher(self._reactor, settings.config, self._reload_queue)
            self._watcher.start()
        if settings.serve:
            path = queue_socket_path(self.config)
            self._queue_port = listen_unix(
                self._reactor,
                path,
                LeaseFactory(self.queue.scheduler),
                backlog=self.config.server.backlog,
            )
            _log.info("lease protocol served on {path}", path=path)
        return leases

    def _reload_queue(self) -> None:
        """
        The queue config changed: apply it, or keep the last good one and say why.
        """
        assert self.queue is not None
        outcome, problems = self.queue.reload()
        _say_problems(problems)
        _log.info("queue config {path}: {outcome}", path=self.queue.config_path, outcome=outcome)

    def _listen(self, gateway: Gateway) -> Deferred[IListeningPort]:
        """
        Listen with the gateway's site on its Unix socket through L{listen_unix} (0600, stale
        file reclaimed); no token there.
        """
        path = listen_path(self.config)
        site = gateway.site()
        return succeed(listen_unix(self._reactor, path, site, backlog=self.config.server.backlog))

    def _prepare_tcp(self) -> tuple[TcpAddress | None, str | None]:
        """
        Before anything starts: the TCP listener's address and its token (read, or made at
        this first start), and the warning of an address that is not a loopback one; C{None}s
        when C{[server] tcp} names none.

        @raise loopd.access_token.TokenError: the token file cannot be used.
        """
        server = self.config.server
        if server.tcp is None:
            return None, None
        tcp = parse_tcp_address(server.tcp)
        self.token_file = token_path(server)
        token, created = load_or_create_token(self.token_file)
        if created:
            _log.info("made the TCP listener's token in {path}", path=self.token_file)
        if not tcp.loopback:
            warning = (
                f"loopd: warning: [server] tcp = {server.tcp!r} is not a loopback address and "
                "allow_remote is true: other machines can reach loopd there (each request "
                "still needs the token, and travels unencrypted)"
            )
            stderr = _stderr()
            stderr.write(warning + "\n")
            stderr.flush()
            _log.warn("{warning}", warning=warning)
        return tcp, token

    def _listen_tcp(
        self, gateway: Gateway, tcp: TcpAddress, token: str
    ) -> Deferred[IListeningPort]:
        """
        Listen on C{tcp} with a site of its own whose root is behind the L{TokenGuard}.
        """
        guarded = gateway.site(
            guard=lambda root: TokenGuard(
                root,
                token,
                gateway.error_shapes(),
                on_refusal=gateway.metrics.observe_refusal,
                logins=gateway.logins,
            )
        )
        backlog = self.config.server.backlog
        endpoint_type = TCP6ServerEndpoint if tcp.ipv6 else TCP4ServerEndpoint
        endpoint = endpoint_type(self._reactor, tcp.port, backlog=backlog, interface=tcp.host)
        listening: Deferred[IListeningPort] = endpoint.listen(guarded)
        return listening

    def _start_failed(self, reason: Failure) -> None:
        """
        The start failed: say why on the real stderr and in the log, fail the L{when_ready}
        waiters, and stop the reactor so that the process exits with status 1 after shutdown.
        """
        if isinstance(reason.value, SelftestFailed):
            message = f"loopd: {reason.value}"
        else:
            message = f"loopd: cannot start: {reason.getErrorMessage()}"
        stderr = _stderr()
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
        End the exchanges under way with an error, stop the lease queue and the config
        watcher, close the capture's file, and stop listening (removing the sockets); the
        telemetry sends its last spans (those of the exchanges just ended too), waiting at
        most C{stop_wait_ms}.
        """
        super().stopService()
        if self.gateway is not None:
            self.gateway.stop()
        if self.queue is not None:
            self.queue.stop()
        if self._watcher is not None:
            self._watcher.stop()
        if self.capture is not None:
            self.capture.close()
            self.capture = None
        stopping: list[Deferred[Any]] = []
        if self.telemetry is not None:
            stopping.append(self.telemetry.stop())
            self.telemetry = None
        for port in (self._port, self._tcp_port, self._queue_port):
            if port is not None:
                stopped: Any = port.stopListening()
                if isinstance(stopped, Deferred):
                    stopping.append(stopped)
        self._port = self._tcp_port = self._queue_port = None
        if not stopping:
            return None
        return gatherResults(stopping).addCallback(lambda _: None)


def _say_problems(problems: tuple[str, ...]) -> None:
    """Print each problem of the queue config on stderr."""
    if problems:
        stderr = _stderr()
        stderr.write("".join(line + "\n" for line in problems))
        stderr.flush()


def _stderr() -> Any:
    """
    The process's real stderr: twist sends C{sys.stderr} to the log (stdout), and a
    reason to stop belongs on stderr.
    """
    stderr = sys.stderr
    if isinstance(stderr, LoggingFile) and sys.__stderr__ is not None:
        return sys.__stderr__
    return stderr
