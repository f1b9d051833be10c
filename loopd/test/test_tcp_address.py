"""
Tests for L{loopd.tcp_address}: C{HOST:PORT} into the interface, port and loopback flag.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from loopd.tcp_address import TcpAddress, parse_tcp_address


class ParseTests(SynchronousTestCase):
    """
    L{parse_tcp_address}.
    """

    def test_loopback(self) -> None:
        """IPv4, bracketed IPv6, localhost and an IPv4-mapped loopback are loopback."""
        cases = {
            "127.0.0.1:8080": TcpAddress("127.0.0.1", 8080, False, True),
            "[::1]:0": TcpAddress("::1", 0, True, True),
            "localhost:80": TcpAddress("127.0.0.1", 80, False, True),
            "LocalHost:80": TcpAddress("127.0.0.1", 80, False, True),
            "127.1.2.3:1": TcpAddress("127.1.2.3", 1, False, True),
            "[::ffff:127.0.0.1]:5": TcpAddress("::ffff:7f00:1", 5, True, True),
        }
        for text, expected in cases.items():
            self.assertEqual(parse_tcp_address(text), expected, text)

    def test_remote(self) -> None:
        """Every other address is not loopback."""
        for text in ("0.0.0.0:1", "[::]:1", "10.0.0.1:1", "[fe80::1]:1"):
            self.assertFalse(parse_tcp_address(text).loopback, text)

    def test_refused(self) -> None:
        """No port, a port past 65535, a name, unbracketed IPv6, bracketed IPv4."""
        for text in (
            "127.0.0.1",
            "127.0.0.1:",
            ":80",
            "127.0.0.1:65536",
            "host:80",
            "::1:80",
            "[127.0.0.1]:80",
            "[::1]",
            "127.0.0.1:-1",
            "1.2.3.4.5:80",
        ):
            self.assertRaises(ValueError, parse_tcp_address, text)

    def test_url(self) -> None:
        """The HTTP root, IPv6 in brackets, with the port bound when asked for port 0."""
        self.assertEqual(parse_tcp_address("127.0.0.1:80").url(), "http://127.0.0.1:80")
        self.assertEqual(parse_tcp_address("[::1]:0").url(4321), "http://[::1]:4321")

    def test_browser_url(self) -> None:
        """
        A browser opens the listener's own root, or the loopback one for a listener on
        every address.
        """
        self.assertEqual(parse_tcp_address("127.0.0.1:0").browser_url(80), "http://127.0.0.1:80")
        self.assertEqual(parse_tcp_address("[::1]:8080").browser_url(), "http://[::1]:8080")
        self.assertEqual(parse_tcp_address("0.0.0.0:9").browser_url(), "http://127.0.0.1:9")
        self.assertEqual(parse_tcp_address("[::]:0").browser_url(7), "http://[::1]:7")
        self.assertEqual(parse_tcp_address("10.1.2.3:9").browser_url(), "http://10.1.2.3:9")
