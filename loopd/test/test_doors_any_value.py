"""
Any JSON value in any field of a request the doors read is an answer or a 400 naming a
field in the door's shape, never another exception (a 500): a list or an object where a
name is expected included (issue 26, item 5). Each door's body below has every field it
reads with a fixed set of values (the enum-like ones: roles, types, modes, efforts, tiers,
includes); hypothesis puts any JSON value at any of its paths.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.messages import MessagesDoor
from loopd.gateway.doors.table import front_doors
from loopd.gateway.errors import GatewayError

#: A body per door with every enum-like field it reads.
BODIES: dict[str, dict[str, Any]] = {
    "chat": {
        "model": "m",
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "x"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "reasoning_effort": "low",
        "reasoning": {"effort": "low", "enabled": True},
        "chat_template_kwargs": {"enable_thinking": True},
        "response_format": {"type": "json_object"},
        "stream": True,
        "stream_options": {"include_usage": True},
        "service_tier": "auto",
        "stop": ["END"],
        "max_tokens": 10,
    },
    "messages": {
        "model": "m",
        "max_tokens": 10,
        "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "t", "signature": ""},
                    {"type": "tool_use", "id": "t", "name": "f", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}],
            },
        ],
        "tools": [{"name": "f", "input_schema": {}}],
        "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {}}},
        "service_tier": "auto",
        "speed": "standard",
        "metadata": {"user_id": "u"},
        "stop_sequences": ["END"],
    },
    "responses": {
        "model": "m",
        "instructions": "s",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "message", "role": "developer", "content": "d"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "x"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
        ],
        "tools": [
            {"type": "function", "name": "f", "parameters": {}, "strict": True},
            {"type": "web_search"},
        ],
        "tool_choice": {"type": "function", "name": "f"},
        "reasoning": {"effort": "low", "summary": "auto"},
        "text": {"format": {"type": "json_object"}, "verbosity": "medium"},
        "include": ["reasoning.encrypted_content"],
        "service_tier": "auto",
        "truncation": "disabled",
        "background": False,
        "store": False,
        "stream": True,
        "stream_options": {"include_obfuscation": True},
    },
}

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
#: The values that broke the doors before: lists and objects where a name was expected.
_UNHASHABLE = st.sampled_from([[], {}, [[]], [{}], {"a": []}])


def paths(value: object, path: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """Every path in C{value}, the whole value's (C{()}) first."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths(item, (*path, index))


def replaced(body: dict[str, Any], path: tuple[str | int, ...], value: object) -> object:
    """C{body} with C{value} at C{path}."""
    if not path:
        return value
    copy = json.loads(json.dumps(body))
    place = copy
    for step in path[:-1]:
        place = place[step]
    place[path[-1]] = value
    return copy


def _cases(values: st.SearchStrategy[object]) -> st.SearchStrategy[tuple[str, object]]:
    """A door's name and its body with one value replaced."""
    return st.sampled_from(sorted(BODIES)).flatmap(
        lambda name: st.tuples(
            st.just(name),
            st.builds(
                replaced,
                st.just(BODIES[name]),
                st.sampled_from(list(paths(BODIES[name]))),
                values,
            ),
        )
    )


class AnyValueTests(SynchronousTestCase):
    """Every door's reader, and C{count_tokens}', on any value anywhere."""

    def setUp(self) -> None:
        """The gateway's three doors."""
        self.doors = {door.name: door for _, door in front_doors("drop", Clock().seconds).by_path}

    def read(self, name: str, body: object) -> None:
        """Read C{body} through door C{name}: an answer, or a 400 naming a field."""
        raw = json.dumps(body).encode()
        no_headers: dict[bytes, bytes] = {}
        try:
            self.doors[name].read(raw, no_headers.get, lambda: "conn-1")
            door = self.doors[name]
            if isinstance(door, MessagesDoor):
                door.read_count(raw, no_headers.get)
        except GatewayError as error:
            self.assertEqual(error.status, 400, error.message)

    def test_bodies_are_read(self) -> None:
        """Each body as it is is a request its door takes (so every field is reached)."""
        no_headers: dict[bytes, bytes] = {}
        for name, body in BODIES.items():
            with self.subTest(name):
                self.doors[name].read(json.dumps(body).encode(), no_headers.get, lambda: "c")

    @settings(max_examples=500)
    @given(_cases(_JSON))
    def test_any_value(self, case: tuple[str, object]) -> None:
        """Any JSON value anywhere: an answer or a 400."""
        self.read(*case)

    @settings(max_examples=300)
    @given(_cases(_UNHASHABLE))
    def test_lists_and_objects(self, case: tuple[str, object]) -> None:
        """A list or an object anywhere, where a name is expected too: an answer or a 400."""
        self.read(*case)

    def test_named_fields(self) -> None:
        """The two fields that gave 500s before each give a 400 naming them."""
        messages = dict(BODIES["messages"], tool_choice={"type": []})
        responses = dict(BODIES["responses"], include=[[]])
        no_headers: dict[bytes, bytes] = {}
        for name, body, field in (
            ("messages", messages, "tool_choice.type"),
            ("responses", responses, "include[0]"),
        ):
            with self.subTest(name):
                raw = json.dumps(body).encode()
                error = self.assertRaises(
                    GatewayError, self.doors[name].read, raw, no_headers.get, lambda: "c"
                )
                self.assertEqual((error.status, error.param), (400, field))
