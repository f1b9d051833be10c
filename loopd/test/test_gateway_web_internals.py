"""
Tests for L{loopd.gateway.web_internals}: the private twisted.web names the gateway's HTTP
channel is built on exist in the installed Twisted, the list names every one the channel
uses, and nothing else in the package reaches into twisted.web's privates.
"""

from __future__ import annotations

import ast
from pathlib import Path

from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http import HTTPChannel

import loopd
from loopd.gateway import channel as channel_module
from loopd.gateway import web_internals
from loopd.gateway.web_internals import CHANNEL_ATTRIBUTES, CHANNEL_METHODS, missing

PACKAGE = Path(loopd.__file__).parent


def connected_channel() -> HTTPChannel:
    """A plain twisted.web channel, connected, as the gateway's own are."""
    channel = HTTPChannel()
    channel.makeConnection(StringTransport())
    return channel


def private_names_used(source: str) -> set[str]:
    """Every C{self._name} in C{source}."""
    return {
        node.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    }


class InstalledTwistedTests(SynchronousTestCase):
    """The installed Twisted has every name the channel relies on."""

    def test_none_missing(self) -> None:
        """
        A connected C{HTTPChannel} has every listed method and attribute. When a Twisted
        release moves one, this fails naming it.
        """
        self.assertEqual(missing(connected_channel()), [])

    def test_missing_names_what_is_gone(self) -> None:
        """A channel without one of the names is reported by that name."""
        channel = connected_channel()
        del channel._dataBuffer
        self.assertEqual(missing(channel), ["_dataBuffer"])


class GatheredTests(SynchronousTestCase):
    """The private names are gathered here, and only here."""

    def test_channel_uses_only_listed_names(self) -> None:
        """
        Every private name of C{HTTPChannel} that the gateway's channel reads, sets, calls or
        overrides is in the list.
        """
        source = Path(channel_module.__file__).read_text()
        plain = connected_channel()
        inherited = {name for name in private_names_used(source) if hasattr(plain, name)}
        tree = ast.parse(source)
        overridden = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef)
            and node.name.startswith("_")
            and not node.name.startswith("__")
            and hasattr(HTTPChannel, node.name)
        }
        self.assertEqual((inherited | overridden) - (CHANNEL_METHODS | CHANNEL_ATTRIBUTES), set())

    def test_no_other_module_imports_twisted_privates(self) -> None:
        """
        Only L{loopd.gateway.web_internals} imports a private name from twisted.web; the
        package's other modules take them from it.
        """
        own = Path(web_internals.__file__)
        offenders = []
        for path in sorted(PACKAGE.rglob("*.py")):
            if path == own or "test" in path.relative_to(PACKAGE).parts[:1]:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "twisted.web"
                ):
                    offenders += [
                        f"{path.relative_to(PACKAGE)}: {alias.name}"
                        for alias in node.names
                        if alias.name.startswith("_")
                    ]
        self.assertEqual(offenders, [])
