# -*- test-case-name: loopd.test.test_moa_report -*-
"""
What a mesh turn reports besides its answer (reference/mesh-moa.md §1.12, DESIGN §3 decision
33): how it ended (L{TurnLabel}) and its counts (L{TurnReport}), as the C{x-moa-*} headers
(L{moa_headers}), and the ids of its answer (L{moa_id}) and of the tool call it emits
(L{call_id}). The answer itself is written by the front door the request came through
(L{loopd.gateway.doors.door.Door.mesh_answer}); on chat completions in the reference's own
shapes, L{loopd.gateway.doors.chat_mesh}.

Nothing here reads a clock: ids are the lowercase hex of the nanoseconds the caller passes,
so tests and replays are exact.

L{moa_headers} writes C{x-moa-elapsed-ms}, C{x-moa-turn}, C{x-moa-workers},
C{x-moa-workers-ok}, C{x-moa-reducer} (C{true}/C{false}) and C{x-moa-reducer-attempts}, in
that order, as bytes, with CR and LF stripped from the values. Per decision 33 they go on
every non-streaming response and on every 502; a streamed success sends its headers before
the result is known and may leave them out. Quirks 5 and 6 of §7: the labels say what
happened; decision 33 says which label and counts a turn reports: a grace exit is
C{early-exit}, and a tool-result turn reports 1 worker, also when every reducer failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["TurnLabel", "TurnReport", "call_id", "moa_headers", "moa_id"]


class TurnLabel(str, Enum):
    """
    The C{x-moa-turn} value: how the turn ended (§1.12, decision 33).
    """

    EARLY_EXIT = "early-exit"
    FANOUT = "fanout"
    TOOL_RESULT = "tool-result"
    FAILED = "failed"


@dataclass(frozen=True)
class TurnReport:
    """
    What the C{x-moa-*} headers say about one turn (§1.12).

    @ivar elapsed_ms: the turn's duration in milliseconds
    @ivar turn: how it ended
    @ivar workers: the number of workers dispatched (1 on a tool-result turn)
    @ivar workers_ok: how many of them succeeded
    @ivar reducer_used: whether a reducer's reply made the answer
    @ivar reducer_attempts: how many reducer calls were started
    """

    elapsed_ms: int
    turn: TurnLabel
    workers: int
    workers_ok: int
    reducer_used: bool
    reducer_attempts: int


def _hex(nanoseconds: int) -> str:
    """
    C{nanoseconds} in lowercase hex, without prefix; a negative count is a C{ValueError}.
    """
    if nanoseconds < 0:
        raise ValueError(f"nanoseconds must not be negative, got {nanoseconds}")
    return format(nanoseconds, "x")


def moa_id(nanoseconds: int) -> str:
    """
    The completion id of a mesh body: C{"chatcmpl-moa-"} plus C{nanoseconds} (since the
    epoch, from the caller's clock) in lowercase hex.
    """
    return "chatcmpl-moa-" + _hex(nanoseconds)


def call_id(nanoseconds: int) -> str:
    """
    The id of a tool call the mesh emits: C{"call_"} plus C{nanoseconds} in lowercase hex.
    """
    return "call_" + _hex(nanoseconds)


def _header_value(value: str) -> bytes:
    """
    C{value} as a header value: CR and LF removed, UTF-8 encoded.
    """
    return value.replace("\r", "").replace("\n", "").encode("utf-8")


def moa_headers(report: TurnReport) -> list[tuple[bytes, bytes]]:
    """
    The C{x-moa-*} headers of C{report} (§1.12), in the reference's order, names and values
    as bytes, CR and LF stripped from the values.
    """
    values = [
        (b"x-moa-elapsed-ms", str(report.elapsed_ms)),
        (b"x-moa-turn", str(report.turn.value)),
        (b"x-moa-workers", str(report.workers)),
        (b"x-moa-workers-ok", str(report.workers_ok)),
        (b"x-moa-reducer", "true" if report.reducer_used else "false"),
        (b"x-moa-reducer-attempts", str(report.reducer_attempts)),
    ]
    return [(name, _header_value(value)) for name, value in values]
