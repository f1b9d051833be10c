# -*- test-case-name: loopd.test.test_reactor -*-
"""
A memory reactor that loopd's reactor interfaces accept.

Twisted's C{MemoryReactorClock} provides each of Twisted's interfaces that
L{loopd.reactor.IServiceReactor} combines but C{callFromThread}, and declares none of
loopd's combined ones, so the type checker refuses it where a part of loopd takes an
L{IUnixReactor <loopd.reactor.IUnixReactor>} or an L{IServiceReactor
<loopd.reactor.IServiceReactor>}. L{MemoryLoopdReactor} is that reactor with
C{callFromThread} (the call runs at once: there is one thread) and the declaration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.testing import MemoryReactorClock
from zope.interface import implementer

from loopd.reactor import IServiceReactor

__all__ = ["MemoryLoopdReactor"]


@implementer(IServiceReactor)
class MemoryLoopdReactor(MemoryReactorClock):
    """
    A C{MemoryReactorClock} that provides L{IServiceReactor} (and so
    L{IUnixReactor <loopd.reactor.IUnixReactor>}): its clock is advanced by hand, its
    listeners and connections are recorded, and C{callFromThread} runs the call at once.

    @ivar from_threads: every call made through C{callFromThread}, in order: the callable,
        its positional and its keyword arguments.
    """

    def __init__(self) -> None:
        """A reactor at time 0 with nothing listening, connecting or called."""
        super().__init__()
        self.from_threads: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []

    def callFromThread(  # noqa: N802 - Twisted's name
        self, callable: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> None:
        """Record the call and run it at once."""
        self.from_threads.append((callable, args, kwargs))
        callable(*args, **kwargs)
