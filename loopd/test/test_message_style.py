"""
Tests for L{loopd._message_style}: the paths, value renderings and line templates of
loopd.toml's and the lease protocol's problem lines.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd._message_style import (
    JSON_STYLE,
    TOML_STYLE,
    index_path,
    json_member_path,
    key_path,
    render,
    render_json,
    toml_string,
)


def nested(depth: int, *, objects: bool) -> object:
    """Arrays (or objects) nested C{depth} deep."""
    value: object = 0
    for _ in range(depth):
        value = {"a": value} if objects else [value]
    return value


class PathTests(SynchronousTestCase):
    """Each style's way of naming where a value is."""

    def test_toml_keys(self) -> None:
        """Bare TOML keys join with dots; others are quoted as TOML basic strings."""
        self.assertEqual(key_path("limits", "poll_ms"), "limits.poll_ms")
        self.assertEqual(key_path("", "max_tokens"), "max_tokens")
        self.assertEqual(key_path("limits", "a.b"), 'limits."a.b"')
        self.assertEqual(key_path("t", 'q"\\\n'), 't."q\\"\\\\\\u000a"')
        self.assertEqual(key_path("t", 7), "t.7")

    def test_json_members(self) -> None:
        """Plain names join with dots ($ is plain); others are a JSON string in brackets."""
        url = "http://h:1/v1"
        self.assertEqual(json_member_path("queues", "zen"), "queues.zen")
        self.assertEqual(json_member_path("", "x$1"), "x$1")
        self.assertEqual(json_member_path("queues", url), f'queues["{url}"]')
        self.assertEqual(json_member_path("", "é\n"), '["é\\n"]')

    def test_index(self) -> None:
        """An array index is the same in both styles."""
        self.assertEqual(index_path("endpoint", 2), "endpoint[2]")

    def test_toml_string(self) -> None:
        """Quotes, backslashes and control characters are escaped; the rest is kept."""
        self.assertEqual(toml_string('a"\\\x7fé'), '"a\\"\\\\\\u007fé"')


class RenderTests(SynchronousTestCase):
    """Values shown the way each file spells them."""

    def test_toml(self) -> None:
        """Booleans, strings, floats, arrays, tables and None read as TOML would show them."""
        values = [True, "x", 1.5, float("nan"), float("-inf"), [1, "a", {}], {"k": 1}, None, 3]
        shown = ["true", '"x"', "1.5", "nan", "-inf", '[1, "a", {...}]', "a table", "null", "3"]
        self.assertEqual([render(value) for value in values], shown)

    def test_toml_shortened(self) -> None:
        """A long value is cut to 60 characters, ending in an ellipsis."""
        text = render("x" * 100)
        self.assertEqual((len(text), text[-4:]), (60, "x..."))

    def test_json(self) -> None:
        """Compact JSON; integral floats are ints; NaN and Infinity read as JavaScript's."""
        values = [True, "é", -3.0, 1.5, float("nan"), float("inf"), {"n": [1, "x"]}, None]
        shown = ["true", '"é"', "-3", "1.5", "NaN", "Infinity", '{"n":[1,"x"]}', "null"]
        self.assertEqual([render_json(value) for value in values], shown)

    def test_json_shortened(self) -> None:
        """A long value is cut to 120 characters, ending in an ellipsis."""
        text = render_json(["x" * 200])
        self.assertEqual((len(text), text[:3], text[-3:]), (120, '["x', "..."))

    def test_json_too_deep(self) -> None:
        """A value nested past the interpreter's stack is named, not rendered."""
        self.assertEqual(render_json(nested(100_000, objects=True)), "an object")
        self.assertEqual(render_json(nested(100_000, objects=False)), "an array")

    @given(st.recursive(st.none() | st.booleans() | st.floats() | st.text(), st.lists))
    def test_json_never_raises(self, value: object) -> None:
        """Any value renders to at most 120 characters."""
        self.assertLessEqual(len(render_json(value)), 120)


class TemplateTests(SynchronousTestCase):
    """Each style's templates and its handling of unknown keys."""

    def test_toml(self) -> None:
        """loopd.toml: C{path: expected X, got Y}; unknown keys are errors."""
        line = TOML_STYLE.expected.format(path="p", expected="a table", got="1")
        note = TOML_STYLE.note.format(path="p", message="unknown key")
        self.assertEqual((line, note), ("p: expected a table, got 1", "p: unknown key"))
        self.assertEqual((TOML_STYLE.table, TOML_STYLE.reject_unknown), ("a table", True))

    def test_json(self) -> None:
        """The lease protocol's files: C{path must be X (got Y)}; unknown keys are ignored."""
        line = JSON_STYLE.expected.format(path="p", expected="an object", got="1")
        self.assertEqual(line, "p must be an object (got 1)")
        self.assertEqual((JSON_STYLE.table, JSON_STYLE.reject_unknown), ("an object", False))

    def test_style_functions(self) -> None:
        """Each style paths and renders with its own functions."""
        self.assertEqual((TOML_STYLE.member, TOML_STYLE.render), (key_path, render))
        self.assertEqual((JSON_STYLE.member, JSON_STYLE.render), (json_member_path, render_json))
