# -*- test-case-name: loopd.test.test_queue_daemon -*-
"""
C{twist llmqueue}: command-line options and the lease daemon they build.
"""

from __future__ import annotations

import sys
from typing import Any

from twisted.application.service import IService
from twisted.python import usage

from loopd.queue.daemon import LlmQueueService
from loopd.queue.paths import agent_dir
from loopd.reactor import IServiceReactor, global_reactor
from loopd.tap import freeze_startup_objects, positive_int

__all__ = ["Options", "makeService"]

_DEFAULT_SWEEP_MS = 1000


class Options(usage.Options):
    """
    Options of C{twist llmqueue}.
    """

    synopsis = "[--agent-dir DIR] [--sweep-ms N] [--models-json PATH]"
    longdesc = (
        "Serve the LLM lease queue on <agent dir>/llm-queue.sock (newline-delimited JSON), "
        "with the policy of <agent dir>/llm-queue.json, reloaded when it changes. The agent "
        "dir is --agent-dir, else $PI_CODING_AGENT_DIR, else ~/.pi/agent."
    )
    # Defaults are real numbers: usage.Options does not coerce a default.
    optParameters: list[list[Any]] = [
        ["agent-dir", None, None, "The directory of the socket and the config file."],
        [
            "sweep-ms",
            None,
            _DEFAULT_SWEEP_MS,
            "Milliseconds between sweeps for lapsed and idle leases.",
            positive_int,
        ],
        [
            "models-json",
            None,
            None,
            "The models.json that maps provider names to endpoints (optional).",
        ],
    ]


def makeService(options: Options, reactor: IServiceReactor | None = None) -> IService:
    """
    Build the lease daemon from parsed options.

    @param options: the parsed L{Options}.
    @param reactor: the reactor to use; the global one when C{None}.
    """
    if reactor is None:
        reactor = global_reactor()
        freeze_startup_objects(reactor)
    return LlmQueueService(
        reactor,
        agent_dir(options["agent-dir"]),
        options["sweep-ms"],
        options["models-json"],
        sys.stderr,
        sys.exit,
        stdout=sys.stdout,
        handle_sigterm=True,
    )
