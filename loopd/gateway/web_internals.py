# -*- test-case-name: loopd.test.test_gateway_web_internals -*-
"""
The private parts of twisted.web that the gateway's HTTP channel (L{loopd.gateway.channel})
is built on, named in one place.

twisted.web's C{HTTPChannel} has no public hooks for what the channel adds (deadlines from
the first byte, a body rate floor, refusals in a front door's JSON shape, no parsing while a
pipelining client does not read, request smuggling refused), so the channel overrides two of
its private methods, reads and sets its parsing state, and makes its transfer decoders
itself. Twisted promises none of these names: C{setup.cfg} accepts only the Twisted releases
the channel is tested with, and L{missing} says which of them the installed Twisted lacks,
which C{loopd.test.test_gateway_web_internals} checks (it also fails when the channel uses a
private name of C{HTTPChannel} that is not listed here). Moving to a new Twisted release
starts with that test.
"""

from __future__ import annotations

from typing import Final

from twisted.web.http import HTTPChannel
from twisted.web.http import _ChunkedTransferDecoder as ChunkedTransferDecoder
from twisted.web.http import _IdentityTransferDecoder as IdentityTransferDecoder

__all__ = [
    "CHANNEL_ATTRIBUTES",
    "CHANNEL_METHODS",
    "ChunkedTransferDecoder",
    "IdentityTransferDecoder",
    "missing",
]

CHANNEL_METHODS: Final = frozenset(
    {
        # Overridden: the channel picks the body's decoder itself (smuggling, the size cap).
        "_maybeChooseTransferDecoder",
        # Overridden: twisted.web's own 400 becomes a JSON refusal.
        "_respondToBadRequestAndDisconnect",
        # Called: the decoders' end-of-body callback.
        "_finishRequestBody",
    }
)
"""The private methods of C{HTTPChannel} the channel overrides or calls."""

CHANNEL_ATTRIBUTES: Final = frozenset(
    {
        "_abortingCall",  # the forced close after abortTimeout
        "_buffer",  # LineReceiver's unparsed bytes: has a header block begun?
        "_dataBuffer",  # what arrives while a request is handled
        "_handlingRequest",  # whether a request is being answered
        "_networkProducer",  # the transport, paused while answers go unread
        "_optimisticEagerReadSize",  # how much is buffered before reading pauses
        "_receivedHeaderCount",  # header lines so far
        "_receivedHeaderSize",  # header bytes so far
        "_savedTimeOut",  # the idle timeout put back after a request
        "_transferDecoder",  # the body's decoder
        "_waitingForTransport",  # answers the transport has not taken yet
    }
)
"""The private attributes of a connected C{HTTPChannel} the channel reads or sets."""


def missing(channel: HTTPChannel) -> list[str]:
    """
    The names of L{CHANNEL_METHODS} and L{CHANNEL_ATTRIBUTES} that C{channel}, a connected
    C{HTTPChannel} of the installed Twisted, lacks, sorted; the decoder classes are imported
    above, so a Twisted without them fails on import, naming them.
    """
    return sorted(
        name for name in CHANNEL_METHODS | CHANNEL_ATTRIBUTES if not hasattr(channel, name)
    )
