"""
Request capture and C{loopd replay} end to end, every part a real process: a real llama.cpp
server with the tiny model behind a C{twist inferproxy}, C{twist loopd} with C{[capture]}, two
turns of one session through it, then the real C{loopd replay} command sending that session
again. With C{prompts = true} the capture holds what a replay needs and the replay's second
turn reuses its first's cache as the captured one did; without it the capture holds no word
of the prompts or answers, and the replay refuses in one line.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import SkipTest, TestCase

from loopd import http
from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import TwistProcess, spawn_twist, stop_twist

try:
    from loopd.test.support.gateway_stack import SLOTS, loopd_toml, serve_behind_proxy
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the capture's end-to-end test needs the test extra: {e}") from None

_BIN = os.path.join(os.path.dirname(sys.executable), "loopd")
LOOPD = [_BIN] if os.path.exists(_BIN) else [sys.executable, "-m", "loopd.cli"]
SESSION = "capture-e2e"
#: Words of the first turn that no capture without prompts may hold.
SECRET = "the orchid password is marzipan"
TURNS = (SECRET + ", remember it and tell me about llamas", "And now about alpacas?")


class CaptureEndToEndTests(TestCase):
    """A captured session, replayed."""

    timeout = 240

    @inlineCallbacks
    def session(self, prompts: bool) -> Any:
        """
        Serve loopd with a capture (C{prompts} or not), send L{TURNS} as one session, stop
        loopd; fire with the loopd socket and the capture directory (the stack still runs
        for a replay against a second loopd).
        """
        reactor = real_reactor()
        directory, _server, infer = yield serve_behind_proxy(self, "tiny.gguf", SLOTS)
        capture = os.path.join(directory, "capture")
        socket = os.path.join(directory, "loopd.sock")
        config = os.path.join(directory, "loopd.toml")
        with open(config, "w") as f:
            f.write(loopd_toml(socket, infer, None, long=False))
            f.write(f"[capture]\ndir = {json.dumps(capture)}\nprompts = {str(prompts).lower()}\n")
        loopd: TwistProcess = spawn_twist(reactor, b"loopd serving", "loopd", "--config", config)
        self.addCleanup(stop_twist, loopd)
        yield loopd.ready
        messages: list[dict[str, str]] = []
        for text in TURNS:
            messages.append({"role": "user", "content": text})
            body = json.dumps({"model": "tiny", "messages": messages}).encode()
            response = yield http.request(
                reactor, socket, "POST", "/v1/chat/completions", body, {"X-Session-Id": SESSION}
            )
            answer = json.loads((yield response.read_body()))
            self.assertEqual(response.status, 200, answer)
            messages.append(
                {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
            )
        assert loopd.transport is not None
        loopd.transport.signalProcess("TERM")
        yield loopd.ended
        return socket, capture, config

    def lines(self, capture: str) -> list[dict[str, Any]]:
        """Every capture line, after checking the directory's and the files' modes."""
        self.assertEqual(stat.S_IMODE(os.stat(capture).st_mode), 0o700)
        found = []
        for name in sorted(os.listdir(capture)):
            path = os.path.join(capture, name)
            self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600, name)
            with open(path, encoding="utf-8") as f:
                found += [json.loads(line) for line in f if line.strip()]
        return found

    @inlineCallbacks
    def test_replayed(self) -> Any:
        """
        With prompts: two lines for the session, the second reusing the first's prompt; the
        real C{loopd replay} against a fresh loopd sends both again, answered, the second
        again reusing the first's.
        """
        reactor = real_reactor()
        socket, capture, config = yield self.session(prompts=True)
        lines = [line for line in self.lines(capture) if line.get("session") == SESSION]
        self.assertEqual(len(lines), 2, lines)
        self.assertIn(SECRET, json.dumps(lines[0]))
        loopd: TwistProcess = spawn_twist(reactor, b"loopd serving", "loopd", "--config", config)
        self.addCleanup(stop_twist, loopd)
        yield loopd.ready
        out, err, code = yield getProcessOutputAndValue(
            LOOPD[0],
            [*LOOPD[1:], "replay", capture, "--session", SESSION, "--socket", socket],
            env=dict(os.environ),
        )
        text = out.decode()
        self.assertEqual(code, 0, (text, err))
        rows = [line for line in text.splitlines() if line.startswith(("1/2", "2/2"))]
        self.assertEqual(len(rows), 2, text)
        self.assertTrue(all(" 200 " in row for row in rows), text)
        reused = int(rows[1].split("reused", 1)[1].split()[0].replace(",", ""))
        self.assertGreater(reused, 0, text)
        self.assertIn("2 of 2 answered", text)

    @inlineCallbacks
    def test_without_prompts(self) -> Any:
        """
        Without prompts: the session's lines carry its figures and no word of the prompt or
        the answer, and the replay refuses in one line with status 2.
        """
        socket, capture, _config = yield self.session(prompts=False)
        lines = [line for line in self.lines(capture) if line.get("session") == SESSION]
        self.assertEqual(len(lines), 2, lines)
        whole = json.dumps(lines)
        for word in ("orchid", "marzipan", "llamas", "alpacas"):
            self.assertNotIn(word, whole)
        out, err, code = yield getProcessOutputAndValue(
            LOOPD[0],
            [*LOOPD[1:], "replay", capture, "--session", SESSION, "--socket", socket],
            env=dict(os.environ),
        )
        self.assertEqual(code, 2, (out, err))
        self.assertIn(b"captured without prompts", err)
