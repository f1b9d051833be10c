"""
L{loopd.strict_json}: the one JSON decoder, with JavaScript's rules and the interoperable
profile.
"""

from __future__ import annotations

import json
import math

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.strict_json import JSONError, decode, decode_prefix

#: JSON values that every implementation reads the same: finite numbers, valid text.
PLAIN_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(exclude_categories=["Cs"])),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=12,
)


class DecodeTests(SynchronousTestCase):
    """L{decode} reads what C{JSON.parse} reads, and refuses the rest with L{JSONError}."""

    @given(PLAIN_JSON)
    def test_round_trip(self, value: object) -> None:
        """Every plain JSON value, as text or as UTF-8 bytes, decodes to itself."""
        text = json.dumps(value, ensure_ascii=False)
        self.assertEqual(decode(text), value)
        self.assertEqual(decode(text.encode("utf-8"), interoperable=True), value)

    def test_constants_refused(self) -> None:
        """NaN and the infinities are JavaScript values, not JSON, in both modes."""
        for token in ("NaN", "Infinity", "-Infinity"):
            for interoperable in (False, True):
                error = self.assertRaises(
                    JSONError, decode, f'{{"a": {token}}}', interoperable=interoperable
                )
                self.assertIn(token, str(error))

    def test_overflow_is_infinity(self) -> None:
        """A number beyond a double is Infinity, as JSON.parse gives; an integer stays exact."""
        self.assertEqual(decode('{"a": 1e400}'), {"a": math.inf})
        self.assertEqual(decode('{"a": -1e400}'), {"a": -math.inf})
        self.assertEqual(decode(str(10**400)), 10**400)

    def test_overflow_refused_when_interoperable(self) -> None:
        """The interoperable profile refuses a number beyond a double, naming it."""
        error = self.assertRaises(JSONError, decode, "[1e400]", interoperable=True)
        self.assertIn("1e400", str(error))

    def test_lone_surrogate(self) -> None:
        """An escaped lone surrogate is kept by default and refused when interoperable."""
        self.assertEqual(decode('"\\ud800"'), "\ud800")
        self.assertRaises(JSONError, decode, '["\\ud800"]', interoperable=True)
        self.assertEqual(decode('"\\ud83d\\ude00"', interoperable=True), "\U0001f600")

    def test_not_utf8(self) -> None:
        """Bytes must be UTF-8."""
        self.assertRaises(JSONError, decode, b"\xff{}")

    def test_too_deep(self) -> None:
        """Nesting too deep for the parser is a JSONError, never a RecursionError."""
        self.assertRaises(JSONError, decode, "[" * 100_000 + "]" * 100_000)

    def test_malformed(self) -> None:
        """Text that is not JSON is a JSONError, which is a ValueError."""
        for text in ("", "{", "{'a': 1}", "[1,]", "1 2"):
            self.assertRaises(JSONError, decode, text)
        self.assertTrue(issubclass(JSONError, ValueError))

    @given(st.text())
    def test_never_anything_else(self, text: str) -> None:
        """Any text decodes or raises JSONError; nothing else escapes."""
        for interoperable in (False, True):
            try:
                decode(text, interoperable=interoperable)
            except JSONError:
                pass


class DecodePrefixTests(SynchronousTestCase):
    """L{decode_prefix} reads one value at a position and says where it ended."""

    def test_value_and_end(self) -> None:
        """The value that starts at the index, and the index just past it."""
        text = 'say {"a": [1, 2]} then more'
        self.assertEqual(decode_prefix(text, 4), ({"a": [1, 2]}, 17))

    def test_same_rules(self) -> None:
        """The constants are refused; the interoperable profile refuses as L{decode} does."""
        self.assertRaises(JSONError, decode_prefix, "x NaN", 2)
        self.assertRaises(JSONError, decode_prefix, '["\\udc00"] tail', 0, interoperable=True)
        self.assertRaises(JSONError, decode_prefix, "[1e999]", 0, interoperable=True)
        self.assertRaises(JSONError, decode_prefix, "no json here", 0)
