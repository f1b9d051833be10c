# -*- test-case-name: loopd.test.test_moa_normalize -*-
"""
One worker's (or the reducer's) reply, normalized: the value the mesh arbiter works from
(reference/mesh-moa.md §1.9, the C{NormalizedOutput} of C{normalize.rs}, with the v2 flags of
§6).

An L{Outcome} carries everything §1.10 looks at: the kind (agreement compares answers, tool
consensus compares tool names), the text (the answer, or the payload shipped when the
decision is C{Answer}), the tool name and arguments (C{best_tool_proposal} prefers a proposal
with arguments), the confidence (the consensus, grace, dominant-tool and critique thresholds),
and the worker that produced it. The v2 flags say what must never be shipped verbatim: a
truncated reply (C{finish_reason: "length"}) and a reasoning-only reply, which also counts as
a failed call (the hedged ladder moves on).
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_CONFIDENCE", "Kind", "Outcome", "Rule"]

#: The confidence of an output that states none, and what a non-finite one becomes.
DEFAULT_CONFIDENCE = 0.5


class Kind(enum.Enum):
    """
    What a reply is. The first four are the reference's C{OutputKind}; L{Kind.EMPTY} is a
    reply with nothing usable in it (malformed, empty, or reasoning only), which the arbiter
    counts as a failed call.
    """

    ANSWER = "answer"
    TOOL_PROPOSAL = "tool_proposal"
    CRITIQUE = "critique"
    UNCERTAINTY = "uncertainty"
    EMPTY = "empty"


class Rule(enum.Enum):
    """
    Which rule of §1.8/§1.9 classified a reply (for logs and tests; the arbiter ignores it).
    """

    NATIVE_TOOL_CALL = "native_tool_call"
    JSON_ENVELOPE = "json_envelope"
    INLINE_TOOL_JSON = "inline_tool_json"
    KV_ENVELOPE = "kv_envelope"
    RESCUE = "rescue"
    TOOL_HEURISTIC = "tool_heuristic"
    CRITIQUE = "critique"
    UNCERTAINTY = "uncertainty"
    PLAIN = "plain"
    NO_TEXT = "no_text"


def _finite_confidence(value: object) -> float:
    """
    C{value} as a finite float: a non-number, a non-finite number or a number too large for
    a float becomes L{DEFAULT_CONFIDENCE} (the sanitizer of §1.9).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return DEFAULT_CONFIDENCE
    try:
        number = float(value)
    except OverflowError:
        return DEFAULT_CONFIDENCE
    return number if math.isfinite(number) else DEFAULT_CONFIDENCE


@dataclass(frozen=True)
class Outcome:
    """
    A normalized reply.

    Construction keeps the value valid: the confidence is always a finite float (NaN, ±inf,
    or anything that is not a number becomes 0.5), and only a L{Kind.TOOL_PROPOSAL} may carry
    a tool name or arguments (C{ValueError} otherwise).

    @ivar kind: what the reply is.
    @ivar text: the payload: the answer, the critique, the uncertain text, or the prose around
        a tool proposal (C{"calling NAME"} for a native tool call). Empty for L{Kind.EMPTY}:
        a failed reply's text is never shipped.
    @ivar confidence: the worker's stated or implied confidence.
    @ivar tool_name: the proposed tool; C{None} when the proposal names none.
    @ivar tool_arguments: the proposed arguments, always a JSON object when set; C{None}
        means none were given, which goes on the wire as C{{}}. Treat it as read-only.
    @ivar worker: the worker (endpoint) that replied.
    @ivar role: the worker's role label (C{fast}, C{specialist}, C{strong}, C{generalist},
        C{reducer}; a L{loopd.moa.roles.Role} is one), or empty.
    @ivar rule: which normalizer rule decided the kind.
    @ivar truncated: the backend stopped at its token budget (C{finish_reason: "length"});
        v2: the text takes no part in consensus and is never shipped verbatim.
    @ivar reasoning_only: the reply had reasoning and nothing else; v2: a failed call.
    @ivar demoted_tool: the undeclared tool the worker proposed, when the hallucinated-tool
        filter turned the proposal into an uncertainty.
    @ivar error: why an L{Kind.EMPTY} reply is empty.
    @ivar finish_reason: the backend's C{finish_reason}, if it gave one.
    @ivar elapsed_ms: how long the call took.
    """

    kind: Kind
    text: str
    confidence: float = DEFAULT_CONFIDENCE
    tool_name: str | None = None
    tool_arguments: dict[str, Any] | None = field(default=None, hash=False)
    worker: str = ""
    role: str = ""
    rule: Rule = Rule.PLAIN
    truncated: bool = False
    reasoning_only: bool = False
    demoted_tool: str | None = None
    error: str | None = None
    finish_reason: str | None = None
    elapsed_ms: float = 0.0

    def __post_init__(self) -> None:
        """
        Clamp the confidence and check that tool fields sit on a tool proposal only.
        """
        object.__setattr__(self, "confidence", _finite_confidence(self.confidence))
        if self.kind is not Kind.TOOL_PROPOSAL and (
            self.tool_name is not None or self.tool_arguments is not None
        ):
            raise ValueError(f"a {self.kind.value} outcome carries no tool call")
        if self.tool_arguments is not None and not isinstance(self.tool_arguments, dict):
            raise ValueError("tool arguments must be a JSON object")

    @property
    def failed(self) -> bool:
        """
        Whether the reply counts as a failed call: nothing usable in it, or reasoning only
        (v2 §6: the hedged ladder moves to the next candidate).
        """
        return self.kind is Kind.EMPTY or self.reasoning_only

    @property
    def verbatim_ok(self) -> bool:
        """
        Whether the text may be shipped as it is and take part in consensus: not failed, and
        not truncated (v2 §6).
        """
        return not self.failed and not self.truncated

    @property
    def has_arguments(self) -> bool:
        """
        Whether the proposal carries non-empty arguments (C{best_tool_proposal} prefers it
        to a higher-confidence proposal without).
        """
        return bool(self.tool_arguments)

    def arguments_json(self) -> str:
        """
        Return the arguments as compact JSON text for a C{tool_calls} entry: C{"{}"} when
        there are none.
        """
        return json.dumps(self.tool_arguments or {}, separators=(",", ":"), ensure_ascii=False)
