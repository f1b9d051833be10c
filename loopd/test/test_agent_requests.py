"""
What the real coding agents sent (C{fixtures/agents}, L{loopd.test.support.agent_captures})
through loopd's front doors (issue 24, DESIGN decision 43): every request each agent sent
over two turns with its default tools and prompts is read without a 400, its session is the
one the agent named, and what loopd does with each agent's peculiar fields holds.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.chat import ChatDoor
from loopd.gateway.doors.door import Door
from loopd.gateway.doors.messages import MessagesDoor
from loopd.gateway.doors.responses import ResponsesDoor
from loopd.gateway.doors.responses_store import ResponseStore
from loopd.gateway.request import SESSION_ID_HEADERS, GatewayRequest
from loopd.llama.types import Assistant, System, Tool, User
from loopd.test.support.agent_captures import FIXTURES, load

#: Every fixture, by name: an agent, and for pi the API it spoke.
AGENTS = sorted(path.stem for path in FIXTURES.glob("*.json"))
#: The agents that name their session, and the header they name it in.
NAMED = {
    "claude-code": "x-claude-code-session-id",
    "codex": "session-id",
    "opencode": "x-session-affinity",
    "pi-openai-completions": "session_id",
    "pi-openai-responses": "session_id",
}


def door_for(path: str) -> Door:
    """The front door of a request's path (its query string aside)."""
    route = path.split("?", 1)[0]
    if route == "/v1/messages":
        return MessagesDoor()
    if route == "/v1/responses":
        return ResponsesDoor(ResponseStore(Clock().seconds))
    if route == "/v1/chat/completions":
        return ChatDoor()
    raise AssertionError(f"no door at {path}")


def read(request: dict[str, Any]) -> GatewayRequest:
    """One captured request through its door, as the gateway reads it."""
    headers = {name.encode(): value.encode() for name, value in request["headers"].items()}
    body = json.dumps(request["body"]).encode()
    return door_for(request["path"]).read(body, headers.get, lambda: "anonymous:1")


class EveryRequestTests(SynchronousTestCase):
    """Each agent's every request, through its door."""

    def test_fixtures_present(self) -> None:
        """Every agent the issue names has its fixture (pi once per API)."""
        self.assertEqual(
            AGENTS,
            [
                "aider",
                "claude-code",
                "cline",
                "codex",
                "opencode",
                "pi-anthropic-messages",
                "pi-openai-completions",
                "pi-openai-responses",
                "qwen",
            ],
        )

    def test_accepted(self) -> None:
        """No request of any agent is refused; each has a conversation to answer."""
        for agent in AGENTS:
            for index, request in enumerate(load(agent)):
                with self.subTest(agent=agent, request=index):
                    parsed = read(request)
                    self.assertTrue(parsed.messages)
                    self.assertTrue(parsed.stream)

    def test_sessions(self) -> None:
        """
        An agent that names its session is that session on every request; one that names
        none is its connection's anonymous session.
        """
        for agent in AGENTS:
            for request in load(agent):
                session = read(request).session
                with self.subTest(agent=agent):
                    if agent in NAMED:
                        named = request["headers"][NAMED[agent]]
                        self.assertEqual((session.id, session.anonymous), (named, False))
                    else:
                        self.assertEqual(session.anonymous, True)
                        self.assertFalse(
                            set(request["headers"])
                            & {name.decode() for name, _ in SESSION_ID_HEADERS}
                        )


class AgentShapeTests(SynchronousTestCase):
    """What loopd makes of each agent's peculiar fields."""

    def test_claude_code(self) -> None:
        """
        Claude Code: its C{system} turn after the first user turn stays there; thinking
        adaptive turns thinking on; its metadata, context management and effort change
        nothing; its tools are offered as sent, none left out.
        """
        for request in load("claude-code"):
            parsed = read(request)
            self.assertIsInstance(parsed.messages[0], System)
            self.assertIsInstance(parsed.messages[1], User)
            self.assertIsInstance(parsed.messages[2], System)
            self.assertEqual((parsed.thinking, parsed.dropped), (True, ()))
            self.assertEqual(len(parsed.tools), len(request["body"]["tools"]))
            self.assertNotIn("context_management", parsed.fields)

    def test_codex(self) -> None:
        """
        Codex CLI: C{client_metadata} accepted and not forwarded; C{web_search} left out
        and named; the C{multi_agent_v1} namespace flattened; its developer messages system
        messages; its reasoning items replayed as the assistant turn's reasoning.
        """
        for request in load("codex"):
            parsed = read(request)
            self.assertEqual(parsed.dropped, ("web_search",))
            self.assertNotIn("client_metadata", parsed.fields)
            flat = {name for name in parsed.tool_namespaces}
            self.assertIn("multi_agent_v1__spawn_agent", flat)
            self.assertTrue(all(name.startswith("multi_agent_v1__") for name in flat))
            self.assertIsInstance(parsed.messages[0], System)
        turn_two = read(load("codex")[-1])
        answered = [m for m in turn_two.messages if isinstance(m, Assistant)]
        self.assertTrue(any(m.reasoning_content for m in answered))
        self.assertTrue(any(isinstance(m, Tool) for m in turn_two.messages))

    def test_opencode(self) -> None:
        """OpenCode: its title request has no tools and another system prompt."""
        title, main = (read(request) for request in load("opencode")[:2])
        self.assertEqual(title.tools, ())
        self.assertNotEqual(title.messages[0], main.messages[0])
        self.assertEqual(title.session.id, main.session.id)

    def test_pi_anthropic(self) -> None:
        """pi on Messages: its tools' C{eager_input_streaming} and C{cache_control} pass."""
        for request in load("pi-anthropic-messages"):
            self.assertTrue(read(request).tools)

    def test_aider(self) -> None:
        """Aider offers no tools and names its sampling temperature."""
        for request in load("aider"):
            parsed = read(request)
            self.assertEqual((parsed.tools, parsed.temperature), ((), 0.0))
