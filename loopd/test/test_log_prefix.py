"""
Tests for the names that Twisted's log lines give loopd's connections: each protocol and
factory's C{logPrefix} names its component (C{inferproxy}, C{loopd.http}, C{llmqueue}, ...),
never a private class such as C{_CappedClientProtocol}.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.interfaces import ILoggingContext
from twisted.trial.unittest import SynchronousTestCase

from loopd import chatloop, http, inferproxy
from loopd.gateway import channel
from loopd.queue import client_connect, protocol, show

#: Each class whose connections Twisted logs, and the component its lines name.
NAMED: list[tuple[Any, str]] = [
    (http._CappedClientProtocol, "loopd.http"),
    (http._ClientFactory, "loopd.http"),
    (http._BodyReceiver, "loopd.http"),
    (inferproxy._Refusal, "inferproxy"),
    (inferproxy._UpstreamSide, "inferproxy"),
    (inferproxy._ClientSide, "inferproxy"),
    (inferproxy._UpstreamFactory, "inferproxy"),
    (inferproxy.InferProxyFactory, "inferproxy"),
    (protocol.LeaseProtocol, "llmqueue"),
    (protocol.LeaseFactory, "llmqueue"),
    (client_connect.LeaseWire, "llmqueue.client"),
    (client_connect._WireFactory, "llmqueue.client"),
    (show._StatusAsker, "loopd.queue.status"),
    (channel.GatewayChannel, "loopd.gateway"),
    (channel.GatewaySite, "loopd.gateway"),
    (channel._Overloaded, "loopd.gateway"),
    (chatloop._TerminalLines, "loopd.chat"),
]


class LogPrefixTests(SynchronousTestCase):
    """Every protocol and factory of loopd names its component."""

    def test_component_names(self) -> None:
        """
        C{logPrefix()} of each class (an instance made without its constructor, which the
        method does not need) is its component's name, and Twisted asks for it: the class
        provides C{ILoggingContext}.
        """
        for cls, name in NAMED:
            instance = cls.__new__(cls)
            self.assertTrue(ILoggingContext.providedBy(instance), cls)
            self.assertEqual(instance.logPrefix(), name, cls)

    def test_no_class_name(self) -> None:
        """No prefix is a class's own name (Twisted's default)."""
        for cls, _ in NAMED:
            self.assertNotEqual(cls.__new__(cls).logPrefix(), cls.__name__)
