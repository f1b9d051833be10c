# -*- test-case-name: loopd.test.test_cli -*-
"""
The C{loopd} command: C{loopd selftest}, C{loopd chat}, C{loopd status},
C{loopd queue status}, C{loopd replay}, C{loopd token}, C{loopd ui} and C{loopd demo}.

C{main} parses the arguments and runs one command on the global reactor, which this module
(and C{twisted/plugins}) alone imports, inside L{run_on_reactor}. Each command is a function
of an injected reactor that fires with the exit status, so tests drive it on a memory
reactor. This module is the top: it imports the commands, nothing in the package imports
it. The chat itself is L{loopd.chatloop} (its pure rendering L{loopd.chatui}), the queue
status L{loopd.queue.show}, the replay L{loopd.replay}, the demo's orchestration
L{loopd.demo.run}; C{loopd status} asks loopd here and prints with L{loopd.status_show}.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.error import ReactorNotRunning
from twisted.python.failure import Failure

from loopd.access_token import TokenError, load_or_create_token, token_path
from loopd.chatloop import restore_blocking, terminal_chat
from loopd.chatui import Conversation
from loopd.config import ConfigError, load_config
from loopd.llama import Client
from loopd.llama.discovery import Discovered, discover_routers
from loopd.reactor import ILoopdReactor, IUnixReactor, global_reactor
from loopd.replay import ReplayError, read_capture, replay_session, request_bodies
from loopd.selftest import SelftestFailed, SelftestReport, require_selftests
from loopd.service import default_socket_path, listen_path, queue_socket_path
from loopd.settings import Config, Server
from loopd.status_command import INTERRUPTED, STATUS_INTERVAL, status_command
from loopd.tap.loopd import default_config_path
from loopd.ui_command import open_in_browser, ui_command
from loopd.unixsocket import UnixSocketError, check_peer_socket

__all__ = [
    "build_parser",
    "chat_socket_path",
    "main",
    "own_gateway",
    "queue_socket",
    "replay_command",
    "run_on_reactor",
    "selftest_command",
    "token_command",
]

#: A command: given the reactor, fires with the exit status.
Command = Callable[[ILoopdReactor], "Deferred[int]"]
#: Runs a command to its end and returns its exit status.
Runner = Callable[[Command], int]
Write = Callable[[str], None]

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
    status = commands.add_parser(
        "status",
        help="print what a running loopd is doing: endpoints and slots, sessions, lease "
        "queues, requests under way and the last ones",
    )
    status.add_argument(
        "--socket",
        metavar="PATH",
        help="loopd's socket (default: the default config's [server] listen, "
        f"else {default_socket_path()})",
    )
    status.add_argument(
        "--watch",
        action="store_true",
        help=f"print it again every {STATUS_INTERVAL:g} s until Ctrl-C",
    )
    status.add_argument(
        "--json", action="store_true", help="print the status document (JSON) as loopd sends it"
    )
    replay = commands.add_parser(
        "replay",
        help="send a captured session's requests to loopd again, in order, and print what "
        "each did (a capture made with [capture] prompts = true)",
    )
    replay.add_argument("file", metavar="FILE", help="a capture file, or the capture directory")
    replay.add_argument("--session", metavar="ID", required=True, help="the session to replay")
    replay.add_argument(
        "--socket",
        metavar="PATH",
        help="loopd's socket (default: the default config's [server] listen, "
        f"else {default_socket_path()})",
    )
    replay.add_argument(
        "--model", metavar="NAME", help="send every request to this model instead of its own"
    )
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
    token = commands.add_parser(
        "token",
        help="print the token of loopd's TCP listener ([server] tcp), made if there is none",
    )
    token.add_argument(
        "--config", metavar="F", help=f"the loopd.toml (default: {default_config_path()})"
    )
    ui = commands.add_parser(
        "ui",
        help="print a one-time login link to the status page on loopd's TCP listener",
    )
    ui_where = ui.add_mutually_exclusive_group()
    ui_where.add_argument(
        "--config",
        metavar="F",
        help="the loopd.toml whose [server] listen socket to ask "
        f"(default: {default_config_path()})",
    )
    ui_where.add_argument(
        "--socket",
        metavar="PATH",
        help="loopd's Unix socket (default: the config's [server] listen, "
        f"else {default_socket_path()})",
    )
    ui.add_argument("--open", action="store_true", help="open the link in a browser too")
    demo = commands.add_parser(
        "demo", help="run a real llama.cpp server with a tiny model, an inferproxy and loopd"
    )
    demo.add_argument("--once", action="store_true", help="stop everything after the chat")
    demo.add_argument(
        "--port", metavar="N", type=int, default=0, help="the llama.cpp server's port (0: any)"
    )
    demo.add_argument(
        "--models",
        metavar="N",
        type=_demo_models,
        default=0,
        help="serve N tiny models (2 to 9) from one llama-server in router mode, one loaded "
        "at a time; the genuine llama-server is built into a cache the first time (minutes)",
    )
    return parser


def _demo_models(value: str) -> int:
    """C{--models}: a whole number from 2 to 9."""
    if not value.isdigit() or not 2 <= int(value) <= 9:
        raise argparse.ArgumentTypeError(f"expected a number of models from 2 to 9, got {value!r}")
    return int(value)


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
        return runner(lambda reactor: selftest_command(reactor, config, out, err))
    if args.command == "chat":
        try:
            socket_path = chat_socket_path(args.socket)
        except (ConfigError, ValueError) as e:
            err(f"loopd chat: {e}\n")
            return USAGE_ERROR
        try:
            check_peer_socket(socket_path)
        except UnixSocketError as e:
            err(f"loopd chat: not connecting: {e}\n")
            return 1
        conversation = Conversation(model=args.model, thinking=not args.no_think)
        return runner(lambda reactor: terminal_chat(reactor, socket_path, conversation))
    if args.command == "status":
        try:
            socket_path = chat_socket_path(args.socket)
        except (ConfigError, ValueError) as e:
            err(f"loopd status: {e}\n")
            return USAGE_ERROR
        clear = sys.stdout.isatty()
        return runner(
            lambda reactor: status_command(
                reactor, socket_path, out, err, watch=args.watch, as_json=args.json, clear=clear
            )
        )
    if args.command == "replay":
        return replay_command(args, runner, out, err)
    if args.command == "token":
        return token_command(args.config, out, err)
    if args.command == "ui":
        try:
            if args.config:
                ui_socket = listen_path(load_config(args.config))
            else:
                ui_socket = chat_socket_path(args.socket)
        except (ConfigError, ValueError) as e:
            err(f"loopd ui: {e}\n")
            return USAGE_ERROR
        browser = open_in_browser if args.open else None
        return runner(
            lambda reactor: ui_command(reactor, ui_socket, out, err, open_browser=browser)
        )
    if args.command == "queue":
        from loopd.queue.show import queue_status_command

        path = queue_socket(args.socket, args.agent_dir)
        gateway = own_gateway(path)
        # Named if --socket turns out to be an HTTP socket (the gateway's, say).
        lease = queue_socket(None, None) if args.socket else None
        return runner(lambda reactor: queue_status_command(reactor, path, out, err, gateway, lease))
    from loopd.demo.run import run_demo

    tty = sys.stdout.isatty()
    return runner(
        lambda reactor: run_demo(
            reactor, out, once=args.once, port=args.port, tty=tty, models=args.models
        )
    )


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


def own_gateway(lease_socket: str, config_path: str | None = None) -> str | None:
    """
    loopd's gateway socket when C{lease_socket} is the lease socket of loopd's default
    config (C{config_path}) and that gateway socket exists, so C{loopd queue status} can
    show each endpoint's health state too; else C{None} (an C{llmqueue} daemon's socket).
    """
    path = config_path or default_config_path()
    try:
        config = load_config(path) if os.path.exists(path) else None
    except (ConfigError, OSError):
        return None
    if queue_socket_path(config) != lease_socket:
        return None
    gateway = listen_path(config) if config is not None else default_socket_path()
    return gateway if gateway is not None and os.path.exists(gateway) else None


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
    return listen_path(load_config(path))


def token_command(config_path: str | None, write: Write, err: Write) -> int:
    """
    C{loopd token}: write the TCP listener's token (and nothing else) to C{write}, making
    the token file first if there is none, so C{ANTHROPIC_API_KEY=$(loopd token)} works
    before loopd's first start. The file is C{[server] token_file} of the config
    (C{config_path}, else the default config when it exists), else the default one.

    @return: 0; L{USAGE_ERROR} for an invalid config; 1 when the token file is unusable.
    """
    path = config_path or default_config_path()
    server = Server()
    if config_path is not None or os.path.exists(path):
        try:
            server = load_config(path).server
        except ConfigError as e:
            err(f"loopd token: invalid configuration:\n{e}\n")
            return USAGE_ERROR
    try:
        token, _ = load_or_create_token(token_path(server))
    except TokenError as e:
        err(f"loopd token: {e}\n")
        return 1
    write(token + "\n")
    if server.tcp is None:
        err(f"loopd token: note: {path} has no [server] tcp, so no listener asks for it yet\n")
    return 0


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
    reactor = global_reactor()
    outcome: list[int] = []

    def finished(result: int | Failure) -> None:
        """
        The command ended: keep its status (1, reported on stderr, for a failure) and stop the
        reactor, unless it has stopped already.
        """
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
    restore_blocking()
    return outcome[0] if outcome else INTERRUPTED


def replay_command(args: argparse.Namespace, runner: Runner, write: Write, err: Write) -> int:
    """
    C{loopd replay FILE --session ID}: read the session's requests from the capture, then
    send them to loopd (L{loopd.replay}) under a new session id.

    @return: the exit status: L{USAGE_ERROR} (after one line on C{err}) for a capture that
        cannot be replayed or a bad config; else what the replay fires with.
    """
    try:
        socket_path = chat_socket_path(args.socket)
        requests, skipped = read_capture(os.path.expanduser(args.file), args.session)
        bodies = request_bodies(requests, args.model)
    except (ConfigError, ValueError, ReplayError) as e:
        err(f"loopd replay: {e}\n")
        return USAGE_ERROR
    if skipped:
        err(f"loopd replay: passed over {skipped} lines that are not capture lines\n")
    session_id = f"replay-{uuid.uuid4().hex[:12]}"
    return runner(
        lambda reactor: replay_session(
            reactor,
            socket_path,
            requests,
            bodies,
            write,
            err,
            session_id=session_id,
            captured_as=args.session,
        )
    )


# -- selftest ------------------------------------------------------------------------------


def selftest_command(
    reactor: IUnixReactor, config: Config, write: Write, progress: Write | None = None
) -> Deferred[int]:
    """
    Run the self-test of every C{llama-server} endpoint with C{selftest = true}; write one
    line per check.

    @param progress: gets the self-test's progress lines (what it waits for, as it waits),
        each ending in a newline; C{loopd selftest} passes stderr. Not given: C{write}.

    @return: fires with 0 when every check passed, 1 otherwise.
    """
    if not any(e.selftest and e.kind != "openai" for e in config.endpoints):
        write("no endpoint has selftest = true: nothing to check\n")
        return succeed(0)

    def show(reports: Sequence[SelftestReport], status: int) -> int:
        """Write every report's lines, each naming its endpoint; C{status} passes on."""
        for report in reports:
            for line in report.lines():
                write(f"{report.endpoint}: {line}\n")
        return status

    def failed(reason: Failure) -> int:
        """
        A failed self-test still shows every report, with status 1; any other failure is one
        line saying the self-test could not run.
        """
        if reason.check(SelftestFailed):
            error: Any = reason.value
            return show(error.reports, 1)
        write(f"self-test could not run: {reason.getErrorMessage()}\n")
        return 1

    show_progress = progress if progress is not None else write

    def check(found: Discovered) -> Deferred[Any]:
        """The self-test of every endpoint, each router's models among them."""
        return require_selftests(
            reactor, found.config, found.clients, lambda line: show_progress(f"{line}\n")
        )

    clients = {e.name: Client(reactor, config, e) for e in config.endpoints}
    running = discover_routers(reactor, config, clients).addCallback(check)
    return running.addCallbacks(lambda reports: show(reports, 0), failed)


if __name__ == "__main__":
    sys.exit(main())
