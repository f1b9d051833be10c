# -*- test-case-name: loopd.test.test_moa_arbiter -*-
"""
The mesh arbiter: what a fan-out turn does next, given what its workers have said so far
(reference/mesh-moa.md §1.10 with the grace timer of §1.7, the constants of §2 and the v2
changes of §6 that issue 6 adopts).

L{decide} is a pure function of an L{ArbiterState}: the outcomes that have landed (arrival
order), the workers still running, whether the request declared tools, and whether the
grace and strong-patience times have passed. It returns one of four decisions: L{Wait},
L{Ship} (an outcome, as an answer or as a tool call), L{Reduce} (the reducer synthesizes
from the drafts) or L{Fail}. Timers are the turn module's: it arms grace while
L{grace_eligible} holds and strong patience while L{patience_holds} does, and calls
L{decide} again after every worker completion and every timer.

Where this differs from v1, on purpose:
 - v2 §6: disagreeing answers go to the reducer for synthesis; v1's full arbiter shipped the
   highest-confidence one (quirk 4 of §7).
 - v2 §6: a truncated reply takes no part in answer consensus and is never shipped; where
   v1 would ship it, the decision is L{Reduce}. A reasoning-only or empty reply is a failed
   worker (L{Outcome.failed}).
 - DESIGN decision 31, strong patience: while a big-tier Strong worker of a pool that also
   has small-tier workers still runs (and patience has not elapsed), a consensus with no
   big-tier member, the sole-survivor exit and grace wait; once Strong has answered and
   disagrees with such a consensus, the drafts go to the reducer. Tool decisions are never
   held.
 - DESIGN decision 30: grace ships the best qualifying answer (v1), held only by patience.
 - Issue 6: every tie resolves to the first of equals in arrival order (v1: the last).
 - Issue 6 / quirk 11: nothing here waits on a failed worker; with two workers, one failed
   and one answered, the turn ships at once (remaining is zero).
 - When tool proposals agree on a name, the shipped proposal is the best of those that
   carry that name (a nameless proposal never ships as a tool call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias

from loopd.moa.arbiter_agree import answers_agree, cluster_members, largest_agreeing_cluster
from loopd.moa.outcome import Kind, Outcome
from loopd.moa.roles import Role, Tier

__all__ = [
    "ALL_WORKERS_FAILED",
    "CONSENSUS_MIN_CONFIDENCE",
    "CRITIQUE_ESCALATION_BELOW",
    "DISSENT_PHRASES",
    "DOMINANT_OTHERS_BELOW",
    "DOMINANT_TOOL_ABOVE",
    "GRACE_MIN_CONFIDENCE",
    "NAMELESS_TOOL_ABOVE",
    "ArbiterState",
    "Decision",
    "Fail",
    "Landed",
    "Reduce",
    "Running",
    "Ship",
    "Wait",
    "best_tool_proposal",
    "decide",
    "grace_eligible",
    "patience_holds",
]

ALL_WORKERS_FAILED: Final = "all_workers_failed"
"""The error code when no worker produced an output."""
CONSENSUS_MIN_CONFIDENCE: Final = 0.5
"""The representative of an answer consensus needs at least this confidence."""
GRACE_MIN_CONFIDENCE: Final = 0.5
"""An answer qualifies for grace at this confidence or more."""
DOMINANT_TOOL_ABOVE: Final = 0.7
"""A conflicting tool proposal ships when its confidence is above this ..."""
DOMINANT_OTHERS_BELOW: Final = 0.5
"""... and every proposal of another name is below this."""
NAMELESS_TOOL_ABOVE: Final = 0.6
"""A lone nameless tool proposal above this confidence escalates."""
CRITIQUE_ESCALATION_BELOW: Final = 0.5
"""A best answer below this confidence escalates when a critique exists."""
DISSENT_PHRASES: Final = ("don't", "should not", "no tool")
"""A critique whose lowercase text contains one of these dissents from a tool proposal."""


@dataclass(frozen=True)
class Landed:
    """A worker that has finished, with its normalized outcome (failed ones included)."""

    outcome: Outcome
    """What it said; L{Outcome.failed} when it failed."""
    role: Role
    """Its role this turn."""
    tier: Tier
    """Its size tier."""


@dataclass(frozen=True)
class Running:
    """A worker still running."""

    name: str
    """The worker's name."""
    role: Role
    """Its role this turn."""
    tier: Tier
    """Its size tier."""


@dataclass(frozen=True)
class ArbiterState:
    """Everything L{decide} looks at."""

    landed: tuple[Landed, ...]
    """The finished workers, in arrival order (ties go to the earlier)."""
    running: tuple[Running, ...] = ()
    """The workers still running."""
    has_tools: bool = False
    """Whether the request declared a non-empty C{tools} array."""
    grace_elapsed: bool = False
    """Whether the grace time since dispatch has passed (meaningless with tools)."""
    patience_elapsed: bool = False
    """Whether the strong-patience time since dispatch has passed."""


@dataclass(frozen=True)
class Wait:
    """Nothing to do yet: wait for the next worker or timer."""


@dataclass(frozen=True)
class Ship:
    """Return this outcome to the caller (never a failed or truncated one)."""

    outcome: Outcome
    """What ships."""
    tool_call: bool = False
    """Ship it as a C{tool_calls} entry (name and arguments) rather than as its text."""
    reason: str = ""
    """Why, for logs: C{consensus}, C{sole survivor}, C{grace}, C{single output} ..."""


@dataclass(frozen=True)
class Reduce:
    """Run the reducer ladder to synthesize an answer from the drafts."""

    reason: str
    """Why, for logs and the reducer."""
    outcomes: tuple[Outcome, ...]
    """The drafts: every non-failed outcome, in arrival order."""


@dataclass(frozen=True)
class Fail:
    """The turn fails with this error code."""

    code: str
    """The C{error.code} of the 502 body."""


Decision: TypeAlias = Wait | Ship | Reduce | Fail
"""What L{decide} returns."""


def best_tool_proposal(proposals: Sequence[Outcome]) -> Outcome | None:
    """
    The preferred tool proposal (§1.10): one with non-empty arguments beats any without,
    then the higher confidence; the first of equals (v1: the last). None when empty.
    """
    best: Outcome | None = None
    for proposal in proposals:
        if best is None or (proposal.has_arguments, proposal.confidence) > (
            best.has_arguments,
            best.confidence,
        ):
            best = proposal
    return best


def _best_by_confidence(outcomes: Sequence[Outcome]) -> Outcome | None:
    """The highest-confidence outcome, the first of equals; None when empty."""
    best: Outcome | None = None
    for outcome in outcomes:
        if best is None or outcome.confidence > best.confidence:
            best = outcome
    return best


def _outputs(state: ArbiterState) -> tuple[Outcome, ...]:
    """The non-failed outcomes, in arrival order."""
    return tuple(item.outcome for item in state.landed if not item.outcome.failed)


def _of_kind(outcomes: Sequence[Outcome], kind: Kind) -> list[Outcome]:
    """The outcomes of one kind, in order."""
    return [outcome for outcome in outcomes if outcome.kind is kind]


def _ship(outcome: Outcome, outputs: Sequence[Outcome], reason: str, *, tool: bool) -> Decision:
    """Ship C{outcome}, or hand the drafts to the reducer when it is truncated (v2)."""
    if not outcome.verbatim_ok:
        return Reduce(f"truncated reply ({reason})", tuple(outputs))
    return Ship(outcome, tool_call=tool, reason=reason)


def _strong_big_running(state: ArbiterState) -> bool:
    """Whether a big-tier Strong worker runs in a pool that also has a small-tier worker."""
    strong = [item for item in state.running if item.role is Role.STRONG and item.tier is Tier.BIG]
    if not strong:
        return False
    tiers = [item.tier for item in state.landed] + [item.tier for item in state.running]
    return Tier.SMALL in tiers


def patience_holds(state: ArbiterState) -> bool:
    """
    Whether strong patience is in force (DESIGN decision 31): a big-tier Strong worker of a
    mixed-tier pool still runs and the patience time has not passed. The turn module arms
    its patience timer while this holds.
    """
    return not state.patience_elapsed and _strong_big_running(state)


def _qualifying_answers(state: ArbiterState) -> list[Outcome]:
    """The answers that grace may ship: verbatim, confidence at least 0.5."""
    return [
        outcome
        for outcome in _of_kind(_outputs(state), Kind.ANSWER)
        if outcome.verbatim_ok and outcome.confidence >= GRACE_MIN_CONFIDENCE
    ]


def grace_eligible(state: ArbiterState) -> bool:
    """
    Whether the turn may use grace (§1.7): no tools, some worker still running, and at
    least one qualifying answer. The turn module arms the grace timer while this holds.
    """
    return not state.has_tools and bool(state.running) and bool(_qualifying_answers(state))


def _single_output(
    outcome: Outcome, outputs: Sequence[Outcome], has_tools: bool, reason: str
) -> Decision:
    """C{single_output_decision} of §1.10."""
    if outcome.kind is Kind.TOOL_PROPOSAL and has_tools and outcome.tool_name:
        return _ship(outcome, outputs, reason, tool=True)
    if outcome.kind is Kind.UNCERTAINTY:
        return Reduce("single worker uncertain", tuple(outputs))
    return _ship(outcome, outputs, reason, tool=False)


def _strong_answer(state: ArbiterState) -> Outcome | None:
    """The verbatim answer of a big-tier Strong worker that has landed, if any."""
    for item in state.landed:
        if (
            item.role is Role.STRONG
            and item.tier is Tier.BIG
            and item.outcome.kind is Kind.ANSWER
            and item.outcome.verbatim_ok
        ):
            return item.outcome
    return None


def _answer_consensus(state: ArbiterState, answers: Sequence[Landed]) -> Decision | None:
    """Rule 4 of C{try_early_decision}, with strong patience."""
    outputs = _outputs(state)
    cluster = cluster_members([item.outcome for item in answers])
    if cluster is None:
        return None
    chosen, members = cluster
    representative = answers[chosen].outcome
    if len(members) * 2 < len(answers) or representative.confidence < CONSENSUS_MIN_CONFIDENCE:
        return None
    if all(answers[j].tier is Tier.SMALL for j in members):
        strong = _strong_answer(state)
        if strong is not None and not answers_agree(strong.text, representative.text):
            return Reduce("the strong worker disagrees with the small-tier consensus", outputs)
        if patience_holds(state):
            return Wait()
    return _ship(representative, outputs, "consensus", tool=False)


def _early(state: ArbiterState) -> Decision | None:
    """C{try_early_decision} of §1.10, evaluated after every completion."""
    outputs = _outputs(state)
    remaining = len(state.running)
    total = len(state.landed) + remaining
    failed = len(state.landed) - len(outputs)
    if not outputs:
        return None
    if len(outputs) == 1:
        if remaining == 0:
            return _single_output(outputs[0], outputs, state.has_tools, "single output")
        if failed > 0 and failed >= total // 2:
            if patience_holds(state):
                return None
            return _single_output(outputs[0], outputs, state.has_tools, "sole survivor")
        return None
    answers = _of_kind(outputs, Kind.ANSWER)
    proposals = _of_kind(outputs, Kind.TOOL_PROPOSAL)
    verbatim_answers = [
        item
        for item in state.landed
        if item.outcome.kind is Kind.ANSWER and item.outcome.verbatim_ok
    ]
    if len(verbatim_answers) >= 2 and not proposals:
        decision = _answer_consensus(state, verbatim_answers)
        if decision is not None:
            return decision
    if state.has_tools and len(proposals) >= 2 and not answers:
        names = {p.tool_name for p in proposals if p.tool_name}
        if len(names) == 1:
            (name,) = names
            best = best_tool_proposal([p for p in proposals if p.tool_name == name])
            assert best is not None
            return _ship(best, outputs, "tool consensus", tool=True)
    if proposals and answers:
        return Reduce("some workers propose tools, others answer directly", outputs)
    return None


def _arbitrate_tools(outputs: tuple[Outcome, ...], proposals: list[Outcome]) -> Decision | None:
    """Step 3 of C{arbitrate}: tool proposals in a request with tools."""
    for critique in _of_kind(outputs, Kind.CRITIQUE):
        if any(phrase in critique.text.lower() for phrase in DISSENT_PHRASES):
            return Reduce("tool proposal with dissenting critique", outputs)
    named = [p for p in proposals if p.tool_name]
    if named:
        if _of_kind(outputs, Kind.ANSWER):
            return Reduce("some workers propose tools, others answer directly", outputs)
        names = list(dict.fromkeys(p.tool_name for p in named))
        if len(names) == 1:
            best = best_tool_proposal(named)
            assert best is not None
            return _ship(best, outputs, "tool agreement", tool=True)
        top = best_tool_proposal(named)
        assert top is not None
        if top.confidence > DOMINANT_TOOL_ABOVE and all(
            p.confidence < DOMINANT_OTHERS_BELOW for p in named if p.tool_name != top.tool_name
        ):
            return _ship(top, outputs, "dominant tool proposal", tool=True)
        return Reduce("conflicting tool proposals: " + " vs ".join(map(str, names)), outputs)
    if sum(1 for p in proposals if p.confidence > NAMELESS_TOOL_ABOVE) == 1:
        return Reduce("tool proposal without parseable tool name", outputs)
    return None


def _arbitrate(state: ArbiterState) -> Decision:
    """C{arbitrate} of §1.10, with v2's synthesis of disagreeing answers."""
    outputs = _outputs(state)
    if not outputs:
        return Fail(ALL_WORKERS_FAILED)
    if len(outputs) == 1:
        return _single_output(outputs[0], outputs, state.has_tools, "single output")
    if all(outcome.kind is Kind.UNCERTAINTY for outcome in outputs):
        return Reduce("all workers uncertain", outputs)
    proposals = _of_kind(outputs, Kind.TOOL_PROPOSAL)
    if state.has_tools and proposals:
        decision = _arbitrate_tools(outputs, proposals)
        if decision is not None:
            return decision
    answers = _of_kind(outputs, Kind.ANSWER)
    if answers:
        verbatim = [answer for answer in answers if answer.verbatim_ok]
        if not verbatim:
            return Reduce("only truncated answers", outputs)
        best = _best_by_confidence(verbatim)
        assert best is not None
        if best.confidence < CRITIQUE_ESCALATION_BELOW and _of_kind(outputs, Kind.CRITIQUE):
            return Reduce("low confidence answer with critique", outputs)
        cluster = largest_agreeing_cluster(verbatim)
        if len(verbatim) >= 2 and (cluster is None or cluster[0] < len(verbatim)):
            return Reduce(f"{len(verbatim)} disagreeing answers to synthesize", outputs)
        return _ship(best, outputs, "arbiter", tool=False)
    return Reduce("no clear answer or tool proposal", outputs)


def decide(state: ArbiterState) -> Decision:
    """
    What the turn does next (§1.10 and §1.7 with the v2 changes of the module docstring).

    With no worker at all, or every worker finished and failed: L{Fail}. Otherwise the
    early rules in order: a single output when nothing runs any more; the sole-survivor
    exit (C{failed > 0 and failed >= total // 2}); an answer consensus (no tool proposals,
    a cluster of at least half the verbatim answers, representative confidence >= 0.5);
    tool consensus (tools declared, two or more proposals, no answers, one name);
    escalation when proposals meet answers. Then, while workers run: grace (no tools,
    grace elapsed) ships the best qualifying answer, else L{Wait}. When every worker has
    finished and no early rule applied, the full arbiter decides.
    """
    if not state.landed and not state.running:
        return Fail(ALL_WORKERS_FAILED)
    early = _early(state)
    if early is not None:
        return early
    if state.running:
        if state.grace_elapsed and grace_eligible(state) and not patience_holds(state):
            best = _best_by_confidence(_qualifying_answers(state))
            assert best is not None
            return _ship(best, _outputs(state), "grace", tool=False)
        return Wait()
    return _arbitrate(state)
