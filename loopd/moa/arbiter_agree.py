# -*- test-case-name: loopd.test.test_moa_arbiter_agree -*-
"""
Content agreement between answers: the token sets, the subset + negation rule and the
largest agreeing cluster of reference/mesh-moa.md §1.10.

Where this differs from v1, on purpose (issue 6: ties resolve to the first of equals): the
cluster representative and every other pick take the I{first} of equal candidates, where
v1's C{max_by} took the last (quirk 1 of §7).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from loopd.moa.outcome import Outcome

__all__ = [
    "NEGATION_TOKENS",
    "STOPWORDS",
    "answers_agree",
    "cluster_members",
    "content_tokens",
    "largest_agreeing_cluster",
]

NEGATION_TOKENS: Final = frozenset(
    "no not never none nor without neither cannot "
    "dont doesnt didnt wont wouldnt cant shouldnt isnt arent wasnt werent "
    "don doesn didn won wouldn shouldn isn aren wasn weren hadn haven hasn".split()
)
"""
The tokens that are always kept and that block agreement when only one side has them: the 32
§1.10 lists (its heading says 33, but no 33rd is named).
"""

STOPWORDS: Final = frozenset(
    "a an and are as at be but by for from in into is "
    "it its of on or out so that the their them then "
    "there these they this those to was were will with".split()
)
"""The 36 words dropped from a token set."""

_MIN_TOKEN_BYTES: Final = 3


def content_tokens(text: str) -> frozenset[str]:
    """
    The content token set of a text (§1.10): lowercased, every non-alphanumeric character a
    separator; a negation token is kept, a stopword dropped, an all-ASCII-digit token kept
    whatever its length (C{"42"}, C{"7"}), any other token kept only at 3 bytes or more.
    """
    spaced = "".join(char if char.isalnum() else " " for char in text.lower())
    kept = set()
    for token in spaced.split():
        if token in NEGATION_TOKENS:
            kept.add(token)
        elif token in STOPWORDS:
            continue
        elif token.isascii() and token.isdigit():
            kept.add(token)
        elif len(token.encode("utf-8", "surrogatepass")) >= _MIN_TOKEN_BYTES:
            kept.add(token)
    return frozenset(kept)


def answers_agree(first: str, second: str) -> bool:
    """
    Whether two answers agree (§1.10): neither token set is empty, one is a subset of the
    other, and the tokens only one side has include no negation token.
    """
    a, b = content_tokens(first), content_tokens(second)
    if not a or not b:
        return False
    if not (a <= b or b <= a):
        return False
    return not ((a ^ b) & NEGATION_TOKENS)


def largest_agreeing_cluster(answers: Sequence[Outcome]) -> tuple[int, Outcome] | None:
    """
    The largest cluster of agreeing answers as C{(size, representative)}, or None when no
    two answers agree (§1.10); see L{cluster_members} for the rule.
    """
    cluster = cluster_members(answers)
    if cluster is None:
        return None
    representative, members = cluster
    return len(members), answers[representative]


def cluster_members(answers: Sequence[Outcome]) -> tuple[int, tuple[int, ...]] | None:
    """
    The largest cluster of agreeing answers as C{(representative, members)}: indexes into
    C{answers}, the members in ascending order; None when no two answers agree (§1.10).

    Each answer in turn is an anchor; its cluster is the anchor and every other answer that
    agrees with the anchor (members are not checked against each other). Only a strictly
    larger cluster replaces the best so far, so the first anchor wins ties. The
    representative is the member with the most tokens, then the higher confidence, then
    the first of equals (v1 took the last).
    """
    tokens = [content_tokens(answer.text) for answer in answers]
    best: tuple[int, tuple[int, ...]] | None = None
    for i, anchor in enumerate(answers):
        members = [i] + [
            j for j in range(len(answers)) if j != i and answers_agree(anchor.text, answers[j].text)
        ]
        if len(members) < 2 or (best is not None and len(members) <= len(best[1])):
            continue
        members.sort()
        chosen = members[0]
        for j in members[1:]:
            if (len(tokens[j]), answers[j].confidence) > (
                len(tokens[chosen]),
                answers[chosen].confidence,
            ):
                chosen = j
        best = (chosen, tuple(members))
    return best
