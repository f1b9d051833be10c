"""
Tests for L{loopd.reactor}, the reactor interfaces loopd's parts take, and
L{loopd.testing.reactor}, the memory reactor that provides them.
"""

from __future__ import annotations

import ast
from pathlib import Path

from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

import loopd
from loopd.reactor import (
    ILoopdReactor,
    IProcessReactor,
    IServiceReactor,
    IUnixReactor,
    as_loopd_reactor,
    global_reactor,
    missing_parts,
)
from loopd.testing.reactor import MemoryLoopdReactor

PACKAGE = Path(loopd.__file__).parent


def untyped_in(source: str) -> list[int]:
    """
    The lines of C{source} where a parameter or annotated name called C{reactor} (or
    C{_reactor}, an attribute too) is annotated with C{Any}.
    """
    lines: list[int] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg):
            name, annotation = node.arg, node.annotation
        elif isinstance(node, ast.AnnAssign):
            target = node.target
            name = target.attr if isinstance(target, ast.Attribute) else ast.unparse(target)
            annotation = node.annotation
        else:
            continue
        if name.lstrip("_") == "reactor" and annotation is not None:
            if "Any" in ast.unparse(annotation):
                lines.append(node.lineno)
    return sorted(lines)


def untyped_reactors() -> list[str]:
    """L{untyped_in} over the package, its tests aside, as C{path:line}."""
    found: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "test":
            continue
        name = path.relative_to(PACKAGE.parent)
        found.extend(f"{name}:{line}" for line in untyped_in(path.read_text(encoding="utf-8")))
    return found


class NoAnyReactorTests(SynchronousTestCase):
    """
    The package says what each part needs of its reactor: no C{reactor: Any} outside the
    tests.
    """

    def test_none_left(self) -> None:
        """No parameter or attribute named C{reactor} is annotated C{Any}."""
        self.assertEqual(untyped_reactors(), [])

    def test_found(self) -> None:
        """
        The search finds C{reactor: Any} in a parameter and an attribute, C{Any} inside
        another type too, and nothing in a typed reactor or another name.
        """
        source = (
            "def f(reactor: Any, clock: Any, other: IReactorTime) -> None:\n"
            "    self._reactor: Any | None = reactor\n"
            "def g(reactor: IUnixReactor) -> None:\n"
            "    pass\n"
        )
        self.assertEqual(untyped_in(source), [1, 2])


class GlobalReactorTests(SynchronousTestCase):
    """
    The reactor Twisted installs by default provides every interface loopd combines, and
    L{global_reactor} declares loopd's on it.
    """

    def test_default_reactor_has_every_part(self) -> None:
        """
        The default reactor provides each of Twisted's interfaces that L{ILoopdReactor}
        combines, before anything is declared on it.
        """
        from twisted.internet import reactor

        self.assertEqual(missing_parts(ILoopdReactor, reactor), [])

    def test_declared(self) -> None:
        """
        L{global_reactor} is the global reactor, and then it provides L{ILoopdReactor} and
        every interface that this combines.
        """
        from twisted.internet import reactor

        self.assertIs(global_reactor(), reactor)
        provided = [
            i.providedBy(reactor)
            for i in (ILoopdReactor, IServiceReactor, IUnixReactor, IProcessReactor)
        ]
        self.assertEqual(provided, [True] * 4)

    def test_lacking_refused(self) -> None:
        """
        A reactor lacking a part is refused, naming what it lacks: a C{MemoryReactorClock}
        starts no process and takes no call from another thread.
        """
        lacking = MemoryReactorClock()
        error = self.assertRaises(TypeError, as_loopd_reactor, lacking)
        self.assertIn("no IReactorProcess, IReactorFromThreads", str(error))
        self.assertFalse(ILoopdReactor.providedBy(lacking))


class MemoryLoopdReactorTests(SynchronousTestCase):
    """
    L{MemoryLoopdReactor} is a C{MemoryReactorClock} that provides L{IServiceReactor}.
    """

    def test_provides(self) -> None:
        """It has every part of L{IServiceReactor}, declared and verified."""
        reactor = MemoryLoopdReactor()
        self.assertEqual(missing_parts(IServiceReactor, reactor), [])
        self.assertTrue(verifyObject(IServiceReactor, reactor))

    def test_call_from_thread_at_once(self) -> None:
        """C{callFromThread} runs the call at once, and records it."""
        reactor = MemoryLoopdReactor()
        calls: list[tuple[int, str]] = []

        def record(number: int, *, word: str) -> None:
            calls.append((number, word))

        reactor.callFromThread(record, 1, word="one")
        self.assertEqual(
            (calls, reactor.from_threads), ([(1, "one")], [(record, (1,), {"word": "one"})])
        )
