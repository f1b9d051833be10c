# -*- test-case-name: loopd.test.test_llama_flow -*-
"""
Flow control from a consumer to the upstream read of a chat: backpressure through the
llama client.

A L{Flow} is the push producer that a consumer registers, e.g. a twisted.web request
streaming a chat to its client (C{request.registerProducer(flow, True)}). The caller passes
the same flow to L{loopd.llama.Client.chat} or C{chat_with_retry}; each chat call attaches
itself (an L{IFlowReader}) when its stream starts and detaches when it ends. When the
consumer's buffers fill up it calls C{pauseProducing}: every attached call stops reading
its socket, and a call that attaches while the flow is paused starts paused.
C{resumeProducing} lets them read again. A retry's new attempt is a new call: it attaches
in whatever state the flow is in at that time.

A paused call is the consumer's doing, not the server's, so its liveness timer is
suspended while paused and counts afresh from the resume. Events from bytes already read
may still arrive while paused.

C{stopProducing} says the consumer has gone for good: every attached call is cancelled
(its connection aborted, which makes llama-server stop generating), as is any call that
attaches later; the chat's Deferred fails with C{CancelledError}. Pure: no reactor, no I/O.
"""

from __future__ import annotations

from twisted.internet.interfaces import IPushProducer
from zope.interface import Interface, implementer

__all__ = ["Flow", "IFlowReader"]


class IFlowReader(Interface):
    """
    What a L{Flow} controls: the upstream read of one chat call.
    """

    def pause() -> None:
        """
        Stop reading the upstream socket until L{resume}, and suspend the liveness limit.
        """

    def resume() -> None:
        """
        Read the upstream socket again; the liveness limit counts from now.
        """

    def cancel() -> None:
        """
        End the call as its Deferred's C{cancel} does: the consumer has gone.
        """


@implementer(IPushProducer)
class Flow:
    """
    A push producer that pauses and resumes the upstream reads of the chat calls attached
    to it (see the module docstring).
    """

    def __init__(self) -> None:
        """
        Start neither paused nor stopped, with no reader attached.
        """
        self._paused = False
        self._stopped = False
        self._readers: list[IFlowReader] = []

    @property
    def paused(self) -> bool:
        """
        Whether the consumer has paused the flow (and not resumed it since).
        """
        return self._paused

    @property
    def stopped(self) -> bool:
        """
        Whether the consumer has stopped the flow for good.
        """
        return self._stopped

    @property
    def readers(self) -> tuple[IFlowReader, ...]:
        """
        The readers attached now, oldest first.
        """
        return tuple(self._readers)

    def attach(self, reader: IFlowReader) -> None:
        """
        Put C{reader} under this flow: it is paused at once if the flow is paused, and
        cancelled at once if the flow is stopped. Attaching it again does nothing.
        """
        if self._stopped:
            reader.cancel()
            return
        if reader in self._readers:
            return
        self._readers.append(reader)
        if self._paused:
            reader.pause()

    def detach(self, reader: IFlowReader) -> None:
        """
        Release C{reader} from this flow, e.g. because its call ended. Detaching a reader
        that is not attached does nothing.
        """
        if reader in self._readers:
            self._readers.remove(reader)

    def pauseProducing(self) -> None:
        """
        The consumer cannot take more for now: pause every attached reader.
        """
        if self._paused or self._stopped:
            return
        self._paused = True
        for reader in self.readers:
            reader.pause()

    def resumeProducing(self) -> None:
        """
        The consumer can take more again: resume every attached reader.
        """
        if not self._paused or self._stopped:
            return
        self._paused = False
        for reader in self.readers:
            reader.resume()

    def stopProducing(self) -> None:
        """
        The consumer has gone for good: cancel every attached reader, and every reader that
        attaches from now on.
        """
        if self._stopped:
            return
        self._stopped = True
        readers, self._readers = self._readers, []
        for reader in readers:
            reader.cancel()
