"""
Tests for L{loopd.gateway.doors.tools}: the tool rules every door's reader shares, once.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.tools import TOOLS_CODE, narrowed, offered_tool
from loopd.gateway.errors import GatewayError
from loopd.llama.types import ToolSchema

READ = ToolSchema("read", "Read a file.", {"type": "object"})
WRITE = ToolSchema("write", "", {"type": "object", "properties": {}})


class OfferedToolTests(SynchronousTestCase):
    """L{offered_tool}."""

    def refused(self, tool: dict[str, Any], field: str, **options: Any) -> GatewayError:
        """Assert C{tool} is refused with C{invalid_tools} naming C{field}."""
        error: GatewayError = self.assertRaises(
            GatewayError, offered_tool, tool, "tools[1]", [READ], **options
        )
        self.assertEqual((error.status, error.code, error.param), (400, TOOLS_CODE, field))
        return error

    def test_read(self) -> None:
        """Name, description and schema as given; an absent schema takes any object."""
        schema = {"type": "object", "properties": {"path": {"type": "string"}}}
        tool = {"name": "write", "description": "Write.", "parameters": schema}
        self.assertEqual(
            offered_tool(tool, "tools[1]", [READ]), ToolSchema("write", "Write.", schema)
        )
        self.assertEqual(
            offered_tool({"name": "write"}, "tools[1]", [READ]),
            ToolSchema("write", "", {"type": "object"}),
        )

    def test_schema_key(self) -> None:
        """The schema comes from the door's own key, and may be required."""
        tool = {"name": "write", "input_schema": {"type": "object"}}
        read = offered_tool(tool, "tools[1]", [], schema_key="input_schema", schema_required=True)
        self.assertEqual(read.parameters, {"type": "object"})
        error = self.refused(
            {"name": "write"},
            "tools[1].input_schema",
            schema_key="input_schema",
            schema_required=True,
        )
        self.assertIn("required", error.message)

    def test_refusals(self) -> None:
        """A missing or empty name, a name offered twice, a bad description or schema."""
        self.refused({}, "tools[1].name")
        self.refused({"name": ""}, "tools[1].name")
        self.assertIn("offered twice", self.refused({"name": "read"}, "tools[1].name").message)
        self.refused({"name": "w", "description": 3}, "tools[1].description")
        self.refused({"name": "w", "parameters": []}, "tools[1].parameters")

    @given(st.text(min_size=1), st.text(), st.dictionaries(st.text(), st.integers()))
    def test_any_valid_tool(self, name: str, description: str, schema: dict[str, int]) -> None:
        """Any non-empty name, string description and object schema reads back as given."""
        tool = {"name": name, "description": description, "parameters": schema}
        self.assertEqual(offered_tool(tool, "t", []), ToolSchema(name, description, schema))


class NarrowedTests(SynchronousTestCase):
    """L{narrowed}."""

    def test_narrowed(self) -> None:
        """The one tool named stays on offer."""
        self.assertEqual(narrowed((READ, WRITE), "write", "tool_choice.name", "x"), (WRITE,))

    def test_refused(self) -> None:
        """A name that is no string, or no tool offered, is the door's code at the path."""
        for name in (None, 3, "edit"):
            with self.subTest(name):
                error = self.assertRaises(
                    GatewayError, narrowed, (READ,), name, "tool_choice.name", "bad_choice"
                )
                self.assertEqual((error.code, error.param), ("bad_choice", "tool_choice.name"))
