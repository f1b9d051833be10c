# -*- test-case-name: loopd.test.test_cli -*-
"""
Child processes of C{loopd demo}: C{python -m twisted ...} commands that say when they are
ready with a line of their log, and are stopped with SIGTERM (SIGKILL after a grace). Each
runs behind L{loopd.demo.orphan_guard}, so it dies with the demo even when the demo is
killed with SIGKILL, and may copy its output to a log file as it comes.

L{spawn_twist} starts one; its L{Child} fires C{ready} at the first output line containing
the marker, or fails it with L{ChildFailed} when the child ends (or the start timeout
passes) first; C{ended} fires with the exit status whatever happens. Every output line is
kept, stdout and stderr alike, so a caller can show what a failing child said.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from contextlib import suppress
from typing import IO, Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ProcessDone, ProcessExitedAlready
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from loopd.demo.orphan_guard import guarded_argv
from loopd.reactor import IProcessReactor

__all__ = ["Child", "ChildFailed", "spawn_twist", "stop_child"]

#: Output lines a child keeps; the oldest go first.
MAX_LINES = 2000
#: Lines of output a failure message shows.
TAIL_LINES = 20


class ChildFailed(Exception):  # noqa: N818 - reads better at the call site
    """
    A child ended, or stayed silent past its start timeout, before it was ready.

    @ivar child: the child, with its output lines.
    """

    def __init__(self, child: Child, why: str) -> None:
        """@param why: what happened, e.g. C{exited with status 1}."""
        tail = "\n".join(child.lines[-TAIL_LINES:])
        super().__init__(f"{child.name} {why}" + (f"; its last output:\n{tail}" if tail else ""))
        self.child = child


class Child(ProcessProtocol):
    """
    One child process: its output lines, a ready Deferred and an ended Deferred.

    @ivar name: how messages name the child.
    @ivar marker: the text of the output line that means the child is ready.
    @ivar ready: fires once the marker line arrived; fails with L{ChildFailed}.
    @ivar ended: fires with the exit status (a negative number for a signal).
    @ivar lines: the output lines so far, stdout and stderr interleaved as they came.
    @ivar status: the exit status once the child ended, else None.
    @ivar log_path: the file each output line is also written to, or None.
    """

    def __init__(self, name: str, marker: str, log_path: str | None = None) -> None:
        """
        Describe the child; L{spawn_twist} starts it.

        @param log_path: a file to copy the output lines to, as they come (made anew).
        """
        self.name = name
        self.marker = marker
        self.log_path = log_path
        self._log: IO[str] | None = None
        if log_path is not None:
            self._log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed at the end
        self.ready: Deferred[None] = Deferred()
        self.ended: Deferred[int] = Deferred()
        self.lines: list[str] = []
        self.status: int | None = None
        self._partial = {1: b"", 2: b""}
        self._timer: IDelayedCall | None = None

    def outReceived(self, data: bytes) -> None:
        """Collect stdout lines."""
        self._received(1, data)

    def errReceived(self, data: bytes) -> None:
        """Collect stderr lines."""
        self._received(2, data)

    def _received(self, fd: int, data: bytes) -> None:
        """
        Split a piece of the output of C{fd} into lines; the partial last line waits for the
        rest.
        """
        *complete, self._partial[fd] = (self._partial[fd] + data).split(b"\n")
        for raw in complete:
            self._line(raw.decode("utf-8", "replace").rstrip("\r"))

    def _line(self, line: str) -> None:
        """
        Keep one output line (the last L{MAX_LINES} are kept); the first holding the marker
        fires C{ready} and stops the start timeout.
        """
        self.lines.append(line)
        del self.lines[:-MAX_LINES]
        if self._log is not None:
            self._log.write(line + "\n")
            self._log.flush()
        if self.marker in line and not self.ready.called:
            self._cancel_timer()
            self.ready.callback(None)

    def start_timeout(self, clock: IReactorTime, seconds: float) -> None:
        """Fail C{ready} and kill the child if it is not ready within C{seconds}."""
        self._timer = clock.callLater(seconds, self._timed_out, seconds)

    def _timed_out(self, seconds: float) -> None:
        """The start timeout passed: fail C{ready}, if it has not fired, and kill the child."""
        self._timer = None
        if not self.ready.called:
            self.ready.errback(ChildFailed(self, f"was not ready within {seconds:g} s"))
        self.signal("KILL")

    def _cancel_timer(self) -> None:
        """Stop the start timeout, if it is pending."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def signal(self, name: str) -> None:
        """Send signal C{name} (C{"TERM"}, C{"KILL"}) unless the child is gone."""
        transport: Any = self.transport
        if transport is not None and self.status is None:
            with suppress(ProcessExitedAlready, OSError):
                transport.signalProcess(name)

    def processEnded(self, reason: Failure) -> None:
        """Flush partial lines, fail C{ready} if it never came, fire C{ended}."""
        for fd, rest in self._partial.items():
            if rest:
                self._partial[fd] = b""
                self._line(rest.decode("utf-8", "replace").rstrip("\r"))
        self._cancel_timer()
        if self._log is not None:
            self._log.close()
            self._log = None
        status = self.status = _status(reason)
        if not self.ready.called:
            why = (
                f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
            )
            self.ready.errback(ChildFailed(self, why))
        self.ended.callback(status)


def _status(reason: Failure) -> int:
    """The exit status of an ended child; minus the signal number if a signal ended it."""
    if reason.check(ProcessDone):
        return 0
    value: Any = reason.value
    if getattr(value, "signal", None) is not None:
        return -int(value.signal)
    code = getattr(value, "exitCode", None)
    return int(code) if code is not None else 1


def spawn_twist(
    reactor: IProcessReactor,
    name: str,
    marker: str,
    args: Sequence[str],
    *,
    start_timeout: float = 60.0,
    cwd: str | None = None,
    log_path: str | None = None,
) -> Child:
    """
    Start C{python -m twisted --log-format=text ARGS...} with this interpreter, behind
    L{loopd.demo.orphan_guard} (it dies with this process).

    @param reactor: starts the child and times its start out.
    @param marker: the text of the log line that says the command is ready.
    @param start_timeout: seconds before C{ready} fails and the child is killed.
    @param log_path: a file the child's output is copied to, line by line.
    """
    child = Child(name, marker, log_path)
    argv = guarded_argv([sys.executable, "-m", "twisted", "--log-format=text", *args])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    reactor.spawnProcess(child, sys.executable, argv, env=env, path=cwd)
    child.start_timeout(reactor, start_timeout)
    return child


def stop_child(clock: IReactorTime, child: Child, grace: float = 10.0) -> Deferred[int]:
    """
    SIGTERM C{child}, SIGKILL it if it still runs after C{grace} seconds; fire with its
    exit status once it is gone.
    """
    if child.status is not None:
        return succeed(child.status)
    child.signal("TERM")
    timer = clock.callLater(grace, child.signal, "KILL")
    ended: Deferred[int] = Deferred()

    def gone(status: int) -> int:
        """The child is gone: stop the SIGKILL timer and fire with the status."""
        if timer.active():
            timer.cancel()
        ended.callback(status)
        return status

    child.ended.addCallback(gone)
    return ended
