"""
Tests for L{loopd.llama.token_list}: a C{/tokenize} answer's ids counted as its bytes
arrive, in any pieces, and any other answer refused.
"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.errors import Protocol
from loopd.llama.token_list import TokenListCounter

_SPACE = st.sampled_from(["", " ", "\n", "\t ", "\r\n"])


def counted(answer: bytes, cuts: list[int]) -> int:
    """The count of C{answer} fed in the pieces C{cuts} make."""
    counter = TokenListCounter()
    start = 0
    for cut in sorted(set(cuts)):
        counter.feed(answer[start:cut])
        start = cut
    counter.feed(answer[start:])
    return counter.count()


@st.composite
def answers(draw: st.DrawFn) -> tuple[bytes, int]:
    """A well-formed answer, JSON whitespace anywhere it may be, and its count."""
    ids = draw(st.lists(st.integers(min_value=0, max_value=300_000), max_size=40))
    space = draw(_SPACE)
    separator = space + "," + draw(_SPACE)
    array = "[" + space + separator.join(str(i) for i in ids) + draw(_SPACE) + "]"
    text = f'{space}{{{space}"tokens"{space}:{draw(_SPACE)}{array}{space}}}{draw(_SPACE)}'
    return text.encode(), len(ids)


class CounterTests(SynchronousTestCase):
    """L{TokenListCounter}."""

    @given(answers(), st.lists(st.integers(min_value=0, max_value=400)))
    def test_any_answer_any_pieces(self, answer: tuple[bytes, int], cuts: list[int]) -> None:
        """Any well-formed answer, cut anywhere, counts its ids."""
        raw, ids = answer
        self.assertEqual(counted(raw, cuts), ids)

    def test_llama_server_answer(self) -> None:
        """llama-server's own compact answer."""
        raw = json.dumps({"tokens": [1, 15043, 29991]}, separators=(",", ":")).encode()
        self.assertEqual(counted(raw, [3, 12]), 3)
        self.assertEqual(counted(b'{"tokens":[]}', []), 0)

    def test_refused(self) -> None:
        """Any other shape is the server breaking the protocol."""
        for raw in (
            b'{"tokens":[1,,2]}',
            b'{"tokens":[,1]}',
            b'{"tokens":[1,]}',
            b'{"tokens":[-1]}',
            b'{"tokens":["a"]}',
            b'{"tokens":[{"id":1,"piece":"a"}]}',
            b'{"other":[1]}',
            b'{"tokens":[1]',
            b'{"tokens":[1]}{}',
            b"[1,2]",
            b"",
        ):
            with self.subTest(raw):
                self.assertRaises(Protocol, counted, raw, [len(raw) // 2])

    def test_long_answers_held_short(self) -> None:
        """A million ids are counted without their list: nothing of the array is kept."""
        counter = TokenListCounter()
        counter.feed(b'{"tokens":[')
        piece = b",".join(b"123456" for _ in range(10_000))
        for index in range(100):
            counter.feed((b"," if index else b"") + piece)
        counter.feed(b"]}")
        self.assertEqual(counter.count(), 1_000_000)
        self.assertLess(len(vars(counter)["_head"]) + len(vars(counter)["_after"]), 64)
