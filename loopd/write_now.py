# -*- test-case-name: loopd.test.test_write_now -*-
"""
Writing without waiting for the reactor's next turn.

A Twisted transport's C{write} only queues: the bytes go out when the reactor next finds the
socket writable, which costs every hop a reactor turn (an C{epoll_ctl} to ask for
writability, an C{epoll_wait} that reports it, another C{epoll_ctl} to stop asking). On the
hot path that is one turn per streamed chunk in each process it passes, and one more before
a request leaves. The two functions here send at once what the kernel takes; what it does
not take stays queued in the transport and goes out as before, so backpressure (a
producer paused when the buffer fills) works unchanged.

 - L{send_or_queue}: C{data} straight to the socket when the transport has nothing queued
   (inferproxy's relay: it never has anything to add to the bytes).
 - L{flush}: what has been queued on the transport already, at once (the gateway's answers
   and the llama client's requests, which twisted.web and C{HTTP11ClientProtocol} write
   as several pieces).

Both read the buffer attributes of L{twisted.internet.abstract.FileDescriptor}, which every
socket transport of Twisted's reactors is; any other transport (a test's in-memory one, a
TLS wrapper) is left to its own C{write}, which is always correct, only later. A transport
that is closing or half-closed is never touched: its last bytes and its close stay in
Twisted's order.
"""

from __future__ import annotations

from typing import Any

__all__ = ["flush", "send_or_queue"]


def _writable_now(transport: Any) -> bool:
    """
    Whether C{transport} is a socket transport of Twisted's that is open both ways and may
    be written to directly.
    """
    return (
        hasattr(transport, "_tempDataLen")
        and transport.connected
        and not transport.disconnecting
        and not getattr(transport, "_writeDisconnecting", False)
        and not getattr(transport, "_writeDisconnected", False)
    )


def send_or_queue(transport: Any, data: bytes) -> None:
    """
    Send C{data} at once when C{transport} has nothing queued, else queue it; what the
    kernel does not take is queued too.
    """
    if _writable_now(transport) and transport._tempDataLen == 0 and not transport.dataBuffer:
        sent = transport.writeSomeData(data)
        if isinstance(sent, int) and sent > 0:
            data = data[sent:]
    if data:
        transport.write(data)


def flush(transport: Any) -> None:
    """
    Send what C{transport} has queued now, as far as the kernel takes it, rather than on the
    reactor's next turn.

    This is the transport's own C{doWrite}, the step the reactor takes when the socket is
    writable: it sends the queue, stops asking for writability once the queue is empty and
    resumes a producer paused on it. A socket that takes nothing keeps its queue; one that
    fails is left for the reactor, whose next C{doWrite} meets the same error and closes the
    connection as usual.
    """
    if _writable_now(transport) and (transport._tempDataLen or transport.dataBuffer):
        transport.doWrite()
