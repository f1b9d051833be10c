# -*- test-case-name: test.test_tap_loopd -*-
"""
C{twist loopd}: command-line options and the service they build.
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any

from twisted.application.service import IService
from twisted.python import usage

from loopd.config import ConfigError, load_config
from loopd.reactor import IServiceReactor, global_reactor
from loopd.service import LoopdService
from loopd.tap import freeze_startup_objects

__all__ = ["EX_USAGE", "Options", "default_config_path", "makeService"]

#: The exit status of a config that cannot be used (C{sysexits.h}'s C{EX_USAGE}, as C{twist}
#: exits for a usage error).
EX_USAGE = 64


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

    @ivar stderr: where an invalid configuration's errors are written (C{sys.stderr} unless
        set).
    """

    stderr: IO[str] | None = None

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
        Read and validate the configuration now, before anything starts.

        @raise SystemExit: with L{EX_USAGE}, the configuration is invalid; its errors have been
            written to C{stderr}, and only they: not a C{UsageError}, after which C{twist}
            would print the whole usage block and bury the errors above it.
        """
        path = self["config"] or default_config_path()
        try:
            self["loaded"] = load_config(path)
        except ConfigError as e:
            out = self.stderr if self.stderr is not None else sys.stderr
            out.write(f"twist loopd: invalid configuration:\n{e}\n")
            out.flush()
            raise SystemExit(EX_USAGE) from None


def makeService(options: Options, reactor: IServiceReactor | None = None) -> IService:
    """
    Build the loopd service from parsed options.
    """
    if reactor is None:
        reactor = global_reactor()
        freeze_startup_objects(reactor)
    return LoopdService(reactor, options["loaded"])
