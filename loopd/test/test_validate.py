"""
Tests for L{loopd._validate}: problems worded in each style, reading a table of rules, and
the rules themselves (loopd.toml's messages are tested through L{loopd.config} too).
"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd._message_style import JSON_STYLE, TOML_STYLE
from loopd._validate import (
    ABSENT,
    Problems,
    Rule,
    RuleError,
    array_of,
    as_table,
    integer,
    js_integer,
    predicate,
    read_fields,
    scalar_parser,
    string,
)

URL = "http://h:1/v1"
DOUBLE_OVERFLOW = 2**1024 - 2**970
"""The smallest int that rounds to Infinity as a double (halfway past the largest one)."""


def phrase_of(rule: Rule, value: object) -> str:
    """What C{rule} says it expected when C{value} breaks it (it must)."""
    try:
        rule(value)
    except RuleError as error:
        return error.expected
    raise AssertionError(f"{value!r} passed")


class ProblemsTests(SynchronousTestCase):
    """Lines in the words of a style."""

    def test_toml_lines(self) -> None:
        """A TOML problem reads C{path: expected X, got Y}; a note C{path: message}."""
        problems = Problems(TOML_STYLE)
        problems.expected("limits.poll_ms", "a positive integer", "0")
        problems.add("colour", "unknown key")
        want = ('limits.poll_ms: expected a positive integer, got "0"', "colour: unknown key")
        self.assertEqual((problems.lines(), tuple(problems)), (want, want))

    def test_json_lines(self) -> None:
        """A JSON problem reads C{path must be X (got Y)}, the suffix after it as given."""
        problems = Problems(JSON_STYLE)
        problems.expected("queues.zen.maxStreams", "a positive integer", 0.0)
        problems.expected("schemaVersion", "at most 1", 2, suffix=": upgrade pi-llm-queue")
        self.assertEqual(
            problems.lines(),
            (
                "queues.zen.maxStreams must be a positive integer (got 0)",
                "schemaVersion must be at most 1 (got 2): upgrade pi-llm-queue",
            ),
        )

    def test_broken_items(self) -> None:
        """A rule error naming items is reported at each item's path, nested ones too."""
        problems = Problems(JSON_STYLE)
        inner = RuleError("an array", [(1, None, RuleError("a string"))])
        problems.broken(
            "m", RuleError("arrays", [(0, 5, RuleError("a string")), (2, [], inner)]), 0
        )
        want = ("m[0] must be a string (got 5)", "m[2][1] must be a string (got null)")
        self.assertEqual(problems.lines(), want)

    def test_ignored_are_not_problems(self) -> None:
        """Ignored keys are listed apart, and a list with only them is empty of problems."""
        problems = Problems(JSON_STYLE)
        problems.ignore("x")
        self.assertEqual(
            (bool(problems), problems.lines(), problems.ignored()), (False, (), ("x",))
        )

    def test_as_table(self) -> None:
        """A value that is not a table is one problem, named as each file names tables."""
        for style, line in (
            (TOML_STYLE, "p: expected a table, got [1]"),
            (JSON_STYLE, "p must be an object (got [1])"),
        ):
            problems = Problems(style)
            self.assertEqual((as_table([1], "p", problems), problems.lines()), ({}, (line,)))
            self.assertEqual(as_table({"a": 1}, "p", problems), {"a": 1})


RULES = {"poll_ms": integer(1), "poll": integer(0)}


class ReadFieldsTests(SynchronousTestCase):
    """read_fields in each style."""

    def test_toml_unknown_keys_rejected(self) -> None:
        """Unknown TOML keys are problems at their quoted paths, with a guess when close."""
        problems = Problems(TOML_STYLE)
        values = read_fields({"pol_ms": 1, "a.b": 2, "poll": 3}, "limits", RULES, problems)
        want = ('limits.pol_ms: unknown key (did you mean "poll_ms"?)', 'limits."a.b": unknown key')
        self.assertEqual((values, problems.lines(), problems.ignored()), ({"poll": 3}, want, ()))

    def test_json_unknown_keys_ignored(self) -> None:
        """Unknown JSON keys are listed as ignored, at their member paths, in table order."""
        problems = Problems(JSON_STYLE)
        values = read_fields({URL: 1, "poll": 2, "pol_ms": 3}, "queues", RULES, problems)
        want = (f'queues["{URL}"]', "queues.pol_ms")
        self.assertEqual((values, problems.lines(), problems.ignored()), ({"poll": 2}, (), want))

    def test_broken_values_left_out(self) -> None:
        """A value that breaks its rule is a problem and not in the result."""
        problems = Problems(JSON_STYLE)
        self.assertEqual(read_fields({"poll": -1}, "d", RULES, problems), {})
        self.assertEqual(problems.lines(), ("d.poll must be a non-negative integer (got -1)",))

    def test_required_and_handled(self) -> None:
        """A missing required key is a problem; a handled one is known but not read."""
        problems = Problems(TOML_STYLE)
        table = {"expect": {"n_ctx": 1}}
        values = read_fields(table, "e", RULES, problems, required=["poll"], handled=["expect"])
        self.assertEqual(
            (values, problems.lines()), ({}, ("e.poll: missing (this key is required)",))
        )

    def test_scalar_parser(self) -> None:
        """A top-level value is checked alone; absent or broken, it is ABSENT."""
        parse = scalar_parser(integer(1))
        problems = Problems(TOML_STYLE)
        self.assertEqual([parse(v, "n", problems) for v in (ABSENT, 0, 5)], [ABSENT, ABSENT, 5])
        self.assertEqual(problems.lines(), ("n: expected a positive integer, got 0",))


class IntegerTests(SynchronousTestCase):
    """Integers in TOML and in JavaScript terms."""

    def test_phrases(self) -> None:
        """Each range is said in words."""
        rules = [
            integer(1),
            integer(0),
            integer(1000),
            integer(-1, 9),
            integer(1000, javascript=True),
        ]
        self.assertEqual(
            [phrase_of(rule, "x") for rule in rules],
            [
                "a positive integer",
                "a non-negative integer",
                "an integer of at least 1000",
                "an integer from -1 to 9",
                "an integer of at least 1000",
            ],
        )

    def test_toml_integers(self) -> None:
        """Only an int is a TOML integer: 2.0 and True are not."""
        rule = integer(0)
        self.assertEqual(rule(2), 2)
        for value in (2.0, True, "2", None):
            self.assertRaises(RuleError, rule, value)

    def test_javascript_integers(self) -> None:
        """2.0 is the int 2, -0.0 is 0; true, 1.5, Infinity and ints beyond a double are not."""
        rule = integer(0, javascript=True)
        self.assertEqual([rule(2.0), rule(-0.0), rule(10**300)], [2, 0, 10**300])
        self.assertIsInstance(rule(2.0), int)
        for value in (True, 1.5, math.inf, math.nan, 10**400, "2", -1.0):
            self.assertRaises(RuleError, rule, value)

    def test_range(self) -> None:
        """The bounds are inclusive."""
        rule = integer(-1, 9)
        self.assertEqual((rule(-1), rule(9)), (-1, 9))
        self.assertRaises(RuleError, rule, 10)
        self.assertRaises(RuleError, rule, -2)

    @given(st.floats(allow_nan=True, allow_infinity=True))
    def test_js_integer_floats(self, value: float) -> None:
        """A float is an integer exactly when it is finite and whole, as Number.isInteger."""
        whole = math.isfinite(value) and value == math.floor(value)
        self.assertEqual(js_integer(value), int(value) if whole else None)

    @given(st.integers())
    def test_js_integer_ints(self, value: int) -> None:
        """An int is itself while a double can hold it (JSON.parse gives Infinity past that)."""
        self.assertEqual(js_integer(value), value if abs(value) < DOUBLE_OVERFLOW else None)

    def test_js_integer_edge(self) -> None:
        """The first int that rounds to Infinity as a double is none; the one before is one."""
        for sign in (1, -1):
            self.assertEqual(js_integer(sign * (DOUBLE_OVERFLOW - 1)), sign * (DOUBLE_OVERFLOW - 1))
            self.assertIsNone(js_integer(sign * DOUBLE_OVERFLOW))


class RuleTests(SynchronousTestCase):
    """predicate, string and array_of."""

    def test_predicate(self) -> None:
        """A value passing the test is kept as it is; any other breaks the rule."""
        rule = predicate("a boolean", lambda value: isinstance(value, bool))
        self.assertIs(rule(False), False)
        self.assertEqual(phrase_of(rule, 0), "a boolean")

    def test_string(self) -> None:
        """A non-empty string by default; any string when empty ones are allowed."""
        self.assertEqual(phrase_of(string(), ""), "a non-empty string")
        self.assertEqual(
            (string(non_empty=False)(""), phrase_of(string(non_empty=False), 1)), ("", "a string")
        )

    def test_array_shape(self) -> None:
        """Not an array, or an empty one where one is required, breaks the array's rule."""
        rule = array_of(string(), "a non-empty array of strings", non_empty=True)
        values: list[object] = ["a", [], {"a": 1}, None]
        for value in values:
            error = self.assertRaises(RuleError, rule, value)
            self.assertEqual((error.expected, error.items), ("a non-empty array of strings", ()))
        self.assertEqual(array_of(string(), "any")([]), ())

    def test_array_items(self) -> None:
        """Every wrong item is named with its index and value; good arrays are tuples."""
        rule = array_of(string(), "an array of strings")
        self.assertEqual(rule(["a", "b"]), ("a", "b"))
        error = self.assertRaises(RuleError, rule, ["a", 7, "", "b"])
        self.assertEqual(
            [(i, v, e.expected) for i, v, e in error.items],
            [(1, 7, "a non-empty string"), (2, "", "a non-empty string")],
        )

    def test_array_items_normalised(self) -> None:
        """Items come back as the item rule returns them."""
        self.assertEqual(array_of(integer(0, javascript=True), "ints")([1.0, 2]), (1, 2))
