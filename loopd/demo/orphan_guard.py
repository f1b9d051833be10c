# -*- test-case-name: loopd.test.test_orphan_guard -*-
"""
Children that die with their parent: L{guarded_argv} turns a child's argv into one that
runs this file first, as a script (it imports nothing of loopd, so it costs one short
interpreter start). On Linux the script asks the kernel to SIGKILL it when its parent
dies (C{prctl(PR_SET_PDEATHSIG)}, through ctypes), checks that the parent has not died
already, and C{exec}s the real command, which keeps the setting (C{execve} does not reset
it). So C{loopd demo} killed with SIGKILL, which runs no cleanup, leaves no child running.
Elsewhere the script just C{exec}s the command.

Usage: C{python orphan_guard.py PARENT_PID PROGRAM ARG...}.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["SCRIPT", "guarded_argv", "main"]

#: This file, run as a script by L{guarded_argv}'s argv.
SCRIPT = os.path.abspath(__file__)
#: prctl's option number for the parent-death signal (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def guarded_argv(argv: Sequence[str], parent: int | None = None) -> list[str]:
    """
    The argv of a child that runs C{argv} and is killed when process C{parent} (default:
    this one) dies. Its first element is this Python interpreter.
    """
    owner = os.getpid() if parent is None else parent
    return [sys.executable, SCRIPT, str(owner), *argv]


def _die_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; C{False} when it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0)


def main(argv: Sequence[str]) -> int:
    """
    Run as C{orphan_guard.py PARENT_PID PROGRAM ARG...}: die with the parent, then become
    C{PROGRAM}. Exits 2 for a bad command line, 1 when the parent is gone already.
    """
    if len(argv) < 2 or not argv[0].isdigit():
        sys.stderr.write("usage: orphan_guard.py PARENT_PID PROGRAM [ARG...]\n")
        return 2
    parent, command = int(argv[0]), list(argv[1:])
    if _die_with_parent() and os.getppid() != parent:
        # The parent died before the request took effect: nobody will be told.
        sys.stderr.write(f"orphan_guard: parent {parent} is gone; not running {command[0]}\n")
        return 1
    os.execvp(command[0], command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
