# -*- test-case-name: loopd.test.test_queue_paths -*-
"""
Where the lease daemon's files live (DESIGN §3 decision 13): the agent dir is C{--agent-dir},
else C{$PI_CODING_AGENT_DIR} (with C{~} expanded), else C{~/.pi/agent}; the socket and the
config file sit in it under fixed names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["CONFIG_NAME", "SOCKET_NAME", "agent_dir", "config_path", "socket_path"]

SOCKET_NAME = "llm-queue.sock"
CONFIG_NAME = "llm-queue.json"


def agent_dir(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """
    Return the agent dir: C{explicit}, else C{$PI_CODING_AGENT_DIR}, else C{~/.pi/agent};
    C{~} is expanded in each.
    """
    env = os.environ if environ is None else environ
    chosen = explicit or env.get("PI_CODING_AGENT_DIR") or os.path.join("~", ".pi", "agent")
    return os.path.expanduser(chosen)


def socket_path(directory: str) -> str:
    """
    Return the daemon's socket path in the agent dir C{directory}.
    """
    return os.path.join(directory, SOCKET_NAME)


def config_path(directory: str) -> str:
    """
    Return the queue config's path in the agent dir C{directory}.
    """
    return os.path.join(directory, CONFIG_NAME)
