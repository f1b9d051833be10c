"""
Tests for L{loopd.gateway.anthropic}: Anthropic Messages bodies in (every bad input a 400
naming the field), the C{message} object, the event stream as the C{anthropic} SDK parses
it, and errors in Anthropic's shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import anthropic
import httpx2
from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.anthropic import (
    TOOL_ERROR_PREFIX,
    MessagesDoor,
    anthropic_error,
    parse_messages,
    tool_input,
    without_attribution,
)
from loopd.gateway.errors import GatewayError
from loopd.gateway.request import GatewayRequest
from loopd.llama.request import render_messages
from loopd.llama.types import (
    Assistant,
    ChatEvent,
    Completion,
    Content,
    FinishReason,
    Progress,
    Queued,
    Reasoning,
    Retrying,
    System,
    ThinkingCapped,
    Timings,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolSchema,
    User,
    Waiting,
)
from loopd.settings import Doors
from loopd.testing.fake_llama import CHAT
from loopd.testing.gateway import GatewayHarness, Response, make_config
from loopd.testing.llama_replies import answer

USER = {"role": "user", "content": "Hi"}
TOOL = {"name": "read", "description": "Read a file.", "input_schema": {"type": "object"}}
PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
TIMINGS = Timings(cache_n=90, prompt_n=10, predicted_n=7)


def encode(document: object) -> bytes:
    """A JSON request body."""
    return json.dumps(document).encode("utf-8")


def parse(**fields: Any) -> GatewayRequest:
    """Parse a body of one user message and C{max_tokens} 100, plus C{fields}."""
    return parse_messages(encode({"max_tokens": 100, "messages": [USER], **fields}))


def no_headers(name: bytes) -> bytes | None:
    """A request without headers."""
    return None


def headers(values: Mapping[bytes, bytes]) -> Any:
    """A request's header lookup over C{values}."""
    return values.get


class ReaderTests(SynchronousTestCase):
    """L{parse_messages}: what a Messages body becomes."""

    def test_minimal(self) -> None:
        """A model, max_tokens and one user turn; thinking is the server's default (on)."""
        request = parse(model="tiny")
        self.assertEqual(request.model, "tiny")
        self.assertEqual(request.messages, (User("Hi"),))
        self.assertEqual(request.max_tokens, 100)
        self.assertEqual((request.thinking_switches, request.thinking_cap), ((), None))
        self.assertTrue(request.thinking)
        self.assertFalse(request.stream)
        self.assertEqual(dict(request.fields), {})

    def test_model_absent(self) -> None:
        """No model is C{auto}'s C{None}."""
        self.assertIsNone(parse().model)

    def test_system_string_and_blocks(self) -> None:
        """System text, a string or text blocks (joined by a blank line), comes first."""
        self.assertEqual(parse(system="Be brief.").messages[0], System("Be brief."))
        blocks = [
            {"type": "text", "text": "One.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Two."},
        ]
        self.assertEqual(parse(system=blocks).messages[0], System("One.\n\nTwo."))
        self.assertEqual(parse(system="").messages, (User("Hi"),))

    def test_system_turn_where_it_stands(self) -> None:
        """
        A C{system} turn in C{messages} (Claude Code sends its Agent tool's agent types
        after the first user turn) is a system message in its place; text blocks join.
        """
        later = {"role": "system", "content": [{"type": "text", "text": "Agents: a"}]}
        request = parse(
            system="Be brief.", messages=[USER, later, {"role": "assistant", "content": "Ok"}]
        )
        self.assertEqual(
            request.messages,
            (System("Be brief."), User("Hi"), System("Agents: a"), Assistant("Ok")),
        )
        self.assertEqual(
            parse(messages=[USER, {"role": "system", "content": "x"}]).messages[1], System("x")
        )

    def test_empty_messages(self) -> None:
        """An empty C{messages} is the system prompt alone, as llama-server answers it."""
        self.assertEqual(parse(system="Be brief.", messages=[]).messages, (System("Be brief."),))
        self.assertEqual(parse(messages=[]).messages, ())

    def test_server_tools_left_out(self) -> None:
        """
        Server tools are left out of what the model sees and named once each in
        C{dropped}; custom tools stay; under C{refuse} the first is a 400 naming it.
        """
        tools = [
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
            TOOL,
            {"type": "web_fetch_20250910", "name": "web_fetch"},
            {"type": "code_execution_20250825", "name": "code_execution"},
            {"type": "web_search_20250305", "name": "web_search"},
        ]
        request = parse(tools=tools)
        self.assertEqual([tool.name for tool in request.tools], ["read"])
        self.assertEqual(
            request.dropped,
            ("web_search_20250305", "web_fetch_20250910", "code_execution_20250825"),
        )
        self.assertEqual(parse(tools=[TOOL]).dropped, ())
        body = encode({"max_tokens": 1, "messages": [USER], "tools": [TOOL, *tools]})
        error = self.assertRaises(GatewayError, parse_messages, body, hosted_tools="refuse")
        self.assertEqual((error.code, error.param), ("hosted_tool", "tools[1].type"))

    def test_user_blocks(self) -> None:
        """Text blocks join; an image (base64 or url) keeps the turn's OpenAI parts."""
        content = [
            {"type": "text", "text": "Look: "},
            {"type": "image", "source": PNG},
            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
        ]
        (user,) = parse(messages=[{"role": "user", "content": content}]).messages
        self.assertEqual(
            user,
            User(
                "Look: ",
                (
                    {"type": "text", "text": "Look: "},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
                    },
                    {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                ),
            ),
        )
        self.assertEqual(
            parse(messages=[{"role": "user", "content": content}]).modalities, {"vision"}
        )

    def test_assistant_turn(self) -> None:
        """Thinking, text and tool uses of an earlier turn, the input as JSON arguments."""
        content = [
            {"type": "thinking", "thinking": "Hmm.", "signature": "sig"},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "é"}},
        ]
        messages = [USER, {"role": "assistant", "content": content}]
        request = parse(messages=messages)
        call = ToolCall("toolu_1", "read", '{"path": "é"}')
        self.assertEqual(request.messages[1], Assistant("Reading.", "Hmm.", (call,)))
        only_tool = [USER, {"role": "assistant", "content": content[2:]}]
        self.assertEqual(parse(messages=only_tool).messages[1], Assistant(None, None, (call,)))
        self.assertEqual(
            parse(messages=[USER, {"role": "assistant", "content": "Sure"}]).messages[1],
            Assistant("Sure"),
        )

    def test_tool_results(self) -> None:
        """
        Tool results come first as tool messages (text blocks joined, errors prefixed,
        images after them as a user turn), then the turn's own text.
        """
        content = [
            {"type": "tool_result", "tool_use_id": "a", "content": "ok"},
            {
                "type": "tool_result",
                "tool_use_id": "b",
                "content": [{"type": "text", "text": "no "}, {"type": "text", "text": "file"}],
                "is_error": True,
            },
            {"type": "tool_result", "tool_use_id": "c"},
            {
                "type": "tool_result",
                "tool_use_id": "d",
                "content": [{"type": "image", "source": PNG}],
            },
            {"type": "text", "text": "Go on."},
        ]
        messages = parse(messages=[{"role": "user", "content": content}]).messages
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        self.assertEqual(
            messages,
            (
                Tool("a", "ok"),
                Tool("b", TOOL_ERROR_PREFIX + "no file"),
                Tool("c", ""),
                Tool("d", ""),
                User("", (image,)),
                User("Go on."),
            ),
        )

    def test_tools_and_choice(self) -> None:
        """Tools become schemas; each tool_choice maps onto OpenAI's."""
        other = {"name": "write", "input_schema": {"type": "object", "properties": {}}}
        request = parse(tools=[TOOL, other])
        self.assertEqual(
            request.tools,
            (
                ToolSchema("read", "Read a file.", {"type": "object"}),
                ToolSchema("write", "", {"type": "object", "properties": {}}),
            ),
        )
        self.assertIsNone(request.tool_choice)
        cases = {"auto": "auto", "any": "required", "none": "none"}
        for kind, expected in cases.items():
            chosen = parse(tools=[TOOL, other], tool_choice={"type": kind})
            self.assertEqual((chosen.tool_choice, len(chosen.tools)), (expected, 2))
        named = parse(tools=[TOOL, other], tool_choice={"type": "tool", "name": "write"})
        self.assertEqual(
            (named.tool_choice, [t.name for t in named.tools]), ("required", ["write"])
        )
        single = parse(
            tools=[TOOL], tool_choice={"type": "auto", "disable_parallel_tool_use": True}
        )
        self.assertEqual(dict(single.fields), {"parallel_tool_calls": False})

    def test_sampling(self) -> None:
        """stop_sequences, temperature, top_p; top_k goes to the server as it is."""
        request = parse(stop_sequences=["END", "\n\n"], temperature=0.5, top_p=1, top_k=40)
        self.assertEqual(request.stop, ("END", "\n\n"))
        self.assertEqual((request.temperature, request.top_p), (0.5, 1.0))
        self.assertEqual(dict(request.fields), {"top_k": 40})
        self.assertEqual(parse(max_tokens=2.0).max_tokens, 2)

    def test_thinking(self) -> None:
        """enabled sets the request's cap; adaptive is on; disabled turns thinking off."""
        enabled = parse(thinking={"type": "enabled", "budget_tokens": 2048})
        self.assertEqual((enabled.thinking, enabled.thinking_cap), (True, 2048))
        adaptive = parse(thinking={"type": "adaptive"})
        self.assertEqual((adaptive.thinking, adaptive.thinking_cap), (True, None))
        disabled = parse(thinking={"type": "disabled"})
        self.assertEqual((disabled.thinking, disabled.thinking_override), (False, False))
        self.assertFalse(disabled.chat_request().thinking)

    def test_stream(self) -> None:
        """stream is a boolean."""
        self.assertTrue(parse(stream=True).stream)

    def test_output_format(self) -> None:
        """output_config.format's JSON schema is llama-server's response_format."""
        schema = {"type": "object", "properties": {"a": {"type": "string"}}}
        request = parse(output_config={"format": {"type": "json_schema", "schema": schema}})
        self.assertEqual(
            request.fields["response_format"],
            {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}},
        )
        self.assertEqual(dict(parse(output_config={"effort": "high"}).fields), {})

    def test_hints_accepted(self) -> None:
        """cache_control anywhere, context_management, service_tier auto: accepted, ignored."""
        ephemeral = {"type": "ephemeral"}
        content = [{"type": "text", "text": "Hi", "cache_control": ephemeral}]
        request = parse(
            messages=[{"role": "user", "content": content}],
            tools=[{**TOOL, "cache_control": ephemeral}],
            cache_control=ephemeral,
            context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
            service_tier="auto",
            speed="standard",
            metadata={"user_id": None},
            top_k=None,
        )
        self.assertEqual(request.messages, (User("Hi"),))

    def test_counting(self) -> None:
        """A count_tokens body may leave out max_tokens."""
        body = encode({"messages": [USER], "model": "tiny"})
        self.assertIsNone(parse_messages(body, counting=True).max_tokens)


class AttributionTests(SynchronousTestCase):
    """Claude Code's attribution line never reaches the model."""

    def claude_code(self, attribution: str, as_line: bool) -> list[dict[str, Any]]:
        """The prompt of a Claude-Code-shaped request with this attribution."""
        header = "x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; "
        header += f"cch={attribution};"
        identity = "You are Claude Code, Anthropic's official CLI for Claude."
        system: list[dict[str, Any]]
        if as_line:
            system = [{"type": "text", "text": header + "\n" + identity}]
        else:
            system = [{"type": "text", "text": header}, {"type": "text", "text": identity}]
        system.append(
            {"type": "text", "text": "Long rules.", "cache_control": {"type": "ephemeral"}}
        )
        request = parse_messages(
            encode(
                {
                    "model": "tiny",
                    "max_tokens": 32000,
                    "system": system,
                    "messages": [USER],
                    "tools": [TOOL],
                    "metadata": {"user_id": "user_x_account__session_1"},
                    "stream": True,
                }
            )
        )
        return render_messages(request.chat_request().messages)

    def test_two_requests_share_their_prefix(self) -> None:
        """Two requests that differ only in the attribution give the same prompt."""
        for as_line in (False, True):
            first = self.claude_code("36ee5", as_line)
            self.assertEqual(first, self.claude_code("0aaa9", as_line))
            self.assertNotIn("x-anthropic-billing-header", json.dumps(first))
            self.assertTrue(first[0]["content"].startswith("You are Claude Code"))

    def test_string_system(self) -> None:
        """A string system prompt loses the line too, and nothing else."""
        text = "  x-anthropic-billing-header: cch=1;\nRules.\nMore x-anthropic-billing-header: x"
        self.assertEqual(without_attribution(text), "Rules.\nMore x-anthropic-billing-header: x")
        self.assertEqual(parse(system="x-anthropic-billing-header: a;").messages, (User("Hi"),))


class RefusalTests(SynchronousTestCase):
    """Every bad or unsupported input is a 400 naming the field."""

    def assertRefused(self, body: object, path: str, code: str | None = None) -> GatewayError:
        """
        C{body} is a 400 whose message starts with C{path}, which is its C{param} (none for
        a body that is not a JSON object).
        """
        raw = body if isinstance(body, bytes) else encode(body)
        error: GatewayError = self.assertRaises(GatewayError, parse_messages, raw)
        self.assertEqual((error.status, error.type), (400, "invalid_request_error"))
        self.assertTrue(error.message.startswith(path + ":"), error.message)
        self.assertEqual(error.param, None if path == "body" else path)
        if code is not None:
            self.assertEqual(error.code, code)
        return error

    def refused(self, path: str, code: str | None = None, **fields: Any) -> GatewayError:
        """A body of one user message, max_tokens and C{fields} is refused at C{path}."""
        return self.assertRefused({"max_tokens": 100, "messages": [USER], **fields}, path, code)

    def test_body(self) -> None:
        """Not JSON, not an object."""
        self.assertRefused(b"{", "body", "invalid_json")
        self.assertRefused([], "body", "not_an_object")

    def test_required(self) -> None:
        """max_tokens and messages are required; max_tokens is a positive integer."""
        self.assertRefused({"messages": [USER]}, "max_tokens", "missing_max_tokens")
        self.assertRefused({"max_tokens": 1}, "messages", "missing_messages")
        for bad in (0, -1, 1.5, True, "10"):
            self.refused("max_tokens", max_tokens=bad)

    def test_unknown_top_level(self) -> None:
        """Fields loopd cannot honour, and fields no API defines, are refused by name."""
        for name, value in (
            ("container", "c1"),
            ("mcp_servers", [{"type": "url", "url": "https://x"}]),
            ("frequency_penalty", 1),
            ("output_format", {"type": "json_schema"}),
        ):
            self.refused(name, "unsupported_parameter", **{name: value})
        self.refused("service_tier", service_tier="priority")
        self.refused("speed", speed="fast")

    def test_parameters(self) -> None:
        """Each parameter's type and range."""
        self.refused("model", model=3)
        self.refused("temperature", temperature=1.5)
        self.refused("top_p", top_p=-0.1)
        self.refused("top_k", top_k=-1)
        self.refused("stop_sequences", stop_sequences="END")
        self.refused("stop_sequences[1]", stop_sequences=["a", ""])
        self.refused("stream", stream="yes")
        self.refused("metadata", metadata="me")
        self.refused("metadata.tenant", metadata={"tenant": "t"})

    def test_thinking(self) -> None:
        """thinking's type, its budget, its display."""
        self.refused("thinking.type", thinking={"type": "on"})
        self.refused("thinking.budget_tokens", thinking={"type": "enabled"})
        self.refused("thinking.budget_tokens", thinking={"type": "enabled", "budget_tokens": 0})
        self.refused("thinking.display", thinking={"type": "adaptive", "display": "omitted"})
        self.refused("thinking", thinking=True)

    def test_tools(self) -> None:
        """
        Client tools with Anthropic's own schemas, missing schemas and names, duplicates,
        unknown tool fields.
        """
        for kind in ("bash_20250124", "text_editor_20250728", "computer_20250124"):
            self.refused("tools[0].type", tools=[{"type": kind, "name": "t"}])
        self.refused("tools[0].input_schema", tools=[{"name": "f"}])
        self.refused("tools[0].name", tools=[{"input_schema": {}}])
        self.refused("tools[1].name", tools=[TOOL, TOOL])
        self.refused("tools[0].defer_loading", tools=[{**TOOL, "defer_loading": True}])
        self.refused("tools", tools={"read": TOOL})

    def test_tool_choice(self) -> None:
        """An unknown type, a name not offered, fields a choice does not have."""
        self.refused("tool_choice.type", tools=[TOOL], tool_choice={"type": "function"})
        self.refused("tool_choice.name", tools=[TOOL], tool_choice={"type": "tool", "name": "x"})
        self.refused("tool_choice.name", tools=[TOOL], tool_choice={"type": "tool"})
        self.refused(
            "tool_choice.disable_parallel_tool_use",
            tools=[TOOL],
            tool_choice={"type": "none", "disable_parallel_tool_use": True},
        )
        self.refused("tool_choice", tool_choice="auto")

    def test_messages(self) -> None:
        """Roles, content shapes, block fields."""
        self.refused("messages[0].role", messages=[{"role": "developer", "content": "x"}])
        self.refused("messages[0].role", messages=[{"role": "tool", "content": "x"}])
        self.refused(
            "messages[1].content[0].type",
            messages=[USER, {"role": "system", "content": [{"type": "image", "source": PNG}]}],
        )
        self.refused("messages[0].content", messages=[{"role": "user", "content": 3}])
        self.refused("messages[0].name", messages=[{**USER, "name": "me"}])
        self.refused("messages[0]", messages=["Hi"])
        self.refused(
            "messages[0].content[0].text",
            messages=[{"role": "user", "content": [{"type": "text"}]}],
        )
        self.refused("system", system=3)
        self.refused("system[0].type", system=[{"type": "image", "source": PNG}])

    def test_unknown_blocks(self) -> None:
        """A block loopd does not translate is refused at its type's path."""
        turns: list[Any] = [
            USER,
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "document"}]},
        ]
        error = self.refused("messages[2].content[1].type", "unsupported_content", messages=turns)
        self.assertIn("document", error.message)
        for kind in ("search_result", "container_upload", "thinking"):
            turns[2] = {"role": "user", "content": [{"type": kind}]}
            self.refused("messages[2].content[0].type", "unsupported_content", messages=turns)
        for kind in ("server_tool_use", "web_search_tool_result", "image", "tool_result"):
            turns[1] = {"role": "assistant", "content": [{"type": kind}]}
            self.refused("messages[1].content[0].type", "unsupported_content", messages=turns[:2])
        turns[1] = {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}
        error = self.refused("messages[1].content[0].type", messages=turns[:2])
        self.assertIn("encrypted", error.message)
        result = {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "document"}]}
        self.refused(
            "messages[0].content[0].content[0].type",
            messages=[{"role": "user", "content": [result]}],
        )

    def test_blocks(self) -> None:
        """Images' sources, tool uses' and tool results' fields."""

        def user(*blocks: object) -> list[Any]:
            return [{"role": "user", "content": list(blocks)}]

        def image(source: object) -> dict[str, Any]:
            return {"type": "image", "source": source}

        self.refused(
            "messages[0].content[0].source.type",
            messages=user(image({"type": "file", "file_id": "f"})),
        )
        self.refused(
            "messages[0].content[0].source.media_type",
            messages=user(image({**PNG, "media_type": "image/tiff"})),
        )
        self.refused(
            "messages[0].content[0].source.data", messages=user(image({**PNG, "data": None}))
        )
        self.refused("messages[0].content[0].source.url", messages=user(image({"type": "url"})))
        self.refused("messages[0].content[0].tool_use_id", messages=user({"type": "tool_result"}))
        self.refused(
            "messages[0].content[0].is_error",
            messages=user({"type": "tool_result", "tool_use_id": "a", "is_error": "yes"}),
        )
        self.refused(
            "messages[0].content[0].content",
            messages=user({"type": "tool_result", "tool_use_id": "a", "content": 3}),
        )
        use = {"type": "tool_use", "id": "t", "name": "read", "input": {}}
        for field, value in (("input", "{}"), ("id", None), ("name", 3)):
            self.refused(
                f"messages[1].content[0].{field}",
                messages=[USER, {"role": "assistant", "content": [{**use, field: value}]}],
            )
        self.refused(
            "messages[1].content[0].caller",
            messages=[USER, {"role": "assistant", "content": [{**use, "caller": {"type": "x"}}]}],
        )
        self.refused(
            "messages[0].content[0].citations",
            messages=user({"type": "text", "text": "x", "citations": [{"type": "char_location"}]}),
        )

    @given(
        st.dictionaries(
            st.sampled_from(
                [
                    "model",
                    "max_tokens",
                    "messages",
                    "system",
                    "tools",
                    "tool_choice",
                    "thinking",
                    "stop_sequences",
                    "temperature",
                    "top_p",
                    "top_k",
                    "metadata",
                    "stream",
                    "output_config",
                    "service_tier",
                    "container",
                ]
            ),
            st.recursive(
                st.none()
                | st.booleans()
                | st.integers(-3, 3000)
                | st.floats(allow_nan=False, allow_infinity=False)
                | st.sampled_from(
                    ["user", "assistant", "text", "image", "tool_use", "tool_result", "thinking"]
                )
                | st.sampled_from(["enabled", "disabled", "auto", "any", "tool", "base64", "url"]),
                lambda inner: (
                    st.lists(inner, max_size=3)
                    | st.dictionaries(
                        st.sampled_from(
                            [
                                "type",
                                "role",
                                "content",
                                "text",
                                "source",
                                "id",
                                "name",
                                "input",
                                "tool_use_id",
                                "input_schema",
                                "budget_tokens",
                                "user_id",
                                "media_type",
                                "data",
                                "url",
                                "is_error",
                                "thinking",
                                "signature",
                            ]
                        ),
                        inner,
                        max_size=4,
                    )
                ),
                max_leaves=12,
            ),
        )
    )
    def test_never_another_exception(self, document: dict[str, Any]) -> None:
        """Any body of the right shape parses, or is a 400 GatewayError; never anything else."""
        try:
            request = parse_messages(encode(document))
        except GatewayError as error:
            self.assertEqual(error.status, 400)
        else:
            self.assertIsInstance(request, GatewayRequest)
            render_messages(request.messages)


class DoorTests(SynchronousTestCase):
    """L{MessagesDoor.read}, L{MessagesDoor.read_count}: the session."""

    def test_user_id_names_the_session(self) -> None:
        """metadata.user_id names the session when no header does."""
        body = encode({"max_tokens": 1, "messages": [USER], "metadata": {"user_id": " s1 "}})
        request = MessagesDoor().read(body, no_headers, lambda: "anon")
        self.assertEqual((request.session.id, request.session.anonymous), ("s1", False))

    def test_header_first(self) -> None:
        """Claude Code's session header comes before the body's id."""
        body = encode({"max_tokens": 1, "messages": [USER], "metadata": {"user_id": "s1"}})
        lookup = headers({b"x-claude-code-session-id": b"cc-7"})
        self.assertEqual(MessagesDoor().read(body, lookup, lambda: "anon").session.id, "cc-7")

    def test_anonymous(self) -> None:
        """Without an id the connection's anonymous one is used."""
        body = encode({"max_tokens": 1, "messages": [USER]})
        session = MessagesDoor().read(body, no_headers, lambda: "anon").session
        self.assertEqual((session.id, session.anonymous), ("anon", True))

    def test_bad_user_id(self) -> None:
        """A user_id that is not a string is a 400 naming it."""
        body = encode({"max_tokens": 1, "messages": [USER], "metadata": {"user_id": 3}})
        error = self.assertRaises(GatewayError, MessagesDoor().read, body, no_headers, str)
        self.assertIn("metadata.user_id", error.message)

    def test_read_count(self) -> None:
        """count_tokens reads without max_tokens; its session is the headers'."""
        body = encode({"model": "tiny", "messages": [USER]})
        request = MessagesDoor().read_count(body, headers({b"x-session-id": b"s"}))
        self.assertEqual((request.max_tokens, request.session.id), (None, "s"))
        self.assertEqual(MessagesDoor().read_count(body, no_headers).session.id, "")


def completion(
    content: str | None = "Hello.",
    reasoning: str | None = "Hmm.",
    calls: tuple[ToolCall, ...] = (),
    finish: FinishReason = FinishReason.STOP,
) -> Completion:
    """A finished answer with L{TIMINGS}."""
    return Completion("c", content, reasoning, calls, finish, TIMINGS)


class BodyTests(SynchronousTestCase):
    """L{MessagesAnswer.body}: the C{message} object."""

    def body(self, done: Completion) -> dict[str, Any]:
        """The answer's body, checked by the SDK's own model."""
        body = MessagesDoor().answer(parse(), "tiny", 0).body(done)
        assert isinstance(body, dict)
        anthropic.types.Message.model_validate(body)
        return body

    def test_text_and_thinking(self) -> None:
        """A thinking block (signature ""), a text block, end_turn, usage apart."""
        body = self.body(completion())
        self.assertTrue(body["id"].startswith("msg_"))
        self.assertEqual(
            {k: v for k, v in body.items() if k != "id"},
            {
                "type": "message",
                "role": "assistant",
                "model": "tiny",
                "content": [
                    {"type": "thinking", "thinking": "Hmm.", "signature": ""},
                    {"type": "text", "text": "Hello."},
                ],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {
                    "input_tokens": 10,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 90,
                    "output_tokens": 7,
                },
            },
        )

    def test_tool_use(self) -> None:
        """Tool calls are tool_use blocks, their input parsed; stop_reason tool_use."""
        calls = (ToolCall("a", "read", '{"path": "x"}'), ToolCall("b", "list", ""))
        body = self.body(completion(None, None, calls, FinishReason.TOOL_CALLS))
        self.assertEqual(
            body["content"],
            [
                {"type": "tool_use", "id": "a", "name": "read", "input": {"path": "x"}},
                {"type": "tool_use", "id": "b", "name": "list", "input": {}},
            ],
        )
        self.assertEqual(body["stop_reason"], "tool_use")

    def test_stop_reasons(self) -> None:
        """length is max_tokens."""
        self.assertEqual(
            self.body(completion(finish=FinishReason.LENGTH))["stop_reason"], "max_tokens"
        )
        self.assertEqual(self.body(completion(None, None))["content"], [])

    def test_tool_input(self) -> None:
        """Arguments that are not a JSON object are kept as text."""
        self.assertEqual(tool_input('{"a": [1]}'), {"a": [1]})
        self.assertEqual(tool_input("  "), {})
        self.assertEqual(tool_input("{oops"), {"_raw_arguments": "{oops"})
        self.assertEqual(tool_input("[1]"), {"_raw_arguments": "[1]"})


def events(raw: bytes) -> list[tuple[str, Any]]:
    """The named events of a stream, each with its decoded data (comments left out)."""
    out = []
    for frame in raw.decode().split("\n\n"):
        lines = [line for line in frame.split("\n") if line and not line.startswith(":")]
        if lines:
            name = lines[0].removeprefix("event: ")
            out.append((name, json.loads(lines[1].removeprefix("data: "))))
    return out


def stream_bytes(pieces: Iterable[ChatEvent], done: Completion) -> bytes:
    """A whole stream of C{pieces} ending with C{done}."""
    answer = MessagesDoor().answer(parse(stream=True), "tiny", 0)
    return answer.opening() + b"".join(answer.during(e) for e in pieces) + answer.closing(done)


def sdk_client(status: int, body: bytes, content_type: str) -> anthropic.Anthropic:
    """An SDK client whose every request is answered with C{body}."""

    def handle(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(status, headers={"content-type": content_type}, content=body)

    transport = httpx2.MockTransport(handle)
    return anthropic.Anthropic(
        api_key="token",
        base_url="http://loopd",
        max_retries=0,
        http_client=httpx2.Client(transport=transport),
    )


def sdk_stream(raw: bytes) -> anthropic.types.Message:
    """What the SDK's own stream accumulation makes of C{raw}."""
    client = sdk_client(200, raw, "text/event-stream")
    with client.messages.stream(model="tiny", max_tokens=100, messages=[USER]) as stream:  # type: ignore[list-item]
        return stream.get_final_message()


PIECES: tuple[ChatEvent, ...] = (
    Queued(1),
    Waiting(True),
    Progress(100, 90, 100),
    Reasoning("Let me "),
    Reasoning("think."),
    ThinkingCapped(2),
    Content("Hi "),
    Content(""),
    Content("there."),
    ToolCallDelta(0, "call_a", "read", ""),
    ToolCallDelta(0, None, None, '{"path": '),
    ToolCallDelta(0, None, None, '"x"}'),
    Retrying(1, 10, "boom"),
    ToolCallDelta(1, "call_b", None, "{}"),
    ToolCallDelta(1, None, "list", ""),
)
DONE = completion(
    "Hi there.",
    "Let me think.",
    (ToolCall("call_a", "read", '{"path": "x"}'), ToolCall("call_b", "list", "{}")),
    FinishReason.TOOL_CALLS,
)


class StreamTests(SynchronousTestCase):
    """The event stream, event by event and as the SDK accumulates it."""

    def test_sdk_accumulates_the_same_message(self) -> None:
        """The SDK's MessageStream over the stream gives the non-streaming body's message."""
        message = sdk_stream(stream_bytes(PIECES, DONE))
        body = MessagesDoor().answer(parse(), "tiny", 0).body(DONE)
        assert isinstance(body, dict)
        self.assertEqual([block.to_dict() for block in message.content], body["content"])
        self.assertEqual((message.stop_reason, message.stop_sequence), ("tool_use", None))
        self.assertEqual(message.usage.to_dict(), body["usage"])
        self.assertEqual(message.model, "tiny")

    def test_events(self) -> None:
        """
        Each event, in order: the waits' pings, the message's start at the first progress
        event, blocks that start and stop as the kind of piece changes.
        """
        raw = stream_bytes(PIECES, DONE)
        names = [name for name, _ in events(raw)]
        self.assertEqual(
            names,
            [
                "ping",
                "ping",
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ],
        )
        for name, data in events(raw):
            self.assertEqual(data["type"], name)
        parsed = events(raw)
        self.assertEqual(
            parsed[3][1],
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""},
            },
        )
        self.assertEqual(parsed[6][1]["delta"], {"type": "signature_delta", "signature": ""})
        self.assertEqual(
            parsed[12][1]["content_block"],
            {"type": "tool_use", "id": "call_a", "name": "read", "input": {}},
        )
        self.assertEqual(
            parsed[13][1],
            {
                "type": "content_block_delta",
                "index": 2,
                "delta": {"type": "input_json_delta", "partial_json": '{"path": '},
            },
        )
        self.assertEqual(
            parsed[-2][1],
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {
                    "input_tokens": 10,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 90,
                    "output_tokens": 7,
                },
            },
        )
        start = parsed[2][1]["message"]
        self.assertEqual((start["content"], start["stop_reason"]), ([], None))
        self.assertEqual(
            start["usage"],
            {
                "input_tokens": 10,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 90,
                "output_tokens": 0,
            },
        )

    def test_loopd_events_are_comments(self) -> None:
        """loopd's own events are comment lines; queued and waiting also send a ping."""
        answer = MessagesDoor().answer(parse(stream=True), "tiny", 0)
        self.assertEqual(
            answer.during(Queued(2)),
            b': loopd {"event":"queued","ahead":2}\n\nevent: ping\ndata: {"type":"ping"}\n\n',
        )
        started = answer.during(Progress(3, 1, 2))
        self.assertTrue(started.startswith(b"event: message_start\n"))
        self.assertTrue(
            started.endswith(b': loopd {"event":"progress","total":3,"cache":1,"processed":2}\n\n')
        )
        self.assertEqual(
            answer.during(Progress(3, 1, 3)),
            b': loopd {"event":"progress","total":3,"cache":1,"processed":3}\n\n',
        )
        self.assertEqual(answer.during(Content("")), b"")

    def test_start_without_progress(self) -> None:
        """
        An endpoint that reports no progress: the message starts, its usage zero, before
        the first piece; or before the end when there is no piece at all.
        """
        answer = MessagesDoor().answer(parse(stream=True), "tiny", 0)
        self.assertEqual(answer.opening(), b"")
        first = events(answer.during(Content("Hi")))
        self.assertEqual([name for name, _ in first][:2], ["message_start", "content_block_start"])
        self.assertEqual(first[0][1]["message"]["usage"]["input_tokens"], 0)
        empty = MessagesDoor().answer(parse(stream=True), "tiny", 0)
        names = [name for name, _ in events(empty.closing(completion(None, None)))]
        self.assertEqual(names, ["message_start", "message_delta", "message_stop"])

    def test_frames(self) -> None:
        """Every event is C{event: <type>}, one C{data:} line of JSON, a blank line."""
        answer = MessagesDoor().answer(parse(stream=True), "tiny", 0)
        self.assertEqual(
            answer.closing(completion(None, None))[-40:],
            b'event: message_stop\ndata: {"type":"message_stop"}\n\n'[-40:],
        )
        frame = answer.during(Content("a\nb"))
        self.assertEqual(frame.count(b"\ndata: "), 2)
        self.assertTrue(frame.endswith(b'"text":"a\\nb"}}\n\n'))

    def test_empty_answer(self) -> None:
        """An answer with nothing in it still starts and ends as the SDK expects."""
        message = sdk_stream(stream_bytes((), completion(None, None, finish=FinishReason.LENGTH)))
        self.assertEqual((message.content, message.stop_reason), ([], "max_tokens"))

    def test_stream_error(self) -> None:
        """A failure after the stream opened is an error event, which the SDK raises."""
        answer = MessagesDoor().answer(parse(stream=True), "tiny", 0)
        failure = GatewayError(502, "the model server failed", "upstream_error", "protocol")
        raw = answer.opening() + answer.during(Content("Hi")) + answer.stream_error(failure)
        self.assertEqual(
            events(raw)[-1],
            (
                "error",
                {
                    "type": "error",
                    "error": {"type": "api_error", "message": "the model server failed"},
                },
            ),
        )
        error = self.assertRaises(anthropic.APIStatusError, sdk_stream, raw)
        self.assertIn("the model server failed", str(error))


class ErrorTests(SynchronousTestCase):
    """L{anthropic_error}: Anthropic's error shape and status."""

    def test_types(self) -> None:
        """Each status has Anthropic's type; Busy is 529 overloaded."""
        cases = [
            (GatewayError(400, "m", "invalid_request_error", "x"), 400, "invalid_request_error"),
            (GatewayError(401, "m", "authentication_error", "x"), 401, "authentication_error"),
            (GatewayError(403, "m", "x", "x"), 403, "permission_error"),
            (
                GatewayError(404, "m", "invalid_request_error", "model_not_found"),
                404,
                "not_found_error",
            ),
            (GatewayError(405, "m", "invalid_request_error", "x"), 405, "invalid_request_error"),
            (GatewayError(413, "m", "invalid_request_error", "x"), 413, "request_too_large"),
            (GatewayError(429, "m", "rate_limit_error", "busy"), 529, "overloaded_error"),
            (GatewayError(429, "m", "rate_limit_error", "http"), 429, "rate_limit_error"),
            (GatewayError(500, "m", "server_error", "internal_error"), 500, "api_error"),
            (GatewayError(502, "m", "upstream_error", "connect"), 502, "api_error"),
            (
                GatewayError(503, "m", "server_error", "endpoint_unavailable"),
                503,
                "overloaded_error",
            ),
            (GatewayError(504, "m", "timeout", "stalled"), 504, "timeout_error"),
        ]
        for error, status, kind in cases:
            self.assertEqual(
                anthropic_error(error),
                (status, {"type": "error", "error": {"type": kind, "message": "m"}}),
            )
            self.assertEqual(MessagesDoor().error(error), anthropic_error(error))

    def test_prompt_too_long(self) -> None:
        """A prompt over the context says so as Anthropic does, for Claude Code's compaction."""
        error = GatewayError(
            400, "the request exceeds the context", "invalid_request_error", "context_exceeded"
        )
        _, body = anthropic_error(error)
        self.assertEqual(
            body["error"]["message"], "prompt is too long: the request exceeds the context"
        )

    def test_sdk_reads_them(self) -> None:
        """The SDK raises its own error class for each: 529 is OverloadedError."""
        for error, kind in (
            (GatewayError(429, "full", "rate_limit_error", "busy"), anthropic.OverloadedError),
            (
                GatewayError(401, "no", "authentication_error", "token"),
                anthropic.AuthenticationError,
            ),
            (GatewayError(400, "bad", "invalid_request_error", "x"), anthropic.BadRequestError),
        ):
            status, body = anthropic_error(error)
            client = sdk_client(status, json.dumps(body).encode(), "application/json")
            raised = self.assertRaises(
                kind, client.messages.create, model="tiny", max_tokens=1, messages=[USER]
            )
            self.assertEqual(raised.body, body)


class GatewayTests(SynchronousTestCase):
    """The door behind the gateway's C{/v1/messages} route, over a fake llama-server."""

    def post(self, document: object, *headers: str) -> Response:
        """POST C{document} to C{/v1/messages?beta=true}; the response once all is said."""
        connection = self.harness.connect()
        lines = ["Content-Type: application/json", "anthropic-version: 2023-06-01", *headers]
        connection.request("POST", "/v1/messages?beta=true", encode(document), lines)
        self.harness.advance(1)
        return connection.response()

    def setUp(self) -> None:
        """A gateway over one fake llama-server, C{tiny}."""
        self.harness = GatewayHarness()

    def test_stream(self) -> None:
        """A streamed answer as the SDK reads it; the request's fields reach the server."""
        self.harness.fake.script(
            "POST", CHAT, answer({"reasoning_content": "Hm."}, {"content": "Hi"})
        )
        document = {
            "model": "tiny",
            "max_tokens": 50,
            "top_k": 5,
            "stream": True,
            "system": "x-anthropic-billing-header: cch=1;\nBe brief.",
            "messages": [USER],
            "thinking": {"type": "enabled", "budget_tokens": 64},
        }
        response = self.post(document, "anthropic-beta: interleaved-thinking-2025-05-14")
        self.assertEqual(response.status, 200)
        message = sdk_stream(response.body)
        self.assertEqual(
            [block.to_dict() for block in message.content],
            [
                {"type": "thinking", "thinking": "Hm.", "signature": ""},
                {"type": "text", "text": "Hi"},
            ],
        )
        [sent] = self.harness.fake.requests_to("POST", CHAT)
        assert sent.json is not None
        self.assertEqual(sent.json["messages"][0], {"role": "system", "content": "Be brief."})
        self.assertEqual((sent.json["top_k"], sent.json["max_tokens"]), (5, 50))

    def test_message(self) -> None:
        """A non-streaming answer is the message object."""
        self.harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
        response = self.post({"model": "tiny", "max_tokens": 50, "messages": [USER]})
        body = response.json()
        self.assertEqual((response.status, body["type"]), (200, "message"))
        self.assertEqual(body["content"], [{"type": "text", "text": "Hello"}])

    def test_dropped_header(self) -> None:
        """
        A request with server tools is answered with them named in C{X-Loopd-Dropped} and
        counted in C{loopd_dropped_tools_total}; the server sees only the custom tools.
        """
        self.harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
        tools = [{"type": "web_search_20250305", "name": "web_search"}, TOOL]
        document = {"model": "tiny", "max_tokens": 50, "messages": [USER], "tools": tools}
        response = self.post(document)
        self.assertEqual(response.status, 200)
        self.assertEqual(response.headers["x-loopd-dropped"], "web_search_20250305")
        [sent] = self.harness.fake.requests_to("POST", CHAT)
        assert sent.json is not None
        self.assertEqual([t["function"]["name"] for t in sent.json["tools"]], ["read"])
        key = frozenset({("door", "messages"), ("tool", "web_search_20250305")})
        self.assertEqual(self.harness.scrape()[("loopd_dropped_tools_total", key)], 1)
        plain = self.post({"model": "tiny", "max_tokens": 50, "messages": [USER]})
        self.assertNotIn("x-loopd-dropped", plain.headers)

    def test_hosted_tools_refused(self) -> None:
        """With C{[doors] hosted_tools = "refuse"} such a request is a 400, nothing sent."""
        self.harness = GatewayHarness(make_config(doors=Doors(hosted_tools="refuse")))
        tools = [{"type": "web_fetch_20250910", "name": "web_fetch"}]
        response = self.post({"model": "tiny", "max_tokens": 5, "messages": [USER], "tools": tools})
        self.assertEqual(response.status, 400)
        self.assertIn("tools[0].type: web_fetch_20250910", response.json()["error"]["message"])
        self.assertEqual(self.harness.fake.requests, [])

    def test_refusal(self) -> None:
        """A refused request is a 400 in Anthropic's shape, and nothing reaches the server."""
        response = self.post({"model": "tiny", "messages": [USER]})
        self.assertEqual(response.status, 400)
        self.assertEqual(
            response.json(),
            {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": "max_tokens: required: a positive integer",
                },
            },
        )
        self.assertEqual(self.harness.fake.requests, [])
