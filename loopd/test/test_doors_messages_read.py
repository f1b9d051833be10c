"""
Tests for L{loopd.gateway.doors.messages}: Anthropic Messages bodies in (every bad input a 400
naming the field), the C{message} object, the event stream as the C{anthropic} SDK parses
it, and errors in Anthropic's shape.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.messages_read import TOOL_ERROR_PREFIX, parse_messages, without_attribution
from loopd.gateway.errors import GatewayError
from loopd.gateway.request import GatewayRequest
from loopd.llama.request import render_messages
from loopd.llama.types import (
    Assistant,
    System,
    Tool,
    ToolCall,
    ToolSchema,
    User,
)

USER = {"role": "user", "content": "Hi"}
TOOL = {"name": "read", "description": "Read a file.", "input_schema": {"type": "object"}}
PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}


def encode(document: object) -> bytes:
    """A JSON request body."""
    return json.dumps(document).encode("utf-8")


def parse(**fields: Any) -> GatewayRequest:
    """Parse a body of one user message and C{max_tokens} 100, plus C{fields}."""
    return parse_messages(encode({"max_tokens": 100, "messages": [USER], **fields}))


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
