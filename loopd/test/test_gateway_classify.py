"""
Tests for L{loopd.gateway.classify}, the C{auto} router's classifier (reference/mesh-moa.md
§5): categories, complexity, media and tool needs. Requests are written as bodies and read
through the chat-completions front door, as the gateway reads them.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.classify import Classification, classify
from loopd.gateway.doors.chat_read import parse_request
from loopd.gateway.errors import GatewayError
from loopd.gateway.request import GatewayRequest


def request(body: dict[str, Any]) -> GatewayRequest:
    """The request the front door reads from C{body}."""
    return parse_request(json.dumps(body).encode())


def found(body: dict[str, Any]) -> Classification:
    """What L{classify} finds in the request of C{body}."""
    return classify(request(body))


def user(*texts: Any, **fields: Any) -> dict[str, Any]:
    """A request body with one user message per text."""
    return {"messages": [{"role": "user", "content": t} for t in texts], **fields}


def category(body: dict[str, Any]) -> str:
    """The category L{classify} gives C{body}."""
    return found(body).category


TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {}}}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}


class ClassifierTextTests(SynchronousTestCase):
    """The classifier reads the lowercased text of every message."""

    def test_string_content(self) -> None:
        """A string content is a text part; signals match it lowercased."""
        self.assertEqual(category(user("Write a POEM")), "creative")

    def test_text_parts(self) -> None:
        """Text parts are read as the text they make."""
        body = user([{"type": "text", "text": "A Haiku"}, {"type": "text", "text": "please"}])
        self.assertEqual(category(body), "creative")

    def test_every_message_counts(self) -> None:
        """Signals in different messages (any role) add up to one score."""
        body = {
            "messages": [
                {"role": "assistant", "content": "Here is the traceback"},
                {"role": "user", "content": "fix it in python"},
            ]
        }
        self.assertEqual(category(body), "code")

    def test_distinct_signals(self) -> None:
        """A score counts distinct signals: the same one twice is 1, not 2."""
        self.assertEqual(category(user("proof, proof and proof")), "chat")
        self.assertEqual(category(user("a proof by logic")), "reasoning")

    def test_malformed_never_reaches_it(self) -> None:
        """What v1 skipped as malformed is refused by the front door, before any routing."""
        bodies: list[dict[str, Any]] = [
            {"messages": [3, {"role": "user", "content": "poem"}]},
            {"messages": "poem"},
            user([None, {"text": 7}, "poem"]),
        ]
        for body in bodies:
            self.assertEqual(self.assertRaises(GatewayError, request, body).status, 400)

    @given(st.lists(st.sampled_from(["user", "system", "assistant"]), min_size=1), st.text())
    def test_any_conversation(self, roles: list[str], text: str) -> None:
        """Any conversation of text classifies, into one of the categories."""
        body = {"messages": [{"role": role, "content": text} for role in roles]}
        self.assertIsInstance(found(body), Classification)


class NeedsToolsTests(SynchronousTestCase):
    """needs_tools = the request offers tools."""

    def test_tools_array(self) -> None:
        """A non-empty C{tools} array needs tools."""
        self.assertTrue(found(user("hi", tools=[TOOL])).needs_tools)

    def test_empty_tools_array(self) -> None:
        """An empty C{tools} array does not."""
        self.assertFalse(found(user("hi", tools=[])).needs_tools)

    def test_anthropic_blocks_refused(self) -> None:
        """Anthropic's tool_use and tool_result blocks are no chat-completions content."""
        for block in (
            {"type": "tool_use", "id": "1", "name": "read_file", "input": {}},
            {"type": "tool_result", "tool_use_id": "1", "content": "ok"},
        ):
            error = self.assertRaises(GatewayError, request, user([block]))
            self.assertEqual(error.code, "unsupported_content")


class CategoryTests(SynchronousTestCase):
    """Category, first match wins."""

    def test_table(self) -> None:
        """Every rule of the category list, and its precedence, as a table."""
        system = {"role": "system", "content": "You are a helpful Programmer."}
        table: list[tuple[str, dict[str, Any], str]] = [
            # 1. code
            (
                "system prompt names programmer",
                {"messages": [system, *user("hi")["messages"]]},
                "code",
            ),
            (
                "code score >= 2 beats reasoning",
                user("python traceback: prove that, proof"),
                "code",
            ),
            ("code 1, no reasoning or creative", user("my json is odd"), "code"),
            ("code 1 with a creative signal is not code", user("a poem about json"), "creative"),
            ("code 1 with a reasoning signal is not code", user("json logic"), "chat"),
            # 2. reasoning
            ("reasoning score >= 2", user("prove that it holds: a proof"), "reasoning"),
            ("reasoning 1 is not enough", user("a proof"), "chat"),
            ("reasoning beats creative", user("a poem, a proof, some logic"), "reasoning"),
            # 3. creative
            ("creative score >= 1", user("a limerick please"), "creative"),
            ("creative beats image", user("a haiku about this picture"), "creative"),
            # 4. image
            ("image signal", user("what is in this screenshot"), "image"),
            ("vision block", user([IMAGE]), "image"),
            ("image beats tool_call", user("draw a diagram", tools=[TOOL]), "image"),
            # 5. tool_call
            ("tools and no code/reasoning/creative", user("hi", tools=[TOOL]), "tool_call"),
            ("tool_call beats info", user("what is it, how many", tools=[TOOL]), "tool_call"),
            ("a single reasoning signal blocks tool_call", user("calculate", tools=[TOOL]), "chat"),
            # 6. info
            ("info score >= 2", user("what is the capital of Peru"), "info"),
            ("info 1 is chat", user("what is up"), "chat"),
            # 7. chat
            ("nothing else", user("hello there"), "chat"),
        ]
        for label, body, expected in table:
            self.assertEqual((label, category(body)), (label, expected))

    def test_system_prompt_only(self) -> None:
        """The code signal words count in the system prompt only, not in user text."""
        self.assertEqual(category(user("I am a developer")), "chat")
        body = {"messages": [{"role": "developer", "content": "coding assistant"}]}
        self.assertEqual(category(body), "code")


class ComplexityTests(SynchronousTestCase):
    """Complexity: deep, quick, or moderate."""

    def complexity(self, body: dict[str, Any]) -> str:
        """The complexity of C{body}."""
        return found(body).complexity

    def test_deep_signal(self) -> None:
        """A deep signal makes the request deep."""
        self.assertEqual(self.complexity(user("a detailed answer")), "deep")

    def test_long_last_user_message(self) -> None:
        """A last user message over 500 bytes (UTF-8) is deep; 500 is not."""
        self.assertEqual(self.complexity(user("é" * 251)), "deep")
        self.assertEqual(self.complexity(user("é" * 250)), "moderate")
        self.assertEqual(self.complexity(user("x" * 501)), "deep")

    def test_many_messages(self) -> None:
        """More than 10 messages is deep; 10 is not."""
        self.assertEqual(self.complexity(user(*["hi"] * 11)), "deep")
        self.assertEqual(self.complexity(user(*["hi"] * 10)), "moderate")

    def test_quick(self) -> None:
        """A last user message under 60 bytes in at most 2 messages is quick."""
        self.assertEqual(self.complexity(user("x" * 59)), "quick")
        self.assertEqual(self.complexity(user("hi", "x" * 59)), "quick")

    def test_quick_limits(self) -> None:
        """60 bytes, 3 messages, or a reasoning signal make it moderate."""
        self.assertEqual(self.complexity(user("x" * 60)), "moderate")
        self.assertEqual(self.complexity(user("hi", "hi", "hi")), "moderate")
        self.assertEqual(self.complexity(user("a proof")), "moderate")

    def test_last_user_message(self) -> None:
        """Only the last user message's length counts, not an earlier one or the assistant's."""
        body = {
            "messages": [
                {"role": "user", "content": "x" * 600},
                {"role": "assistant", "content": "y" * 600},
                {"role": "user", "content": "ok"},
            ]
        }
        self.assertEqual(self.complexity(body), "moderate")


class MediaTests(SynchronousTestCase):
    """Media requirements: the image and audio parts of user turns."""

    def media(self, *parts: dict[str, Any]) -> tuple[bool, bool, bool]:
        """(needs_vision, needs_audio, has_media) of a request with C{parts}."""
        result = found(user([*parts, {"type": "text", "text": "an image of audio"}]))
        return result.needs_vision, result.needs_audio, result.has_media

    def test_table(self) -> None:
        """An image part asks for vision, an audio part for audio; words alone for none."""
        self.assertEqual(self.media(IMAGE), (True, False, True))
        self.assertEqual(self.media(AUDIO), (False, True, True))
        self.assertEqual(self.media(IMAGE, AUDIO), (True, True, True))
        self.assertEqual(self.media(), (False, False, False))

    def test_other_media_refused(self) -> None:
        """Other part kinds (files, Responses or Anthropic images) are refused, not routed."""
        for kind in ("input_image", "image", "audio_url", "audio", "file", "input_file"):
            error = self.assertRaises(GatewayError, request, user([{"type": kind}]))
            self.assertEqual(error.code, "unsupported_content", kind)
