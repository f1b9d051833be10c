# -*- test-case-name: loopd.test.test_moa_normalize -*-
"""
The mesh normalizer: a worker's or the reducer's reply turned into an L{Outcome}
(reference/mesh-moa.md §1.9, with the text extraction of §1.8 and the v2 changes of §6).

L{normalize_completion} reads a backend's finished reply (the llama client's
L{Completion}); L{normalize_text} classifies a text. The order of the rules, the first match wins:
 - a native C{tool_calls} entry (§1.8): a tool proposal, confidence 0.9;
 - a JSON object in the text (§1.9 step 1): OpenAI-shaped inline tool JSON (no C{kind}, a
   name and C{arguments}), confidence 0.75; or a C{kind} envelope;
 - a C{kind:} line envelope (step 2);
 - the heuristics (step 3): the tool-call rescue (0.7), a known tool with an action phrase
   or a structured marker (0.6), a critique (0.5), an uncertainty (0.3), else a plain answer
   (0.5).
Then the sanitizer (non-finite confidence is 0.5, arguments an object or none) and the
hallucinated-tool filter (L{enforce_allowed_tools}).

Where this differs from v1, on purpose:
 - v2 §6: a reply whose only text is reasoning (in C{<think>} blocks, C{reasoning_content}
   or C{reasoning}) is never an answer: it is L{Kind.EMPTY} with C{reasoning_only} set, a
   failed call (v1 shipped the reasoning, #617). A C{finish_reason: "length"} reply is
   classified but flagged C{truncated}, so it is neither counted in consensus nor shipped
   verbatim.
 - An answer with no text left is L{Kind.EMPTY} too: an empty string is never an answer.
 - Think tags of both styles are stripped everywhere, orphan closers included (see
   L{loopd.moa.normalize_think}).
 - A line envelope without a payload falls back to its text without the key lines, not to
   the whole text (see L{loopd.moa.normalize_kv.parse_kv_envelope}).
 - Only a tool proposal carries a tool name and arguments; a JSON envelope of another kind
   that names a tool keeps its kind and drops the tool, which §1.10 never reads there. An
   empty tool name is no name.
 - A native tool call is kept as a value rather than written out as a line envelope and
   parsed back, so arguments that span lines survive (see L{loopd.moa.normalize_reply}).
 - JSON is strict (no C{NaN}); a confidence too large for a float counts as non-finite.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from loopd.llama.types import Completion
from loopd.moa.normalize_heuristics import (
    is_critique,
    is_uncertain,
    looks_like_tool_proposal,
    tool_proposal_parts,
)
from loopd.moa.normalize_json import (
    extract_json_object,
    normalize_tool_arguments,
    tool_arguments_of,
    tool_name_of,
)
from loopd.moa.normalize_kv import parse_kv_envelope, strip_kv_envelope
from loopd.moa.normalize_reply import extract_reply
from loopd.moa.normalize_rescue import rescue_tool_call
from loopd.moa.normalize_think import extract_thinking, strip_thinking
from loopd.moa.outcome import DEFAULT_CONFIDENCE, Kind, Outcome, Rule

__all__ = [
    "CONFIDENCE_CRITIQUE",
    "CONFIDENCE_HEURISTIC_TOOL",
    "CONFIDENCE_INLINE_TOOL",
    "CONFIDENCE_NATIVE_TOOL",
    "CONFIDENCE_RESCUE",
    "CONFIDENCE_UNCERTAINTY",
    "ERROR_EMPTY",
    "ERROR_REASONING_ONLY",
    "demote_undeclared",
    "enforce_allowed_tools",
    "normalize_completion",
    "normalize_text",
]

#: A native C{tool_calls} entry.
CONFIDENCE_NATIVE_TOOL = 0.9
#: OpenAI-shaped tool JSON written in the text.
CONFIDENCE_INLINE_TOOL = 0.75
#: A tool call found by the rescue.
CONFIDENCE_RESCUE = 0.7
#: A tool proposal found by the prose heuristic.
CONFIDENCE_HEURISTIC_TOOL = 0.6
#: A critique.
CONFIDENCE_CRITIQUE = 0.5
#: An uncertain reply.
CONFIDENCE_UNCERTAINTY = 0.3
#: What a proposal of an undeclared tool is left with.
CONFIDENCE_DEMOTED = 0.0

#: The reply has no text, no tool call and no reasoning.
ERROR_EMPTY = "empty response"
#: The reply has reasoning and nothing else.
ERROR_REASONING_ONLY = "reasoning-only response"

_ENVELOPE_KINDS = {kind.value: kind for kind in Kind if kind is not Kind.EMPTY}
_TRUNCATED = "length"


def enforce_allowed_tools(outcome: Outcome, allowed_tools: Collection[str]) -> Outcome:
    """
    Demote a proposal of a tool the request did not declare (C{tool_guard.rs}): a named
    tool proposal whose name is not in a non-empty C{allowed_tools} becomes an uncertainty
    with confidence 0.0, no tool, the payload kept, and C{demoted_tool} set. With no tools
    declared nothing changes.
    """
    if not allowed_tools:
        return outcome
    return demote_undeclared(outcome, allowed_tools)


def demote_undeclared(outcome: Outcome, allowed_tools: Collection[str]) -> Outcome:
    """
    Demote a named tool proposal whose tool is not in C{allowed_tools} (an empty collection
    allows none): an uncertainty with confidence 0.0, no tool, the payload kept, and
    C{demoted_tool} set. Every other outcome is returned unchanged.
    """
    name = outcome.tool_name
    if outcome.kind is not Kind.TOOL_PROPOSAL or name is None or name in allowed_tools:
        return outcome
    return replace(
        outcome,
        kind=Kind.UNCERTAINTY,
        tool_name=None,
        tool_arguments=None,
        confidence=CONFIDENCE_DEMOTED,
        demoted_tool=name,
    )


def _from_json(text: str) -> Outcome | None:
    """
    Step 1: the JSON object in C{text} as inline tool JSON or a C{kind} envelope, or C{None}.
    """
    found = extract_json_object(text)
    if found is None:
        return None
    if "kind" not in found:
        name = tool_name_of(found)
        present, raw = tool_arguments_of(found)
        if name is None or not present:
            return None
        return Outcome(
            Kind.TOOL_PROPOSAL,
            text,
            CONFIDENCE_INLINE_TOOL,
            tool_name=name,
            tool_arguments=normalize_tool_arguments(present, raw),
            rule=Rule.INLINE_TOOL_JSON,
        )
    kind = found["kind"]
    if not isinstance(kind, str) or kind not in _ENVELOPE_KINDS:
        return None
    payload = found.get("payload")
    outcome = Outcome(
        _ENVELOPE_KINDS[kind],
        payload if isinstance(payload, str) else text,
        found.get("confidence", DEFAULT_CONFIDENCE),
        rule=Rule.JSON_ENVELOPE,
    )
    if outcome.kind is not Kind.TOOL_PROPOSAL:
        return outcome
    tool = found.get("tool")
    return replace(
        outcome,
        tool_name=tool if isinstance(tool, str) and tool.strip() else None,
        tool_arguments=normalize_tool_arguments("arguments" in found, found.get("arguments")),
    )


def _from_kv(text: str) -> Outcome | None:
    """
    Step 2: the line envelope in C{text}, or C{None}.
    """
    envelope = parse_kv_envelope(text)
    if envelope is None:
        return None
    confidence = DEFAULT_CONFIDENCE if envelope.confidence is None else envelope.confidence
    outcome = Outcome(envelope.kind, envelope.payload, confidence, rule=Rule.KV_ENVELOPE)
    if outcome.kind is not Kind.TOOL_PROPOSAL:
        return outcome
    return replace(
        outcome,
        tool_name=envelope.tool,
        tool_arguments=normalize_tool_arguments(envelope.has_arguments, envelope.arguments),
    )


def _from_heuristics(text: str) -> Outcome:
    """
    Step 3: the rescue, then the prose checks, then a plain answer.
    """
    payload = strip_kv_envelope(text)
    rescued = rescue_tool_call(text)
    if rescued is not None:
        return Outcome(
            Kind.TOOL_PROPOSAL,
            payload,
            CONFIDENCE_RESCUE,
            tool_name=rescued[0],
            tool_arguments=rescued[1],
            rule=Rule.RESCUE,
        )
    lower = text.lower()
    if looks_like_tool_proposal(lower):
        name, arguments = tool_proposal_parts(text)
        return Outcome(
            Kind.TOOL_PROPOSAL,
            payload,
            CONFIDENCE_HEURISTIC_TOOL,
            tool_name=name,
            tool_arguments=arguments,
            rule=Rule.TOOL_HEURISTIC,
        )
    if is_critique(lower):
        return Outcome(Kind.CRITIQUE, payload, CONFIDENCE_CRITIQUE, rule=Rule.CRITIQUE)
    if is_uncertain(lower):
        return Outcome(Kind.UNCERTAINTY, payload, CONFIDENCE_UNCERTAINTY, rule=Rule.UNCERTAINTY)
    return Outcome(Kind.ANSWER, payload, rule=Rule.PLAIN)


def _empty(error: str, reasoning_only: bool = False) -> Outcome:
    """
    A reply with nothing usable in it.
    """
    return Outcome(Kind.EMPTY, "", rule=Rule.NO_TEXT, reasoning_only=reasoning_only, error=error)


def _classify(text: str) -> Outcome:
    """
    Classify a text: thinking stripped, then steps 1-3; an answer with no text left, or a
    text with nothing but thinking, is empty.
    """
    cleaned = strip_thinking(text)
    if not cleaned:
        if extract_thinking(text):
            return _empty(ERROR_REASONING_ONLY, reasoning_only=True)
        return _empty(ERROR_EMPTY)
    outcome = _from_json(cleaned) or _from_kv(cleaned) or _from_heuristics(cleaned)
    if outcome.kind is Kind.ANSWER and not outcome.text.strip():
        return _empty(ERROR_EMPTY)
    return outcome


def normalize_text(
    text: str,
    *,
    allowed_tools: Collection[str] = (),
    worker: str = "",
    role: str = "",
    finish_reason: str | None = None,
    elapsed_ms: float = 0.0,
) -> Outcome:
    """
    Normalize a reply's text (C{normalize_worker_output} and C{enforce_allowed_tools}).

    @param allowed_tools: the names of the tools the request declared; a proposal of any
        other tool is demoted (none declared: no filter).
    @param worker: the worker (endpoint) that replied.
    @param role: its role label.
    @param finish_reason: the backend's C{finish_reason}; C{"length"} flags the outcome
        truncated.
    @param elapsed_ms: how long the call took.
    """
    outcome = replace(
        _classify(text),
        worker=worker,
        role=role,
        finish_reason=finish_reason,
        truncated=finish_reason == _TRUNCATED,
        elapsed_ms=elapsed_ms,
    )
    return enforce_allowed_tools(outcome, allowed_tools)


def normalize_completion(
    completion: Completion,
    *,
    allowed_tools: Collection[str] = (),
    worker: str = "",
    role: str = "",
    elapsed_ms: float = 0.0,
) -> Outcome:
    """
    Normalize a backend's finished reply (never raises): its first native tool call, else
    its content, else it is empty (reasoning only, or nothing at all). The parameters are
    L{normalize_text}'s.
    """
    reply = extract_reply(completion)
    if reply.tool_name is not None:
        outcome = Outcome(
            Kind.TOOL_PROPOSAL,
            f"calling {reply.tool_name}",
            CONFIDENCE_NATIVE_TOOL,
            tool_name=reply.tool_name,
            tool_arguments=reply.tool_arguments,
            rule=Rule.NATIVE_TOOL_CALL,
        )
    elif reply.content:
        outcome = _classify(reply.content)
    elif reply.reasoning:
        outcome = _empty(ERROR_REASONING_ONLY, reasoning_only=True)
    else:
        outcome = _empty(ERROR_EMPTY)
    outcome = replace(
        outcome,
        worker=worker,
        role=role,
        finish_reason=reply.finish_reason,
        truncated=reply.finish_reason == _TRUNCATED,
        elapsed_ms=elapsed_ms,
    )
    return enforce_allowed_tools(outcome, allowed_tools)
