# -*- test-case-name: loopd.test.test_selftest -*-
"""
The startup self-test (seed §5): the server behind an endpoint is the one the config
describes, its tool calls parse, and a second turn reuses the first turn's prompt cache.

Pure orchestration over a L{Client}. The three checks run in order on the endpoint's main
slot (slot 0) and cost about 1,000 tokens; a failing check is recorded and the next one still
runs, except after a C{/props} that never reached the server: then the other two are not run
(they would only wait again) and fail as such.

The self-test has its own short, bounded wait (L{wait_for}), not the llama client's retry
schedule (2 + 8 + 30 s per request, which made an unreachable endpoint silent for ~113 s):
a request that fails because the endpoint cannot be reached (no socket, connection refused,
refused by its inferproxy, closed before any answer, no answer) is tried again after 0.5, 1,
then every 2 s, until the endpoint's C{selftest_wait_ms} (default 10 s) since the first
attempt; a server loading its model (HTTP 503) is waited for up to C{limits.load_wait_ms}
instead. Each failed attempt is reported as it happens, one progress line saying what the
self-test waits for and how long it has waited ("endpoint tiny: connection refused (nothing
is listening on the socket), retrying 1.5 of 10 s"); the check's failure line says what is
wrong in words (L{describe_error}). L{require_selftests} is the gate C{twist loopd} passes
before it serves.

The package is cut by concept: L{loopd.selftest.report} (the results), L{loopd.selftest.wait}
(the bounded wait and its words) and L{loopd.selftest.checks} (the checks and the gate).
"""

from __future__ import annotations

from loopd.selftest.checks import (
    WEATHER_TOOL,
    judge_cache,
    judge_props,
    judge_tool_call,
    require_selftests,
    run_selftest,
)
from loopd.selftest.report import CheckResult, SelftestFailed, SelftestReport
from loopd.selftest.wait import RETRY_STEPS_S, NoAnswer, Progress, describe_error, wait_for

__all__ = [
    "RETRY_STEPS_S",
    "CheckResult",
    "NoAnswer",
    "Progress",
    "SelftestFailed",
    "SelftestReport",
    "WEATHER_TOOL",
    "describe_error",
    "judge_cache",
    "judge_props",
    "judge_tool_call",
    "require_selftests",
    "run_selftest",
    "wait_for",
]
