"""
Tests for the classifier and the filters of L{loopd.gateway.router} (reference/mesh-moa.md §5):
categories, complexity, media and tool needs, the media and capability filters.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.classify import Classification, classify, wants_auto
from loopd.gateway.errors import error_for
from loopd.gateway.router import (
    Candidate,
    MediaUnsupportedError,
    capability_filter,
    media_filter,
)
from loopd.moa.roles import Tier

BIG = Tier.BIG
SMALL = Tier.SMALL


def user(*texts: Any, **fields: Any) -> dict[str, Any]:
    """A request body with one user message per text."""
    return {"messages": [{"role": "user", "content": t} for t in texts], **fields}


def category(body: dict[str, Any]) -> str:
    """The category L{classify} gives C{body}."""
    return classify(body).category


def _json_children(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """JSON arrays and objects of C{children}, with the keys the classifier looks at."""
    keys = st.sampled_from(["role", "content", "type", "text", "image", "audio", "x"])
    return st.lists(children, max_size=4) | st.dictionaries(keys | st.text(), children)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(), _json_children)

TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {}}}
CHAT = Classification("chat", "quick", False)


class ClassifierTextTests(SynchronousTestCase):
    """The classifier reads the lowercased text of every message."""

    def test_string_content(self) -> None:
        """A string content is a text part; signals match it lowercased."""
        self.assertEqual(category(user("Write a POEM")), "creative")

    def test_anthropic_text_blocks(self) -> None:
        """Each content block's C{text} is a text part."""
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

    def test_malformed_parts_skipped(self) -> None:
        """Non-object messages, non-text blocks and non-list messages are skipped, not fatal."""
        body = {"messages": [3, {"role": "user", "content": [None, {"text": 7}, "poem"]}]}
        self.assertEqual(classify(body), Classification("chat", "quick", False))
        self.assertEqual(classify({"messages": "poem"}), Classification("chat", "quick", False))

    @given(_json)
    def test_any_json_body(self, value: object) -> None:
        """Any JSON value in C{messages} or C{tools} classifies without an exception."""
        result = classify({"messages": value, "tools": value})
        self.assertIsInstance(result, Classification)


class NeedsToolsTests(SynchronousTestCase):
    """needs_tools = a non-empty tools array, or a tool_use / tool_result block."""

    def test_tools_array(self) -> None:
        """A non-empty C{tools} array needs tools."""
        self.assertTrue(classify(user("hi", tools=[TOOL])).needs_tools)

    def test_empty_tools_array(self) -> None:
        """An empty C{tools} array does not."""
        self.assertFalse(classify(user("hi", tools=[])).needs_tools)

    def test_tool_use_block(self) -> None:
        """A C{tool_use} content block needs tools."""
        body = user([{"type": "tool_use", "id": "1", "name": "read_file", "input": {}}])
        self.assertTrue(classify(body).needs_tools)

    def test_tool_result_block(self) -> None:
        """A C{tool_result} content block needs tools."""
        body = user([{"type": "tool_result", "tool_use_id": "1", "content": "ok"}])
        self.assertTrue(classify(body).needs_tools)


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
            ("vision block", user([{"type": "image_url", "image_url": {"url": "x"}}]), "image"),
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
        return classify(body).complexity

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
    """Media requirements from content blocks."""

    def media(self, block: dict[str, Any]) -> tuple[bool, bool, bool]:
        """(needs_vision, needs_audio, has_media) of a request with C{block}."""
        found = classify(user([block]))
        return found.needs_vision, found.needs_audio, found.has_media

    def test_table(self) -> None:
        """Block types and fields that ask for vision, audio or only a file."""
        table: list[tuple[dict[str, Any], tuple[bool, bool, bool]]] = [
            ({"type": "image_url", "image_url": {"url": "u"}}, (True, False, True)),
            ({"type": "input_image"}, (True, False, True)),
            ({"type": "image"}, (True, False, True)),
            ({"type": "audio_url"}, (False, True, True)),
            ({"type": "input_audio", "input_audio": {}}, (False, True, True)),
            ({"type": "audio"}, (False, True, True)),
            ({"type": "file", "file": {}}, (False, False, True)),
            ({"type": "input_file"}, (False, False, True)),
            ({"type": "custom", "image_url": "u"}, (True, False, True)),
            ({"type": "custom", "image": "u"}, (True, False, True)),
            ({"type": "custom", "audio_url": "u"}, (False, True, True)),
            ({"type": "custom", "audio": "u"}, (False, True, True)),
            ({"type": "text", "text": "an image of audio"}, (False, False, False)),
        ]
        for block, expected in table:
            self.assertEqual((block, self.media(block)), (block, expected))


class WantsAutoTests(SynchronousTestCase):
    """When the auto router runs: model auto or no model."""

    def test_table(self) -> None:
        """auto, missing, null and empty route; a named model and mesh do not."""
        table: list[tuple[dict[str, Any], bool]] = [
            ({"model": "auto"}, True),
            ({}, True),
            ({"model": None}, True),
            ({"model": ""}, True),
            ({"model": "mesh"}, False),
            ({"model": "Qwen3-8B"}, False),
            ({"model": "AUTO"}, False),
        ]
        for body, expected in table:
            self.assertEqual((body, wants_auto(body)), (body, expected))


class MediaFilterTests(SynchronousTestCase):
    """The media filter keeps endpoints that support every required modality."""

    eye = Candidate("eye", BIG, vision=True)
    ear = Candidate("ear", BIG, audio=True)
    both = Candidate("both", SMALL, vision=True, audio=True)
    plain = Candidate("plain", BIG)

    def test_vision(self) -> None:
        """An image request keeps the vision endpoints."""
        found = classify(user([{"type": "image_url"}]))
        self.assertEqual(
            media_filter([self.eye, self.ear, self.both, self.plain], found), (self.eye, self.both)
        )

    def test_vision_and_audio(self) -> None:
        """A request with both keeps endpoints with both."""
        found = classify(user([{"type": "image"}, {"type": "audio"}]))
        self.assertEqual(media_filter([self.eye, self.ear, self.both], found), (self.both,))

    def test_none_left(self) -> None:
        """No endpoint with the modality: media unsupported, a 400 naming it."""
        found = classify(user([{"type": "input_audio"}]))
        error = self.assertRaises(MediaUnsupportedError, media_filter, [self.eye], found)
        self.assertEqual((error.status, error.code), (400, "media_unsupported"))
        self.assertIn("audio", error.message)
        self.assertIs(error_for(error), error)

    def test_file_only(self) -> None:
        """A request with only a file keeps every endpoint."""
        found = classify(user([{"type": "file"}]))
        self.assertEqual(media_filter([self.plain, self.ear], found), (self.plain, self.ear))

    def test_no_media(self) -> None:
        """A text request keeps every endpoint."""
        self.assertEqual(media_filter([self.plain, self.eye], CHAT), (self.plain, self.eye))


class CapabilityFilterTests(SynchronousTestCase):
    """The capability filter prefers suited endpoints and falls back to all."""

    tooled = Candidate("tooled", BIG, tools=True, reasoning=False)
    bare = Candidate("bare", BIG, tools=False, vision=True)
    thinker = Candidate("thinker", SMALL, tools=False, reasoning=True)

    def test_tools(self) -> None:
        """A request with tools keeps the endpoints that support tool use."""
        found = classify(user("hi", tools=[TOOL]))
        self.assertEqual(capability_filter([self.bare, self.tooled], found), (self.tooled,))

    def test_tools_win_over_category(self) -> None:
        """Tool use decides even for a reasoning request."""
        found = classify(user("prove that, with logic", tools=[TOOL]))
        self.assertEqual(found.category, "reasoning")
        self.assertEqual(capability_filter([self.thinker, self.tooled], found), (self.tooled,))

    def test_reasoning(self) -> None:
        """A reasoning request keeps the endpoints that reason."""
        found = classify(user("prove that, with logic"))
        self.assertEqual(capability_filter([self.tooled, self.thinker], found), (self.thinker,))

    def test_image(self) -> None:
        """An image request keeps the vision endpoints."""
        found = classify(user("describe the screenshot"))
        self.assertEqual(capability_filter([self.tooled, self.bare], found), (self.bare,))

    def test_other_categories(self) -> None:
        """Any other category keeps every endpoint."""
        found = classify(user("a limerick"))
        self.assertEqual(
            capability_filter([self.bare, self.tooled], found), (self.bare, self.tooled)
        )

    def test_fallback(self) -> None:
        """When nothing qualifies, every endpoint stays."""
        found = classify(user("hi", tools=[TOOL]))
        self.assertEqual(
            capability_filter([self.bare, self.thinker], found), (self.bare, self.thinker)
        )
