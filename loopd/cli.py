# -*- test-case-name: loopd.test.test_cli -*-
"""
The C{loopd} command: C{loopd selftest}, C{loopd chat} and C{loopd demo}.

C{main} parses the arguments and runs one command on the global reactor, which this module
(and C{twisted/plugins}) alone imports, inside L{run_on_reactor}. Each command is a function
of an injected reactor that fires with the exit status, so tests drive it on a memory
reactor. The chat's pure parts (history, rendering) are in L{loopd.chatui}; the demo's
orchestration is in L{loopd.demo.run}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.error import ReactorNotRunning
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.protocols.basic import LineReceiver
from twisted.python.failure import Failure
from zope.interface import implementer

from loopd import http
from loopd.chatui import QUIT, Conversation, TurnView, http_error_text
from loopd.config import Config, ConfigError, load_config
from loopd.errors import Connect
from loopd.selftest import SelftestFailed, SelftestReport, require_selftests
from loopd.service import default_socket_path, listen_path, queue_socket_path
from loopd.sse import SSEDecoder
from loopd.tap.loopd import default_config_path

__all__ = [
    "ChatSession",
    "build_parser",
    "chat_socket_path",
    "main",
    "run_on_reactor",
    "selftest_command",
    "stream_turn",
]

#: A command: given the reactor, fires with the exit status.
Command = Callable[[Any], "Deferred[int]"]
#: Runs a command to its end and returns its exit status.
Runner = Callable[[Command], int]
Write = Callable[[str], None]

CHAT_PATH = "/v1/chat/completions"
PROMPT = "you> "
#: How much of an error answer (before any stream) is read.
ERROR_BODY_LIMIT = 65536
#: The exit status of a command cut short by Ctrl-C (128 + SIGINT).
INTERRUPTED = 130
#: A config or usage error.
USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    """The C{loopd} argument parser, one subcommand per command."""
    parser = argparse.ArgumentParser(
        prog="loopd", description="Bounded, cache-friendly access to local LLM servers."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    selftest = commands.add_parser(
        "selftest", help="run the startup self-test of every endpoint with selftest = true"
    )
    selftest.add_argument(
        "--config", metavar="F", help=f"the loopd.toml (default: {default_config_path()})"
    )
    chat = commands.add_parser("chat", help="chat with a model through a running loopd")
    chat.add_argument(
        "--socket",
        metavar="PATH",
        help="loopd's socket (default: the default config's [server] listen, "
        f"else {default_socket_path()})",
    )
    chat.add_argument(
        "--model",
        metavar="NAME",
        help="an endpoint's name, auto or mesh (default: auto, the router picks one per turn)",
    )
    chat.add_argument("--no-think", action="store_true", help="ask the model not to think")
    queue = commands.add_parser("queue", help="the lease scheduler")
    queue_commands = queue.add_subparsers(dest="queue_command", metavar="COMMAND", required=True)
    status = queue_commands.add_parser(
        "status", help="print every queue's slots, holders, waiters and switches"
    )
    where = status.add_mutually_exclusive_group()
    where.add_argument(
        "--socket",
        metavar="PATH",
        help="the lease socket (default: loopd's, from the default config, if it exists; "
        "else the llmqueue daemon's in the agent dir)",
    )
    where.add_argument("--agent-dir", metavar="DIR", help="ask the llmqueue daemon of DIR")
    demo = commands.add_parser(
        "demo", help="run a real llama.cpp server with a tiny model, an inferproxy and loopd"
    )
    demo.add_argument("--once", action="store_true", help="stop everything after the chat")
    demo.add_argument(
        "--port", metavar="N", type=int, default=0, help="the llama.cpp server's port (0: any)"
    )
    return parser


def main(argv: Sequence[str] | None = None, *, run: Runner | None = None) -> int:
    """
    Run the C{loopd} command with C{argv} (default: the process's arguments) and return
    its exit status.

    @param run: runs the chosen command; by default L{run_on_reactor} (the global reactor).
    """
    args = build_parser().parse_args(argv)
    runner = run if run is not None else run_on_reactor
    out, err = _writer(sys.stdout), _writer(sys.stderr)
    if args.command == "selftest":
        try:
            config = load_config(args.config or default_config_path())
        except ConfigError as e:
            err(f"loopd selftest: invalid configuration:\n{e}\n")
            return USAGE_ERROR
        return runner(lambda reactor: selftest_command(reactor, config, out))
    if args.command == "chat":
        try:
            socket_path = chat_socket_path(args.socket)
        except (ConfigError, ValueError) as e:
            err(f"loopd chat: {e}\n")
            return USAGE_ERROR
        conversation = Conversation(model=args.model, thinking=not args.no_think)
        return runner(lambda reactor: _terminal_chat(reactor, socket_path, conversation))
    if args.command == "queue":
        from loopd.queue.show import queue_status_command

        path = queue_socket(args.socket, args.agent_dir)
        return runner(lambda reactor: queue_status_command(reactor, path, out, err))
    from loopd.demo.run import run_demo

    tty = sys.stdout.isatty()
    return runner(lambda reactor: run_demo(reactor, out, once=args.once, port=args.port, tty=tty))


def queue_socket(explicit: str | None, agent: str | None) -> str:
    """
    The lease socket C{loopd queue status} asks: C{--socket}; else the llmqueue daemon's
    of C{--agent-dir}; else loopd's own (from the default config) when that socket exists;
    else the llmqueue daemon's in the default agent dir.
    """
    from loopd.queue.paths import agent_dir, socket_path

    if explicit:
        return os.path.expanduser(explicit)
    if agent is None:
        try:
            own = queue_socket_path(load_config(default_config_path()))
        except (ConfigError, OSError):
            own = queue_socket_path(None)
        if os.path.exists(own):
            return own
    return socket_path(agent_dir(agent))


def _writer(stream: Any) -> Write:
    """Write and flush at once: the output is a live display."""

    def write(text: str) -> None:
        if text:
            stream.write(text)
            stream.flush()

    return write


def run_on_reactor(command: Command) -> int:
    """
    Run C{command} on the global reactor until it fires, and return its exit status:
    1 for an unexpected failure (reported on stderr), L{INTERRUPTED} when the reactor
    stopped first (Ctrl-C).
    """
    from twisted.internet import reactor

    outcome: list[int] = []

    def finished(result: int | Failure) -> None:
        if isinstance(result, Failure):
            sys.stderr.write(f"loopd: {result.getErrorMessage()}\n")
            result = 1
        outcome.append(result)
        try:
            reactor.stop()
        except ReactorNotRunning:
            pass

    def start() -> None:
        maybeDeferred(command, reactor).addBoth(finished)

    reactor.callWhenRunning(start)
    reactor.run()
    _restore_blocking()
    return outcome[0] if outcome else INTERRUPTED


# -- selftest ------------------------------------------------------------------------------


def selftest_command(reactor: Any, config: Config, write: Write) -> Deferred[int]:
    """
    Run the self-test of every endpoint with C{selftest = true}; write one line per check.

    @return: fires with 0 when every check passed, 1 otherwise.
    """
    if not any(e.selftest and e.kind == "llama-server" for e in config.endpoints):
        write("no endpoint has selftest = true: nothing to check\n")
        return succeed(0)

    def show(reports: Sequence[SelftestReport], status: int) -> int:
        for report in reports:
            for line in report.lines():
                write(f"{report.endpoint}: {line}\n")
        return status

    def failed(reason: Failure) -> int:
        if reason.check(SelftestFailed):
            error: Any = reason.value
            return show(error.reports, 1)
        write(f"self-test could not run: {reason.getErrorMessage()}\n")
        return 1

    running = require_selftests(reactor, config, {})
    return running.addCallbacks(lambda reports: show(reports, 0), failed)


# -- chat ----------------------------------------------------------------------------------


def chat_socket_path(explicit: str | None, config_path: str | None = None) -> str:
    """
    The socket C{loopd chat} talks to: C{explicit} when given; else the C{[server] listen}
    socket of the default config (C{config_path}) when that file exists; else
    L{default_socket_path}.

    @raise ConfigError: the default config exists but is invalid.
    @raise ValueError: its listener is not a Unix socket.
    """
    if explicit:
        return explicit
    path = config_path or default_config_path()
    if not os.path.exists(path):
        return default_socket_path()
    found = listen_path(load_config(path))
    if found is None:
        raise ValueError(f"{path}: [server] listen is not a Unix socket; pass --socket PATH")
    return found


def stream_turn(
    reactor: Any,
    socket_path: str,
    body: dict[str, Any],
    view: TurnView,
    write: Write,
    *,
    session_id: str,
    connect_timeout: float = 5.0,
) -> Deferred[TurnView]:
    """
    Send one streaming chat request to loopd over C{socket_path} and write C{view}'s text
    for everything that comes back, as it comes.

    @param session_id: the C{X-Session-Id}, so every turn of a chat is one session whose
        slot (and prompt cache) loopd keeps.
    @return: fires with C{view} when the turn is over, failed or not (C{view.error}); the
        output then ends at the start of a line.
    """
    encoded = json.dumps(body).encode()
    headers = {"X-Session-Id": session_id, "Accept": "text/event-stream"}
    sending = http.request(
        reactor,
        socket_path,
        "POST",
        CHAT_PATH,
        encoded,
        headers,
        connect_timeout=connect_timeout,
    )

    def answered(response: http.HttpResponse) -> Deferred[None]:
        if response.status != 200:

            def refused(raw: bytes) -> None:
                write(view.fail(http_error_text(response.status, raw)))

            return response.read_body(ERROR_BODY_LIMIT).addCallback(refused)
        decoder = SSEDecoder()

        def received(data: bytes) -> None:
            for item in decoder.feed(data):
                write(view.item(item))

        def ended(_: None) -> None:
            for item in decoder.finish():
                write(view.item(item))

        return response.deliver(received).addCallback(ended)

    def failed(reason: Failure) -> None:
        if reason.check(Connect):
            write(view.fail(f"cannot connect to loopd: {reason.value}"))
        else:
            error: Any = reason.value
            write(view.fail(f"{type(error).__name__}: {reason.getErrorMessage()}"))

    def closed(_: None) -> TurnView:
        write(view.close())
        return view

    return sending.addCallback(answered).addErrback(failed).addCallback(closed)


class ChatSession:
    """
    The terminal chat: typed lines in, streamed answers out, one turn at a time (lines
    typed during a turn wait for it). C{/quit} or the end of input ends it.

    @ivar finished: fires with the exit status (0) when the chat ends.
    """

    def __init__(
        self,
        reactor: Any,
        socket_path: str,
        conversation: Conversation,
        write: Write,
        *,
        tty: bool = False,
        session_id: str | None = None,
    ) -> None:
        """
        @param write: where the chat's text goes.
        @param tty: the output is a terminal (the thinking is dimmed).
        @param session_id: the session's C{X-Session-Id}; a new random one by default.
        """
        self._reactor = reactor
        self._socket = socket_path
        self.conversation = conversation
        self._write = write
        self._tty = tty
        self._session = session_id or f"chat-{uuid.uuid4().hex[:16]}"
        self._lines: deque[str] = deque()
        self._busy = False
        self._input_over = False
        self.finished: Deferred[int] = Deferred()

    def start(self) -> None:
        """Write the greeting and the first prompt."""
        model = self.conversation.model or "auto"
        self._write(f"loopd chat on {self._socket} with {model}; {QUIT} or Ctrl-D ends it.\n")
        self._write(PROMPT)

    def line(self, text: str) -> None:
        """A line the user typed."""
        if not self.finished.called:
            self._lines.append(text)
            self._next()

    def end_of_input(self) -> None:
        """The input ended: finish once the turn under way (if any) is over."""
        self._input_over = True
        self._next()

    def _next(self) -> None:
        while self._lines and not self._busy and not self.finished.called:
            text = self._lines.popleft().strip()
            if text == QUIT:
                self._finish()
            elif not text:
                self._write(PROMPT)
            else:
                self._ask(text)
        if self._input_over and not self._busy and not self.finished.called:
            self._write("\n")
            self._finish()

    def _ask(self, text: str) -> None:
        self._busy = True
        body = self.conversation.ask(text)
        view = TurnView(tty=self._tty)
        turn = stream_turn(
            self._reactor, self._socket, body, view, self._write, session_id=self._session
        )
        turn.addCallback(self._answered)

    def _answered(self, view: TurnView) -> None:
        if view.succeeded:
            self.conversation.answered(view.content, view.reasoning)
        else:
            self.conversation.retract()
        self._busy = False
        if not self._input_over:
            self._write(PROMPT)
        self._next()

    def _finish(self) -> None:
        self._lines.clear()
        self.finished.callback(0)


@implementer(IHalfCloseableProtocol)
class _TerminalLines(LineReceiver):
    """
    Standard input and output for a L{ChatSession}: typed lines go to it, its text goes
    out through the transport, and the end of input does not cut the answer under way.
    """

    delimiter = b"\n"
    #: A pasted line may be long; a longer one ends the chat (LineReceiver's default).
    MAX_LENGTH = 1 << 20

    def __init__(self, make_session: Callable[[Write], ChatSession]) -> None:
        self._make_session = make_session
        self.session: ChatSession | None = None
        self.closed: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        """Start the session, its text written to standard output."""
        session = self.session = self._make_session(self._out)
        session.finished.addCallback(self._session_over)
        session.start()

    def _out(self, text: str) -> None:
        if text and self.transport is not None:
            self.transport.write(text.encode("utf-8"))

    def lineReceived(self, line: bytes) -> None:
        """Hand a typed line to the session."""
        if self.session is not None:
            self.session.line(line.decode("utf-8", "replace").rstrip("\r"))

    def readConnectionLost(self) -> None:
        """Standard input ended (Ctrl-D, or a pipe that ran dry)."""
        if self.session is not None:
            self.session.end_of_input()

    def writeConnectionLost(self) -> None:
        """Standard output went away: nobody reads the chat any more."""
        if self.transport is not None:
            self.transport.loseConnection()
        self._closed()

    def _session_over(self, status: int) -> int:
        # Closing flushes what is still buffered for standard output first.
        if self.transport is not None:
            self.transport.loseConnection()
        return status

    def connectionLost(self, reason: Failure | None = None) -> None:
        """Standard input and output are both closed."""
        self._closed()

    def _closed(self) -> None:
        if not self.closed.called:
            self.closed.callback(None)


def _terminal_chat(reactor: Any, socket_path: str, conversation: Conversation) -> Deferred[int]:
    """Run a L{ChatSession} on standard input and output; fire with 0 when it is over."""
    from twisted.internet.stdio import StandardIO

    tty = os.isatty(1)
    protocol = _TerminalLines(
        lambda write: ChatSession(reactor, socket_path, conversation, write, tty=tty)
    )
    StandardIO(protocol, reactor=reactor)
    return protocol.closed.addCallback(lambda _: 0)


def _restore_blocking() -> None:
    """
    Standard input and output back to blocking mode, as the shell expects them (the chat's
    C{StandardIO} made them non-blocking, and the terminal is shared with the shell).
    """
    for fd in (0, 1):
        try:
            os.set_blocking(fd, True)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
