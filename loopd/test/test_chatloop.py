"""
Tests for L{loopd.chatloop}: one streamed turn, the chat session and the terminal line
reader, and the first line of C{loopd chat} (its greeting names the model), against a
scripted fake gateway (L{FakeLlama}) on a L{MemoryNet}, in memory.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from typing import Any

from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from loopd import chatloop
from loopd.chatloop import ChatSession, _ReadlineLines, _TerminalLines, check_gateway, stream_turn
from loopd.chatui import Conversation, TurnView
from loopd.testing.fake_llama import CHAT, FakeLlama, Piece, Reply, json_reply, sse_reply
from loopd.testing.memory_net import MemoryNet
from loopd.testing.reactor import MemoryLoopdReactor

GATEWAY = "/tmp/ld-memory/chatloop-loopd.sock"
GREETING_GATEWAY = "/tmp/ld-greeting/loopd.sock"


def chunk(delta: dict[str, Any], finish: str | None = None) -> Any:
    """One streamed chat-completion chunk."""
    out: dict[str, Any] = {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}]}
    out.update(id="chatcmpl-1", object="chat.completion.chunk")
    return out


def comment(event: str, **fields: Any) -> Piece:
    """A C{: loopd {...}} comment piece, as the gateway writes it."""
    return Piece(0.0, b": loopd " + json.dumps({"event": event, **fields}).encode() + b"\n\n")


class ChatSessionTests(SynchronousTestCase):
    """
    L{ChatSession} streams turns from a (fake) gateway and keeps the history.
    """

    def setUp(self) -> None:
        self.reactor = MemoryLoopdReactor()
        self.net = MemoryNet(self.reactor)
        self.gateway = FakeLlama(self.reactor)
        self.net.listen(GATEWAY, self.gateway)
        self.output: list[str] = []
        conversation = Conversation(model="tiny")
        self.session = ChatSession(
            self.reactor, GATEWAY, conversation, self.output.append, session_id="s1"
        )
        self.session.start()

    def answer(self, text: str, *before: Piece) -> Reply:
        """A streamed answer of C{text}, after C{before} (loopd comments)."""
        return sse_reply([*before, chunk({"content": text}), chunk({}, "stop")])

    def say(self, line: str) -> str:
        """Type C{line}, run the turn; return what was written for it."""
        start = len(self.output)
        self.session.line(line)
        self.net.advance(1)
        return "".join(self.output[start:])

    def test_two_turns(self) -> None:
        """The second request repeats the first turn; both carry the same session id."""
        progress = comment("progress", total=10, cache=0, processed=10)
        self.gateway.script("POST", CHAT, self.answer("First.", progress), self.answer("Second."))
        self.assertIn("First.\nyou> ", self.say("One"))
        self.assertIn("Second.\nyou> ", self.say("Two"))
        first, second = self.gateway.requests_to("POST", CHAT)
        self.assertEqual(first.json["model"], "tiny")
        self.assertTrue(second.json["stream"])
        self.assertEqual(
            [(m["role"], m["content"]) for m in second.json["messages"]],
            [("user", "One"), ("assistant", "First."), ("user", "Two")],
        )
        self.assertEqual([r.header("X-Session-Id") for r in (first, second)], ["s1", "s1"])

    def test_progress_shown(self) -> None:
        """Progress and queue events are shown on the status line."""
        events = (comment("queued", ahead=1), comment("progress", total=4, cache=0, processed=2))
        self.gateway.script("POST", CHAT, self.answer("Hi", *events))
        out = self.say("One")
        self.assertIn("\rqueued: position 2 (1 ahead)", out)
        self.assertIn("  50% 2/4 tokens", out)

    def test_error_then_go_on(self) -> None:
        """An error is one line, the question leaves the history, and the chat goes on."""
        error = {"message": "no endpoint serves model 'tiny'", "code": "model_not_found"}
        refused = json_reply(404, {"error": {**error, "type": "invalid_request_error"}})
        self.gateway.script("POST", CHAT, refused, self.answer("Fine."))
        out = self.say("One")
        self.assertEqual(
            out, "error: HTTP 404: no endpoint serves model 'tiny' (model_not_found)\nyou> "
        )
        self.say("Two")
        last = self.gateway.requests_to("POST", CHAT)[-1]
        self.assertEqual([m["content"] for m in last.json["messages"]], ["Two"])
        self.assertFalse(self.session.finished.called)

    def test_stream_error(self) -> None:
        """An error event mid-stream is one line after the partial answer."""
        error = {"error": {"message": "upstream failed", "type": "server_error"}}
        reply = sse_reply([chunk({"content": "Hal"}), error], done=False)
        self.gateway.script("POST", CHAT, reply)
        self.assertEqual(self.say("One"), "Hal\nerror: upstream failed\nyou> ")
        self.assertEqual(self.session.conversation.messages, [])

    def test_no_gateway(self) -> None:
        """No loopd on the socket is one error line naming the socket."""
        self.net.stop_listening(GATEWAY)
        out = self.say("One")
        self.assertTrue(out.startswith("error: cannot connect to loopd: "), out)
        self.assertIn(GATEWAY, out)
        self.assertTrue(out.endswith("\nyou> "))

    def test_quit(self) -> None:
        """/quit ends the chat with status 0; blank lines just prompt again."""
        self.assertEqual(self.say("   "), "you> ")
        self.say("/quit")
        self.assertEqual(self.successResultOf(self.session.finished), 0)
        self.assertEqual(self.gateway.requests, [])

    def test_end_of_input_waits_for_the_turn(self) -> None:
        """Input that ends during a turn ends the chat after the answer is shown."""
        self.gateway.script("POST", CHAT, self.answer("Last."))
        self.session.line("One")
        self.session.end_of_input()
        self.assertNoResult(self.session.finished)
        self.net.advance(1)
        self.assertEqual(self.successResultOf(self.session.finished), 0)
        self.assertTrue("".join(self.output).endswith("Last.\n\n"))

    def test_lines_wait_their_turn(self) -> None:
        """Lines typed during a turn are asked one after the other."""
        self.gateway.script("POST", CHAT, self.answer("A."), self.answer("B."))
        self.session.line("One")
        self.session.line("Two")
        self.net.advance(1)
        self.net.advance(1)
        self.assertEqual(len(self.gateway.requests_to("POST", CHAT)), 2)
        self.assertIn("A.\nyou> B.\nyou> ", "".join(self.output))


class StreamTurnTests(SynchronousTestCase):
    """
    L{stream_turn} sends one streaming request and fires with its view, failed or not.
    """

    def setUp(self) -> None:
        self.reactor = MemoryLoopdReactor()
        self.net = MemoryNet(self.reactor)
        self.gateway = FakeLlama(self.reactor)
        self.net.listen(GATEWAY, self.gateway)
        self.output: list[str] = []

    def turn(self, body: dict[str, Any]) -> TurnView:
        """Stream one turn of C{body} to its end; return the view it fired with."""
        view = TurnView()
        d = stream_turn(self.reactor, GATEWAY, body, view, self.output.append, session_id="demo")
        self.net.advance(1)
        self.assertIs(self.successResultOf(d), view)
        return view

    def test_request(self) -> None:
        """The body goes as JSON, with the session id and an event-stream Accept."""
        self.gateway.script("POST", CHAT, sse_reply([chunk({"content": "Hi"}), chunk({}, "stop")]))
        body = Conversation(model="tiny").ask("Hello")
        view = self.turn(body)
        self.assertTrue(view.succeeded)
        self.assertEqual(view.content, "Hi")
        self.assertEqual("".join(self.output), "Hi\n")
        (request,) = self.gateway.requests_to("POST", CHAT)
        self.assertEqual(request.json, body)
        self.assertEqual(request.header("X-Session-Id"), "demo")
        self.assertEqual(request.header("Accept"), "text/event-stream")

    def test_refused(self) -> None:
        """An error answer fires with a failed view, its error the status and message."""
        error = {"message": "all slots busy", "type": "server_error", "code": "busy"}
        self.gateway.script("POST", CHAT, json_reply(429, {"error": error}))
        view = self.turn(Conversation().ask("Hello"))
        self.assertFalse(view.succeeded)
        self.assertEqual(view.error, "HTTP 429: all slots busy (busy)")
        self.assertEqual("".join(self.output), f"error: {view.error}\n")


class TerminalLinesTests(SynchronousTestCase):
    """
    L{_TerminalLines} feeds typed lines to a L{ChatSession} and writes its text out; the
    end of input waits for the answer under way, and the session's end closes the terminal.
    """

    def setUp(self) -> None:
        self.reactor = MemoryLoopdReactor()
        self.net = MemoryNet(self.reactor)
        self.gateway = FakeLlama(self.reactor)
        self.net.listen(GATEWAY, self.gateway)
        self.terminal = _TerminalLines(
            lambda write: ChatSession(self.reactor, GATEWAY, Conversation(), write, session_id="t")
        )
        self.transport = StringTransport()
        self.terminal.makeConnection(self.transport)

    def written(self) -> str:
        """Everything written to standard output so far."""
        data: bytes = self.transport.value()
        return data.decode("utf-8")

    def test_greeting(self) -> None:
        """The session starts at once: the greeting and the prompt are written."""
        self.assertEqual(
            self.written(), f"loopd chat on {GATEWAY} with auto; /quit or Ctrl-D ends it.\nyou> "
        )

    def test_line_is_asked(self) -> None:
        """A typed line (CR LF ending too) is a turn whose answer is written."""
        self.gateway.script(
            "POST", CHAT, sse_reply([chunk({"content": "Yes."}), chunk({}, "stop")])
        )
        self.terminal.dataReceived(b"Are you there?\r\n")
        self.net.advance(1)
        (request,) = self.gateway.requests_to("POST", CHAT)
        self.assertEqual(request.json["messages"][-1]["content"], "Are you there?")
        self.assertTrue(self.written().endswith("you> Yes.\nyou> "))

    def test_quit_closes(self) -> None:
        """/quit ends the session and closes the terminal; closed fires once it is lost."""
        self.terminal.dataReceived(b"/quit\n")
        self.assertTrue(self.transport.disconnecting)
        self.assertNoResult(self.terminal.closed)
        self.terminal.connectionLost()
        self.successResultOf(self.terminal.closed)

    def test_end_of_input_waits(self) -> None:
        """Input ending during a turn closes the terminal only after the answer."""
        self.gateway.script(
            "POST", CHAT, sse_reply([chunk({"content": "Bye."}), chunk({}, "stop")])
        )
        self.terminal.dataReceived(b"One\n")
        self.terminal.readConnectionLost()
        self.assertFalse(self.transport.disconnecting)
        self.net.advance(1)
        self.assertTrue(self.transport.disconnecting)
        self.assertTrue(self.written().endswith("Bye.\n\n"))

    def test_output_gone(self) -> None:
        """Standard output going away closes the terminal and fires closed."""
        self.terminal.writeConnectionLost()
        self.assertTrue(self.transport.disconnecting)
        self.successResultOf(self.terminal.closed)

    def test_overlong_line(self) -> None:
        """A line over C{MAX_LENGTH} closes the terminal without asking anything."""
        self.terminal.dataReceived(b"x" * (_TerminalLines.MAX_LENGTH + 1))
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(self.gateway.requests, [])


class GreetingTests(SynchronousTestCase):
    """What the chat says first, and which model its requests name."""

    def chat(self, model: str | None) -> tuple[list[str], FakeLlama]:
        """Start a chat with C{model}, ask one question; its output and the fake gateway."""
        reactor = MemoryLoopdReactor()
        net, gateway = MemoryNet(reactor), FakeLlama(reactor)
        net.listen(GREETING_GATEWAY, gateway)
        gateway.script("POST", CHAT, sse_reply([chunk({"content": "Hi"}), chunk({}, "stop")]))
        output: list[str] = []
        session = ChatSession(reactor, GREETING_GATEWAY, Conversation(model=model), output.append)
        session.start()
        session.line("Hello")
        net.advance(1)
        return output, gateway

    def test_named_model(self) -> None:
        """A chat with --model names it in the greeting and in every request."""
        output, gateway = self.chat("mesh")
        self.assertIn(" with mesh; ", output[0])
        (request,) = gateway.requests_to("POST", CHAT)
        self.assertEqual(request.json["model"], "mesh")

    def test_default_is_auto(self) -> None:
        """Without --model the greeting says auto and the request names no model."""
        output, gateway = self.chat(None)
        self.assertIn(" with auto; ", output[0])
        (request,) = gateway.requests_to("POST", CHAT)
        self.assertNotIn("model", request.json)


MODELS = "/v1/models"


def models(*ids: str) -> Reply:
    """The gateway's C{GET /v1/models} answer listing C{ids}."""
    data = [{"id": i, "object": "model", "created": 0, "owned_by": "loopd"} for i in ids]
    return json_reply(200, {"object": "list", "data": data})


class CheckGatewayTests(SynchronousTestCase):
    """
    L{check_gateway} says, before the first prompt, what is wrong with the socket or the
    model, or fires with C{None}.
    """

    def setUp(self) -> None:
        self.reactor = MemoryLoopdReactor()
        self.net = MemoryNet(self.reactor)
        self.gateway = FakeLlama(self.reactor)
        self.net.listen(GATEWAY, self.gateway)

    def check(self, model: str | None) -> str | None:
        """Run the check for C{model} to its end; what it fired with."""
        d = check_gateway(self.reactor, GATEWAY, model)
        self.net.advance(1)
        result: str | None = self.successResultOf(d)
        return result

    def test_known_model(self) -> None:
        """A model the gateway lists, or the default, is fine."""
        self.gateway.script("GET", MODELS, models("tiny", "auto", "mesh"))
        self.assertIsNone(self.check("tiny"))
        self.gateway.script("GET", MODELS, models("tiny", "auto", "mesh"))
        self.assertIsNone(self.check(None))

    def test_unknown_model(self) -> None:
        """An unknown model is named, with the models the gateway serves."""
        self.gateway.script("GET", MODELS, models("tiny", "auto", "mesh"))
        self.assertEqual(
            self.check("gpt-9"), f"unknown model 'gpt-9': {GATEWAY} serves tiny, auto, mesh"
        )

    def test_no_socket(self) -> None:
        """Nobody listening: no loopd there, the socket named."""
        self.net.stop_listening(GATEWAY)
        problem = self.check(None)
        assert problem is not None
        self.assertTrue(problem.startswith(f"no loopd at {GATEWAY}: "), problem)

    def test_not_a_model_list(self) -> None:
        """An HTTP server without a model list is not a loopd gateway."""
        self.gateway.script("GET", MODELS, json_reply(404, {"detail": "no"}))
        self.assertEqual(
            self.check(None),
            f"{GATEWAY} is not a loopd gateway: GET /v1/models answered HTTP 404, not a model list",
        )

    def test_not_http(self) -> None:
        """A socket that answers something that is not HTTP is not a loopd gateway."""
        self.gateway.script("GET", MODELS, Reply(head=b'{"op":"error"}\n'))
        problem = self.check(None)
        assert problem is not None
        self.assertTrue(problem.startswith(f"{GATEWAY} is not a loopd gateway: "), problem)

    def test_silent(self) -> None:
        """A socket that says nothing is said to be silent after the timeout."""
        self.gateway.script("GET", MODELS, json_reply(200, {}, headers_delay=60))
        d = check_gateway(self.reactor, GATEWAY, None, timeout=5)
        self.net.advance(4.9)
        self.assertNoResult(d)
        self.net.advance(0.2)
        self.assertEqual(
            self.successResultOf(d), f"{GATEWAY} did not answer GET /v1/models within 5 s"
        )


class QuietSessionTests(SynchronousTestCase):
    """With piped input the chat writes the answers alone."""

    def test_answers_only(self) -> None:
        """
        No greeting, prompt, progress, thinking or ANSI code: the answer's text and its
        newline, for each turn.
        """
        reactor = MemoryLoopdReactor()
        net, gateway = MemoryNet(reactor), FakeLlama(reactor)
        net.listen(GATEWAY, gateway)
        pieces = [
            comment("queued", ahead=1),
            comment("progress", processed=5, total=10, cache=0),
            comment("mesh_worker", worker="a", role="fast", ok=True, kind="text", elapsed_ms=9),
            chunk({"reasoning_content": "hmm"}),
            chunk({"content": "Hi"}),
            chunk({}, "stop"),
        ]
        output: list[str] = []
        session = ChatSession(reactor, GATEWAY, Conversation(), output.append, quiet=True)
        session.start()
        for line in ("One", "Two"):
            gateway.script("POST", CHAT, sse_reply(pieces))
            session.line(line)
            net.advance(1)
        session.end_of_input()
        self.assertEqual("".join(output), "Hi\nHi\n")
        self.assertEqual(self.successResultOf(session.finished), 0)


class _Editor:
    """A stand-in for the C{readline} module: its history in a list."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.length = -1
        self.read_from: list[str] = []

    def set_history_length(self, length: int) -> None:
        self.length = length

    def read_history_file(self, path: str) -> None:
        self.read_from.append(path)

    def write_history_file(self, path: str) -> None:
        with open(path, "w") as f:
            f.write("\n".join(self.lines[-self.length :]))


class ReadlineLinesTests(SynchronousTestCase):
    """
    L{_ReadlineLines} reads a line with C{readline} each time the session asks, and keeps
    the history, bounded, in a private file.
    """

    def test_lines_and_history(self) -> None:
        """
        Each asked-for line goes to the session, the end of input ends it, and the history
        is read at the start and written at the end, 0600 in a 0700 directory.
        """
        home = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, home, True)
        history = chatloop.history_path({"XDG_STATE_HOME": home})
        self.assertEqual(history, os.path.join(home, "loopd", "chat_history"))
        typed = iter(["/quit"])
        prompts: list[str] = []

        def read(prompt: str) -> str:
            prompts.append(prompt)
            try:
                return next(typed)
            except StopIteration:
                raise EOFError from None

        editor = _Editor(["a", "b", "/quit"])
        lines = _ReadlineLines(MemoryLoopdReactor(), history, editor=editor, read=read)
        output: list[str] = []
        session = ChatSession(
            MemoryLoopdReactor(), GATEWAY, Conversation(), output.append, prompt=lines.ask
        )
        lines.attach(session)
        self.assertEqual((editor.read_from, editor.length), ([history], chatloop.HISTORY_LENGTH))
        session.start()
        self.assertTrue(lines.read_one())
        self.assertEqual(self.successResultOf(session.finished), 0)
        self.assertEqual(prompts, [chatloop.PROMPT])
        self.assertNotIn(chatloop.PROMPT, "".join(output))
        lines.save()
        self.assertEqual(stat.S_IMODE(os.stat(history).st_mode), 0o600)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(history)).st_mode), 0o700)
        with open(history) as f:
            self.assertEqual(f.read(), "a\nb\n/quit")

    def test_end_of_input(self) -> None:
        """Ctrl-D (C{EOFError}) is the end of input: the session ends."""

        def read(prompt: str) -> str:
            raise EOFError

        lines = _ReadlineLines(
            MemoryLoopdReactor(), "/nonexistent/h", editor=_Editor([]), read=read
        )
        session = ChatSession(MemoryLoopdReactor(), GATEWAY, Conversation(), lambda t: None)
        lines.attach(session)
        lines.ask()
        self.assertFalse(lines.read_one())
        self.assertEqual(self.successResultOf(session.finished), 0)
