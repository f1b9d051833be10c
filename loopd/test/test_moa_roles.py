"""
Tests for L{loopd.moa.roles}: the single-digit-B tier rule, sizes from the config, role
assignment by pool size (reference C{mesh-moa.md} §1.4), canonical names and the pool's
alias dedup (§1.2).
"""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.moa.roles import (
    SMALL_TIER_MAX_B,
    Assignment,
    Role,
    Tier,
    Worker,
    assign_roles,
    build_pool,
    canonical_name,
    group_aliases,
    is_single_digit_b_name,
    is_small_tier,
    tier_of,
)

SMALL_NAMES = (
    "Qwen3-8B",
    "Qwen2.5-3B",
    "Qwen3.5-9B-Q4_K_M",
    "llama-3-7b-instruct",
    "Mistral-7B-Instruct-v0.3",
    "gemma-2-2b-it",
)
"""The reference's small-tier examples (§1.4)."""

BIG_NAMES = (
    "Qwen3-32B",
    "llama-3-70b",
    "MiniMax-M2.5",
    "Coder-Next",
    "Qwen3.6-35B-A3B",
    "model-bf16",
    "phi-3.5-mini-3.8B",
    "Qwen2.5-1.5B",
    "foo-2b1-bar",
    "",
)
"""The reference's big-tier examples (§1.4)."""

# An independent formulation of the rule: a digit 1-9 not after an ASCII letter, digit or
# dot, then b or B, then no digit.
_RULE = re.compile(r"(?<![0-9A-Za-z.])[1-9][bB](?![0-9])", re.ASCII)

name_texts = st.text(
    alphabet=st.one_of(st.sampled_from(list("0123456789bB.-_aAzZ:/@ ")), st.characters()),
    max_size=24,
)


class SingleDigitBTests(SynchronousTestCase):
    """C{is_single_digit_b_name}: the name rule of the size tier."""

    def test_small_examples(self) -> None:
        """Every small-tier name of the reference's table is a single-digit-B name."""
        for name in SMALL_NAMES:
            self.assertTrue(is_single_digit_b_name(name), name)

    def test_big_examples(self) -> None:
        """Every big-tier name of the reference's table is not (decimals, A3B, 2b1, "")."""
        for name in BIG_NAMES:
            self.assertFalse(is_single_digit_b_name(name), name)

    def test_zero_is_not_a_size(self) -> None:
        """ "byte i is a digit from 1 to 9": C{0B} is not a single-digit size."""
        self.assertFalse(is_single_digit_b_name("model-0B"))

    def test_at_start_and_end(self) -> None:
        """The digit may be the first byte, and the b the last."""
        self.assertTrue(is_single_digit_b_name("7b"))
        self.assertTrue(is_single_digit_b_name("x_3B"))

    def test_non_ascii_neighbours(self) -> None:
        """Only ASCII letters and digits count as neighbours: C{é7B} and C{7B٣} are small."""
        self.assertTrue(is_single_digit_b_name("é7B"))
        self.assertTrue(is_single_digit_b_name("7B٣"))
        self.assertFalse(is_single_digit_b_name("٣7B".replace("٣", "x")))

    @given(name_texts)
    def test_matches_regex(self, name: str) -> None:
        """The byte scan agrees with an independent regular expression on any text."""
        self.assertEqual(is_single_digit_b_name(name), _RULE.search(name) is not None)


class TierTests(SynchronousTestCase):
    """C{is_small_tier} and C{tier_of}: a configured size overrides the name rule."""

    def test_name_rule_without_size(self) -> None:
        """Without a size the name rule decides."""
        self.assertEqual(tier_of("Qwen3-8B"), Tier.SMALL)
        self.assertEqual(tier_of("Qwen3-32B"), Tier.BIG)

    def test_size_overrides_name(self) -> None:
        """size_b < 10 is small and >= 10 big, whatever the name says."""
        self.assertEqual(tier_of("Qwen3-8B", 32), Tier.BIG)
        self.assertEqual(tier_of("Qwen3-32B", 8), Tier.SMALL)
        self.assertEqual(tier_of("Coder-Next", 9.99), Tier.SMALL)

    def test_exactly_ten_is_big(self) -> None:
        """Exactly 10 B is big (v2's SMALL_TIER_MAX_B = 10.0, "Big if >= 10 B")."""
        self.assertEqual(SMALL_TIER_MAX_B, 10.0)
        self.assertFalse(is_small_tier("tiny-1B", 10))
        self.assertFalse(is_small_tier("tiny-1B", 10.0))

    def test_nan_size_is_unknown(self) -> None:
        """A NaN size counts as not configured: the name rule decides."""
        self.assertTrue(is_small_tier("Qwen3-8B", float("nan")))
        self.assertFalse(is_small_tier("Qwen3-32B", float("nan")))

    @given(name_texts, st.floats(min_value=0, max_value=1000))
    def test_size_decides(self, name: str, size: float) -> None:
        """Any configured size decides alone."""
        self.assertEqual(is_small_tier(name, size), size < 10)


def names_of(assignments: tuple[Assignment, ...]) -> list[tuple[str, Role]]:
    """The (name, role) pairs of an assignment."""
    return [(a.name, a.role) for a in assignments]


class AssignRolesTests(SynchronousTestCase):
    """C{assign_roles}: roles by pool size and tier (§1.4)."""

    def test_no_models(self) -> None:
        """0 models → no workers."""
        self.assertEqual(assign_roles([]), ())

    def test_one_model(self) -> None:
        """1 model → a single Generalist (with its tier)."""
        self.assertEqual(
            assign_roles([Worker("Qwen3-8B")]),
            (Assignment("Qwen3-8B", Role.GENERALIST, Tier.SMALL),),
        )

    def test_two_models(self) -> None:
        """With 2 the small one is Fast and the big one Strong, whatever the input order."""
        result = assign_roles([Worker("Qwen3-32B"), Worker("Qwen3-8B")])
        self.assertEqual(
            result,
            (
                Assignment("Qwen3-8B", Role.FAST, Tier.SMALL),
                Assignment("Qwen3-32B", Role.STRONG, Tier.BIG),
            ),
        )

    def test_reference_pool(self) -> None:
        """The reference's pool: Qwen2.5-3B Fast, Strong the last big model (Qwen3-32B)."""
        pool = [Worker(n) for n in ("MiniMax-M2.5", "Qwen2.5-3B", "Qwen3-32B", "Qwen3-8B")]
        self.assertEqual(
            names_of(assign_roles(pool)),
            [
                ("Qwen2.5-3B", Role.FAST),
                ("Qwen3-8B", Role.SPECIALIST),
                ("MiniMax-M2.5", Role.SPECIALIST),
                ("Qwen3-32B", Role.STRONG),
            ],
        )

    def test_all_big(self) -> None:
        """An all-big pool keeps its order: the first is Fast, the last Strong."""
        pool = [Worker("a-70b"), Worker("b-32b"), Worker("c-14b")]
        self.assertEqual(
            names_of(assign_roles(pool)),
            [("a-70b", Role.FAST), ("b-32b", Role.SPECIALIST), ("c-14b", Role.STRONG)],
        )

    def test_all_small_stays_committee(self) -> None:
        """An all-small pool still gets Fast, Specialist and Strong (DESIGN decision 30)."""
        pool = [Worker("a-1b"), Worker("b-3b"), Worker("c-7b")]
        roles = [a.role for a in assign_roles(pool)]
        self.assertEqual(roles, [Role.FAST, Role.SPECIALIST, Role.STRONG])

    def test_size_moves_worker(self) -> None:
        """A configured size moves a worker across tiers: a sized 3 B "Coder-Next" is Fast."""
        pool = [Worker("Coder-Next", 3), Worker("Qwen3-8B", 30)]
        self.assertEqual(
            assign_roles(pool),
            (
                Assignment("Coder-Next", Role.FAST, Tier.SMALL),
                Assignment("Qwen3-8B", Role.STRONG, Tier.BIG),
            ),
        )

    @given(st.lists(st.tuples(name_texts, st.none() | st.integers(0, 80)), max_size=8))
    def test_properties(self, specs: list[tuple[str, int | None]]) -> None:
        """A stable permutation, small before big; one Fast first and one Strong last."""
        pool = [Worker(name, size) for name, size in specs]
        result = assign_roles(pool)
        self.assertEqual(sorted(a.name for a in result), sorted(w.name for w in pool))
        tiers = [a.tier for a in result]
        self.assertEqual(tiers, sorted(tiers, key=lambda t: t is Tier.BIG))
        for tier in Tier:
            expected = [w.name for w in pool if tier_of(w.name, w.size_b) is tier]
            self.assertEqual([a.name for a in result if a.tier is tier], expected)
        roles = [a.role for a in result]
        if len(pool) >= 2:
            self.assertEqual(roles[0], Role.FAST)
            self.assertEqual(roles[-1], Role.STRONG)
            self.assertEqual(set(roles[1:-1]) - {Role.SPECIALIST}, set())
        elif pool:
            self.assertEqual(roles, [Role.GENERALIST])


class CanonicalNameTests(SynchronousTestCase):
    """C{canonical_name}: the alias identity of §1.2."""

    def test_reference_example(self) -> None:
        """C{unsloth/Qwen3-8B-GGUF:Q4_K_M} and C{Qwen3-8B-Q4_K_M} are both qwen38bq4km."""
        self.assertEqual(canonical_name("unsloth/Qwen3-8B-GGUF:Q4_K_M"), "qwen38bq4km")
        self.assertEqual(canonical_name("Qwen3-8B-Q4_K_M"), "qwen38bq4km")

    def test_branch_keeps_quant(self) -> None:
        """From C{@} up to the next C{:} is deleted: repo@main:q4_k_m → repo:q4_k_m."""
        self.assertEqual(canonical_name("repo@main:q4_k_m"), "repoq4km")

    def test_branch_without_colon(self) -> None:
        """With no C{:} after the C{@}, everything from the C{@} on is deleted."""
        self.assertEqual(canonical_name("GLM-4.7-Flash@main"), "glm47flash")

    def test_only_first_at(self) -> None:
        """Only the first C{@} starts a branch."""
        self.assertEqual(canonical_name("a@b@c:d@e"), "ade")

    def test_prefixes_dropped(self) -> None:
        """C{-gguf}, C{unsloth/} and C{meshllm/} are deleted (after lowercasing)."""
        self.assertEqual(canonical_name("MeshLLM/Foo-GGUF"), "foo")
        self.assertEqual(canonical_name("UNSLOTH/x"), "x")

    def test_removal_can_join(self) -> None:
        """The deletions run in order, so removing C{-gguf} can form an C{unsloth/}."""
        self.assertEqual(canonical_name("unsl-ggufoth/m"), "m")

    def test_non_ascii_dropped(self) -> None:
        """Only ASCII letters and digits survive."""
        self.assertEqual(canonical_name("Modèle_7B"), "modle7b")

    @given(st.text(max_size=30))
    def test_shape(self, name: str) -> None:
        """Any name maps to lowercase ASCII letters and digits, and canonicalizing is stable."""
        result = canonical_name(name)
        self.assertIsNotNone(re.fullmatch("[a-z0-9]*", result))
        self.assertEqual(canonical_name(result), result)


class PoolTests(SynchronousTestCase):
    """C{group_aliases} and C{build_pool}: one worker per canonical model (§1.2)."""

    def test_groups_and_order(self) -> None:
        """Aliases group by canonical name; shorter first, then lexicographic; groups by first."""
        names = ["unsloth/Qwen3-8B-GGUF:Q4_K_M", "zeta-1b", "Qwen3-8B-Q4_K_M", "Qwen3-8B:Q4-K-M"]
        self.assertEqual(
            group_aliases(names),
            (
                ("Qwen3-8B-Q4_K_M", "Qwen3-8B:Q4-K-M", "unsloth/Qwen3-8B-GGUF:Q4_K_M"),
                ("zeta-1b",),
            ),
        )

    def test_local_first(self) -> None:
        """A locally served alias goes before shorter ones."""
        names = ["Qwen3-8B-Q4_K_M", "unsloth/Qwen3-8B-GGUF:Q4_K_M"]
        local = {"unsloth/Qwen3-8B-GGUF:Q4_K_M"}.__contains__
        self.assertEqual(group_aliases(names, local=local), (tuple(reversed(names)),))

    def test_mesh_and_duplicates_dropped(self) -> None:
        """C{mesh} is never a worker, and a repeated name counts once."""
        self.assertEqual(group_aliases(["mesh", "a-7b", "a-7b"]), (("a-7b",),))

    def test_first_reachable_alias(self) -> None:
        """Each group yields its first reachable alias; a group with none yields nothing."""
        workers = [
            Worker("Qwen3-8B-Q4_K_M", 8),
            Worker("unsloth/Qwen3-8B-GGUF:Q4_K_M"),
            Worker("b"),
        ]
        reachable = {"unsloth/Qwen3-8B-GGUF:Q4_K_M"}.__contains__
        self.assertEqual(
            build_pool(workers, reachable=reachable),
            (Worker("unsloth/Qwen3-8B-GGUF:Q4_K_M"),),
        )

    def test_sizes_kept(self) -> None:
        """The pool's workers keep their configured sizes, in group order."""
        workers = [Worker("z-70b", 70), Worker("a-7b", 7)]
        self.assertEqual(build_pool(workers), (Worker("a-7b", 7), Worker("z-70b", 70)))

    def test_small_pool_allowed(self) -> None:
        """Fewer than 2 workers is a valid pool (v2: the single model serves)."""
        self.assertEqual(build_pool([Worker("a"), Worker("A")]), (Worker("A"),))
        self.assertEqual(build_pool([]), ())

    @given(st.lists(name_texts, max_size=10), st.sets(name_texts, max_size=10))
    def test_one_per_canonical_name(self, names: list[str], down: set[str]) -> None:
        """The pool holds reachable names only, one per canonical name, never C{mesh}."""
        pool = build_pool([Worker(n) for n in names], reachable=lambda n: n not in down)
        canon = [canonical_name(w.name) for w in pool]
        self.assertEqual(len(canon), len(set(canon)))
        for worker in pool:
            self.assertIn(worker.name, names)
            self.assertNotIn(worker.name, down)
            self.assertNotEqual(worker.name, "mesh")
        expected = {canonical_name(n) for n in names if n not in down and n != "mesh"}
        self.assertEqual(set(canon), expected)
