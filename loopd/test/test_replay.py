"""
Tests for L{loopd.replay} and C{loopd replay}: reading a session out of capture files
(written by the real capture watcher; any bytes at all read without an error), the cache
figures of an answer, and sending a session again to a gateway in memory, and once to one
on a real Unix socket over a fake llama-server on another.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
from typing import cast

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase, TestCase

from loopd import cli
from loopd.gateway.activity import RequestRecord
from loopd.gateway.capture import CaptureWatcher, capture_line, encode_line
from loopd.gateway.capture_files import CaptureFiles
from loopd.gateway.site import Gateway
from loopd.llama import Client
from loopd.reactor import ILoopdReactor, global_reactor
from loopd.replay import (
    AGENT,
    CommentLines,
    ReplayError,
    cache_figures,
    captured_request,
    read_capture,
    replay_session,
    request_bodies,
)
from loopd.settings import Config, Endpoint, Expect, Retry
from loopd.testing.fake_llama import CHAT, FakeLlama, error_reply
from loopd.testing.gateway import HI, NOW, GatewayHarness
from loopd.testing.llama_replies import answer
from loopd.unixsocket import listen_unix

#: Where the in-memory gateway of L{ReplayTests} listens.
GATEWAY = "/tmp/ld-memory/replay-loopd.sock"
MESSAGES = {
    "model": "tiny",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "Hello there"}],
}
STREAM = {**HI, "stream": True}


def captured(harness: GatewayHarness, directory: str, prompts: bool = True) -> CaptureFiles:
    """Capture C{harness}'s requests into C{directory} (0700, made here)."""
    os.mkdir(directory, 0o700)
    files = CaptureFiles(directory, 1 << 20, wall_clock=lambda: NOW)
    paths = {door.name: path for path, door in harness.gateway.doors.by_path}
    harness.gateway.activity.watch(CaptureWatcher(files, prompts, paths))
    return files


def send(harness: GatewayHarness, path: str, body: bytes, session: str) -> None:
    """POST C{body} to C{path} as C{session}, and let the answer end."""
    connection = harness.connect()
    headers = ["Content-Type: application/json", f"X-Session-Id: {session}"]
    connection.request("POST", path, body, headers)
    harness.advance(1)


class CaptureCase(SynchronousTestCase):
    """A capture of a gateway in memory: session s1 (three requests) and s2 (one)."""

    prompts = True

    def setUp(self) -> None:
        self.harness = GatewayHarness()
        self.directory = os.path.abspath(self.mktemp())
        self.files = captured(self.harness, self.directory, self.prompts)
        self.addCleanup(self.files.close)
        self.bodies = [
            json.dumps(HI).encode(),
            b'{"max_tokens": 64, "model": "tiny",\n "messages": [{"role": "user", '
            b'"content": "Hello there"}]}',
            json.dumps(STREAM).encode(),
        ]
        self.harness.fake.script(
            "POST", CHAT, *(answer({"content": f"Answer {n}"}) for n in range(4))
        )
        send(self.harness, "/v1/chat/completions", self.bodies[0], "s1")
        send(self.harness, "/v1/chat/completions", json.dumps(HI).encode(), "s2")
        self.harness.reactor.advance(0)
        send(self.harness, "/v1/messages", self.bodies[1], "s1")
        send(self.harness, "/v1/chat/completions", self.bodies[2], "s1")


class ReadTests(CaptureCase):
    """A session's requests out of a capture."""

    def test_directory(self) -> None:
        """
        From the capture directory: the session's requests in order, each with its door's
        path, its body as the agent sent it, and what it did then.
        """
        requests, skipped = read_capture(self.directory, "s1")
        self.assertEqual(skipped, 0)
        self.assertEqual(
            [(r.door, r.path) for r in requests],
            [
                ("chat", "/v1/chat/completions"),
                ("messages", "/v1/messages"),
                ("chat", "/v1/chat/completions"),
            ],
        )
        self.assertEqual([r.body for r in requests], self.bodies)
        self.assertEqual([r.status for r in requests], [200, 200, 200])
        self.assertEqual((requests[0].reused, requests[0].evaluated), (3, 10))
        self.assertEqual(request_bodies(requests, None), self.bodies)

    def test_file(self) -> None:
        """From one capture file, whatever its name."""
        [name] = os.listdir(self.directory)
        copy = os.path.join(os.path.abspath(self.mktemp()))
        shutil.copy(os.path.join(self.directory, name), copy)
        requests, _ = read_capture(copy, "s2")
        self.assertEqual([r.body for r in requests], [json.dumps(HI).encode()])

    def test_order_of_arrival(self) -> None:
        """
        Requests are taken in the order they arrived, not the order their lines were
        written (a later request may end first), across files.
        """
        [name] = os.listdir(self.directory)
        with open(os.path.join(self.directory, name), "rb") as f:
            lines = f.read().splitlines(keepends=True)
        os.unlink(os.path.join(self.directory, name))
        earlier = os.path.join(self.directory, "loopd-capture-20231114T221320Z-000009.jsonl")
        with open(earlier, "wb") as f:
            f.writelines(reversed(lines))
        self.assertEqual([r.body for r in read_capture(self.directory, "s1")[0]], self.bodies)

    def test_model(self) -> None:
        """With --model, every body names that model, the rest as it was."""
        requests, _ = read_capture(self.directory, "s1")
        bodies = [json.loads(body) for body in request_bodies(requests, "big")]
        self.assertEqual([body["model"] for body in bodies], ["big"] * 3)
        self.assertEqual(bodies[1]["messages"], MESSAGES["messages"])

    def test_model_needs_an_object(self) -> None:
        """A body that is not a JSON object cannot take another model."""
        requests, _ = read_capture(self.directory, "s1")
        bad = [requests[0].__class__(**{**requests[0].__dict__, "body": b"[1]"})]
        error = self.assertRaises(ReplayError, request_bodies, bad, "big")
        self.assertIn("--model", str(error))
        self.assertEqual(request_bodies(bad, None), [b"[1]"])

    def test_unknown_session(self) -> None:
        """A session not in the capture is named, with those that are."""
        error = self.assertRaises(ReplayError, read_capture, self.directory, "s9")
        self.assertEqual(
            str(error), f"no request of session 's9' in {self.directory} (its sessions: s1, s2)"
        )

    def test_lines_passed_over(self) -> None:
        """A line cut short or not a capture line is passed over and counted."""
        [name] = os.listdir(self.directory)
        with open(os.path.join(self.directory, name), "ab") as f:
            f.write(b'{"capture":1,"session":"s1","door":"chat"\n')
            f.write(b'not json "s1"\n')
            f.write(b'{"capture":2,"session":"s1"}\n')
        requests, skipped = read_capture(self.directory, "s1")
        self.assertEqual((len(requests), skipped), (3, 3))

    def test_nothing_there(self) -> None:
        """A missing path, or a directory without capture files, is said."""
        missing = os.path.join(self.directory, "nope")
        self.assertEqual(
            str(self.assertRaises(ReplayError, read_capture, missing, "s1")),
            f"{missing} does not exist",
        )
        empty = os.path.abspath(self.mktemp())
        os.mkdir(empty)
        self.assertIn(
            "holds no capture file", str(self.assertRaises(ReplayError, read_capture, empty, "s1"))
        )


class WithoutPromptsTests(CaptureCase):
    """A capture without prompts cannot be replayed."""

    prompts = False

    def test_refused(self) -> None:
        """Reading its session says why in one line."""
        error = str(self.assertRaises(ReplayError, read_capture, self.directory, "s1"))
        self.assertEqual(
            error,
            f"session 's1' in {self.directory} cannot be replayed: captured without prompts, "
            "so the requests' bodies are not there (set prompts = true in [capture] to "
            "capture what a replay needs)",
        )

    def test_command(self) -> None:
        """C{loopd replay} exits 2 after that one line, and sends nothing."""
        stderr = io.StringIO()
        self.patch(sys, "stderr", stderr)
        status = cli.main(["replay", self.directory, "--session", "s1", "--socket", GATEWAY])
        self.assertEqual(status, 2)
        self.assertEqual(stderr.getvalue().count("\n"), 1)
        self.assertIn("loopd replay: session 's1' in ", stderr.getvalue())


texts = st.text(max_size=20)


class LineTests(SynchronousTestCase):
    """Any line at all is read, or passed over; a capture line is read back whole."""

    @settings(max_examples=300)
    @given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
    def test_any_bytes(self, raw: bytes) -> None:
        """No bytes make the reader fail: a line is a request, or nothing."""
        parsed = captured_request(raw)
        self.assertTrue(parsed is None or isinstance(parsed, tuple))

    @settings(max_examples=200)
    @given(
        st.sampled_from([("chat", "/v1/chat/completions"), ("messages", "/v1/messages")]),
        texts,
        st.binary(max_size=80),
        st.floats(0, 4e9),
        st.booleans(),
    )
    def test_round_trip(
        self, door: tuple[str, str], session: str, body: bytes, wall: float, prompts: bool
    ) -> None:
        """A capture line is read back with its session, door and body (with prompts)."""
        record = RequestRecord(1, door[0], 0.0, wall, session=session, body=body)
        record.ended, record.status, record.outcome = 1.0, 200, "ok"
        parsed = captured_request(encode_line(capture_line(record, door[1], prompts)))
        assert parsed is not None
        read_session, request = parsed
        self.assertEqual(read_session, session or None)
        self.assertEqual((request.door, request.path, request.status), (door[0], door[1], 200))
        self.assertEqual(request.body, body if prompts else None)

    @given(st.lists(st.text(max_size=30), max_size=6), st.lists(st.integers(0, 400), max_size=8))
    def test_comments_in_any_pieces(self, texts: list[str], cuts: list[int]) -> None:
        """A stream's loopd comments are found whatever pieces it comes in; nothing else."""
        events = [
            f": loopd {json.dumps({'n': t})}" if i % 2 else f"data: {t!r}"
            for i, t in enumerate(texts)
        ]
        raw = ("\n\n".join(events) + "\n\n").encode()
        lines = CommentLines()
        start = 0
        for cut in sorted(cuts):
            lines.feed(raw[start:cut])
            start = max(start, cut)
        lines.feed(raw[start:])
        lines.finish()
        expected = [e.encode() for e in events if e.startswith(": loopd ")]
        self.assertEqual(lines.comments, expected)


class CacheFiguresTests(SynchronousTestCase):
    """The reused and evaluated tokens loopd reported for an answer."""

    def test_header(self) -> None:
        """A whole answer's C{X-Loopd-Cache} header."""
        self.assertEqual(cache_figures("reused=120; evaluated=4; saved_ms=30", []), (120, 4))

    def test_comment(self) -> None:
        """A stream's last cache comment, without a header."""
        comments = [
            b': loopd {"event":"progress"}',
            b': loopd {"event":"cache","reused":7,"evaluated":2,"saved_ms":0}',
        ]
        self.assertEqual(cache_figures(None, comments), (7, 2))

    def test_neither(self) -> None:
        """Neither (an error answer), or one that does not read: C{None}s."""
        self.assertEqual(cache_figures(None, []), (None, None))
        self.assertEqual(cache_figures("reused=x; evaluated=1", [b": loopd {"]), (None, None))


class ReplayTests(CaptureCase):
    """A captured session sent again to a gateway in memory."""

    def replay(self, socket_path: str = GATEWAY, model: str | None = None) -> tuple[int, str, str]:
        """Replay session s1 to C{socket_path}; exit status, output and errors."""
        self.harness.net.listen(GATEWAY, self.harness.site)
        requests, _ = read_capture(self.directory, "s1")
        out: list[str] = []
        err: list[str] = []
        d = replay_session(
            self.harness.reactor,
            socket_path,
            requests,
            request_bodies(requests, model),
            out.append,
            err.append,
            session_id="replay-1",
            captured_as="s1",
        )
        self.harness.advance(5)
        return self.successResultOf(d), "".join(out), "".join(err)

    def test_replayed(self) -> None:
        """
        Each request goes to its door's path with its body, under the replay's session id
        and agent; each line says its status, reused and evaluated tokens, and the captured
        figures beside them.
        """
        self.harness.fake.script("POST", CHAT, *(answer({"content": "Again"}) for _ in range(3)))
        before = len(self.harness.fake.requests_to("POST", CHAT))
        status, out, err = self.replay()
        self.assertEqual((status, err), (0, ""))
        lines = out.splitlines()
        self.assertEqual(
            lines[0], f"replaying 3 requests of session s1 as session replay-1, to {GATEWAY}"
        )
        self.assertTrue(lines[1].startswith("1/3 chat      200  reused       3  evaluated      10"))
        self.assertTrue(lines[1].endswith("s  (captured: 200, reused 3, evaluated 10, 0.15 s)"))
        self.assertTrue(lines[2].startswith("2/3 messages  200  reused       3"))
        self.assertTrue(lines[3].startswith("3/3 chat      200  reused       3"))
        self.assertEqual(lines[4], "3 of 3 answered")
        sent = self.harness.fake.requests_to("POST", CHAT)[before:]
        self.assertEqual(len(sent), 3)
        self.assertEqual(sent[1].json["messages"][-1]["content"], "Hello there")
        sessions = {
            s["id"]: s for s in self.harness.get("/v1/status").response().json()["sessions"]
        }
        self.assertEqual((sessions["replay-1"]["turns"], sessions["replay-1"]["agent"]), (3, AGENT))

    def test_model(self) -> None:
        """With another model, every request names it."""
        self.harness.fake.script("POST", CHAT, *(answer({"content": "Again"}) for _ in range(3)))
        status, out, _ = self.replay(model="nope")
        self.assertEqual(status, 1)
        self.assertIn("1/3 chat      404", out)
        self.assertIn("0 of 3 answered", out)

    def test_failed_request(self) -> None:
        """A request answered with an error is shown and the replay goes on; status 1."""
        self.harness.fake.script(
            "POST",
            CHAT,
            answer({"content": "Again"}),
            error_reply(500, "server_error", "boom"),
            answer({"content": "Again"}),
        )
        status, out, _ = self.replay()
        self.assertEqual(status, 1)
        self.assertIn("2/3 messages  502  reused       -  evaluated       -", out)
        self.assertIn("2 of 3 answered", out)

    def test_not_running(self) -> None:
        """Nothing at the socket: one line, status 1."""
        status, out, err = self.replay("/tmp/ld-memory/none.sock")
        self.assertEqual(status, 1)
        self.assertTrue(
            err.startswith("loopd replay: cannot reach loopd: /tmp/ld-memory/none.sock")
        )
        self.assertEqual(err.count("\n"), 1)

    def test_command(self) -> None:
        """C{loopd replay FILE --session ID --socket PATH} runs the replay."""
        self.harness.net.listen(GATEWAY, self.harness.site)
        self.harness.fake.script("POST", CHAT, *(answer({"content": "Again"}) for _ in range(3)))
        stdout = io.StringIO()
        self.patch(sys, "stdout", stdout)
        reactor = cast(ILoopdReactor, self.harness.reactor)

        def run(command: cli.Command) -> int:
            d = command(reactor)
            self.harness.advance(5)
            return self.successResultOf(d)

        argv = ["replay", self.directory, "--session", "s1", "--socket", GATEWAY]
        self.assertEqual(cli.main(argv, run=run), 0)
        self.assertIn("3 of 3 answered", stdout.getvalue())
        self.assertRegex(stdout.getvalue(), r"as session replay-[0-9a-f]{12},")


class RealSocketTests(TestCase):
    """A replay over real Unix sockets: loopd's gateway, and a fake llama-server behind it."""

    def test_real_sockets(self) -> Deferred[None]:
        """A captured stream and a whole answer, sent again, answered with their figures."""
        reactor = global_reactor()
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        fake = FakeLlama(reactor)
        fake.script("POST", CHAT, answer({"content": "One"}), answer({"content": "Two"}))
        upstream = fake.listen(reactor, os.path.join(directory, "infer.sock"))
        self.addCleanup(upstream.stopListening)
        self.addCleanup(fake.close_all)
        endpoint = Endpoint(
            name="tiny",
            socket=os.path.join(directory, "infer.sock"),
            selftest=False,
            expect=Expect(total_slots=1),
        )
        config = Config(endpoints=(endpoint,), retry=Retry(attempts=1))
        gateway = Gateway(reactor, config, {"tiny": Client(reactor, config, endpoint)})
        path = os.path.join(directory, "loopd.sock")
        port = listen_unix(reactor, path, gateway.site())
        self.addCleanup(port.stopListening)
        capture = os.path.join(directory, "capture")
        line = capture_line(
            RequestRecord(1, "chat", 0.0, NOW, session="s1", body=json.dumps(STREAM).encode()),
            "/v1/chat/completions",
            prompts=True,
        )
        second = {**line, "started": NOW + 1, "body": json.dumps(HI)}
        os.mkdir(capture, 0o700)
        with open(os.path.join(capture, "loopd-capture-20231114T221320Z-000001.jsonl"), "wb") as f:
            f.write(encode_line(line) + encode_line(second))
        requests, _ = read_capture(capture, "s1")
        out: list[str] = []
        d = replay_session(
            reactor,
            path,
            requests,
            request_bodies(requests, None),
            out.append,
            out.append,
            session_id="replay-real",
            captured_as="s1",
        )

        def replayed(status: int) -> None:
            text = "".join(out)
            self.assertEqual(status, 0, text)
            self.assertIn("1/2 chat      200  reused       3  evaluated      10", text)
            self.assertIn("2/2 chat      200  reused       3  evaluated      10", text)
            self.assertEqual(
                [r.json["stream"] for r in fake.requests_to("POST", CHAT)], [True, True]
            )

        return d.addCallback(replayed)
