# -*- test-case-name: test.test_cli_e2e -*-
"""
C{loopd demo}: the whole main path on any machine, step by step.

In a fresh temporary directory, L{DemoStack} builds the tiny deterministic model, starts a
real llama.cpp server on a free loopback port, a C{twist inferproxy} in front of it, writes
a loopd.toml whose C{[endpoint.expect]} holds what the server's C{/props} says, starts
C{twist loopd} with it and shows the self-test lines loopd logged; L{run_demo} then streams
one chat through loopd.sock and keeps everything running until Ctrl-C (or stops at once
with C{--once}). loopd listens both ways: on loopd.sock (no token) and on a free loopback
TCP port, whose token the demo keeps in its directory and prints with lines to copy for
curl and the SDKs. The inferproxy's and loopd's logs are files in the directory, named as
they start. Every child is stopped on exit or error, and the directory is removed; each
dies with the demo even when the demo is killed with SIGKILL (L{loopd.demo.orphan_guard}).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Generator, Mapping
from typing import Any, Final, TypeVar

from twisted.internet.defer import Deferred, DeferredList, inlineCallbacks, maybeDeferred, succeed
from twisted.python.failure import Failure

from loopd import http
from loopd.access_token import load_or_create_token
from loopd.chatloop import stream_turn
from loopd.chatui import Conversation, TurnView
from loopd.config import load_config
from loopd.demo.children import Child, ChildFailed, spawn_twist, stop_child
from loopd.demo.llama_binary import ensure_llama_server
from loopd.demo.real_server import RealServer
from loopd.demo.router_server import RouterServer, write_models_dir
from loopd.digest import sha256_hex
from loopd.reactor import ILoopdReactor
from loopd.selftest import require_selftests

__all__ = [
    "DemoStack",
    "render_config",
    "render_router_config",
    "run_demo",
    "selftest_lines_from_log",
    "serving_text",
    "tcp_url_from_log",
]

T = TypeVar("T")
Write = Callable[[str], None]

STEPS = 6
#: The endpoint's name in the generated config: the model sessions ask for.
MODEL = "tiny"
QUESTION = "Hello! Who are you?"
#: The demo server's context: two slots of 131,072 tokens, room for a coding agent's prompt
#: (Claude Code's is ~72,000 tokens of the tiny model's small vocabulary).
CONTEXT = 2 * 131_072
SLOTS = 2
#: The inferproxy's limits, as the README gives them for an agent box: an agent's tool loop
#: never waits for a connection, a client that loops on errors is held to 20 a second.
PROXY_LIMITS: Final = {"burst": 100, "refill": 20, "max_connections": 32}
INTERRUPTED = 130
_SELFTEST_LINE = re.compile(r"selftest (\S+): ((?:PASS|FAIL) .*)$")
_TCP_LINE = re.compile(r"TCP listener on (http://\S+):")


def render_config(
    *,
    endpoint_socket: str,
    listen_socket: str,
    props: Mapping[str, Any],
    name: str = MODEL,
    tcp: str | None = None,
    token_file: str | None = None,
) -> str:
    """
    The demo's loopd.toml: one endpoint behind C{endpoint_socket} that expects what
    C{props} (the server's C{/props}) says, and the gateway on C{listen_socket}, and on
    C{tcp} (C{HOST:PORT}) with its token in C{token_file} when given.
    """
    lines = [
        "# Written by `loopd demo`: one tiny llama.cpp server behind an inferproxy.",
        *_gateway_lines(listen_socket, tcp, token_file),
        "",
        "[[endpoint]]",
        f"name = {json.dumps(name)}",
        f"socket = {json.dumps(endpoint_socket)}",
        *_proxy_lines(),
        "",
        "[endpoint.expect]",
    ]
    template = props.get("chat_template")
    if isinstance(template, str):
        lines.append(f'chat_template_sha256 = "{sha256_hex(template.encode("utf-8"))}"')
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    if isinstance(n_ctx, int):
        lines.append(f"n_ctx = {n_ctx}")
    slots = props.get("total_slots")
    if isinstance(slots, int):
        lines.append(f"total_slots = {slots}")
    return "\n".join(lines) + "\n"


def render_router_config(
    *,
    endpoint_socket: str,
    listen_socket: str,
    slot_dir: str,
    tcp: str | None = None,
    token_file: str | None = None,
) -> str:
    """
    The loopd.toml of C{loopd demo --models N}: one C{llama-server-router} endpoint behind
    C{endpoint_socket} whose models loopd serves under their ids, one loaded at a time, its
    slots saved to C{slot_dir} across swaps; the gateway as L{render_config}'s.
    """
    lines = [
        "# Written by `loopd demo --models N`: one llama-server in router mode, several tiny",
        "# models, at most one loaded at a time, behind an inferproxy.",
        *_gateway_lines(listen_socket, tcp, token_file),
        "",
        "[[endpoint]]",
        'name = "router"',
        'kind = "llama-server-router"',
        f"socket = {json.dumps(endpoint_socket)}",
        "models_max = 1",
        "swap_wait_ms = 5000",
        "slot_save = true",
        f"slot_dir = {json.dumps(slot_dir)}",
        *_proxy_lines(),
    ]
    return "\n".join(lines) + "\n"


def _gateway_lines(listen_socket: str, tcp: str | None, token_file: str | None) -> list[str]:
    """The demo config's C{[server]} table: loopd.sock, and the TCP listener when given."""
    lines = [
        "[server]",
        f"listen = {json.dumps('unix:' + listen_socket.replace(':', chr(92) + ':'))}",
    ]
    if tcp is not None:
        lines.append(f"tcp = {json.dumps(tcp)}")
    if token_file is not None:
        lines.append(f"token_file = {json.dumps(token_file)}")
    return lines


def _proxy_lines() -> list[str]:
    """The endpoint's pacing under the demo inferproxy's limits (L{PROXY_LIMITS})."""
    return [
        f"proxy_burst = {PROXY_LIMITS['burst']}",
        f"proxy_refill_per_second = {float(PROXY_LIMITS['refill'])}",
        f"proxy_max_connections = {PROXY_LIMITS['max_connections']}",
    ]


def tcp_url_from_log(lines: list[str]) -> str | None:
    """The TCP listener's URL in C{twist loopd}'s log (C{http://127.0.0.1:PORT}), or None."""
    for line in lines:
        match = _TCP_LINE.search(line)
        if match:
            return match.group(1)
    return None


def selftest_lines_from_log(lines: list[str]) -> list[str]:
    """The self-test result lines in C{twist loopd}'s log, as C{endpoint: PASS ...}."""
    found = []
    for line in lines:
        match = _SELFTEST_LINE.search(line)
        if match:
            found.append(f"{match.group(1)}: {match.group(2)}")
    return found


def _short_tempdir() -> str:
    """A new 0700 directory with a short path (a Unix socket path is at most ~100 bytes)."""
    base = "/tmp" if os.path.isdir("/tmp") else None
    return tempfile.mkdtemp(prefix="loopd-demo-", dir=base)


class DemoStack:
    """
    The demo's processes and files: the model, the server, the inferproxy, loopd.

    @ivar directory: the temporary directory holding the model, sockets and config.
    @ivar loopd_socket: the socket loopd serves on, once started.
    @ivar tcp_url: loopd's TCP listener (C{http://127.0.0.1:PORT}), once started.
    @ivar token: the TCP listener's token, once loopd started.
    @ivar token_path: the file loopd keeps that token in.
    @ivar loopd_log: loopd's log file; C{proxy_log}: the inferproxy's.
    @ivar config_path: the generated loopd.toml.
    @ivar selftest_lines: the self-test lines, once loopd is up.
    """

    def __init__(
        self,
        reactor: ILoopdReactor,
        write: Write,
        *,
        port: int = 0,
        start_timeout: float = 60.0,
        stop_grace: float = 10.0,
        models: int = 0,
    ) -> None:
        """
        @param reactor: provides IReactorProcess, IReactorTime and IReactorUNIX.
        @param write: where the steps are told.
        @param port: the llama.cpp server's port (0: any free one).
        @param models: 0: one tiny model on the C{xllamacpp} server; N: N tiny models on
            the genuine C{llama-server} in router mode, one loaded at a time (the binary
            built into its cache first when missing, L{ensure_llama_server}).
        """
        self._reactor = reactor
        self._write = write
        self._port = port
        self._start_timeout = start_timeout
        self._stop_grace = stop_grace
        self.directory = _short_tempdir()
        self.model_path = os.path.join(self.directory, "tiny.gguf")
        self.models_dir = os.path.join(self.directory, "models")
        self.slot_dir = os.path.join(self.directory, "slots")
        #: The models sessions ask for: C{tiny}, or C{tiny1} ... C{tinyN} of the router.
        self.model_names = [f"tiny{n}" for n in range(1, models + 1)] if models else [MODEL]
        self._binary: str | None = None
        self.infer_socket = os.path.join(self.directory, "infer.sock")
        self.loopd_socket = os.path.join(self.directory, "loopd.sock")
        self.config_path = os.path.join(self.directory, "loopd.toml")
        self.token_path = os.path.join(self.directory, "token")
        self.loopd_log = os.path.join(self.directory, "loopd.log")
        self.proxy_log = os.path.join(self.directory, "inferproxy.log")
        self.tcp_url: str | None = None
        self.token: str | None = None
        self.server: RealServer | RouterServer | None = None
        self.proxy: Child | None = None
        self.loopd: Child | None = None
        self.selftest_lines: list[str] = []
        self.stopping = False
        self._stopped: Deferred[None] | None = None

    def _step(self, number: int, title: str, action: Callable[[], Deferred[T]]) -> Deferred[T]:
        """Tell step C{number}, run C{action}, then say done (with the time) or failed."""
        self._write(f"{number}/{STEPS} {title} ... ")
        started = self._reactor.seconds()

        def done(result: T) -> T:
            """Say done, with the step's time; the result passes on."""
            self._write(f"done ({self._reactor.seconds() - started:.1f} s)\n")
            return result

        def failed(reason: Failure) -> Failure:
            """Say failed, unless a stop is under way; the failure passes on."""
            if not self.stopping:  # else the stop is what is being told
                self._write("failed\n")
            return reason

        return maybeDeferred(action).addCallbacks(done, failed)

    @inlineCallbacks
    def start(self) -> Generator[Deferred[Any], Any, None]:
        """Steps 1 to 5: everything up to a gateway that passed its self-test."""
        if self.routed:
            what = f"building {len(self.model_names)} tiny models and finding llama-server"
            yield self._step(1, what, self._build_models)
            title = "starting llama-server in router mode (--models-max 1)"
        else:
            what = f"building the tiny model in {self.directory}"
            yield self._step(1, what, self._build_model)
            title = "starting a llama.cpp server"
        port = yield self._step(2, title, self._start_server)
        self._write(f"      listening on 127.0.0.1:{port}\n")
        yield self._step(3, "starting twist inferproxy", self._start_proxy)
        self._write(f"      {self.infer_socket} -> 127.0.0.1:{port}, log {self.proxy_log}\n")
        yield self._step(4, "starting twist loopd (self-test first)", self._start_loopd)
        self._write(f"      serving {self.loopd_socket} and {self.tcp_url}\n")
        self._write(f"      config {self.config_path}, log {self.loopd_log}\n")
        lines = yield self._step(5, "self-test results", self._selftest)
        for line in lines:
            self._write(f"      {line}\n")

    def _build_model(self) -> Deferred[None]:
        """
        Step 1: write the tiny model into the directory.

        @raise RuntimeError: the demo's extra (the C{xllamacpp} wheel, C{gguf}) is not installed.
        """
        if importlib.util.find_spec("xllamacpp") is None:
            raise RuntimeError("the xllamacpp wheel is missing: pip install 'loopd[demo]'")
        try:
            from loopd.demo.tiny_model import write_tiny_model
        except ImportError as e:
            raise RuntimeError(f"{e}: pip install 'loopd[demo]'") from None
        write_tiny_model(self.model_path)
        return succeed(None)

    @property
    def routed(self) -> bool:
        """Whether the demo runs a router with several models."""
        return self.model_names != [MODEL]

    def _build_models(self) -> Deferred[None]:
        """
        Step 1 of the router demo: the genuine llama-server (from its cache; built there
        the first time, minutes, its progress told) and a models dir of tiny models.

        @raise RuntimeError: the demo's extra (C{gguf}) is not installed.
        """
        try:
            from loopd.demo.tiny_model import write_tiny_model  # noqa: F401 - gguf present
        except ImportError as e:
            raise RuntimeError(f"{e}: pip install 'loopd[demo]'") from None
        self._write("\n")
        self._binary = ensure_llama_server(lambda line: self._write(f"      {line}\n"))
        self._write(f"      {self._binary}\n")
        write_models_dir(self.models_dir, self.model_names)
        os.mkdir(self.slot_dir, 0o700)
        return succeed(None)

    def _start_server(self) -> Deferred[int]:
        """Step 2: start the llama.cpp server; fires with its port."""
        if self.routed:
            assert self._binary is not None
            router = RouterServer(
                self._reactor,
                self._binary,
                self.models_dir,
                models_max=1,
                port=self._port,
                n_ctx=CONTEXT,
                parallel=SLOTS,
                slot_save_path=self.slot_dir,
                start_timeout=self._start_timeout,
            )
            self.server = router
            return router.start()
        self.server = RealServer(
            self._reactor,
            self.model_path,
            port=self._port,
            n_ctx=CONTEXT,
            parallel=SLOTS,
            start_timeout=self._start_timeout,
        )
        return self.server.start()

    def _start_proxy(self) -> Deferred[None]:
        """
        Step 3: start C{twist inferproxy} from the infer socket to the server's port; fires
        when it logs that it listens.
        """
        assert self.server is not None
        upstream = f"127.0.0.1:{self.server.port}"
        args = ["inferproxy", "--listen", self.infer_socket, "--upstream", upstream]
        args += ["--burst", str(PROXY_LIMITS["burst"]), "--refill", str(PROXY_LIMITS["refill"])]
        args += ["--max-connections", str(PROXY_LIMITS["max_connections"])]
        self.proxy = self._spawn(
            "twist inferproxy", "inferproxy listening on", args, self.proxy_log
        )
        return self.proxy.ready

    @inlineCallbacks
    def _start_loopd(self) -> Generator[Deferred[Any], Any, None]:
        """
        Step 4: ask the server's C{/props} through the inferproxy, write a loopd.toml that
        expects what it says, and start C{twist loopd} with it; fires when loopd logs that it
        serves, that is, after its self-test passed.

        @raise RuntimeError: C{/props} answered another status than 200.
        """
        if self.routed:
            config = render_router_config(
                endpoint_socket=self.infer_socket,
                listen_socket=self.loopd_socket,
                slot_dir=self.slot_dir,
                tcp="127.0.0.1:0",
                token_file=self.token_path,
            )
        else:
            response = yield http.request(self._reactor, self.infer_socket, "GET", "/props")
            raw = yield response.read_body()
            if response.status != 200:
                raise RuntimeError(f"/props answered HTTP {response.status}: {raw[:200]!r}")
            config = render_config(
                endpoint_socket=self.infer_socket,
                listen_socket=self.loopd_socket,
                props=json.loads(raw),
                tcp="127.0.0.1:0",
                token_file=self.token_path,
            )
        with open(self.config_path, "w", encoding="utf-8") as f:
            f.write(config)
        args = ["loopd", "--config", self.config_path]
        self.loopd = self._spawn("twist loopd", "loopd serving", args, self.loopd_log)
        yield self.loopd.ready
        self.tcp_url = tcp_url_from_log(self.loopd.lines)
        self.token, _ = load_or_create_token(self.token_path)

    def _selftest(self) -> Deferred[list[str]]:
        """
        Step 5: the self-test lines that loopd logged, or, when its log shows none, those of
        a self-test run from here against the same config.
        """
        assert self.loopd is not None
        logged = selftest_lines_from_log(self.loopd.lines)
        if logged:
            self.selftest_lines = logged
            return succeed(logged)
        # This loopd did not log its self-test: run it again from here.
        config = load_config(self.config_path)

        def lines(reports: list[Any]) -> list[str]:
            """Keep the reports' lines, each naming its endpoint, as C{selftest_lines}."""
            self.selftest_lines = [f"{r.endpoint}: {line}" for r in reports for line in r.lines()]
            return self.selftest_lines

        return require_selftests(self._reactor, config, {}).addCallback(lines)

    def _spawn(self, name: str, marker: str, args: list[str], log_path: str) -> Child:
        """
        Start one C{twist} child in the directory, ready at the first log line holding
        C{marker}, its output copied to C{log_path}.
        """
        return spawn_twist(
            self._reactor,
            name,
            marker,
            args,
            start_timeout=self._start_timeout,
            cwd=self.directory,
            log_path=log_path,
        )

    @inlineCallbacks
    def chat(self, question: str, *, tty: bool = False) -> Generator[Deferred[Any], Any, TurnView]:
        """
        Step 6: ask C{question} through loopd.sock, the answer streamed as it comes; with
        a router, of each model in turn (each one a swap), then show which model the
        router has loaded as loopd lists them.
        """
        if not self.routed:
            only: TurnView = yield self._chat(
                MODEL, question, tty, "one streamed chat through loopd.sock"
            )
            return only
        title = "one streamed chat per model through loopd.sock (each one a swap)"
        view: TurnView | None = None
        for model in self.model_names:
            view = yield self._chat(model, question, tty, f"{title}: {model}")
            assert view is not None
            if not view.succeeded:
                return view
        response = yield http.request(self._reactor, self.loopd_socket, "GET", "/v1/models")
        listed = json.loads((yield response.read_body()))
        status = {m["id"]: m.get("status") for m in listed["data"] if m.get("router")}
        shown = ", ".join(f"{model} {state}" for model, state in status.items())
        self._write(f"      loopd's /v1/models: {shown}\n")
        assert view is not None
        return view

    def _chat(self, model: str, question: str, tty: bool, title: str) -> Deferred[TurnView]:
        """One streamed chat of C{question} with C{model}, told as step 6."""
        self._write(f"6/{STEPS} {title}\n")
        self._write(f"you> {question}\n")
        body = Conversation(model=model).ask(question)
        started = self._reactor.seconds()
        turn = stream_turn(
            self._reactor,
            self.loopd_socket,
            body,
            TurnView(tty=tty),
            self._write,
            session_id="loopd-demo",
        )

        def told(view: TurnView) -> TurnView:
            """Say the step is done, with its time, when the answer came whole."""
            if view.succeeded:
                elapsed = self._reactor.seconds() - started
                self._write(f"6/{STEPS} done ({elapsed:.1f} s)\n")
            return view

        return turn.addCallback(told)

    def child_ended(self) -> Deferred[str]:
        """Fires with a message when inferproxy or loopd ends while not being stopped."""
        children = [c for c in (self.proxy, self.loopd) if c is not None]
        first = DeferredList([c.ended for c in children], fireOnOneCallback=True)

        def told(result: tuple[int, int]) -> str:
            """The message for the child that ended first."""
            index = result[1]
            child = children[index]
            return f"{child.name} ended unexpectedly (status {child.status})"

        return first.addCallback(told)

    def stop(self) -> Deferred[None]:
        """
        Stop loopd, the inferproxy and the server (SIGTERM, then SIGKILL after a grace) and
        remove the directory. Calling it again waits for the same stop.
        """
        self.stopping = True
        if self._stopped is None:
            self._stopped = self._stop()
        waiter: Deferred[None] = Deferred()

        def release(result: object) -> object:
            """
            Fire this caller's waiter, however the stop ended; the outcome passes on to the next
            caller's.
            """
            waiter.callback(None)
            return result

        self._stopped.addBoth(release)
        return waiter

    @inlineCallbacks
    def _stop(self) -> Generator[Deferred[Any], Any, None]:
        """
        Stop loopd, then the inferproxy (each SIGTERM, SIGKILL after the grace), then the
        server, and remove the directory even if a stop failed.
        """
        try:
            for child in (self.loopd, self.proxy):
                if child is not None:
                    yield stop_child(self._reactor, child, self._stop_grace)
            if self.server is not None:
                yield self.server.stop()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


def _reason(failure: Failure) -> str:
    """What went wrong, for one line (a child's output tail may follow)."""
    if failure.check(ChildFailed):
        return str(failure.value)
    error: Any = failure.value
    message = failure.getErrorMessage()
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


@inlineCallbacks
def run_demo(
    reactor: ILoopdReactor,
    write: Write,
    *,
    once: bool = False,
    port: int = 0,
    tty: bool = False,
    models: int = 0,
) -> Generator[Deferred[Any], Any, int]:
    """
    Run the demo: start the stack, one streamed chat, then serve until Ctrl-C (or stop at
    once with C{once}). Everything is stopped and removed whatever happens. With
    C{models}, a router serves that many tiny models (L{DemoStack}).

    @return: fires with 0 on success (Ctrl-C included once serving), 1 when a step failed,
        130 when Ctrl-C came before the stack was up.
    """
    stack = DemoStack(reactor, write, port=port, models=models)
    serving: Deferred[int] = Deferred()
    interrupted = []

    def on_shutdown() -> Deferred[None]:
        """
        The reactor is shutting down (Ctrl-C): end the serving wait with 0, and stop the stack
        before the reactor goes (the shutdown waits for the returned Deferred).
        """
        interrupted.append(True)
        if not serving.called:
            serving.callback(0)
        write("\nstopping ... ")
        return stack.stop().addCallback(lambda _: write("done\n"))

    trigger = reactor.addSystemEventTrigger("before", "shutdown", on_shutdown)
    status = 0
    try:
        yield stack.start()
        view = yield stack.chat(QUESTION, tty=tty)
        if not view.succeeded:
            raise RuntimeError(f"the chat failed: {view.error}")
        if not once:
            write(serving_text(stack))
            stack.child_ended().addCallback(lambda message: _give_up(serving, write, message))
            status = yield serving
    except Exception:
        failure = Failure()
        if interrupted:
            status = INTERRUPTED
        else:
            write(f"loopd demo: {_reason(failure)}\n")
            status = 1
    if not interrupted:
        reactor.removeSystemEventTrigger(trigger)
        write("stopping ... ")
        yield stack.stop()
        write("done\n")
    return status


def _give_up(serving: Deferred[int], write: Write, message: str) -> None:
    """A child died while serving: say so and end with status 1."""
    if not serving.called:
        write(f"loopd demo: {message}\n")
        serving.callback(1)


def serving_text(stack: DemoStack) -> str:
    """
    What to tell while serving: both listeners, the token, commands and SDK settings to try
    them with (the status in the terminal and the status page too), and where the logs are.
    """
    socket, url, token = stack.loopd_socket, stack.tcp_url, stack.token
    names = ", ".join(repr(name) for name in stack.model_names)
    lines = [
        f"loopd is serving {'models' if stack.routed else 'model'} {names}",
        f"  on the Unix socket {socket} (no token)",
        f"  on {url} (every request needs the token {token})",
        "From another terminal, try:",
        f"  loopd chat --socket {socket}",
        f"  curl --unix-socket {socket} http://loopd/v1/models",
        f'  curl -H "Authorization: Bearer {token}" {url}/v1/models',
        f"  loopd status --watch --socket {socket}",
        f"  loopd ui --open --socket {socket}    (the status page, in this machine's browser)",
        f"An SDK or agent over TCP (model {stack.model_names[0]}):",
        f"  export OPENAI_BASE_URL={url}/v1 OPENAI_API_KEY={token}",
        f"  export ANTHROPIC_BASE_URL={url} ANTHROPIC_API_KEY={token}",
        f"Logs: loopd {stack.loopd_log}, inferproxy {stack.proxy_log} (removed on stop).",
        "Press Ctrl-C to stop.",
    ]
    return "\n".join(lines) + "\n"
