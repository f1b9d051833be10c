"""
Running C{twist} commands as child processes in tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

import loopd

#: The checkout root: C{python -m twisted} run from here finds the plugins.
ROOT = Path(loopd.__file__).parent.parent


class TwistProcess(ProcessProtocol):
    """
    A C{twist} child process: collects its output, fires when a line containing C{ready}
    appears and when it ends.
    """

    def __init__(self, ready: bytes) -> None:
        self.ready_marker = ready
        self.output = b""
        self.errors = b""
        self.ready: Deferred[None] = Deferred()
        self.ended: Deferred[int] = Deferred()
        self._watches: list[tuple[bytes, int, Deferred[None]]] = []

    def outReceived(self, data: bytes) -> None:
        self.output += data
        if self.ready_marker in self.output and not self.ready.called:
            self.ready.callback(None)
        watches, self._watches = self._watches, []
        for watch in watches:
            self._check(*watch)

    def seen(self, marker: bytes, after: int = 0) -> Deferred[None]:
        """
        Fire once C{marker} is in the output from byte C{after} on (at once if it is there
        already): an event to wait on, such as a log line.
        """
        waiting: Deferred[None] = Deferred()
        self._check(marker, after, waiting)
        return waiting

    def _check(self, marker: bytes, after: int, waiting: Deferred[None]) -> None:
        """Fire C{waiting} if C{marker} is in the output past C{after}, else keep watching."""
        if marker in self.output[after:]:
            waiting.callback(None)
        else:
            self._watches.append((marker, after, waiting))

    def errReceived(self, data: bytes) -> None:
        self.errors += data

    def processEnded(self, reason: Failure) -> None:
        ended: Any = reason.value
        self.signal = None if reason.check(ProcessDone) else ended.signal
        code = 0 if reason.check(ProcessDone) else ended.exitCode
        if not self.ready.called:
            self.ready.errback(
                RuntimeError(f"exited {code} before ready: {(self.output + self.errors)!r}")
            )
        self.ended.callback(code)


def spawn_twist(reactor: Any, ready: bytes, *args: str) -> TwistProcess:
    """
    Start C{python -m twisted --log-format=text ARGS...} from the checkout root.

    @param ready: output that says the command is ready.
    """
    process = TwistProcess(ready)
    argv = [sys.executable, "-m", "twisted", "--log-format=text", *args]
    reactor.spawnProcess(process, sys.executable, argv, env=dict(os.environ), path=str(ROOT))
    return process


def stop_twist(process: TwistProcess) -> Deferred[int]:
    """
    Kill the child if it still runs; fire when it has ended.
    """
    if not process.ended.called and process.transport is not None:
        process.transport.signalProcess("KILL")
    return process.ended
