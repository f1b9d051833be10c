# -*- test-case-name: loopd.test.test_moa_tool_guard -*-
"""
The tool guards of the reducer: v2's loop guard (reference C{mesh-moa.md} §6, DESIGN
decision 32) and the response-side rule that a tool call goes out only for a tool the
request declared (§1.12, issue 6).

The pieces already exist elsewhere and are used, not repeated: L{loopd.moa.turn} detects a
loop (L{detect_tool_loop}, the last 3 completed tool calls with the same name and identical
arguments); L{loopd.moa.context} writes the guard instruction and drops the tools
(L{pack_for_tool_result_turn} with a loop); L{loopd.moa.normalize} demotes a proposal of an
undeclared tool when the request declared some (L{enforce_allowed_tools}). This module
decides when they apply and closes the two gaps:

  - v1 quirk 3 (§7) is fixed: a request that declared no tools never gets C{tool_calls},
    so a named tool proposal is demoted there too (v1 emitted it).
  - Under the loop guard the reducer was sent no tools, so a tool proposal it still makes is
    demoted as well: the guard's "Do not call another tool" holds on the response side.

A demoted proposal is an uncertainty, which the reducer ladder reports as
C{no_usable_answer} (L{loopd.moa.reducer.is_usable}).
"""

from __future__ import annotations

from collections.abc import Collection

from loopd.moa.context import Packed, pack_for_tool_result_turn
from loopd.moa.normalize import demote_undeclared
from loopd.moa.outcome import Kind, Outcome
from loopd.moa.turn import ToolLoop, Turn, TurnKind, detect_tool_loop

__all__ = [
    "emits_tool_call",
    "enforce_declared_tools",
    "loop_guard",
    "pack_tool_result_reducer",
    "reducer_allowed_tools",
]


def loop_guard(turn: Turn) -> ToolLoop | None:
    """
    The tool loop that guards this turn's reducer, or None: only a tool-result turn is
    guarded (the reducer answers it alone), when its history ends with a loop by
    L{detect_tool_loop} (the last 3 or more completed tool calls share the name and the
    identical arguments).
    """
    if turn.kind is not TurnKind.TOOL_RESULT:
        return None
    return detect_tool_loop(turn.tool_calls)


def pack_tool_result_reducer(turn: Turn) -> Packed:
    """
    The reducer context of a tool-result turn with the loop guard applied: under a loop
    (L{loop_guard}) no tools and the guard instruction at the end of the system prompt
    (L{loopd.moa.context.loop_guard_text}), else the native tools
    (L{pack_for_tool_result_turn}).
    """
    return pack_for_tool_result_turn(turn, loop_guard(turn))


def reducer_allowed_tools(turn: Turn, loop: ToolLoop | None = None) -> tuple[str, ...]:
    """
    The tool names a reducer reply may call: none under the loop guard (C{loop} set), else
    the tools the request declared (L{Turn.allowed_tools}).
    """
    return () if loop is not None else turn.allowed_tools


def enforce_declared_tools(outcome: Outcome, allowed_tools: Collection[str]) -> Outcome:
    """
    Demote a named tool proposal whose tool is not in C{allowed_tools}: it becomes an
    uncertainty with confidence 0.0, no tool, the payload kept and C{demoted_tool} set, as
    L{enforce_allowed_tools} does. Unlike that function (and v1, quirk 3 of §7), an empty
    C{allowed_tools} allows no tool at all. Every other outcome is returned unchanged.
    """
    return demote_undeclared(outcome, allowed_tools)


def emits_tool_call(outcome: Outcome, allowed_tools: Collection[str]) -> bool:
    """
    Whether the response for C{outcome} is a C{tool_calls} response (§1.12): a named tool
    proposal of a tool in C{allowed_tools}. Anything else is answered as text (or, for an
    uncertain reducer reply, as C{no_usable_answer}).
    """
    return (
        outcome.kind is Kind.TOOL_PROPOSAL
        and outcome.tool_name is not None
        and outcome.tool_name in allowed_tools
    )
