"""
Tests for L{loopd.gateway.capture}: a request's capture line (pure, on records made by
hand), and the watcher on a whole gateway in memory (L{GatewayHarness}) writing to real
files: without prompts no text of the request, the answer or an error is in the files;
with them the body as sent and the answer are; a capture that cannot write harms no
request; and C{twist loopd} captures, or refuses to start on an unsafe directory.
"""

from __future__ import annotations

import base64
import errno
import io
import json
import os
import shutil
import stat
import sys
import tempfile
from typing import Any

from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from loopd.config import parse_config
from loopd.gateway.activity import CallRecord, RequestRecord
from loopd.gateway.capture import CaptureWatcher, capture_line, encode_line
from loopd.gateway.capture_files import CaptureFiles, capture_file_names
from loopd.llama.types import Completion, FinishReason, Timings, ToolCall
from loopd.runtime_dir import UnsafeDirectoryError
from loopd.service import LoopdService
from loopd.testing.fake_llama import CHAT, error_reply
from loopd.testing.gateway import HI, NOW, GatewayHarness
from loopd.testing.llama_replies import answer
from loopd.testing.reactor import MemoryLoopdReactor

#: Words the request, the answer and an error carry, none of which a capture without
#: prompts may hold.
SECRETS = ("PURPLE-ELEPHANT", "SYSTEM-SECRET", "QUIET-THOUGHT", "ZEBRA-ANSWER", "TOOL-ARGUMENT")
REQUEST = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "Keep SYSTEM-SECRET."},
        {"role": "user", "content": "Tell me of the PURPLE-ELEPHANT."},
    ],
}
ANSWER = answer({"reasoning_content": "QUIET-THOUGHT"}, {"content": "A ZEBRA-ANSWER."})
CALL_ANSWER = answer(
    {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {}}]},
    {"tool_calls": [{"index": 0, "function": {"name": "look", "arguments": '"TOOL-ARGUMENT"'}}]},
    finish="tool_calls",
)
TOOL_CALLS = FinishReason.TOOL_CALLS
TOOLS = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]


def record(**changes: Any) -> RequestRecord:
    """A finished chat request with one completed call, changed by C{changes}."""
    call = CallRecord("tiny", "answer", 10.0, holder="s1", leased=10.5, slot=1, sent=10.75)
    call.ended = 12.0
    call.timings = Timings(30, 5, 7, predicted_per_second=200.0, prompt_per_second=40.0)
    call.retries = 1
    call.reasoning_tokens = 4
    done = RequestRecord(7, "chat", 10.0, NOW + 0.25, session="s1", agent="pi/1.0")
    done.model, done.stream, done.calls = "tiny", True, [call]
    done.first_token, done.ended, done.status, done.outcome = 11.0, 12.5, 200, "ok"
    for name, value in changes.items():
        setattr(done, name, value)
    return done


class LineTests(SynchronousTestCase):
    """What a line says of a request, with prompts and without."""

    def test_without_prompts(self) -> None:
        """The request's figures and each call's: no body, answer or error message."""
        line = capture_line(record(), "/v1/chat/completions", prompts=False)
        self.assertEqual(
            line,
            {
                "capture": 1,
                "id": 7,
                "door": "chat",
                "path": "/v1/chat/completions",
                "session": "s1",
                "anonymous": False,
                "agent": "pi/1.0",
                "model": "tiny",
                "stream": True,
                "mesh": False,
                "started": NOW + 0.25,
                "time": "2023-11-14T22:13:20.250Z",
                "seconds": 2.5,
                "first_token_seconds": 1.0,
                "status": 200,
                "outcome": "ok",
                "reused_tokens": 30,
                "evaluated_tokens": 5,
                "generated_tokens": 7,
                "calls": [
                    {
                        "endpoint": "tiny",
                        "role": "answer",
                        "holder": "s1",
                        "slot": 1,
                        "lease_wait_seconds": 0.5,
                        "sent_seconds": 0.75,
                        "seconds": 2.0,
                        "retries": 1,
                        "thinking_capped": False,
                        "reasoning_tokens": 4,
                        "timings": {
                            "cache_n": 30,
                            "prompt_n": 5,
                            "predicted_n": 7,
                            "prompt_per_second": 40.0,
                            "predicted_per_second": 200.0,
                        },
                        "error": None,
                    }
                ],
                "prompts": False,
            },
        )

    def test_error_kinds_only(self) -> None:
        """Without prompts a call's error is its kind; the request's message is left out."""
        failed = CallRecord("tiny", "answer", 10.0)
        failed.error = 'Http: HTTP 500: {"message":"Failed to parse input: ZEBRA-ANSWER"}'
        cancelled = CallRecord("tiny", "worker", 10.0, error="cancelled")
        done = record(calls=[failed, cancelled], status=502, outcome="http", error="ZEBRA-ANSWER")
        line = capture_line(done, None, prompts=False)
        self.assertEqual([c["error"] for c in line["calls"]], ["Http", "cancelled"])
        self.assertEqual([c["timings"] for c in line["calls"]], [None, None])
        self.assertNotIn("error", line)
        self.assertNotIn(b"ZEBRA", encode_line(line))
        with_prompts = capture_line(done, None, prompts=True)
        self.assertEqual(with_prompts["error"], "ZEBRA-ANSWER")
        self.assertEqual(with_prompts["calls"][0]["error"], failed.error)

    def test_with_prompts(self) -> None:
        """With prompts, the body as sent and the answer as the model made it."""
        completion = Completion(
            "c1", "Hi", "hm", (ToolCall("call_1", "look", "{}"),), TOOL_CALLS, Timings()
        )
        body = b'{"messages": [{"role": "user", "content": "caf\xc3\xa9"}]}'
        line = capture_line(record(body=body, completion=completion), None, prompts=True)
        self.assertEqual(line["body"], body.decode("utf-8"))
        self.assertEqual(
            line["answer"],
            {
                "content": "Hi",
                "reasoning": "hm",
                "tool_calls": [{"id": "call_1", "name": "look", "arguments": "{}"}],
                "finish_reason": "tool_calls",
            },
        )
        self.assertEqual((line["prompts"], line["error"]), (True, None))

    def test_body_not_utf8(self) -> None:
        """A body that is not UTF-8 is kept whole, in base64."""
        line = capture_line(record(body=b"\xff\xfe{"), None, prompts=True)
        self.assertEqual((line["body"], line["answer"]), (None, None))
        self.assertEqual(base64.b64decode(line["body_base64"]), b"\xff\xfe{")

    def test_one_line(self) -> None:
        """A line is one line of UTF-8 JSON, whatever its text holds."""
        completion = Completion("c1", "a\nb\u2028é", None, (), FinishReason.STOP, Timings())
        encoded = encode_line(capture_line(record(completion=completion), None, prompts=True))
        self.assertEqual(encoded.count(b"\n"), 1)
        self.assertTrue(encoded.endswith(b"\n"))
        self.assertEqual(json.loads(encoded)["answer"]["content"], "a\nb\u2028é")


class WatcherTests(SynchronousTestCase):
    """The watcher on a gateway in memory, writing real files."""

    def capture(self, prompts: bool, **kwargs: Any) -> CaptureFiles:
        """Watch a new gateway's requests into a new directory; its files."""
        self.harness = GatewayHarness()
        self.directory = os.path.abspath(self.mktemp())
        os.mkdir(self.directory, 0o700)
        files = CaptureFiles(self.directory, 1 << 20, wall_clock=lambda: NOW, **kwargs)
        self.addCleanup(files.close)
        paths = {door.name: path for path, door in self.harness.gateway.doors.by_path}
        self.harness.gateway.activity.watch(CaptureWatcher(files, prompts, paths))
        return files

    def raw(self) -> bytes:
        """Every capture file's bytes, oldest first."""
        data = b""
        for name in capture_file_names(os.listdir(self.directory)):
            with open(os.path.join(self.directory, name), "rb") as f:
                data += f.read()
        return data

    def lines(self) -> list[dict[str, Any]]:
        """Every line written, in the order the requests came."""
        lines = [json.loads(line) for line in self.raw().splitlines()]
        return sorted(lines, key=lambda line: line["id"])

    def requests(self) -> list[int]:
        """Send the requests whose text is L{SECRETS}: an answer, a tool call, a door's
        refusal quoting its value, an upstream error quoting the output; their statuses."""
        fake = self.harness.fake
        fake.script("POST", CHAT, ANSWER, CALL_ANSWER)
        fake.script("POST", CHAT, error_reply(500, "server_error", "Failed at ZEBRA-ANSWER"))
        sent = [
            self.harness.post(REQUEST, session="s1"),
            self.harness.post({**REQUEST, "tools": TOOLS}, session="s1"),
            self.harness.post({"messages": [{"role": "PURPLE-ELEPHANT", "content": "x"}]}),
            self.harness.post(HI, session="s2"),
        ]
        self.harness.advance(1)
        return [connection.response().status for connection in sent]

    def test_no_text_without_prompts(self) -> None:
        """
        Without prompts the files hold a line per request and none of the words of the
        requests, the answers, the tool call or the error messages.
        """
        self.capture(prompts=False)
        self.assertEqual(self.requests(), [200, 200, 400, 502])
        raw = self.raw()
        for word in (*SECRETS, "PURPLE", "ZEBRA", "Keep", "Tell me"):
            self.assertNotIn(word.encode(), raw)
        lines = self.lines()
        self.assertEqual([line["status"] for line in lines], [200, 200, 400, 502])
        self.assertEqual(
            [line["outcome"] for line in lines], ["ok", "ok", "invalid_message", "http"]
        )
        self.assertEqual({line["path"] for line in lines}, {"/v1/chat/completions"})
        first = lines[0]
        self.assertEqual(
            (first["session"], first["model"], first["prompts"]), ("s1", "tiny", False)
        )
        self.assertEqual(first["calls"][0]["timings"]["cache_n"], 3)
        self.assertEqual(lines[3]["calls"][0]["error"], "Http")
        self.assertFalse({"body", "answer", "error"} & set().union(*lines))

    def test_text_with_prompts(self) -> None:
        """With prompts the body is there as sent, and the answer, tool call and errors."""
        self.capture(prompts=True)
        self.requests()
        lines = self.lines()
        self.assertEqual(json.loads(lines[0]["body"]), REQUEST)
        self.assertEqual(lines[0]["answer"]["content"], "A ZEBRA-ANSWER.")
        self.assertEqual(lines[0]["answer"]["reasoning"], "QUIET-THOUGHT")
        [call] = lines[1]["answer"]["tool_calls"]
        self.assertEqual((call["name"], call["arguments"]), ("look", '"TOOL-ARGUMENT"'))
        self.assertIn("PURPLE-ELEPHANT", lines[2]["body"])
        self.assertIn("ZEBRA-ANSWER", lines[3]["error"])
        self.assertIsNone(lines[3]["answer"])

    def test_body_as_sent(self) -> None:
        """The body is the agent's bytes, spacing and key order kept."""
        self.capture(prompts=True)
        self.harness.fake.script("POST", CHAT, ANSWER)
        body = b'{ "messages" : [{"content": "Hi", "role": "user"}],  "stream": true }'
        connection = self.harness.connect()
        connection.request("POST", "/v1/chat/completions", body, ["X-Session-Id: s9"])
        self.harness.advance(1)
        [line] = self.lines()
        self.assertEqual(line["body"].encode(), body)
        self.assertTrue(line["stream"])
        self.assertIsNotNone(line["first_token_seconds"])

    def test_text_kept_only_for_prompts(self) -> None:
        """A capture without prompts does not make the gateway keep the text."""
        self.capture(prompts=False)
        self.assertFalse(self.harness.gateway.activity.keep_text)
        self.capture(prompts=True)
        self.assertTrue(self.harness.gateway.activity.keep_text)

    def test_cannot_write(self) -> None:
        """
        A capture whose writes fail (a full disk) answers every request as before and says
        so once.
        """

        def full(fd: int, data: bytes) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        files = self.capture(prompts=True, write=full)
        with capturedLogs() as events:
            self.assertEqual(self.requests(), [200, 200, 400, 502])
        said = [
            formatEvent(event)
            for event in events
            if event.get("log_namespace") == "loopd.gateway.capture"
        ]
        self.assertEqual(len(said), 1)
        self.assertIn("No space left on device", said[0])
        self.assertEqual(files.lost, 4)
        self.assertEqual(self.flushLoggedErrors(), [])


class ServiceTests(SynchronousTestCase):
    """C{twist loopd} with C{[capture]}: it captures, or refuses to start."""

    def start(self, capture: str) -> tuple[LoopdService, MemoryLoopdReactor, list[int]]:
        """Start the service of a config with C{capture} on a memory reactor."""
        runtime = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, runtime, True)
        self.patch(os, "environ", {**os.environ, "XDG_RUNTIME_DIR": runtime})
        self.patch(sys, "stderr", io.StringIO())
        reactor = MemoryLoopdReactor()
        endpoint = '[[endpoint]]\nname = "remote"\nsocket = "/tmp/ld/r.sock"\nkind = "openai"\n'
        exits: list[int] = []
        service = LoopdService(reactor, parse_config(capture + endpoint), exit_process=exits.append)
        service.startService()
        self.addCleanup(service.stopService)
        return service, reactor, exits

    def test_captures(self) -> None:
        """
        The capture directory is made (0700) and each request of the gateway's socket is a
        line in it, without prompts unless said; stopping closes the file.
        """
        directory = os.path.join(os.path.abspath(self.mktemp()), "capture")
        os.makedirs(os.path.dirname(directory), 0o700)
        service, reactor, _ = self.start(f'[capture]\ndir = "{directory}"\n')
        self.successResultOf(service.when_ready())
        self.assertEqual(stat.S_IMODE(os.stat(directory).st_mode), 0o700)
        [site] = [
            factory for path, factory, _, _, _ in reactor.unixServers if path.endswith("loopd.sock")
        ]
        channel = site.buildProtocol(None)
        channel.makeConnection(StringTransport())
        body = b'{"messages": [{"role": "PURPLE-ELEPHANT"}]}'
        head = f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        channel.dataReceived(head.encode() + body)
        [name] = os.listdir(directory)
        with open(os.path.join(directory, name), "rb") as f:
            [line] = [json.loads(raw) for raw in f]
        self.assertEqual(
            (line["door"], line["path"], line["status"]), ("messages", "/v1/messages", 400)
        )
        self.assertEqual(line["prompts"], False)
        self.assertIsNotNone(service.capture)
        service.stopService()
        self.assertIsNone(service.capture)

    def test_prompts(self) -> None:
        """With C{prompts = true} the gateway keeps the text for the capture."""
        directory = os.path.abspath(self.mktemp())
        os.mkdir(directory, 0o700)
        service, _, _ = self.start(f'[capture]\ndir = "{directory}"\nprompts = true\n')
        self.successResultOf(service.when_ready())
        assert service.gateway is not None
        self.assertTrue(service.gateway.activity.keep_text)

    def test_unsafe_directory(self) -> None:
        """
        A capture directory others may read: the start fails before anything listens, says
        why in one line on stderr, and exits 1.
        """
        directory = os.path.abspath(self.mktemp())
        os.mkdir(directory)
        os.chmod(directory, 0o755)
        service, reactor, exits = self.start(f'[capture]\ndir = "{directory}"\n')
        self.failureResultOf(service.when_ready(), UnsafeDirectoryError)
        assert isinstance(sys.stderr, io.StringIO)
        stderr = sys.stderr.getvalue()
        self.assertEqual(stderr.count("\n"), 1)
        self.assertIn(f"loopd: cannot start: unsafe capture directory {directory}", stderr)
        self.assertIn(f"chmod 700 {directory}", stderr)
        self.assertEqual(reactor.unixServers, [])
        for call, args, kwargs in reactor.triggers["after"]["shutdown"]:
            call(*args, **kwargs)
        self.assertEqual(exits, [1])
