# -*- test-case-name: test.test_tap_loopd -*-
"""
C{twist loopd}: command-line options and the service they build.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.application.service import IService
from twisted.python import usage

from loopd.config import ConfigError, load_config
from loopd.service import LoopdService

__all__ = ["Options", "default_config_path", "makeService"]


def default_config_path(environ: dict[str, str] | None = None) -> str:
    """
    C{$XDG_CONFIG_HOME/loopd/loopd.toml}, else C{~/.config/loopd/loopd.toml}.
    """
    env = os.environ if environ is None else environ
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "loopd", "loopd.toml")


class Options(usage.Options):
    """
    Options of C{twist loopd}.
    """

    synopsis = "[--config PATH]"
    longdesc = (
        "Serve the OpenAI-compatible session gateway for the endpoints of a loopd.toml, "
        "after the startup self-test has passed on each endpoint that asks for it."
    )
    optParameters: list[list[Any]] = [
        ["config", "c", None, "The loopd.toml to read (default: " + default_config_path() + ")."],
    ]

    def postOptions(self) -> None:
        """
        Read and validate the configuration now, so a bad one is a usage error.
        """
        path = self["config"] or default_config_path()
        try:
            self["loaded"] = load_config(path)
        except ConfigError as e:
            raise usage.UsageError(f"invalid configuration:\n{e}") from None


def makeService(options: Options, reactor: Any = None) -> IService:
    """
    Build the loopd service from parsed options.
    """
    if reactor is None:
        from twisted.internet import reactor
    return LoopdService(reactor, options["loaded"])
