"""
The C{twist} plugins' option parsers and service builders, one module per command.
"""

from __future__ import annotations

from twisted.application.service import MultiService

from loopd.unixsocket import UnixSocketError

__all__ = ["ExitOnListenError"]


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
