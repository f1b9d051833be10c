"""
Tests for L{loopd.demo.orphan_guard}: a child started through it dies with its parent, even
a parent killed with SIGKILL; real processes, each wait bounded, the child's end awaited
from the kernel (a pidfd) rather than by polling on a clock.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from loopd.demo.orphan_guard import SCRIPT, guarded_argv, main

#: Seconds any one wait may take.
WAIT = 20.0

#: A parent that starts one guarded child waiting for ever, prints its pid, and waits; the
#: child, which shares its stdout, says when it waits.
PARENT = """
import signal, subprocess, sys
sys.path.insert(0, {root!r})
from loopd.demo.orphan_guard import guarded_argv
code = "import signal; print('waiting', flush=True); signal.pause()"
child = subprocess.Popen(guarded_argv([sys.executable, "-c", code]))
print(child.pid, flush=True)
signal.pause()
"""


def running(pid: int) -> bool:
    """Whether process C{pid} exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def ended(pid: int, timeout: float = WAIT) -> bool:
    """
    Whether process C{pid} ends within C{timeout} seconds: its pidfd turns readable when it
    exits, whoever its parent is.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    return bool(readable) or not running(pid)


class DieWithParentTests(SynchronousTestCase):
    """
    The guard's promise, with real processes.
    """

    def setUp(self) -> None:
        if not sys.platform.startswith("linux"):
            raise SkipTest("PR_SET_PDEATHSIG is Linux's")

    def test_parent_killed(self) -> None:
        """A parent killed with SIGKILL takes its guarded child with it."""
        root = os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))
        parent = subprocess.Popen(
            [sys.executable, "-c", PARENT.format(root=root)], stdout=subprocess.PIPE
        )
        self.addCleanup(parent.wait)
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        self.addCleanup(_kill_if_running, child)
        # The child has become the waiting command (exec kept the pid), past the guard.
        self.assertEqual(parent.stdout.readline(), b"waiting\n")
        self.assertNotIn(b"orphan_guard", _cmdline(child))
        parent.kill()
        self.assertTrue(ended(child), f"child {child} outlived its parent")

    def test_runs_command(self) -> None:
        """The guarded argv runs the command with its arguments and its exit status."""
        argv = guarded_argv(
            [sys.executable, "-c", "import sys; print(sys.argv[1:]); sys.exit(3)", "a b"]
        )
        done = subprocess.run(argv, capture_output=True, timeout=WAIT)
        self.assertEqual((done.returncode, done.stdout), (3, b"['a b']\n"))

    def test_parent_gone_already(self) -> None:
        """A parent that is not the guard's parent any more: the command never runs."""
        argv = guarded_argv([sys.executable, "-c", "print('ran')"], parent=1)
        done = subprocess.run(argv, capture_output=True, timeout=WAIT)
        self.assertEqual((done.returncode, done.stdout), (1, b""))
        self.assertIn(b"parent 1 is gone", done.stderr)

    def test_usage(self) -> None:
        """A bad command line is status 2."""
        self.patch(sys, "stderr", open(os.devnull, "w"))  # noqa: SIM115
        self.assertEqual(main([]), 2)
        self.assertEqual(main(["x", "true"]), 2)


def _cmdline(pid: int) -> bytes:
    """Process C{pid}'s command line, empty once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def _kill_if_running(pid: int) -> None:
    """Kill process C{pid} if it still runs (a failed test's leftover)."""
    if running(pid):
        os.kill(pid, signal.SIGKILL)
