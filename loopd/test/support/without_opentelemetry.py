"""
Run Python as if OpenTelemetry were not installed: the tests of loopd without its
C{telemetry} extra, in a child process, on a machine that has it.

C{python -m loopd.test.support.without_opentelemetry -c CODE} runs C{CODE};
C{python -m loopd.test.support.without_opentelemetry -m MODULE ARGS...} runs C{MODULE} as
C{python -m} would (C{-m twisted loopd --config F} is C{twist loopd}). Either way every import
of C{opentelemetry} or a module under it fails as a missing package's does.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import runpy
import sys
from collections.abc import Sequence
from types import ModuleType

#: The package whose import fails.
BLOCKED = "opentelemetry"


class _Missing(importlib.abc.MetaPathFinder):
    """A finder, first on the path, that finds L{BLOCKED} and its modules missing."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        """Fail as a missing module for L{BLOCKED}'s names; leave every other to the path."""
        if fullname == BLOCKED or fullname.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def block() -> None:
    """Make OpenTelemetry missing for this process (what it imported already stays)."""
    for name in [n for n in sys.modules if n == BLOCKED or n.startswith(BLOCKED + ".")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _Missing())


def main(argv: Sequence[str]) -> None:
    """C{-c CODE} or C{-m MODULE ARGS...}, OpenTelemetry blocked."""
    block()
    if len(argv) >= 2 and argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<-c>", "exec"), {"__name__": "__main__"})
    elif len(argv) >= 2 and argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        raise SystemExit("usage: -c CODE | -m MODULE [ARGS...]")


if __name__ == "__main__":
    main(sys.argv[1:])
