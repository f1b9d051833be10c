"""
Tests for L{loopd.moa.reducer}: the reducer candidate order and the hedged ladder
(reference C{mesh-moa.md} §1.11, with v2's failure rules of §6).
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.moa.outcome import Kind, Outcome
from loopd.moa.reducer import (
    ALL_REDUCERS_FAILED,
    HEDGE_DELAY_S,
    NO_USABLE_ANSWER,
    Action,
    ArmHedge,
    Cancel,
    Fail,
    Finish,
    HedgedLadder,
    Launch,
    StopHedge,
    is_usable,
    reducer_candidates,
)
from loopd.moa.roles import Tier, Worker, tier_of

ANSWER = Outcome(Kind.ANSWER, "Paris")
TOOL = Outcome(Kind.TOOL_PROPOSAL, "", 0.9, tool_name="read_file", tool_arguments={"p": "a"})
CRITIQUE = Outcome(Kind.CRITIQUE, "that is wrong")
UNCERTAIN = Outcome(Kind.UNCERTAINTY, "I am not sure", 0.3)
DEMOTED = Outcome(Kind.UNCERTAINTY, "calling rm", 0.0, demoted_tool="rm")
TRUNCATED = Outcome(Kind.ANSWER, "Par", truncated=True, finish_reason="length")
EMPTY = Outcome(Kind.EMPTY, "", error="empty response")
REASONING_ONLY = Outcome(Kind.EMPTY, "", reasoning_only=True, error="reasoning-only response")
REASONING_ANSWER = Outcome(Kind.ANSWER, "", reasoning_only=True)

NAMES = ("Qwen3-32B", "Llama-70B", "Qwen3-8B")


def started(candidates: tuple[str, ...] = NAMES) -> HedgedLadder:
    """A ladder over C{candidates} that has been started."""
    ladder = HedgedLadder(candidates)
    ladder.start()
    return ladder


class CandidateTests(SynchronousTestCase):
    """The candidate order (§1.11 "Candidate order")."""

    TABLE: tuple[tuple[tuple[Worker, ...], tuple[str, ...]], ...] = (
        ((), ()),
        ((Worker("Qwen3-8B"),), ("Qwen3-8B",)),
        (
            (Worker("gemma-2-2b-it"), Worker("Qwen3-32B"), Worker("Qwen3-8B"), Worker("llama-70b")),
            ("Qwen3-32B", "llama-70b", "gemma-2-2b-it", "Qwen3-8B"),
        ),
        ((Worker("a-70B"), Worker("b-32B")), ("a-70B", "b-32B")),
        ((Worker("x-3B"), Worker("y-7B")), ("x-3B", "y-7B")),
        ((Worker("tiny", 1.5), Worker("huge-3B", 30.0)), ("huge-3B", "tiny")),
        ((Worker("edge", 10.0), Worker("under", 9.9)), ("edge", "under")),
        ((Worker("m-8B"), Worker("m-8B", 40.0), Worker("n-32B")), ("n-32B", "m-8B")),
    )

    def test_table(self) -> None:
        """Big tier first, then small, each in config order; a size_b wins over the name."""
        for models, expected in self.TABLE:
            self.assertEqual(reducer_candidates(models), expected, models)

    def test_failed_workers_included(self) -> None:
        """'All configured models (including workers that failed)': nothing is filtered."""
        models = tuple(Worker(f"m{i}-{i + 1}B") for i in range(5))
        self.assertEqual(len(reducer_candidates(models)), 5)

    def test_head_is_first_big(self) -> None:
        """Quirk 9: the ladder head is the first big model, Strong is the last."""
        models = (Worker("alpha-32B"), Worker("beta-70B"), Worker("gamma-4B"))
        self.assertEqual(reducer_candidates(models)[0], "alpha-32B")

    @given(
        st.lists(
            st.builds(
                Worker,
                st.text(min_size=1, max_size=12),
                st.one_of(st.none(), st.floats(0, 200)),
            ),
            max_size=8,
        )
    )
    def test_stable_partition(self, models: list[Worker]) -> None:
        """The result is the big names in order, then the small ones, each name once."""
        first: dict[str, Worker] = {}
        for model in models:
            first.setdefault(model.name, model)
        big = [n for n, m in first.items() if tier_of(n, m.size_b) is Tier.BIG]
        small = [n for n, m in first.items() if tier_of(n, m.size_b) is Tier.SMALL]
        self.assertEqual(reducer_candidates(models), tuple(big + small))


class UsableTests(SynchronousTestCase):
    """Which reducer replies may ship (v2 §6)."""

    def test_table(self) -> None:
        """Answers, critiques and tool proposals ship; uncertain, truncated, failed do not."""
        table = (
            (ANSWER, True),
            (TOOL, True),
            (CRITIQUE, True),
            (UNCERTAIN, False),
            (DEMOTED, False),
            (TRUNCATED, False),
            (EMPTY, False),
            (REASONING_ONLY, False),
            (REASONING_ANSWER, False),
        )
        for outcome, expected in table:
            self.assertEqual(is_usable(outcome), expected, outcome)


class LadderTests(SynchronousTestCase):
    """The hedged ladder's steps (§1.11 "Ladder steps") and v2's failure rules."""

    def test_no_candidates(self) -> None:
        """Step 1: no candidates is all_reducers_failed "no reducer candidates", 0 attempts."""
        ladder = HedgedLadder(())
        self.assertEqual(ladder.start(), (Fail(ALL_REDUCERS_FAILED, "no reducer candidates"),))
        self.assertEqual(ladder.attempts, 0)
        self.assertTrue(ladder.done)
        self.assertEqual(ladder.on_hedge_timer(), ())

    def test_start(self) -> None:
        """Step 2: candidate 0 is launched (attempts 1) and the 5 s hedge timer armed."""
        ladder = HedgedLadder(NAMES)
        self.assertEqual(ladder.start(), (Launch(0, "Qwen3-32B"), ArmHedge(HEDGE_DELAY_S)))
        self.assertEqual(HEDGE_DELAY_S, 5.0)
        self.assertEqual(ladder.attempts, 1)
        self.assertEqual(ladder.in_flight, (0,))

    def test_hedge_delay_configurable(self) -> None:
        """The hedge delay given to the ladder is the one armed."""
        ladder = HedgedLadder(NAMES, hedge_delay=1.5)
        self.assertEqual(ladder.start()[1], ArmHedge(1.5))

    def test_single_candidate_no_timer(self) -> None:
        """With nothing to hedge to, no timer is armed after the last launch."""
        ladder = HedgedLadder(("only",))
        self.assertEqual(ladder.start(), (Launch(0, "only"), StopHedge()))

    def test_start_twice(self) -> None:
        """Starting a started ladder is a caller bug."""
        ladder = started()
        self.assertRaises(ValueError, ladder.start)

    def test_happy_path(self) -> None:
        """Cost shape: the happy path is 1 call; the first success wins."""
        ladder = started()
        actions = ladder.on_success(0, ANSWER)
        self.assertEqual(actions, (StopHedge(), Finish(0, "Qwen3-32B", ANSWER)))
        self.assertEqual(ladder.attempts, 1)
        self.assertEqual(ladder.winner, "Qwen3-32B")
        self.assertTrue(ladder.done)

    def test_slow_primary(self) -> None:
        """The timer fires: the next candidate runs alongside; its success cancels the first."""
        ladder = started()
        self.assertEqual(ladder.on_hedge_timer(), (Launch(1, "Llama-70B"), ArmHedge(5.0)))
        self.assertEqual(ladder.in_flight, (0, 1))
        actions = ladder.on_success(1, ANSWER)
        self.assertEqual(actions, (StopHedge(), Cancel((0,)), Finish(1, "Llama-70B", ANSWER)))
        self.assertEqual(ladder.attempts, 2)

    def test_primary_wins_after_hedge(self) -> None:
        """The first success wins whichever candidate it is; the hedged one is cancelled."""
        ladder = started()
        ladder.on_hedge_timer()
        actions = ladder.on_success(0, TOOL)
        self.assertEqual(actions, (StopHedge(), Cancel((1,)), Finish(0, "Qwen3-32B", TOOL)))

    def test_fast_failure(self) -> None:
        """A failure launches the next candidate at once, with a fresh timer."""
        ladder = started()
        self.assertEqual(ladder.on_failure(0, "503"), (Launch(1, "Llama-70B"), ArmHedge(5.0)))
        self.assertEqual(ladder.in_flight, (1,))
        self.assertEqual(ladder.last_error, "503")

    def test_failure_while_others_run(self) -> None:
        """A failure launches the next candidate even while another call is in flight."""
        ladder = started()
        ladder.on_hedge_timer()
        self.assertEqual(ladder.on_failure(1, "refused"), (Launch(2, "Qwen3-8B"), StopHedge()))
        self.assertEqual(ladder.in_flight, (0, 2))

    def test_concurrency_grows(self) -> None:
        """Quirk 10: with nothing answering, one more candidate per hedge delay, up to N."""
        ladder = started()
        ladder.on_hedge_timer()
        self.assertEqual(ladder.on_hedge_timer(), (Launch(2, "Qwen3-8B"), StopHedge()))
        self.assertEqual(ladder.in_flight, (0, 1, 2))
        self.assertEqual(ladder.on_hedge_timer(), ())
        self.assertEqual(ladder.attempts, 3)

    def test_reasoning_only_is_failure(self) -> None:
        """v2: a reasoning-only reply counts as a failure; the ladder moves on."""
        ladder = started()
        self.assertEqual(
            ladder.on_success(0, REASONING_ONLY), (Launch(1, "Llama-70B"), ArmHedge(5.0))
        )
        self.assertEqual(ladder.last_error, "reasoning-only response")
        self.assertFalse(ladder.done)

    def test_reasoning_flag_on_answer_is_failure(self) -> None:
        """Any outcome flagged reasoning-only is a failure, whatever its kind."""
        ladder = started()
        self.assertEqual(ladder.on_success(0, REASONING_ANSWER)[0], Launch(1, "Llama-70B"))

    def test_empty_is_failure(self) -> None:
        """An empty reply (Outcome.failed) counts as a failure."""
        ladder = started()
        self.assertEqual(ladder.on_success(0, EMPTY)[0], Launch(1, "Llama-70B"))
        self.assertEqual(ladder.last_error, "empty response")

    def test_all_failed(self) -> None:
        """Step 4: nothing left in flight is all_reducers_failed with the last error."""
        ladder = started()
        ladder.on_failure(0, "boom 0")
        ladder.on_success(1, EMPTY)
        actions = ladder.on_failure(2, "boom 2")
        message = "Reducer failed (tried 3): boom 2"
        self.assertEqual(actions, (StopHedge(), Fail(ALL_REDUCERS_FAILED, message)))
        self.assertEqual(ladder.attempts, 3)
        self.assertIsNone(ladder.winner)
        self.assertTrue(ladder.done)

    def test_all_failed_default_message(self) -> None:
        """Without any error text the reason is "all reducer candidates failed"."""
        ladder = started(("a",))
        actions = ladder.on_failure(0)
        message = "Reducer failed (tried 1): all reducer candidates failed"
        self.assertEqual(actions, (StopHedge(), Fail(ALL_REDUCERS_FAILED, message)))

    def test_exhausted_waits_for_in_flight(self) -> None:
        """Once the list is exhausted, a failure waits for the calls still in flight."""
        ladder = started(("a", "b"))
        ladder.on_hedge_timer()
        self.assertEqual(ladder.on_failure(1, "x"), ())
        self.assertFalse(ladder.done)
        self.assertEqual(ladder.on_success(0, ANSWER), (StopHedge(), Finish(0, "a", ANSWER)))

    def test_uncertain_is_no_usable_answer(self) -> None:
        """v2: a reducer returning uncertainty is no_usable_answer; the rest are cancelled."""
        ladder = started()
        ladder.on_hedge_timer()
        actions = ladder.on_success(0, UNCERTAIN)
        expected = Fail(NO_USABLE_ANSWER, "MoA reducer returned no usable answer", 0)
        self.assertEqual(actions, (StopHedge(), Cancel((1,)), expected))
        self.assertEqual(ladder.winner, "Qwen3-32B")
        self.assertEqual(ladder.on_success(1, ANSWER), ())

    def test_demoted_and_truncated_not_usable(self) -> None:
        """A demoted tool proposal and a truncated reply are no_usable_answer too."""
        for outcome in (DEMOTED, TRUNCATED):
            ladder = started()
            action = ladder.on_success(0, outcome)[-1]
            self.assertIsInstance(action, Fail)
            assert isinstance(action, Fail)
            self.assertEqual(action.code, NO_USABLE_ANSWER)

    def test_critique_ships(self) -> None:
        """§1.10: anything but a tool proposal ships as text, a critique included."""
        ladder = started()
        self.assertEqual(ladder.on_success(0, CRITIQUE)[-1], Finish(0, "Qwen3-32B", CRITIQUE))

    def test_over_means_silent(self) -> None:
        """After the end every event returns nothing; a late timer is harmless."""
        ladder = started()
        ladder.on_hedge_timer()
        ladder.on_success(1, ANSWER)
        self.assertEqual(ladder.on_hedge_timer(), ())
        self.assertEqual(ladder.on_failure(0, "late"), ())
        self.assertEqual(ladder.on_success(0, ANSWER), ())
        self.assertEqual(ladder.attempts, 2)

    def test_stale_result_ignored(self) -> None:
        """A second result for a call already reported changes nothing."""
        ladder = started()
        ladder.on_failure(0, "x")
        self.assertEqual(ladder.on_success(0, ANSWER), ())
        self.assertEqual(ladder.in_flight, (1,))

    def test_never_launched(self) -> None:
        """A result for a candidate never launched is a caller bug."""
        ladder = started()
        self.assertRaises(ValueError, ladder.on_success, 1, ANSWER)
        self.assertRaises(ValueError, ladder.on_failure, -1)
        self.assertRaises(ValueError, HedgedLadder(NAMES).on_failure, 0)

    def test_timer_before_start(self) -> None:
        """A timer before the start launches nothing."""
        self.assertEqual(HedgedLadder(NAMES).on_hedge_timer(), ())


REPLIES = (ANSWER, TOOL, CRITIQUE, UNCERTAIN, TRUNCATED, EMPTY, REASONING_ONLY)

events = st.lists(
    st.one_of(
        st.tuples(st.just("timer"), st.just(0), st.just(0)),
        st.tuples(st.just("failure"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("success"), st.integers(0, 7), st.integers(0, len(REPLIES) - 1)),
    ),
    max_size=30,
)


class LadderPropertyTests(SynchronousTestCase):
    """Any interleaving of results and timer events keeps the ladder's invariants."""

    @given(st.integers(0, 5), events)
    def test_invariants(self, size: int, script: list[tuple[str, int, int]]) -> None:
        """At most one end, no launch after it, attempts == launches, cancels in flight."""
        names = tuple(f"m{i}" for i in range(size))
        ladder = HedgedLadder(names)
        log: list[Action] = list(ladder.start())
        in_flight: set[int] = set()
        launched: list[int] = []
        ended = 0
        failed: set[int] = set()

        def apply(actions: tuple[Action, ...]) -> None:
            nonlocal ended
            for action in actions:
                self.assertEqual(ended, 0, "an action after the end")
                if isinstance(action, Launch):
                    self.assertEqual(action.index, len(launched))
                    self.assertEqual(action.name, names[action.index])
                    launched.append(action.index)
                    in_flight.add(action.index)
                elif isinstance(action, Cancel):
                    self.assertTrue(action.indices)
                    self.assertTrue(set(action.indices) <= in_flight)
                    in_flight.difference_update(action.indices)
                elif isinstance(action, (Finish, Fail)):
                    ended += 1
                    self.assertEqual(in_flight, set())

        apply(tuple(log))
        for kind, pick, reply in script:
            if kind == "timer":
                apply(ladder.on_hedge_timer())
                continue
            if not launched:
                continue
            index = launched[pick % len(launched)]
            was_in_flight = index in in_flight
            if was_in_flight:
                in_flight.discard(index)
            outcome = REPLIES[reply]
            if kind == "failure" or outcome.failed:
                if was_in_flight:
                    failed.add(index)
                actions = (
                    ladder.on_failure(index, "x")
                    if kind == "failure"
                    else ladder.on_success(index, outcome)
                )
                if was_in_flight and not ended and len(launched) < size:
                    # A failure launches the next candidate at once.
                    self.assertEqual(actions[0], Launch(len(launched), names[len(launched)]))
            else:
                actions = ladder.on_success(index, outcome)
                if was_in_flight and not ended:
                    self.assertTrue(actions)
                    end = actions[-1]
                    if is_usable(outcome):
                        self.assertEqual(end, Finish(index, names[index], outcome))
                    else:
                        self.assertIsInstance(end, Fail)
                        assert isinstance(end, Fail)
                        self.assertEqual(end.code, NO_USABLE_ANSWER)
            if not was_in_flight:
                self.assertEqual(actions, ())
            apply(actions)
        self.assertLessEqual(ended, 1)
        self.assertEqual(ladder.attempts, len(launched))
        self.assertEqual(ladder.done, ended == 1)
        self.assertEqual(set(ladder.in_flight), in_flight)
        if not ladder.done:
            # Alive means something still runs (a lost ladder always ends).
            self.assertTrue(in_flight)
        if ladder.done and ladder.winner is None:
            # Lost: every candidate was tried and every one failed.
            self.assertEqual(ladder.attempts, size)
            self.assertEqual(failed, set(range(size)))

    @given(st.integers(1, 6), st.lists(st.booleans(), max_size=12))
    def test_hedge_timer_tracks_launches(self, size: int, script: list[bool]) -> None:
        """A timer is armed after a launch exactly when a candidate remains."""
        ladder = HedgedLadder(tuple(f"m{i}" for i in range(size)))
        batches: list[tuple[Action, ...]] = [ladder.start()]
        for fail_oldest in script:
            if fail_oldest and ladder.in_flight:
                batches.append(ladder.on_failure(ladder.in_flight[0], "x"))
            else:
                batches.append(ladder.on_hedge_timer())
        for batch in batches:
            for position, action in enumerate(batch):
                if isinstance(action, Launch):
                    follow: Any = batch[position + 1]
                    if action.index + 1 < size:
                        self.assertEqual(follow, ArmHedge(HEDGE_DELAY_S))
                    else:
                        self.assertEqual(follow, StopHedge())
