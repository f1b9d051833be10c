"""
The TCP listener end to end (issue 14 item 4): a real llama.cpp server, C{twist
inferproxy}, and C{twist loopd} with C{[server] tcp = "127.0.0.1:0"}: chat completions over
TCP with the token, 401 without it or with another, the Unix socket beside it without one;
C{loopd token} prints the token loopd made; and C{loopd demo} killed with SIGKILL leaves no
child running.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import sys
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import SkipTest, TestCase

from loopd.test.support.peers import real_reactor

try:
    from loopd.test.support.gateway_stack import (
        SLOTS,
        httpx,
        serve_behind_proxy,
        start_loopd_tcp,
    )
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the TCP listener's end-to-end tests need the test extra: {e}") from None

HI = [{"role": "user", "content": "Hi"}]
_BIN = os.path.join(os.path.dirname(sys.executable), "loopd")
LOOPD = [_BIN] if os.path.exists(_BIN) else [sys.executable, "-m", "loopd.cli"]
#: Seconds a poll may take.
WAIT = 30.0


class TcpListenerEndToEndTests(TestCase):
    """
    twist loopd listening both ways.
    """

    timeout = 180

    @inlineCallbacks
    def start(self) -> Any:
        """The stack, loopd on its socket and on a free loopback port; fires with the URL."""
        self.directory, _, infer = yield serve_behind_proxy(self, "tiny.gguf", SLOTS)
        loopd = yield start_loopd_tcp(self, self.directory, infer)
        self.socket, self.token_file, self.config = loopd.socket, loopd.token_file, loopd.config
        return loopd.url

    def post(self, url: str, headers: dict[str, str], **transport: Any) -> Any:
        """POST one chat to C{url} with C{headers} (in a thread); the response."""
        body = {"model": "tiny", "messages": HI, "max_tokens": 16}
        with httpx.Client(transport=httpx.HTTPTransport(**transport), timeout=60) as client:
            return client.post(url + "/v1/chat/completions", json=body, headers=headers)

    @inlineCallbacks
    def test_token(self) -> Any:
        """Over TCP: 200 with the token (Bearer or x-api-key), 401 without or with another."""
        url = yield self.start()
        self.assertEqual(stat.S_IMODE(os.stat(self.token_file).st_mode), 0o600)
        with open(self.token_file) as f:
            token = f.read().strip()
        for headers in ({"Authorization": f"Bearer {token}"}, {"x-api-key": token}):
            response = yield deferToThread(self.post, url, headers)
            self.assertEqual(response.status_code, 200, response.text)
            self.assertTrue(response.json()["choices"][0]["message"]["content"])
        for headers in ({}, {"Authorization": "Bearer loopd-wrong"}):
            response = yield deferToThread(self.post, url, headers)
            self.assertEqual(response.status_code, 401)
            self.assertEqual(response.json()["error"]["code"], "invalid_api_key")
        response = yield deferToThread(self.post, "http://loopd", {}, uds=self.socket)
        self.assertEqual(response.status_code, 200, response.text)
        out, err, status = yield getProcessOutputAndValue(
            LOOPD[0], [*LOOPD[1:], "token", "--config", self.config], env=dict(os.environ)
        )
        self.assertEqual((status, out, err), (0, f"{token}\n".encode(), b""))


def children_of(pid: int) -> list[int]:
    """The processes whose parent is C{pid}, from /proc."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                found.append(int(name))
    return found


def running(pid: int) -> bool:
    """Whether process C{pid} exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class DemoKilledTests(TestCase):
    """
    C{loopd demo} killed with SIGKILL: its children die with it.
    """

    timeout = 180

    @inlineCallbacks
    def test_sigkill(self) -> Any:
        """
        The serving demo names both listeners, the token and its logs; SIGKILLed, its server,
        inferproxy and loopd are all gone within a bounded poll.
        """
        if not sys.platform.startswith("linux"):
            raise SkipTest("PR_SET_PDEATHSIG is Linux's")
        demo = _Output(b"Press Ctrl-C to stop.")
        argv = [*LOOPD, "demo"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        real_reactor().spawnProcess(demo, argv[0], argv, env=env)
        self.addCleanup(_kill, demo)
        yield demo.seen.addTimeout(120, real_reactor())
        output = demo.output
        for text in (b"(no token)", b"every request needs the token loopd-", b"Logs: loopd "):
            self.assertIn(text, output)
        assert demo.transport is not None
        pid = demo.transport.pid
        children = children_of(pid)
        self.assertEqual(len(children), 3, children)
        directory = re.search(rb"building the tiny model in (\S+)", output)
        assert directory is not None
        self.addCleanup(_remove, directory.group(1).decode())
        os.kill(pid, signal.SIGKILL)
        for _ in range(int(WAIT / 0.05)):
            if not any(running(child) for child in children):
                break
            yield deferLater(real_reactor(), 0.05, lambda: None)
        self.assertEqual([c for c in children if running(c)], [])


class _Output(ProcessProtocol):
    """A child's stdout so far; C{seen} fires once it holds C{marker}."""

    def __init__(self, marker: bytes) -> None:
        self.marker = marker
        self.output = b""
        self.seen: Deferred[None] = Deferred()

    def outReceived(self, data: bytes) -> None:
        self.output += data
        if self.marker in self.output and not self.seen.called:
            self.seen.callback(None)


def _kill(child: _Output) -> None:
    """SIGKILL the child if it still runs (a failed test's leftover)."""
    transport: Any = child.transport
    if transport is not None and transport.pid is not None:
        with contextlib.suppress(ProcessExitedAlready, OSError):
            transport.signalProcess("KILL")


def _remove(directory: str) -> None:
    """Remove the demo's directory, which a SIGKILLed demo leaves behind."""
    import shutil

    shutil.rmtree(directory, ignore_errors=True)
