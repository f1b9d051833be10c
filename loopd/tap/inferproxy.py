# -*- test-case-name: loopd.test.test_tap_inferproxy -*-
"""
C{twist inferproxy}: command-line options and the service they build.
"""

from __future__ import annotations

from typing import Any

from twisted.application.service import IService
from twisted.python import usage

from loopd.inferproxy import (
    InferProxyFactory,
    InferProxyService,
    ProxyLimits,
    parse_upstream,
    upstream_endpoint,
)
from loopd.reactor import IServiceReactor, global_reactor
from loopd.tap import ExitOnListenError, freeze_startup_objects, positive_float, positive_int

__all__ = ["Options", "makeService"]

_DEFAULTS = ProxyLimits()


class Options(usage.Options):
    """
    Options of C{twist inferproxy}.
    """

    synopsis = "--listen PATH --upstream HOST:PORT [options]"
    longdesc = (
        "Forward connections accepted on a Unix socket (mode 0600) to a TCP server, "
        "relaying bytes unparsed, with a connection cap and an accept-rate token bucket."
    )
    # Defaults are real numbers: usage.Options does not coerce a default.
    optParameters: list[list[Any]] = [
        ["listen", None, None, "Unix socket path to listen on (required)."],
        ["upstream", None, None, "HOST:PORT of the TCP server (required)."],
        [
            "max-connections",
            None,
            _DEFAULTS.max_connections,
            "Connections open at the same time; more are refused.",
            positive_int,
        ],
        [
            "burst",
            None,
            _DEFAULTS.burst,
            "Accepts allowed back to back (token bucket size).",
            positive_int,
        ],
        [
            "refill",
            None,
            _DEFAULTS.refill_per_second,
            "Token bucket refill, per second.",
            positive_float,
        ],
        [
            "connect-timeout",
            None,
            _DEFAULTS.connect_timeout,
            "Seconds to wait for the upstream connection.",
            positive_float,
        ],
    ]

    def postOptions(self) -> None:
        """
        Require --listen and --upstream, and parse the upstream address.
        """
        for name in ("listen", "upstream"):
            if not self[name]:
                raise usage.UsageError(f"--{name} is required")
        try:
            self["upstream_address"] = parse_upstream(self["upstream"])
        except ValueError as e:
            raise usage.UsageError(str(e)) from None


def makeService(options: Options, reactor: IServiceReactor | None = None) -> IService:
    """
    Build the inferproxy service from parsed options.

    @param options: the parsed L{Options}.
    @param reactor: the reactor to use; the global one when C{None}.
    """
    if reactor is None:
        reactor = global_reactor()
        freeze_startup_objects(reactor)
    limits = ProxyLimits(
        max_connections=options["max-connections"],
        burst=options["burst"],
        refill_per_second=options["refill"],
        connect_timeout=options["connect-timeout"],
    )
    host, port = options["upstream_address"]
    factory = InferProxyFactory(
        upstream_endpoint(reactor, host, port, limits.connect_timeout),
        reactor,
        limits,
        upstream_label=options["upstream"],
    )
    top = ExitOnListenError("inferproxy")
    InferProxyService(reactor, options["listen"], factory).setServiceParent(top)
    return top
