"""
A fake process reactor for the tests of the demo's child-process harnesses
(L{loopd.test.test_real_server}, L{loopd.test.test_router_server}): a C{task.Clock} that
spawns L{FakeProcess}es, which a test feeds with output and ends by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import AnyStr, cast

from twisted.internet.error import ProcessDone, ProcessExitedAlready, ProcessTerminated
from twisted.internet.interfaces import IProcessProtocol, IProcessTransport, IReactorProcess
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from zope.interface import implementer

__all__ = ["FakeProcess", "FakeProcessReactor"]


class FakeProcess:
    """A spawned process (the part of IProcessTransport the harnesses use)."""

    pid = 4242

    def __init__(self, protocol: ProcessProtocol, args: list[str]) -> None:
        self.protocol = protocol
        self.args = args
        self.signals: list[str | int] = []
        self.stdin = b""
        self.stdin_closed = False
        self.ended = False
        protocol.makeConnection(cast(IProcessTransport, self))

    def signalProcess(self, name: str | int) -> None:
        """Record a signal; a finished process refuses it like a real one."""
        if self.ended:
            raise ProcessExitedAlready()
        self.signals.append(name)

    def write(self, data: bytes) -> None:
        """Record bytes written to stdin."""
        self.stdin += data

    def closeStdin(self) -> None:
        """Record that stdin was closed."""
        self.stdin_closed = True

    def end(self, code: int | None = 0, sig: int | None = None) -> None:
        """Finish the process with an exit code or a signal."""
        self.ended = True
        if code == 0 and sig is None:
            reason: Exception = ProcessDone(0)
        else:
            reason = ProcessTerminated(code, sig)
        self.protocol.processEnded(Failure(reason))


@implementer(IReactorProcess)
class FakeProcessReactor(Clock):
    """A `task.Clock` that also spawns `FakeProcess`es."""

    def __init__(self) -> None:
        super().__init__()
        self.spawned: list[FakeProcess] = []

    def spawnProcess(
        self,
        processProtocol: IProcessProtocol,
        executable: bytes | str,
        args: Sequence[bytes | str],
        env: Mapping[AnyStr, AnyStr] | None = None,
        path: bytes | str | None = None,
        uid: int | None = None,
        gid: int | None = None,
        usePTY: bool = False,
        childFDs: Mapping[int, int | str] | None = None,
    ) -> IProcessTransport:
        """Record the spawn and connect the protocol to a fake process."""
        assert isinstance(processProtocol, ProcessProtocol)
        process = FakeProcess(processProtocol, [str(a) for a in args])
        self.spawned.append(process)
        return cast(IProcessTransport, process)
