# -*- test-case-name: loopd.test.test_config -*-
"""
Generic checks for strict configuration tables.

A configuration section is a table of known keys, each checked by a L{Rule}. The checks
collect every violation in a L{Problems} list, each line naming the dotted path of the
offending value (C{limits.poll_ms}, C{endpoint[0].expect.n_ctx}), so a user sees all of
them at once. Pure code: no I/O.

A L{Rule} is a callable that returns the checked (possibly normalised) value or
raises L{RuleError} with a phrase saying what was expected; L{read_fields} turns that
phrase into C{<path>: expected <phrase>, got <value>}. L{table_parser} and
L{scalar_parser} build the parsers of whole top-level sections from rules.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, Final

__all__ = [
    "ABSENT",
    "Problems",
    "Rule",
    "RuleError",
    "SectionParser",
    "as_table",
    "boolean",
    "index_path",
    "integer",
    "integer_list",
    "is_integer",
    "key_path",
    "number",
    "one_of",
    "read_fields",
    "render",
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

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_RENDER_LIMIT = 60


class RuleError(Exception):
    """
    A value broke a L{Rule}.

    @ivar expected: what the rule wanted, as a phrase ("a positive integer").
    """

    def __init__(self, expected: str) -> None:
        """Record what was expected."""
        super().__init__(expected)
        self.expected = expected


Rule = Callable[[object], Any]
"""Checks one value: returns it (possibly normalised) or raises L{RuleError}."""


class Problems:
    """An ordered collection of violations, one line each: C{<path>: <message>}."""

    def __init__(self) -> None:
        """Start with no problems."""
        self._lines: list[str] = []

    def add(self, path: str, message: str) -> None:
        """Record that the value at C{path} is wrong in the way C{message} says."""
        self._lines.append(f"{path}: {message}")

    def lines(self) -> tuple[str, ...]:
        """Return every recorded violation, in the order found."""
        return tuple(self._lines)

    def __bool__(self) -> bool:
        """True when at least one violation was recorded."""
        return bool(self._lines)

    def __iter__(self) -> Iterator[str]:
        """Iterate over the recorded lines."""
        return iter(self._lines)


def key_path(parent: str, key: object) -> str:
    """
    Append C{key} to a dotted path; keys that are not bare TOML keys are quoted.
    """
    text = key if isinstance(key, str) else str(key)
    if not _BARE_KEY.fullmatch(text):
        text = _quote(text)
    return f"{parent}.{text}" if parent else text


def index_path(parent: str, index: int) -> str:
    """Append an array index to a dotted path: C{endpoint[2]}."""
    return f"{parent}[{index}]"


def _quote(text: str) -> str:
    """Quote a string as a TOML basic string, escaping what TOML would."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def render(value: object) -> str:
    """
    Show a configuration value the way the file spells it, shortened if long.

    Booleans read C{true}/C{false}, strings are quoted, a table reads C{a table}.
    """
    if isinstance(value, Mapping):
        return "a table"
    text = _render(value)
    if len(text) > _RENDER_LIMIT:
        text = text[: _RENDER_LIMIT - 3] + "..."
    return text


def _render(value: object) -> str:
    """Render without the length limit; nested tables are shown as C{{...}}."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _quote(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_render(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{...}"
    if value is None:
        return "null"
    return str(value)


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
    problems.add(path, f"expected a table, got {render(value)}")
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

    Keys in neither C{rules} nor C{handled} are unknown. Keys in C{handled} are known
    but left to the caller (nested tables). RuleError and unknown keys are recorded in
    C{problems} and left out of the result, so absent keys keep their defaults.
    """
    known = set(rules) | set(handled)
    values: dict[str, Any] = {}
    for key, value in table.items():
        where = key_path(path, key)
        if key not in known:
            problems.add(where, unknown_key(key, known))
        elif key in rules:
            try:
                values[key] = rules[key](value)
            except RuleError as error:
                problems.add(where, f"expected {error.expected}, got {render(value)}")
    for key in required:
        if key not in table:
            problems.add(key_path(path, key), "missing (this key is required)")
    return values


def is_integer(value: object) -> bool:
    """True for an int that is not a bool (booleans are not integers here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _integer_phrase(minimum: int, maximum: int | None) -> str:
    """Say which integers a range admits."""
    if maximum is not None:
        return f"an integer from {minimum} to {maximum}"
    if minimum == 1:
        return "a positive integer"
    if minimum == 0:
        return "a non-negative integer"
    return f"an integer >= {minimum}"


def integer(minimum: int, maximum: int | None = None) -> Rule:
    """A rule for an integer in C{[minimum, maximum]}; floats and booleans fail it."""
    phrase = _integer_phrase(minimum, maximum)

    def check(value: object) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise RuleError(phrase)
        if value < minimum or (maximum is not None and value > maximum):
            raise RuleError(phrase)
        return value

    return check


def integer_list(minimum: int) -> Rule:
    """A rule for a non-empty array of integers, each at least C{minimum}."""
    nouns = {0: "non-negative integers", 1: "positive integers"}
    phrase = "a non-empty array of " + nouns.get(minimum, f"integers >= {minimum}")

    def check(value: object) -> tuple[int, ...]:
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


def string(*, non_empty: bool = True) -> Rule:
    """A rule for a string, by default a non-empty one."""
    phrase = "a non-empty string" if non_empty else "a string"

    def check(value: object) -> str:
        if not isinstance(value, str) or (non_empty and not value):
            raise RuleError(phrase)
        return value

    return check


def one_of(*choices: str) -> Rule:
    """A rule for one string out of a fixed set."""
    phrase = "one of " + ", ".join(_quote(choice) for choice in choices)

    def check(value: object) -> str:
        if not isinstance(value, str) or value not in choices:
            raise RuleError(phrase)
        return value

    return check


SectionParser = Callable[[object, str, Problems], Any]
"""
Parses the value of one top-level key, or L{ABSENT} when the key is not there; returns
the parsed value, or ABSENT to leave the field at its default.
"""


def table_parser(cls: Callable[..., Any], rules: Mapping[str, Rule]) -> SectionParser:
    """A parser for a flat table whose keys are the keyword arguments of C{cls}."""

    def parse(value: object, path: str, problems: Problems) -> Any:
        if value is ABSENT:
            return ABSENT
        table = as_table(value, path, problems)
        return cls(**read_fields(table, path, rules, problems))

    return parse


def scalar_parser(rule: Rule) -> SectionParser:
    """A parser for a top-level key that holds one value checked by C{rule}."""

    def parse(value: object, path: str, problems: Problems) -> Any:
        if value is ABSENT:
            return ABSENT
        try:
            return rule(value)
        except RuleError as error:
            problems.add(path, f"expected {error.expected}, got {render(value)}")
            return ABSENT

    return parse
