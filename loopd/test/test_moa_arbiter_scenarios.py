"""
Issue 6's arbitration scenarios as a table, and properties of L{loopd.moa.arbiter.decide}
over arbitrary states (reference C{mesh-moa.md} §1.10 with §6).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.moa.arbiter import (
    ArbiterState,
    Decision,
    Fail,
    Landed,
    Reduce,
    Running,
    Ship,
    Wait,
    decide,
)
from loopd.moa.roles import Role, Tier
from loopd.test.test_moa_arbiter import (
    answer,
    critique,
    dead,
    landed,
    mixed,
    state,
    tool,
    uncertain,
)


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
