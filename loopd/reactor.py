# -*- test-case-name: loopd.test.test_reactor -*-
"""
The reactor loopd needs: each part's reactor as one interface, and the global reactor
declared to provide them.

Every part of loopd takes the reactor it runs on as an argument (only L{loopd.cli} and
the C{twist} plugins' C{makeService} reach the global one, through L{global_reactor}). A
part that only schedules timers takes an C{IReactorTime}; one that needs more takes one of
the interfaces below, each combining Twisted's as C{treq}'s C{_ITreqReactor} does, so that
the type checker says what each part uses and still lets it hand the same object to the
Twisted APIs that take one of the parts (C{Deferred.addTimeout} an C{IReactorTime},
C{UNIXClientEndpoint} an C{IReactorUNIX}):

 - L{IUnixReactor}: timers and Unix-socket connections, a client's (of llama-server, of
   the lease daemon, of the gateway).
 - L{IProcessReactor}: timers and child processes, the demo's children's.
 - L{IServiceReactor}: a C{twist} service's and the terminal chat's: a client's, and the
   reactor's own life (C{IReactorCore}), file descriptors (inotify, stdin), calls from
   other threads (a signal handler, the readline thread) and TCP listeners.
 - L{ILoopdReactor}: all of them, what the CLI's commands run on.

These are zope interfaces, not C{typing.Protocol}s, for two reasons: a Protocol is not an
C{IReactorTime} to the mypy-zope plugin, so every Twisted call taking one would need a cast;
and zope interfaces are declared, so L{global_reactor} can check what the running reactor
provides. The price is that a reactor must declare a combined interface to be accepted,
which Twisted's own reactors and test doubles do not: L{global_reactor} declares it on the
global reactor after checking every part, and L{loopd.testing.reactor} offers the memory
reactor that declares L{IServiceReactor} for tests.
"""

from __future__ import annotations

from typing import cast

from twisted.internet.interfaces import (
    IReactorCore,
    IReactorFDSet,
    IReactorFromThreads,
    IReactorProcess,
    IReactorTCP,
    IReactorTime,
    IReactorUNIX,
)
from zope.interface import Interface, alsoProvides
from zope.interface.interface import InterfaceClass

__all__ = [
    "ILoopdReactor",
    "IProcessReactor",
    "IServiceReactor",
    "IUnixReactor",
    "as_loopd_reactor",
    "global_reactor",
    "missing_parts",
]


class IUnixReactor(IReactorTime, IReactorUNIX):
    """
    Timers and Unix-socket connections: what a client of llama-server, of the lease daemon
    or of the gateway runs on.
    """


class IProcessReactor(IReactorProcess, IReactorTime):
    """
    Child processes and timers: what starts a child and times its start out (the demo's).
    """


class IServiceReactor(IUnixReactor, IReactorCore, IReactorFDSet, IReactorFromThreads, IReactorTCP):
    """
    What a C{twist} service (the gateway, the lease daemon, inferproxy) and the terminal
    chat run on: a client's reactor, and the reactor's own life (start, stop, shutdown
    triggers), file descriptors (inotify, stdin), calls from other threads (a signal
    handler, the readline thread) and TCP (the gateway's listener, inferproxy's upstream).
    """


class ILoopdReactor(IServiceReactor, IProcessReactor):
    """
    Everything loopd's programs use of a reactor: what the CLI's commands run on.
    """


def missing_parts(interface: InterfaceClass, reactor: object) -> list[str]:
    """
    The names of Twisted's interfaces that C{interface} combines and C{reactor} does not
    provide, in C{interface}'s resolution order (none for a reactor that can serve as one).
    """
    return [
        part.__name__
        for part in interface.__iro__
        if part is not Interface
        and not part.__module__.startswith(__name__)
        and not part.providedBy(reactor)
    ]


def as_loopd_reactor(reactor: object) -> ILoopdReactor:
    """
    Declare that C{reactor} provides L{ILoopdReactor} (and so every interface here), having
    checked that it provides each of Twisted's interfaces that it combines.

    @raise TypeError: naming the interfaces C{reactor} lacks.
    """
    missing = missing_parts(ILoopdReactor, reactor)
    if missing:
        raise TypeError(f"{reactor!r} is not a reactor loopd can run on: no {', '.join(missing)}")
    alsoProvides(reactor, ILoopdReactor)
    return cast(ILoopdReactor, reactor)


def global_reactor() -> ILoopdReactor:
    """
    The global reactor (installing the default one if none is yet), declared to provide
    L{ILoopdReactor}. Only L{loopd.cli} and the C{twist} plugins' C{makeService} call it.
    """
    from twisted.internet import reactor

    return as_loopd_reactor(reactor)
