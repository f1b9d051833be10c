"""
Tests for L{loopd.gateway.doors.hosted_tools}: which tool types each API's own servers run, and
the refusal under C{[doors] hosted_tools = "refuse"}.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.hosted_tools import (
    dropped_hosted,
    hosted_messages_tool,
    hosted_responses_tool,
    refuse_hosted,
)
from loopd.gateway.errors import GatewayError


class HostedTypesTests(SynchronousTestCase):
    """The hosted tool types of each API, and the tools that are not hosted."""

    def test_responses(self) -> None:
        """OpenAI's hosted tools are hosted; function, namespace and custom tools are not."""
        for kind in (
            "web_search",
            "web_search_preview",
            "file_search",
            "code_interpreter",
            "computer_use_preview",
            "image_generation",
            "mcp",
        ):
            self.assertTrue(hosted_responses_tool(kind), kind)
        for kind in ("function", "namespace", "custom", "local_shell", "web_search_x"):
            self.assertFalse(hosted_responses_tool(kind), kind)

    def test_messages(self) -> None:
        """
        Anthropic's server tools are hosted, by prefix (every dated version); its client
        tools with their own schemas (bash, text editor, computer, memory) and custom tools
        are not.
        """
        for kind in (
            "web_search_20250305",
            "web_fetch_20250910",
            "code_execution_20250825",
            "tool_search_tool_regex_20251119",
            "mcp_toolset",
        ):
            self.assertTrue(hosted_messages_tool(kind), kind)
        for kind in ("custom", "bash_20250124", "text_editor_20250728", "memory_20250818"):
            self.assertFalse(hosted_messages_tool(kind), kind)


class RefusalTests(SynchronousTestCase):
    """C{refuse_hosted}: the 400 that names the tool and the setting."""

    def test_refusal(self) -> None:
        """A 400 C{hosted_tool} whose param is the tool's path and whose message says why."""
        error = self.assertRaises(GatewayError, refuse_hosted, "tools[2].type", "web_search")
        self.assertEqual(
            (error.status, error.code, error.param), (400, "hosted_tool", "tools[2].type")
        )
        self.assertTrue(error.message.startswith("tools[2].type: web_search is run by"))
        self.assertIn('[doors] hosted_tools = "refuse"', error.message)


class DroppedHostedTests(SynchronousTestCase):
    """L{dropped_hosted}: the drop-or-refuse step both readers of hosted tools take."""

    def test_drop(self) -> None:
        """A hosted tool is left out and named once; another tool is not hosted."""
        dropped: list[str] = []
        for kind in ("web_search", "function", "web_search", None):
            dropped_hosted(kind, "tools[0].type", "drop", dropped, hosted_responses_tool)
        self.assertEqual(dropped, ["web_search"])
        self.assertTrue(dropped_hosted("mcp", "t", "drop", dropped, hosted_responses_tool))
        self.assertFalse(dropped_hosted("function", "t", "drop", dropped, hosted_responses_tool))

    def test_refuse(self) -> None:
        """Under C{refuse}, a hosted tool is a 400 C{hosted_tool} at its path."""
        error = self.assertRaises(
            GatewayError,
            dropped_hosted,
            "web_search_20250305",
            "tools[2].type",
            "refuse",
            [],
            hosted_messages_tool,
        )
        self.assertEqual((error.code, error.param), ("hosted_tool", "tools[2].type"))
