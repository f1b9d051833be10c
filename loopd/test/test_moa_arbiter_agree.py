"""
Tests for L{loopd.moa.arbiter_agree}: the token sets, the subset + negation agreement rule
and the largest agreeing cluster (reference C{mesh-moa.md} §1.10).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.moa.arbiter_agree import (
    NEGATION_TOKENS,
    STOPWORDS,
    answers_agree,
    cluster_members,
    content_tokens,
    largest_agreeing_cluster,
)
from loopd.moa.outcome import Kind, Outcome


def answer(text: str, confidence: float = 0.5) -> Outcome:
    """An answer outcome."""
    return Outcome(Kind.ANSWER, text, confidence)


class TokenTests(SynchronousTestCase):
    """C{content_tokens}: the token set of §1.10."""

    def test_constants(self) -> None:
        """
        The negation tokens and 36 stopwords as §1.10 lists them: its heading says 33
        negation tokens but it lists 32, and the list is what is implemented.
        """
        self.assertEqual((len(NEGATION_TOKENS), len(STOPWORDS)), (32, 36))
        self.assertIn("cannot", NEGATION_TOKENS)
        self.assertIn("with", STOPWORDS)

    def test_lowercase_and_split(self) -> None:
        """Lowercased; every non-alphanumeric character separates."""
        self.assertEqual(content_tokens("Hello,WORLD!foo_bar"), {"hello", "world", "foo", "bar"})

    def test_decimal_and_apostrophe(self) -> None:
        """'3.14' is '3' and '14'; "don't" is 'don' (the 't' is too short)."""
        self.assertEqual(content_tokens("3.14"), {"3", "14"})
        self.assertEqual(content_tokens("don't"), {"don"})

    def test_negation_kept_stopword_dropped(self) -> None:
        """A negation token is kept however short; a stopword is dropped."""
        self.assertEqual(content_tokens("no it is the cat"), {"no", "cat"})

    def test_numeric_rule(self) -> None:
        """All-digit tokens survive whatever their length; other short tokens do not."""
        self.assertEqual(content_tokens("7 42 go up"), {"7", "42"})

    def test_unicode(self) -> None:
        """Unicode letters are alphanumeric and lowercased."""
        self.assertEqual(content_tokens("ÉTÉ—Größe"), {"été", "größe"})

    def test_set(self) -> None:
        """Duplicates collapse."""
        self.assertEqual(content_tokens("cat cat CAT"), {"cat"})


AGREEMENT_TABLE = (
    ("Paris", "Paris is the capital of France", True),
    ("The capital is Paris", "The capital is Berlin", False),
    ("use grep", "do not use grep", False),
    ("Do that", "Don't do that", False),
    ("42", "The answer is 42", True),
    ("the a", "the", False),
    ("", "Paris", False),
    ("Paris France", "France Paris", True),
)
"""§1.10's agreement examples, with the empty-set rule."""


class AgreementTests(SynchronousTestCase):
    """C{answers_agree}: subset plus the negation rule."""

    def test_table(self) -> None:
        """The reference examples: subset agrees, different facts and negations do not."""
        for first, second, expected in AGREEMENT_TABLE:
            self.assertEqual(answers_agree(first, second), expected, (first, second))
            self.assertEqual(answers_agree(second, first), expected, (second, first))

    @given(st.text(max_size=40))
    def test_reflexive(self, text: str) -> None:
        """A text with tokens agrees with itself; one without agrees with nothing."""
        self.assertEqual(answers_agree(text, text), bool(content_tokens(text)))


class ClusterTests(SynchronousTestCase):
    """C{largest_agreeing_cluster}."""

    def test_none(self) -> None:
        """No two agreeing answers: None."""
        self.assertIsNone(largest_agreeing_cluster([answer("Paris"), answer("Berlin")]))
        self.assertIsNone(largest_agreeing_cluster([answer("Paris")]))

    def test_members_against_anchor_only(self) -> None:
        """Members agree with the anchor, not necessarily with each other."""
        items = [answer("paris"), answer("paris capital"), answer("paris france")]
        self.assertEqual(cluster_members(items), (1, (0, 1, 2)))

    def test_representative_most_tokens(self) -> None:
        """The representative has the most tokens."""
        items = [answer("Paris"), answer("Paris is the capital of France")]
        self.assertEqual(largest_agreeing_cluster(items), (2, items[1]))

    def test_representative_confidence_then_first(self) -> None:
        """Equal token counts: the higher confidence; full tie: the first (issue 6)."""
        items = [answer("paris", 0.5), answer("Paris!", 0.8), answer("PARIS", 0.8)]
        self.assertIs(largest_agreeing_cluster(items)[1], items[1])  # type: ignore[index]

    def test_first_anchor_wins_ties(self) -> None:
        """Only a strictly larger cluster replaces the best, so the first of equal ones wins."""
        items = [answer("Berlin"), answer("Paris"), answer("Berlin city"), answer("Paris city")]
        self.assertEqual(cluster_members(items), (2, (0, 2)))
