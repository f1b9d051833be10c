"""
Tests for L{loopd.gateway.doors.fields}: the one field reader of the front doors, over every JSON
value hypothesis makes, with each door's error codes.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.fields import Fields, integral
from loopd.gateway.errors import GatewayError

#: A door's reader with codes of its own, so that a test sees which code an error took.
READ = Fields("shape_code", "value_code")

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=5),
)
"""JSON's scalar values (a JSON text has no NaN)."""
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=6,
)
"""Any JSON value."""


class IntegralTests(SynchronousTestCase):
    """L{integral}: the integer rule, said once."""

    @given(st.floats(allow_nan=False, allow_infinity=False))
    def test_integral_floats_are_ints(self, value: float) -> None:
        """An integral float is that int; any other float is left as it is."""
        read = integral(value)
        if value.is_integer():
            self.assertIs(type(read), int)
            self.assertEqual(read, value)
        else:
            self.assertIs(read, value)

    @given(JSON_VALUES.filter(lambda value: not isinstance(value, float)))
    def test_everything_else_unchanged(self, value: Any) -> None:
        """Any value but a float comes back as it is (a boolean stays a boolean)."""
        self.assertIs(integral(value), value)


class FieldsTests(SynchronousTestCase):
    """L{Fields}: each check passes what it should and names the field in its 400."""

    def refused(self, call: Any, code: str, message: str) -> None:
        """C{call} raises a 400 with C{code}, its param C{"a.b"}, its message C{message}."""
        error = self.assertRaises(GatewayError, call)
        self.assertEqual(
            (error.status, error.type, error.code, error.param, error.message),
            (400, "invalid_request_error", code, "a.b", f"a.b: {message}"),
        )

    @given(JSON_VALUES, st.booleans())
    def test_flag(self, value: Any, default: bool) -> None:
        """A boolean, C{default} when absent; anything else is the door's value code."""
        if value is None:
            self.assertIs(READ.flag(value, "a.b", default), default)
        elif isinstance(value, bool):
            self.assertIs(READ.flag(value, "a.b", default), value)
        else:
            self.refused(lambda: READ.flag(value, "a.b"), "value_code", "expected true or false")

    @given(JSON_VALUES)
    def test_string(self, value: Any) -> None:
        """A string; anything else is the door's shape code, or the code the caller gives."""
        if isinstance(value, str):
            self.assertIs(READ.string(value, "a.b"), value)
            return
        self.refused(lambda: READ.string(value, "a.b"), "shape_code", "expected a string")
        self.refused(lambda: READ.string(value, "a.b", "mine"), "mine", "expected a string")

    @given(JSON_VALUES)
    def test_mapping(self, value: Any) -> None:
        """An object, empty when absent and optional; anything else refused."""
        if isinstance(value, dict):
            self.assertIs(READ.mapping(value, "a.b"), value)
            return
        if value is None:
            self.assertEqual(READ.mapping(value, "a.b", optional=True), {})
        self.refused(lambda: READ.mapping(value, "a.b"), "shape_code", "expected an object")
        self.refused(lambda: READ.mapping(value, "a.b", "mine"), "mine", "expected an object")

    @given(JSON_VALUES, st.sampled_from([1, 2]))
    def test_number(self, value: Any, high: int) -> None:
        """A number from 0 to C{high} as a float, None when absent; a boolean is none."""
        if value is None:
            self.assertIsNone(READ.number(value, "a.b", high))
        elif isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= high:
            self.assertEqual(READ.number(value, "a.b", high), float(value))
        else:
            self.refused(
                lambda: READ.number(value, "a.b", high),
                "value_code",
                f"expected a number from 0 to {high}",
            )

    @given(JSON_VALUES, st.sampled_from([0, 1]))
    def test_count(self, value: Any, low: int) -> None:
        """
        A whole number of at least C{low}, an integral float (C{2.0}) as its int; a
        boolean, a fraction or anything smaller is refused, saying what it expects.
        """
        whole = integral(value)
        if isinstance(whole, int) and not isinstance(whole, bool) and whole >= low:
            read = READ.count(value, "a.b", low=low)
            self.assertEqual((type(read), read), (int, whole))
            return
        expected = "a positive integer" if low == 1 else "an integer >= 0"
        self.refused(
            lambda: READ.count(value, "a.b", low=low), "value_code", f"expected {expected}"
        )
