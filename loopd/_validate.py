# -*- test-case-name: loopd.test.test_validate -*-
"""
Generic checks for strict configuration files: loopd.toml and the lease protocol's JSON files.

A configuration section is a table of known keys, each checked by a L{Rule}. The checks
collect every violation in a L{Problems} list, each line naming the dotted path of the
offending value (C{limits.poll_ms}, C{endpoint[0].expect.n_ctx}, C{queues.zen.maxStreams}),
so a user sees all of them at once. Pure code: no I/O.

A L{Rule} is a callable that returns the checked (possibly normalised) value or raises
L{RuleError} with a phrase saying what was expected; L{read_fields} turns that phrase into a
line worded in the L{MessageStyle} of the file (L{loopd._message_style}): C{TOML_STYLE}
reads C{<path>: expected <phrase>, got <value>} and rejects unknown keys, C{JSON_STYLE}
reads C{<path> must be <phrase> (got <value>)} and lists unknown keys as ignored.
L{table_parser} and L{scalar_parser} build the parsers of whole top-level sections from
rules.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, Final, TypeGuard

from loopd._message_style import MessageStyle, index_path, toml_string

__all__ = [
    "ABSENT",
    "Problems",
    "Rule",
    "RuleError",
    "SectionParser",
    "array_of",
    "as_table",
    "boolean",
    "integer",
    "integer_list",
    "is_integer",
    "js_integer",
    "number",
    "one_of",
    "predicate",
    "read_fields",
    "scalar_parser",
    "string",
    "table_parser",
    "unknown_key",
]


class _Absent:
    """The type of L{ABSENT}."""

    def __repr__(self) -> str:
        """Name the sentinel in reprs."""
        return "ABSENT"


ABSENT: Final = _Absent()
"""Stands for a key that is not in its table (distinct from any value, even None)."""


class RuleError(Exception):
    """
    A value broke a L{Rule}.

    @ivar expected: what the rule wanted, as a phrase ("a positive integer").
    @ivar items: for an array whose own shape is right, each wrong item as
        C{(index, item, error)}: each is reported at its own path (C{match[1]}), not the
        array as a whole.
    """

    def __init__(self, expected: str, items: Sequence[tuple[int, object, RuleError]] = ()) -> None:
        """Record what was expected, and which items broke their own rule."""
        super().__init__(expected)
        self.expected = expected
        self.items = tuple(items)


Rule = Callable[[object], Any]
"""Checks one value: returns it (possibly normalised) or raises L{RuleError}."""


class Problems:
    """
    An ordered collection of violations, one line each in the words of a L{MessageStyle},
    and the paths of the keys that style left unread.
    """

    def __init__(self, style: MessageStyle) -> None:
        """Start with no problems, wording them in C{style}."""
        self.style = style
        self._lines: list[str] = []
        self._ignored: list[str] = []

    def add(self, path: str, message: str) -> None:
        """Record that the value at C{path} is wrong in the way C{message} says."""
        self._lines.append(self.style.note.format(path=path, message=message))

    def expected(self, path: str, expected: str, value: object, *, suffix: str = "") -> None:
        """
        Record that the value at C{path} is C{value} where C{expected} (a phrase) was due.

        @param suffix: appended to the line as it is (the seed's C{": upgrade pi-llm-queue"}).
        """
        got = self.style.render(value)
        line = self.style.expected.format(path=path, expected=expected, got=got)
        self._lines.append(line + suffix)

    def broken(self, path: str, error: RuleError, value: object) -> None:
        """Record that C{value} at C{path} broke a rule; wrong items at their own paths."""
        if not error.items:
            self.expected(path, error.expected, value)
        for index, item, item_error in error.items:
            self.broken(index_path(path, index), item_error, item)

    def ignore(self, path: str) -> None:
        """Record that the key at C{path} is not read (not a violation)."""
        self._ignored.append(path)

    def lines(self) -> tuple[str, ...]:
        """Return every recorded violation, in the order found."""
        return tuple(self._lines)

    def ignored(self) -> tuple[str, ...]:
        """Return the paths of the keys left unread, in the order found."""
        return tuple(self._ignored)

    def __bool__(self) -> bool:
        """True when at least one violation was recorded (ignored keys are none)."""
        return bool(self._lines)

    def __iter__(self) -> Iterator[str]:
        """Iterate over the recorded lines."""
        return iter(self._lines)


def unknown_key(key: object, known: Collection[str]) -> str:
    """The message for an unknown key, with a guess when one known key is close."""
    if isinstance(key, str):
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
        if close:
            return f'unknown key (did you mean "{close[0]}"?)'
    return "unknown key"


def as_table(value: object, path: str, problems: Problems) -> Mapping[str, object]:
    """
    Return C{value} as a table; record a problem and return an empty one otherwise.
    """
    if isinstance(value, Mapping):
        return value
    problems.expected(path, problems.style.table, value)
    return {}


def read_fields(
    table: Mapping[str, object],
    path: str,
    rules: Mapping[str, Rule],
    problems: Problems,
    *,
    required: Collection[str] = (),
    handled: Collection[str] = (),
) -> dict[str, Any]:
    """
    Check every key of C{table} against C{rules}; return the valid values by key.

    Keys in neither C{rules} nor C{handled} are unknown: a problem, or ignored, as the style
    of C{problems} says. Keys in C{handled} are known but left to the caller (nested tables).
    Values that break their rule are recorded in C{problems} and left out of the result, so
    absent keys keep their defaults.
    """
    style = problems.style
    known = set(rules) | set(handled)
    values: dict[str, Any] = {}
    for key, value in table.items():
        where = style.member(path, key)
        if key not in known:
            if style.reject_unknown:
                problems.add(where, unknown_key(key, known))
            else:
                problems.ignore(where)
        elif key in rules:
            try:
                values[key] = rules[key](value)
            except RuleError as error:
                problems.broken(where, error, value)
    for key in required:
        if key not in table:
            problems.add(style.member(path, key), "missing (this key is required)")
    return values


def is_integer(value: object) -> TypeGuard[int]:
    """True for an int that is not a bool (booleans are not integers here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def js_integer(value: object) -> int | None:
    """
    The value as an integer if JavaScript's C{Number.isInteger} holds for it, else None.

    C{2.0} is 2; a boolean is no number; an int too large for a double is none either,
    since C{JSON.parse} reads it as C{Infinity}.
    """
    if is_integer(value):
        try:
            float(value)
        except OverflowError:
            return None
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _integer_phrase(minimum: int, maximum: int | None) -> str:
    """Say which integers a range admits."""
    if maximum is not None:
        return f"an integer from {minimum} to {maximum}"
    if minimum == 1:
        return "a positive integer"
    if minimum == 0:
        return "a non-negative integer"
    return f"an integer of at least {minimum}"


def integer(minimum: int, maximum: int | None = None, *, javascript: bool = False) -> Rule:
    """
    A rule for an integer in C{[minimum, maximum]}; booleans fail it.

    @param javascript: take numbers as JavaScript does (L{js_integer}): C{2.0} is 2.
        Otherwise only an int is an integer, and every float fails.
    """
    phrase = _integer_phrase(minimum, maximum)

    def check(value: object) -> int:
        """The value as an int in range (C{2.0} is 2 under C{javascript}); else L{RuleError}."""
        number = js_integer(value) if javascript else value if is_integer(value) else None
        if number is None or number < minimum or (maximum is not None and number > maximum):
            raise RuleError(phrase)
        return number

    return check


def integer_list(minimum: int) -> Rule:
    """A rule for a non-empty array of integers, each at least C{minimum}."""
    nouns = {0: "non-negative integers", 1: "positive integers"}
    phrase = "a non-empty array of " + nouns.get(minimum, f"integers >= {minimum}")

    def check(value: object) -> tuple[int, ...]:
        """The non-empty array as a tuple, each item an int >= C{minimum}; else L{RuleError}."""
        if not isinstance(value, (list, tuple)) or not value:
            raise RuleError(phrase)
        for item in value:
            if not is_integer(item) or item < minimum:
                raise RuleError(phrase)
        return tuple(value)

    return check


def _bound(value: float) -> str:
    """Format a range bound without a needless C{.0}."""
    return f"{value:g}"


def number(
    minimum: float,
    maximum: float,
    *,
    min_open: bool = False,
    max_open: bool = False,
) -> Rule:
    """
    A rule for a finite number (int or float, never bool) in a range; returns a float.

    C{min_open}/C{max_open} exclude the bound itself.
    """
    if min_open or max_open:
        low = "<" if min_open else "<="
        high = "<" if max_open else "<="
        phrase = f"a number x with {_bound(minimum)} {low} x {high} {_bound(maximum)}"
    else:
        phrase = f"a number from {_bound(minimum)} to {_bound(maximum)}"

    def check(value: object) -> float:
        """The value as a finite float inside the range; else L{RuleError}."""
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise RuleError(phrase)
        try:
            result = float(value)
        except OverflowError:
            raise RuleError(phrase) from None
        if not math.isfinite(result):
            raise RuleError(phrase)
        if result < minimum or (min_open and result == minimum):
            raise RuleError(phrase)
        if result > maximum or (max_open and result == maximum):
            raise RuleError(phrase)
        return result

    return check


def boolean(value: object) -> bool:
    """A rule for a boolean (C{true} or C{false}; 0 and 1 are not booleans)."""
    if not isinstance(value, bool):
        raise RuleError("a boolean (true or false)")
    return value


def predicate(phrase: str, test: Callable[[object], bool]) -> Rule:
    """A rule that keeps a value passing C{test} as it is; C{phrase} says what passes."""

    def check(value: object) -> object:
        """The value itself when it passes C{test}; else L{RuleError}."""
        if not test(value):
            raise RuleError(phrase)
        return value

    return check


def string(*, non_empty: bool = True) -> Rule:
    """A rule for a string, by default a non-empty one."""
    phrase = "a non-empty string" if non_empty else "a string"

    def check(value: object) -> str:
        """The value when it is a string (non-empty if so asked); else L{RuleError}."""
        if not isinstance(value, str) or (non_empty and not value):
            raise RuleError(phrase)
        return value

    return check


def one_of(*choices: str) -> Rule:
    """A rule for one string out of a fixed set."""
    phrase = "one of " + ", ".join(toml_string(choice) for choice in choices)

    def check(value: object) -> str:
        """The value when it is one of the choices; else L{RuleError}."""
        if not isinstance(value, str) or value not in choices:
            raise RuleError(phrase)
        return value

    return check


def array_of(item: Rule, phrase: str, *, non_empty: bool = False) -> Rule:
    """
    A rule for an array (a non-empty one if C{non_empty}) whose every item passes C{item};
    returns the checked items as a tuple.

    @param phrase: what the array must be; a wrong item is reported at its own index, in
        the words of C{item}.
    """

    def check(value: object) -> tuple[object, ...]:
        """
        The checked items as a tuple. A value that is no array (or an empty one when
        C{non_empty}) breaks C{phrase}; otherwise every item is checked, and all the wrong ones
        are raised together, each with its index, in one L{RuleError}.
        """
        if not isinstance(value, (list, tuple)) or (non_empty and not value):
            raise RuleError(phrase)
        checked: list[object] = []
        wrong: list[tuple[int, object, RuleError]] = []
        for index, each in enumerate(value):
            try:
                checked.append(item(each))
            except RuleError as error:
                wrong.append((index, each, error))
        if wrong:
            raise RuleError(phrase, wrong)
        return tuple(checked)

    return check


SectionParser = Callable[[object, str, Problems], Any]
"""
Parses the value of one top-level key, or L{ABSENT} when the key is not there; returns
the parsed value, or ABSENT to leave the field at its default.
"""


def table_parser(cls: Callable[..., Any], rules: Mapping[str, Rule]) -> SectionParser:
    """A parser for a flat table whose keys are the keyword arguments of C{cls}."""

    def parse(value: object, path: str, problems: Problems) -> Any:
        """
        L{ABSENT} for a missing key; else the instance of C{cls} built from the table's valid
        fields, the others at their defaults. Wrong values go to C{problems}, as do unknown
        keys (unless its style ignores them) and a value that is no table (every field then at
        its default).
        """
        if value is ABSENT:
            return ABSENT
        table = as_table(value, path, problems)
        return cls(**read_fields(table, path, rules, problems))

    return parse


def scalar_parser(rule: Rule) -> SectionParser:
    """A parser for a top-level key that holds one value checked by C{rule}."""

    def parse(value: object, path: str, problems: Problems) -> Any:
        """
        L{ABSENT} for a missing key; else the value checked by C{rule}. A value that breaks it
        goes to C{problems} and is L{ABSENT} too, which leaves the field at its default.
        """
        if value is ABSENT:
            return ABSENT
        try:
            return rule(value)
        except RuleError as error:
            problems.broken(path, error, value)
            return ABSENT

    return parse
