"""
Tests for L{loopd.moa.arbiter}: best tool proposal, early exit, sole survivor, grace, the
full arbiter and its v2 changes, strong patience, issue 6's arbitration scenarios as a table,
and properties of L{decide} over arbitrary states (reference C{mesh-moa.md} §1.7's grace,
§1.10, §2's constants, §6; DESIGN decisions 30 and 31). The agreement rule is tested in
L{loopd.test.test_moa_arbiter_agree}.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.moa.arbiter import (
    ALL_WORKERS_FAILED,
    CONSENSUS_MIN_CONFIDENCE,
    CRITIQUE_ESCALATION_BELOW,
    DOMINANT_OTHERS_BELOW,
    DOMINANT_TOOL_ABOVE,
    GRACE_MIN_CONFIDENCE,
    NAMELESS_TOOL_ABOVE,
    ArbiterState,
    Decision,
    Fail,
    Landed,
    Reduce,
    Running,
    Ship,
    Wait,
    best_tool_proposal,
    decide,
    grace_eligible,
    patience_holds,
)
from loopd.moa.outcome import Kind, Outcome
from loopd.moa.roles import Role, Tier

S, B = Tier.SMALL, Tier.BIG


def answer(text: str, confidence: float = 0.5, **kw: Any) -> Outcome:
    """An answer outcome."""
    return Outcome(Kind.ANSWER, text, confidence, **kw)


def tool(
    name: str | None, arguments: dict[str, Any] | None = None, confidence: float = 0.6, **kw: Any
) -> Outcome:
    """A tool proposal outcome."""
    return Outcome(Kind.TOOL_PROPOSAL, f"calling {name}", confidence, name, arguments, **kw)


def critique(text: str, confidence: float = 0.5) -> Outcome:
    """A critique outcome."""
    return Outcome(Kind.CRITIQUE, text, confidence)


def uncertain(text: str = "I am not sure") -> Outcome:
    """An uncertainty outcome."""
    return Outcome(Kind.UNCERTAINTY, text, 0.3)


def dead() -> Outcome:
    """A failed worker."""
    return Outcome(Kind.EMPTY, "", error="connection refused")


def landed(outcome: Outcome, tier: Tier = S, role: Role = Role.SPECIALIST) -> Landed:
    """A finished worker."""
    return Landed(outcome, role, tier)


def running(tier: Tier = S, role: Role = Role.SPECIALIST, name: str = "w") -> Running:
    """A running worker."""
    return Running(name, role, tier)


def state(
    outcomes: Sequence[Outcome | Landed], pending: int | list[Running] = 0, **kw: Any
) -> ArbiterState:
    """A state from outcomes (small-tier specialists unless given as L{Landed})."""
    items = tuple(o if isinstance(o, Landed) else landed(o) for o in outcomes)
    run = tuple(running() for _ in range(pending)) if isinstance(pending, int) else tuple(pending)
    return ArbiterState(items, run, **kw)


class BestToolProposalTests(SynchronousTestCase):
    """C{best_tool_proposal}."""

    def test_arguments_beat_confidence(self) -> None:
        """A proposal with arguments beats a higher-confidence one without."""
        bare, full = tool("grep", None, 0.9), tool("grep", {"q": "x"}, 0.6)
        self.assertIs(best_tool_proposal([bare, full]), full)

    def test_empty_object_is_no_arguments(self) -> None:
        """C{{}} counts as no arguments; then the confidence decides."""
        low, high = tool("grep", {}, 0.6), tool("grep", None, 0.7)
        self.assertIs(best_tool_proposal([low, high]), high)

    def test_first_of_equals(self) -> None:
        """Ties go to the first (issue 6; v1 took the last)."""
        first, second = tool("a", {"x": 1}), tool("a", {"x": 2})
        self.assertIs(best_tool_proposal([first, second]), first)
        self.assertIsNone(best_tool_proposal([]))


class EarlyDecisionTests(SynchronousTestCase):
    """The early rules of C{try_early_decision}, evaluated at every completion."""

    def test_nothing(self) -> None:
        """No worker at all, or all failed with none running: all_workers_failed."""
        self.assertEqual(decide(ArbiterState(())), Fail(ALL_WORKERS_FAILED))
        self.assertEqual(decide(state([dead(), dead()])), Fail(ALL_WORKERS_FAILED))

    def test_no_output_yet(self) -> None:
        """Rule 1: no outputs while workers run: wait."""
        self.assertEqual(decide(state([dead()], 2)), Wait())
        self.assertEqual(decide(state([], 2)), Wait())

    def test_single_output_last(self) -> None:
        """Rule 2: one output and nothing remaining ships it."""
        only = answer("Paris")
        self.assertEqual(decide(state([dead(), only])), Ship(only, False, "single output"))

    def test_single_output_waits(self) -> None:
        """Rule 3: one output, no failure, workers remaining: wait."""
        self.assertEqual(decide(state([answer("Paris")], 2)), Wait())

    def test_sole_survivor_thresholds(self) -> None:
        """Rule 3: failed > 0 and failed >= floor(total/2): 1 of 3, 2 of 4 or 5, 3 of 6."""
        for total, failures, ships in (
            (2, 0, False),
            (3, 1, True),
            (4, 1, False),
            (4, 2, True),
            (5, 2, True),
            (6, 2, False),
            (6, 3, True),
        ):
            pending = total - failures - 1
            got = decide(state([dead()] * failures + [answer("Paris")], pending))
            self.assertEqual(isinstance(got, Ship), ships, (total, failures))
            if ships:
                assert isinstance(got, Ship)
                self.assertEqual(got.reason, "sole survivor")

    def test_single_output_kinds(self) -> None:
        """C{single_output_decision}: named tool with tools is a tool call; else the text."""
        named, nameless = tool("grep", {"q": 1}), tool(None)
        self.assertEqual(decide(state([named], has_tools=True)).tool_call, True)  # type: ignore[union-attr]
        self.assertEqual(
            decide(state([nameless], has_tools=True)), Ship(nameless, False, "single output")
        )
        self.assertEqual(decide(state([named])), Ship(named, False, "single output"))
        self.assertEqual(decide(state([critique("hmm")])).tool_call, False)  # type: ignore[union-attr]
        self.assertEqual(
            decide(state([uncertain()])), Reduce("single worker uncertain", (uncertain(),))
        )

    def test_consensus_majority(self) -> None:
        """Rule 4: a cluster of at least half the answers (size*2 >= #answers) ships."""
        a, b, c = answer("Paris"), answer("It is Paris, France"), answer("Berlin")
        self.assertEqual(decide(state([a, b, c], 1)), Ship(b, False, "consensus"))
        d = answer("Rome")
        self.assertEqual(decide(state([a, b, c, d], 1)), Ship(b, False, "consensus"))
        self.assertEqual(decide(state([a, b, c, d, answer("Oslo")], 1)), Wait())

    def test_consensus_confidence_bound(self) -> None:
        """Rule 4: the representative needs confidence >= 0.5."""
        self.assertEqual(CONSENSUS_MIN_CONFIDENCE, 0.5)
        low = [answer("Paris", 0.4), answer("Paris France", 0.49)]
        self.assertEqual(decide(state(low, 1)), Wait())
        edge = [answer("Paris", 0.4), answer("Paris France", 0.5)]
        self.assertEqual(decide(state(edge, 1)), Ship(edge[1], False, "consensus"))

    def test_tool_proposal_blocks_consensus(self) -> None:
        """Rule 4 needs no tool proposals; rule 6 then escalates, with or without tools."""
        items = [answer("Paris"), answer("Paris"), tool("grep")]
        for has_tools in (False, True):
            got = decide(state(items, 1, has_tools=has_tools))
            self.assertEqual(
                got, Reduce("some workers propose tools, others answer directly", tuple(items))
            )

    def test_tool_consensus(self) -> None:
        """Rule 5: tools, >= 2 proposals, no answers, one name: the best proposal ships."""
        bare, full = tool("grep", None, 0.9), tool("grep", {"q": "x"}, 0.6)
        got = decide(state([bare, full, tool(None)], 1, has_tools=True))
        self.assertEqual(got, Ship(full, True, "tool consensus"))

    def test_tool_consensus_needs_tools_and_one_name(self) -> None:
        """Rule 5 needs declared tools and a single name; otherwise wait."""
        self.assertEqual(decide(state([tool("a"), tool("a")], 1)), Wait())
        self.assertEqual(decide(state([tool("a"), tool("b")], 1, has_tools=True)), Wait())
        self.assertEqual(decide(state([tool(None), tool(None)], 1, has_tools=True)), Wait())


class GraceTests(SynchronousTestCase):
    """Grace (§1.7, DESIGN decision 30): the best qualifying answer ships."""

    def test_ships_best_first_of_equals(self) -> None:
        """Grace elapsed, no tools: the highest-confidence qualifying answer, first of equals."""
        self.assertEqual(GRACE_MIN_CONFIDENCE, 0.5)
        a, b, c = answer("Paris"), answer("Berlin", 0.7), answer("Rome", 0.7)
        got = decide(state([a, b, c, answer("Oslo"), answer("Lima")], 1, grace_elapsed=True))
        self.assertEqual(got, Ship(b, False, "grace"))

    def test_single_answer(self) -> None:
        """Two workers, one answered, grace elapsed: it ships (rule 3 alone would wait)."""
        a = answer("Paris")
        self.assertEqual(decide(state([a], 1)), Wait())
        self.assertEqual(decide(state([a], 1, grace_elapsed=True)), Ship(a, False, "grace"))

    def test_not_with_tools(self) -> None:
        """With tools there is never a grace exit."""
        st_ = state([answer("Paris")], 1, has_tools=True, grace_elapsed=True)
        self.assertFalse(grace_eligible(st_))
        self.assertEqual(decide(st_), Wait())

    def test_needs_qualifying(self) -> None:
        """Only answers with confidence >= 0.5 and not truncated qualify."""
        for outcome in (answer("Paris", 0.49), answer("Paris", truncated=True), critique("x")):
            st_ = state([outcome], 1, grace_elapsed=True)
            self.assertFalse(grace_eligible(st_))
            self.assertEqual(decide(st_), Wait())
        self.assertTrue(grace_eligible(state([answer("Paris")], 1)))

    def test_not_elapsed(self) -> None:
        """Before grace elapses, wait."""
        self.assertEqual(decide(state([answer("Paris")], 1, grace_elapsed=False)), Wait())


class ArbitrateTests(SynchronousTestCase):
    """The full arbiter, when every worker has finished with no early decision."""

    def test_all_uncertain(self) -> None:
        """All uncertain: the reducer."""
        items = (uncertain("a"), uncertain("b"))
        self.assertEqual(decide(state(list(items))), Reduce("all workers uncertain", items))

    def test_dissenting_critique(self) -> None:
        """A critique with don't / should not / no tool vetoes tool proposals."""
        for phrase in ("Don't call it", "you SHOULD NOT", "no tool needed"):
            items = (tool("grep", {"q": 1}), critique(phrase))
            got = decide(state(list(items), has_tools=True))
            self.assertEqual(got, Reduce("tool proposal with dissenting critique", items))

    def test_same_names_ship(self) -> None:
        """All named proposals share a name (one proposal and a critique): it ships as a call."""
        a = tool("grep", {"q": 1})
        got = decide(state([a, critique("fine")], has_tools=True))
        self.assertEqual(got, Ship(a, True, "tool agreement"))
        b = tool("grep", None, 0.9)
        got = decide(state([b, a, critique("fine")], has_tools=True))
        self.assertEqual(got, Ship(a, True, "tool consensus"))

    def test_dominant_tool(self) -> None:
        """Names conflict: the best ships when above 0.7 and the others below 0.5."""
        self.assertEqual((DOMINANT_TOOL_ABOVE, DOMINANT_OTHERS_BELOW), (0.7, 0.5))
        top, other = tool("grep", {"q": 1}, 0.75), tool("ls", None, 0.49)
        self.assertEqual(
            decide(state([top, other], has_tools=True)), Ship(top, True, "dominant tool proposal")
        )
        for top_conf, other_conf in ((0.7, 0.4), (0.9, 0.5)):
            items = (tool("grep", None, top_conf), tool("ls", None, other_conf))
            got = decide(state(list(items), has_tools=True))
            self.assertEqual(got, Reduce("conflicting tool proposals: grep vs ls", items))

    def test_arguments_preferred_in_dominance(self) -> None:
        """The dominant candidate is best_tool_proposal, which prefers arguments."""
        items = (tool("grep", {"q": 1}, 0.6), tool("ls", None, 0.9))
        got = decide(state(list(items), has_tools=True))
        self.assertEqual(got, Reduce("conflicting tool proposals: grep vs ls", items))

    def test_nameless_proposal(self) -> None:
        """No names: exactly one proposal above 0.6 escalates."""
        self.assertEqual(NAMELESS_TOOL_ABOVE, 0.6)
        items = (tool(None, None, 0.61), critique("hmm"))
        got = decide(state(list(items), has_tools=True))
        self.assertEqual(got, Reduce("tool proposal without parseable tool name", items))
        items = (tool(None, None, 0.6), critique("hmm"))
        got = decide(state(list(items), has_tools=True))
        self.assertEqual(got, Reduce("no clear answer or tool proposal", items))

    def test_low_confidence_with_critique(self) -> None:
        """A best answer below 0.5 with a critique escalates."""
        self.assertEqual(CRITIQUE_ESCALATION_BELOW, 0.5)
        items = (answer("Paris", 0.4), critique("check it"))
        got = decide(state(list(items)))
        self.assertEqual(got, Reduce("low confidence answer with critique", items))
        items = (answer("Paris", 0.5), critique("check it"))
        self.assertEqual(decide(state(list(items))), Ship(items[0], False, "arbiter"))

    def test_disagreeing_answers_synthesized(self) -> None:
        """v2: disagreeing answers go to the reducer, never one of them shipped."""
        items = (answer("Paris", 0.9), answer("Berlin"), answer("Rome"))
        got = decide(state(list(items)))
        self.assertEqual(got, Reduce("3 disagreeing answers to synthesize", items))

    def test_agreeing_low_confidence_ships(self) -> None:
        """Agreeing answers below the consensus bound: the best by confidence, first of equals."""
        items = [answer("Paris", 0.3), answer("Paris France", 0.3)]
        self.assertEqual(decide(state(items)), Ship(items[0], False, "arbiter"))

    def test_no_clear_answer(self) -> None:
        """Only critiques: the reducer."""
        items = (critique("a"), critique("b"))
        self.assertEqual(
            decide(state(list(items))), Reduce("no clear answer or tool proposal", items)
        )


class TruncatedTests(SynchronousTestCase):
    """v2: truncated replies take no part in consensus and never ship verbatim."""

    def test_excluded_from_consensus(self) -> None:
        """Two agreeing answers, one truncated: no consensus."""
        items = [answer("Paris"), answer("Paris", truncated=True)]
        self.assertEqual(decide(state(items, 1)), Wait())

    def test_single_truncated(self) -> None:
        """A lone truncated answer or tool call goes to the reducer."""
        for item in (answer("Paris", truncated=True), tool("grep", {"q": 1}, truncated=True)):
            got = decide(state([item], has_tools=True))
            self.assertIsInstance(got, Reduce)

    def test_only_truncated_answers(self) -> None:
        """Several answers, all truncated: the reducer."""
        items = (answer("Paris", truncated=True), answer("Rome", truncated=True))
        self.assertEqual(decide(state(list(items))), Reduce("only truncated answers", items))

    def test_reasoning_only_is_failure(self) -> None:
        """A reasoning-only reply counts as a failed worker (sole survivor, all failed)."""
        thinking = Outcome(Kind.EMPTY, "", reasoning_only=True)
        a = answer("Paris")
        self.assertEqual(decide(state([thinking, a], 1)), Ship(a, False, "sole survivor"))
        self.assertEqual(decide(state([thinking])), Fail(ALL_WORKERS_FAILED))


def mixed(outcomes: list[Landed], strong_running: bool = True, **kw: Any) -> ArbiterState:
    """A mixed-tier pool whose big Strong worker may still run."""
    run = (running(B, Role.STRONG, "strong"),) if strong_running else ()
    return ArbiterState(tuple(outcomes), run, **kw)


class StrongPatienceTests(SynchronousTestCase):
    """DESIGN decision 31: a big Strong worker is waited for."""

    def test_small_consensus_held(self) -> None:
        """A small-tier consensus waits while the big Strong worker runs."""
        a, b = answer("Paris"), answer("Paris France")
        st_ = mixed([landed(a, S, Role.FAST), landed(b)])
        self.assertTrue(patience_holds(st_))
        self.assertEqual(decide(st_), Wait())

    def test_patience_elapsed(self) -> None:
        """Once patience has elapsed the small consensus ships."""
        a, b = answer("Paris"), answer("Paris France")
        st_ = mixed([landed(a, S, Role.FAST), landed(b)], patience_elapsed=True)
        self.assertFalse(patience_holds(st_))
        self.assertEqual(decide(st_), Ship(b, False, "consensus"))

    def test_strong_agrees(self) -> None:
        """Strong lands and agrees: the consensus ships."""
        a, b, s = answer("Paris"), answer("Paris France"), answer("Paris, capital of France")
        got = decide(mixed([landed(a), landed(b), landed(s, B, Role.STRONG)], False))
        self.assertEqual(got, Ship(s, False, "consensus"))

    def test_strong_dissents(self) -> None:
        """Strong lands and disagrees with the small consensus: the reducer synthesizes."""
        a, b, s = answer("Paris"), answer("Paris France"), answer("Lyon")
        for elapsed in (False, True):
            got = decide(
                mixed(
                    [landed(a), landed(b), landed(s, B, Role.STRONG)],
                    False,
                    patience_elapsed=elapsed,
                )
            )
            self.assertEqual(
                got,
                Reduce("the strong worker disagrees with the small-tier consensus", (a, b, s)),
            )

    def test_big_member_not_held(self) -> None:
        """A consensus with a big-tier member does not wait for Strong."""
        a, b = answer("Paris"), answer("Paris France")
        got = decide(mixed([landed(a), landed(b, B)]))
        self.assertEqual(got, Ship(b, False, "consensus"))

    def test_all_big_pool_not_held(self) -> None:
        """With no small-tier worker there is no patience."""
        a, b = answer("Paris", 0.5), answer("Paris France")
        st_ = mixed([landed(a, B), landed(b, B)])
        self.assertFalse(patience_holds(st_))

    def test_small_strong_not_held(self) -> None:
        """A small-tier Strong worker is not waited for."""
        st_ = ArbiterState((landed(answer("x")),), (running(S, Role.STRONG),))
        self.assertFalse(patience_holds(st_))

    def test_sole_survivor_and_grace_held(self) -> None:
        """The sole-survivor exit and grace wait for Strong too."""
        a = answer("Paris")
        items = [landed(dead()), landed(a), landed(dead(), S)]
        self.assertEqual(decide(mixed(items)), Wait())
        self.assertEqual(decide(mixed(items, patience_elapsed=True)).reason, "sole survivor")  # type: ignore[union-attr]
        self.assertEqual(decide(mixed([landed(a)], grace_elapsed=True)), Wait())
        got = decide(mixed([landed(a)], grace_elapsed=True, patience_elapsed=True))
        self.assertEqual(got, Ship(a, False, "grace"))

    def test_tools_never_held(self) -> None:
        """Tool consensus ships while Strong runs."""
        a, b = tool("grep", {"q": 1}), tool("grep")
        got = decide(mixed([landed(a), landed(b)], has_tools=True))
        self.assertEqual(got, Ship(a, True, "tool consensus"))


def _kind(decision: Decision) -> str:
    """The decision's kind name, for the scenario table."""
    return type(decision).__name__.lower()


SCENARIOS: tuple[tuple[str, ArbiterState, str, str | None], ...] = (
    (
        "consensus early exit",
        state([answer("The capital is Paris"), answer("Paris")], 1),
        "ship",
        "The capital is Paris",
    ),
    (
        "terse vs verbose agreement",
        state([answer("42"), answer("The answer to the question is 42")]),
        "ship",
        "The answer to the question is 42",
    ),
    (
        "negation blocks agreement",
        state([answer("use grep"), answer("do not use grep")]),
        "reduce",
        None,
    ),
    (
        "disagreement goes to synthesis",
        state([answer("Paris"), answer("Berlin")]),
        "reduce",
        None,
    ),
    (
        "tool consensus with arguments preferred",
        state([tool("read", None, 0.9), tool("read", {"path": "a"}, 0.6)], 1, has_tools=True),
        "ship",
        "calling read",
    ),
    (
        "tool proposal vs answer goes to the reducer",
        state([tool("read", {"path": "a"}), answer("The file says hi")], 1, has_tools=True),
        "reduce",
        None,
    ),
    (
        "strong patience holds a small consensus",
        mixed([landed(answer("Paris")), landed(answer("Paris"))]),
        "wait",
        None,
    ),
    ("one worker dead of two, dead first", state([dead(), answer("Paris")]), "ship", "Paris"),
    ("one worker dead of two, dead last", state([answer("Paris"), dead()]), "ship", "Paris"),
    ("one worker dead of two, other pending", state([dead()], 1), "wait", None),
)
"""The arbitration scenarios of issue 6's list, one state each."""


class ScenarioTests(SynchronousTestCase):
    """Issue 6's arbitration scenarios, table-driven."""

    def test_scenarios(self) -> None:
        """Each scenario gives the expected decision kind (and shipped text)."""
        for name, st_, kind, text in SCENARIOS:
            got = decide(st_)
            self.assertEqual(_kind(got), kind, name)
            if text is not None:
                assert isinstance(got, Ship)
                self.assertEqual(got.outcome.text, text, name)

    def test_tool_consensus_arguments(self) -> None:
        """The tool consensus scenario ships the proposal with arguments."""
        got = decide(SCENARIOS[4][1])
        assert isinstance(got, Ship)
        self.assertEqual((got.tool_call, got.outcome.arguments_json()), (True, '{"path":"a"}'))


WORDS = st.sampled_from(["paris", "berlin", "not", "the", "42", "capital", "grep", "no", "use"])
TEXTS = st.lists(WORDS, max_size=4).map(" ".join)
OUTCOMES = st.one_of(
    st.builds(
        answer,
        TEXTS,
        st.floats(0, 1),
        truncated=st.booleans(),
        reasoning_only=st.booleans(),
    ),
    st.builds(
        tool,
        st.sampled_from([None, "grep", "ls"]),
        st.sampled_from([None, {}, {"q": 1}]),
        st.floats(0, 1),
        truncated=st.booleans(),
    ),
    st.builds(critique, TEXTS),
    st.just(uncertain()),
    st.just(dead()),
)
LANDED = st.builds(Landed, OUTCOMES, st.sampled_from(list(Role)), st.sampled_from(list(Tier)))
RUNNING = st.builds(Running, st.just("w"), st.sampled_from(list(Role)), st.sampled_from(list(Tier)))
STATES = st.builds(
    ArbiterState,
    st.lists(LANDED, max_size=6).map(tuple),
    st.lists(RUNNING, max_size=3).map(tuple),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)


class PropertyTests(SynchronousTestCase):
    """Properties over arbitrary states."""

    @given(STATES)
    def test_decision_shape(self, st_: ArbiterState) -> None:
        """Always one of the four kinds; never ships a failed or truncated outcome."""
        got = decide(st_)
        self.assertIsInstance(got, (Wait, Ship, Reduce, Fail))
        if isinstance(got, Ship):
            self.assertTrue(got.outcome.verbatim_ok)
            self.assertIn(got.outcome, [item.outcome for item in st_.landed])
            if got.tool_call:
                self.assertTrue(st_.has_tools and got.outcome.tool_name)
        if isinstance(got, Reduce):
            self.assertTrue(got.outcomes)
            self.assertFalse(any(outcome.failed for outcome in got.outcomes))
        if isinstance(got, Fail):
            self.assertFalse(st_.running)
            self.assertTrue(all(item.outcome.failed for item in st_.landed))
        if isinstance(got, Wait):
            self.assertTrue(st_.running)
