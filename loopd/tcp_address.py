# -*- test-case-name: loopd.test.test_tcp_address -*-
"""
The address of loopd's TCP listener, C{[server] tcp} (DESIGN decision 41): C{HOST:PORT}
read into a L{TcpAddress} that says which interface to bind, its port, and whether it is a
loopback address. Pure: no sockets, no name lookups (C{localhost} is the one name taken,
and it means C{127.0.0.1}).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Final

__all__ = ["TcpAddress", "parse_tcp_address"]

_HOST_PORT: Final = re.compile(r"(?:\[(?P<v6>[^\[\]]+)\]|(?P<host>[^:\[\]]+)):(?P<port>[0-9]+)")
_SHAPE: Final = 'HOST:PORT, such as "127.0.0.1:8080", "[::1]:8080" or "localhost:8080"'
_PORT_MAX: Final = 65535


@dataclass(frozen=True)
class TcpAddress:
    """
    Where a TCP listener binds.

    @ivar host: the interface's address, C{127.0.0.1} or C{::1} (no brackets).
    @ivar port: the port, 0 for any free one.
    @ivar ipv6: the address is an IPv6 one.
    @ivar loopback: the address is a loopback one (C{127.0.0.0/8}, C{::1}).
    """

    host: str
    port: int
    ipv6: bool
    loopback: bool

    def url(self, port: int | None = None) -> str:
        """
        The HTTP root clients use, C{http://127.0.0.1:8080} or C{http://[::1]:8080}.

        @param port: the port actually bound, when C{port} is 0; default C{port}.
        """
        host = f"[{self.host}]" if self.ipv6 else self.host
        return f"http://{host}:{self.port if port is None else port}"

    def browser_url(self, port: int | None = None) -> str:
        """
        The HTTP root a browser on this machine opens (the status page's links): L{url},
        but a listener on every address (C{0.0.0.0}, C{::}, with C{allow_remote}) is
        reached on the loopback one (C{127.0.0.1}, C{[::1]}).

        @param port: the port actually bound, when C{port} is 0; default C{port}.
        """
        if ipaddress.ip_address(self.host).is_unspecified:
            loopback = "::1" if self.ipv6 else "127.0.0.1"
            return TcpAddress(loopback, self.port, self.ipv6, True).url(port)
        return self.url(port)


def parse_tcp_address(text: str) -> TcpAddress:
    """
    Read C{HOST:PORT}: an IPv4 address, an IPv6 address in brackets, or C{localhost}
    (C{127.0.0.1}); a port from 0 to 65535.

    @raise ValueError: the text is not such an address; the message says what was expected.
    """
    match = _HOST_PORT.fullmatch(text)
    if match is None:
        raise ValueError(_SHAPE)
    port = int(match.group("port"))
    if port > _PORT_MAX:
        raise ValueError(f"{_SHAPE}, with a port from 0 to {_PORT_MAX}")
    host = match.group("v6") or match.group("host")
    if host.lower() == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{_SHAPE}: the host is an IP address or localhost") from None
    if (address.version == 6) != (match.group("v6") is not None):
        raise ValueError(f"{_SHAPE}: brackets hold an IPv6 address, and only that")
    loopback = address.is_loopback
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        loopback = address.ipv4_mapped.is_loopback
    return TcpAddress(str(address), port, address.version == 6, loopback)
