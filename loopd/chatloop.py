# -*- test-case-name: loopd.test.test_chatloop -*-
"""
The terminal chat over loopd.sock: one turn streamed (L{stream_turn}), the conversation
session (L{ChatSession}), the check that the socket is a loopd gateway serving the model
asked for (L{check_gateway}), and the terminal line reader that runs a session on standard
input and output (L{terminal_chat}, undone by L{restore_blocking}).

On a terminal the lines are read with the standard library's C{readline} (line editing, and
a history kept in L{history_path}, at most L{HISTORY_LENGTH} lines), in a thread of its own
that reads one line whenever the session asks for one. Piped input is read by Twisted's
standard I/O, and the chat then writes the answers alone (L{TurnView.quiet}): no greeting,
prompt, progress or ANSI code.

This is the I/O half of C{loopd chat}; C{loopd demo} streams its one chat with the same
L{stream_turn}. What a chat keeps and shows (the history, the text of a streamed answer) is
the pure L{loopd.chatui}; which socket to talk to, and the global reactor, are the
command's (L{loopd.cli}), so every call here takes the reactor it runs on.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.interfaces import IHalfCloseableProtocol, IReactorFromThreads
from twisted.internet.stdio import StandardIO
from twisted.protocols.basic import LineReceiver
from twisted.python.failure import Failure
from zope.interface import implementer

from loopd import http, strict_json
from loopd.chatui import QUIT, Conversation, TurnView, http_error_text
from loopd.errors import Connect
from loopd.reactor import IServiceReactor, IUnixReactor
from loopd.sse import SSEDecoder
from loopd.unixsocket import UnixSocketError, check_peer_socket

__all__ = [
    "HISTORY_LENGTH",
    "ChatSession",
    "check_gateway",
    "history_path",
    "restore_blocking",
    "stream_turn",
    "terminal_chat",
]

#: How Twisted's log lines name C{loopd chat}'s terminal (the C{logPrefix} of its protocols and
#: factories), instead of a private class name.
LOG_PREFIX = "loopd.chat"

Write = Callable[[str], None]

CHAT_PATH = "/v1/chat/completions"
PROMPT = "you> "
#: How much of an error answer (before any stream) is read.
ERROR_BODY_LIMIT = 65536
#: The gateway's model list.
MODELS_PATH = "/v1/models"
#: How much of the model list is read.
MODELS_BODY_LIMIT = 1 << 20
#: The lines of history kept between chats.
HISTORY_LENGTH = 1000


def history_path(environ: dict[str, str] | None = None) -> str:
    """
    Where C{loopd chat} keeps its line history: C{$XDG_STATE_HOME/loopd/chat_history}, else
    C{~/.local/state/loopd/chat_history}.
    """
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "loopd", "chat_history")


def check_gateway(
    reactor: IUnixReactor, socket_path: str, model: str | None, *, timeout: float = 5.0
) -> Deferred[str | None]:
    """
    Check, before the first prompt, that C{socket_path} is a loopd gateway and that it serves
    C{model}: ask it C{GET /v1/models}.

    @param model: the model the chat asks for; C{None} for the default (C{auto}).
    @param timeout: seconds the answer may take (on C{reactor}'s clock).
    @return: fires with C{None} when all is well, else with the one line that says what is
        wrong: nothing there (no socket, nobody listening, an unsafe socket), not a loopd
        gateway (it does not answer HTTP, or not with a model list), or an unknown model,
        with the models it serves.
    """
    try:
        check_peer_socket(socket_path)
    except UnixSocketError as e:
        return succeed(f"not connecting to {socket_path}: {e}")
    asking = http.request(reactor, socket_path, "GET", MODELS_PATH, connect_timeout=timeout)
    not_loopd = f"{socket_path} is not a loopd gateway"

    def answered(response: http.HttpResponse) -> Deferred[str | None]:
        """Read the model list and check C{model} against it."""

        def listed(raw: bytes) -> str | None:
            """C{None} when C{raw} is a model list naming C{model}, else what is wrong."""
            try:
                document = strict_json.decode(raw)
            except ValueError:
                document = None
            data = document.get("data") if isinstance(document, dict) else None
            if response.status != 200 or not isinstance(data, list):
                status = response.status
                return f"{not_loopd}: GET {MODELS_PATH} answered HTTP {status}, not a model list"
            ids = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
            if model is not None and model not in ids:
                return f"unknown model {model!r}: {socket_path} serves {', '.join(ids) or 'none'}"
            return None

        return response.read_body(MODELS_BODY_LIMIT).addCallback(listed)

    def failed(reason: Failure) -> str:
        """No answer: nobody there, silence, or something that is not HTTP."""
        if reason.check(Connect):
            return f"no loopd at {socket_path}: {reason.getErrorMessage()}"
        if reason.check(CancelledError, DeferredTimeout):
            return f"{socket_path} did not answer GET {MODELS_PATH} within {timeout:g} s"
        return f"{not_loopd}: it does not answer HTTP ({reason.getErrorMessage()})"

    checking: Deferred[str | None] = asking.addCallback(answered)
    checking.addTimeout(timeout, reactor)
    return checking.addErrback(failed)


def stream_turn(
    reactor: IUnixReactor,
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
        output then ends at the start of a line. A socket that another user controls
        (L{check_peer_socket}) is not connected to: the turn fails saying so.
    """
    try:
        check_peer_socket(socket_path)
    except UnixSocketError as e:
        write(view.fail(f"not connecting to loopd: {e}"))
        write(view.close())
        return succeed(view)
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
        """
        The headers are in: a 200 streams its events into the view; any other status is a
        refusal, its body (at most L{ERROR_BODY_LIMIT} bytes) read for the error text.
        """
        if response.status != 200:

            def refused(raw: bytes) -> None:
                """Fail the view with the status and what the body says."""
                write(view.fail(http_error_text(response.status, raw)))

            return response.read_body(ERROR_BODY_LIMIT).addCallback(refused)
        decoder = SSEDecoder()

        def received(data: bytes) -> None:
            """
            Write the view's text for each event or comment of a piece of the stream; a stream that
            does not decode aborts the read, and C{failed} shows why.
            """
            for item in decoder.feed(data):
                write(view.item(item))

        def ended(_: None) -> None:
            """The body ended: the decoder's last items, if any, still count."""
            for item in decoder.finish():
                write(view.item(item))

        return response.deliver(received).addCallback(ended)

    def failed(reason: Failure) -> None:
        """
        No answer, or a broken one: fail the view with a connection error or the failure's kind
        and message. The turn itself then ends normally.
        """
        if reason.check(Connect):
            write(view.fail(f"cannot connect to loopd: {reason.value}"))
        else:
            error: Any = reason.value
            write(view.fail(f"{type(error).__name__}: {reason.getErrorMessage()}"))

    def closed(_: None) -> TurnView:
        """End the turn's output at the start of a line and fire with C{view}."""
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
        reactor: IUnixReactor,
        socket_path: str,
        conversation: Conversation,
        write: Write,
        *,
        tty: bool = False,
        session_id: str | None = None,
        quiet: bool = False,
        prompt: Callable[[], None] | None = None,
    ) -> None:
        """
        @param write: where the chat's text goes.
        @param tty: the output is a terminal (the thinking is dimmed).
        @param session_id: the session's C{X-Session-Id}; a new random one by default.
        @param quiet: write the answers alone (piped input): no greeting, no prompt, and
            quiet turns (L{TurnView.quiet}).
        @param prompt: called whenever the chat waits for the next line, instead of writing
            L{PROMPT} (the C{readline} reader prompts itself).
        """
        self._reactor = reactor
        self._socket = socket_path
        self.conversation = conversation
        self._write = write
        self._tty = tty
        self._quiet = quiet
        self._prompt = prompt
        self._session = session_id or f"chat-{uuid.uuid4().hex[:16]}"
        self._lines: deque[str] = deque()
        self._busy = False
        self._input_over = False
        self.finished: Deferred[int] = Deferred()

    def start(self) -> None:
        """Write the greeting and the first prompt (neither when quiet)."""
        if not self._quiet:
            model = self.conversation.model or "auto"
            self._write(f"loopd chat on {self._socket} with {model}; {QUIT} or Ctrl-D ends it.\n")
        self._ask_for_line()

    def _ask_for_line(self) -> None:
        """The chat waits for a line: prompt for it (silently when quiet)."""
        if self._prompt is not None:
            self._prompt()
        elif not self._quiet:
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
        """
        Handle the typed lines that wait, while no turn is under way: C{/quit} ends the chat, a
        blank line prompts again, anything else starts a turn (and stops the loop until it is
        over). Once the input has ended and nothing is under way, the chat ends.
        """
        while self._lines and not self._busy and not self.finished.called:
            text = self._lines.popleft().strip()
            if text == QUIT:
                self._finish()
            elif not text:
                self._ask_for_line()
            else:
                self._ask(text)
        if self._input_over and not self._busy and not self.finished.called:
            if not self._quiet:
                self._write("\n")
            self._finish()

    def _ask(self, text: str) -> None:
        """
        Start a turn: add C{text} to the conversation and stream its answer; lines typed
        meanwhile wait in the queue.
        """
        self._busy = True
        body = self.conversation.ask(text)
        view = TurnView(tty=self._tty, quiet=self._quiet)
        turn = stream_turn(
            self._reactor, self._socket, body, view, self._write, session_id=self._session
        )
        turn.addCallback(self._answered)

    def _answered(self, view: TurnView) -> None:
        """
        A turn is over: keep its answer in the conversation, or take the question back when the
        turn failed (so the next turn does not carry it), then prompt and go on with the queue.
        """
        if view.succeeded:
            self.conversation.answered(view.content, view.reasoning)
        else:
            self.conversation.retract()
        self._busy = False
        if not self._input_over:
            self._ask_for_line()
        self._next()

    def _finish(self) -> None:
        """End the chat with status 0, dropping the lines still queued."""
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

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def __init__(self, make_session: Callable[[Write], ChatSession]) -> None:
        """
        @param make_session: builds the session, given the function that writes to standard
            output; called once the standard I/O is connected.
        """
        self._make_session = make_session
        self.session: ChatSession | None = None
        self.closed: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        """Start the session, its text written to standard output."""
        session = self.session = self._make_session(self._out)
        session.finished.addCallback(self._session_over)
        session.start()

    def _out(self, text: str) -> None:
        """Write C{text} to standard output as UTF-8, while it is there."""
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
        """
        The chat ended: close standard I/O (after what is still buffered for output);
        C{closed} fires once it is closed. C{status} passes on.
        """
        # Closing flushes what is still buffered for standard output first.
        if self.transport is not None:
            self.transport.loseConnection()
        return status

    def connectionLost(self, reason: Failure | None = None) -> None:
        """Standard input and output are both closed."""
        self._closed()

    def _closed(self) -> None:
        """Fire C{closed}, once."""
        if not self.closed.called:
            self.closed.callback(None)


class _ReadlineLines:
    """
    Typed lines read with C{readline}: one line each time the session asks for one
    (L{ask}, its C{prompt}), read by C{input(PROMPT)} in a daemon thread (it blocks) and
    handed to the session on the reactor's thread; the end of input (Ctrl-D) ends it. The
    history is read from C{history} at the start and written back, bounded, at the end.
    """

    def __init__(
        self,
        reactor: IReactorFromThreads,
        history: str,
        *,
        editor: Any = None,
        read: Callable[[str], str] = input,
    ) -> None:
        """
        @param reactor: provides C{callFromThread}.
        @param history: the history file (L{history_path}).
        @param editor: the C{readline} module (a test's stand-in).
        @param read: reads one line after writing its prompt (C{input}).
        """
        self._reactor = reactor
        self._history = history
        if editor is None:
            import readline as editor
        self._editor = editor
        self._read = read
        self._wanted = threading.Semaphore(0)
        self.session: ChatSession | None = None

    def attach(self, session: ChatSession) -> None:
        """Read the history, then serve C{session}'s requests for lines."""
        self.session = session
        self._editor.set_history_length(HISTORY_LENGTH)
        try:
            self._editor.read_history_file(self._history)
        except OSError:
            pass

    def ask(self) -> None:
        """The session waits for a line: let the reader thread read one."""
        self._wanted.release()

    def run(self) -> None:
        """The reader thread's loop: a line each time one is asked for, until the input ends."""
        while self.read_one():
            pass

    def read_one(self) -> bool:
        """
        Wait until a line is asked for, read it and hand it to the session on the reactor's
        thread; C{False} once the input has ended.
        """
        self._wanted.acquire()
        try:
            text = self._read(PROMPT)
        except EOFError:
            self._reactor.callFromThread(self._ended)
            return False
        self._reactor.callFromThread(self._line, text)
        return True

    def _line(self, text: str) -> None:
        """Give the session its line."""
        if self.session is not None:
            self.session.line(text)

    def _ended(self) -> None:
        """The input ended (Ctrl-D)."""
        if self.session is not None:
            self.session.end_of_input()

    def save(self) -> None:
        """
        Write the history (at most L{HISTORY_LENGTH} lines) to its file, 0600 in a 0700
        directory; a file that cannot be written is left as it was.
        """
        try:
            os.makedirs(os.path.dirname(self._history), mode=0o700, exist_ok=True)
            self._editor.write_history_file(self._history)
            os.chmod(self._history, 0o600)
        except OSError:
            pass


def terminal_chat(
    reactor: IServiceReactor, socket_path: str, conversation: Conversation
) -> Deferred[int]:
    """
    Check the gateway and the model (L{check_gateway}), then run a L{ChatSession} on
    standard input and output: with C{readline} when standard input is a terminal, else
    quietly (the answers alone). Fire with 0 when it is over, or with 1 after saying on
    stderr what is wrong with the gateway or the model.
    """
    interactive = os.isatty(0)
    tty = os.isatty(1)

    def checked(problem: str | None) -> int | Deferred[int]:
        """Say what is wrong and exit 1, or start the chat."""
        if problem is not None:
            sys.stderr.write(f"loopd chat: {problem}\n")
            sys.stderr.flush()
            return 1
        if interactive:
            try:
                lines = _ReadlineLines(reactor, history_path())
            except ImportError:
                pass
            else:
                return _readline_chat(reactor, socket_path, conversation, lines, tty)
        protocol = _TerminalLines(
            lambda write: ChatSession(
                reactor, socket_path, conversation, write, tty=tty, quiet=not interactive
            )
        )
        StandardIO(protocol, reactor=reactor)
        return protocol.closed.addCallback(lambda _: 0)

    return check_gateway(reactor, socket_path, conversation.model).addCallback(checked)


def _readline_chat(
    reactor: IUnixReactor,
    socket_path: str,
    conversation: Conversation,
    lines: _ReadlineLines,
    tty: bool,
) -> Deferred[int]:
    """
    Run a L{ChatSession} whose lines C{lines} reads with C{readline}, its text written to
    standard output; the history is saved when it ends. Fires with 0.
    """
    _save_terminal()

    def write(text: str) -> None:
        """Write to standard output at once (the answer streams)."""
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()

    session = ChatSession(reactor, socket_path, conversation, write, tty=tty, prompt=lines.ask)
    lines.attach(session)
    threading.Thread(target=lines.run, name="loopd-chat-readline", daemon=True).start()
    session.start()

    def over(status: int) -> int:
        """Save the history; C{status} passes on."""
        lines.save()
        return status

    return session.finished.addCallback(over)


#: The terminal's modes before C{readline} read from it, for L{restore_blocking}.
_terminal_modes: list[Any] = []


def _save_terminal() -> None:
    """
    Keep the terminal's modes: Ctrl-C while C{readline} reads a line leaves them changed.
    """
    try:
        import termios
    except ImportError:
        return
    try:
        _terminal_modes[:] = [termios.tcgetattr(0)]
    except (OSError, termios.error):
        pass


def restore_blocking() -> None:
    """
    Standard input and output back to blocking mode, as the shell expects them (the chat's
    C{StandardIO} made them non-blocking, and the terminal is shared with the shell), and
    the terminal's modes back as they were before C{readline} read from it.
    """
    for fd in (0, 1):
        try:
            os.set_blocking(fd, True)
        except OSError:
            pass
    if _terminal_modes:
        import termios

        try:
            termios.tcsetattr(0, termios.TCSADRAIN, _terminal_modes.pop())
        except (OSError, termios.error):
            pass
