# -*- test-case-name: loopd.test.test_tap -*-
"""
The C{twist} plugins' option parsers and service builders, one module per command.
"""

from __future__ import annotations

import gc

from twisted.application.service import MultiService
from twisted.internet.interfaces import IReactorCore

from loopd.unixsocket import UnixSocketError

__all__ = ["ExitOnListenError", "freeze_startup_objects", "positive_float", "positive_int"]


class ExitOnListenError(MultiService):
    """
    Starts its children, turning a L{UnixSocketError} into a one-line exit.

    C{twist} starts services before the reactor runs, so the C{SystemExit} raised here ends
    the process with the reason on stderr and status 1, instead of a traceback.
    """

    def __init__(self, command: str) -> None:
        """
        @param command: the command name that prefixes the message.
        """
        super().__init__()
        self.command = command

    def startService(self) -> None:
        """
        Start every child service, or exit with the reason a socket could not be listened on.
        """
        try:
            super().startService()
        except UnixSocketError as e:
            raise SystemExit(f"{self.command}: {e}") from None


def positive_int(value: str) -> int:
    """
    Parse an option value that must be a positive integer.
    """
    number = int(value)
    if number < 1:
        raise ValueError(f"must be a positive integer, got {value}")
    return number


positive_int.coerceDoc = "A positive integer."  # type: ignore[attr-defined]


def positive_float(value: str) -> float:
    """
    Parse an option value that must be a positive, finite number.
    """
    number = float(value)
    if not number > 0 or number == float("inf"):
        raise ValueError(f"must be a positive number, got {value}")
    return number


positive_float.coerceDoc = "A positive number."  # type: ignore[attr-defined]


def freeze_startup_objects(reactor: IReactorCore) -> None:
    """
    Once C{reactor} runs, move every object made so far (modules, the configuration, the
    services) out of the garbage collector's reach with C{gc.freeze()}.

    They live as long as the process, yet each full collection walked them all: in
    C{twist loopd} about 60,000 objects and a 24 ms pause every few hundred requests,
    landing on whichever request was being served. Only the C{twist} commands call this
    (their C{makeService} with no reactor given); a program that embeds the services keeps
    its own collector settings.
    """
    reactor.callWhenRunning(gc.freeze)
