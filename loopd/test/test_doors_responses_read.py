"""
Tests for L{loopd.gateway.doors.responses}: the reader against the issue's list, and the writer
against the C{openai} SDK's own models and stream accumulator.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from loopd.gateway.doors.responses import ResponsesDoor
from loopd.gateway.doors.responses_read import EFFORT_CAPS
from loopd.gateway.doors.responses_store import StoredResponse
from loopd.gateway.errors import GatewayError
from loopd.gateway.request import GatewayRequest, SessionRef, ThinkingSwitch
from loopd.llama.types import (
    Assistant,
    FinishReason,
    System,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolSchema,
    User,
)
from loopd.test.support.responses_door import DoorCase, completion, events_of


class ReadInputTests(DoorCase):
    """C{input}, C{instructions} and C{previous_response_id}."""

    def test_string_input(self) -> None:
        """A string is one user message; the model is kept."""
        request = self.read({"model": "m", "input": "hi"})
        self.assertEqual((request.model, request.messages), ("m", (User("hi"),)))
        self.assertFalse(request.stream)

    def test_instructions_first(self) -> None:
        """C{instructions} is a system message before the input."""
        request = self.read({"instructions": "be brief", "input": "hi"})
        self.assertEqual(request.messages, (System("be brief"), User("hi")))

    def test_message_items(self) -> None:
        """Message items by role, content as a string or text parts; type may be absent."""
        request = self.read(
            {
                "input": [
                    {"type": "message", "role": "developer", "content": "dev"},
                    {"role": "system", "content": [{"type": "input_text", "text": "sys"}]},
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "a"},
                            {"type": "input_text", "text": "b"},
                        ],
                    },
                    {
                        "type": "message",
                        "role": "assistant",
                        "id": "msg_1",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": "ok", "annotations": []}],
                    },
                ]
            }
        )
        self.assertEqual(
            request.messages, (System("dev"), System("sys"), User("ab"), Assistant("ok"))
        )

    def test_image_part(self) -> None:
        """An image part stays on the user turn as a chat-completions C{image_url} part."""
        request = self.read(
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "what is it?"},
                            {"type": "input_image", "image_url": "data:x", "detail": "low"},
                        ],
                    }
                ]
            }
        )
        parts = (
            {"type": "text", "text": "what is it?"},
            {"type": "image_url", "image_url": {"url": "data:x", "detail": "low"}},
        )
        self.assertEqual(request.messages, (User("what is it?", parts),))
        self.assertEqual(request.modalities, frozenset({"vision"}))

    def test_bad_parts(self) -> None:
        """Refusals, files, file ids and images outside a user turn are 400s naming the path."""
        user = {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}
        self.refused(
            {"input": [user]}, "unsupported_content", "input[0].content[0].type", "refusal"
        )
        user = {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}
        self.refused({"input": [user]}, "unsupported_content", "input[0].content[0].type")
        image = {"type": "input_image", "file_id": "file_1"}
        self.refused(
            {"input": [{"role": "user", "content": [image]}]},
            "unsupported_content",
            "input[0].content[0].file_id",
        )
        image = {"type": "input_image", "image_url": "data:x"}
        self.refused(
            {"input": [{"role": "assistant", "content": [image]}]},
            "unsupported_content",
            "input[0].content[0].type",
            "input_image",
        )
        self.refused(
            {"input": [{"role": "tool", "content": "x"}]}, "invalid_input", "input[0].role"
        )

    def test_function_calls_join_the_assistant_turn(self) -> None:
        """An assistant message and the function calls after it are one assistant turn."""
        request = self.read(
            {
                "input": [
                    {"role": "user", "content": "go"},
                    {"role": "assistant", "content": "calling"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "[]"},
                    {"type": "function_call_output", "call_id": "c1", "output": "one"},
                    {
                        "type": "function_call_output",
                        "call_id": "c2",
                        "output": [{"type": "input_text", "text": "two"}],
                    },
                    {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
                ]
            }
        )
        self.assertEqual(
            request.messages,
            (
                User("go"),
                Assistant("calling", None, (ToolCall("c1", "f", "{}"), ToolCall("c2", "g", "[]"))),
                Tool("c1", "one"),
                Tool("c2", "two"),
                Assistant(None, None, (ToolCall("c3", "f", "{}"),)),
            ),
        )

    def test_function_call_output_parts(self) -> None:
        """A function call's output takes text parts only."""
        output = {
            "type": "function_call_output",
            "call_id": "c",
            "output": [{"type": "input_image", "image_url": "data:x"}],
        }
        self.refused({"input": [output]}, "unsupported_content", "input[0].output[0].type")
        self.refused(
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "invalid_input",
            "input[0].call_id",
        )

    def test_reasoning_items(self) -> None:
        """
        A reasoning item's content (else summary) is the next assistant turn's reasoning;
        with no assistant turn after it, it is one of its own.
        """
        request = self.read(
            {
                "input": [
                    {"role": "user", "content": "q"},
                    {
                        "type": "reasoning",
                        "id": "rs_1",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": "hmm"}],
                        "encrypted_content": "opaque",
                    },
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c", "output": "r"},
                    {
                        "type": "reasoning",
                        "summary": [{"type": "summary_text", "text": "sum"}],
                    },
                    {"role": "assistant", "content": "done"},
                    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "late"}]},
                ]
            }
        )
        self.assertEqual(
            request.messages,
            (
                User("q"),
                Assistant(None, "hmm", (ToolCall("c", "f", "{}"),)),
                Tool("c", "r"),
                Assistant("done", "sum"),
                Assistant(None, "late"),
            ),
        )

    def test_bad_items(self) -> None:
        """Other item types and malformed items are 400s naming the item."""
        self.refused(
            {"input": [{"type": "item_reference", "id": "x"}]},
            "invalid_input",
            "input[0].type",
            "item_reference",
        )
        self.refused({"input": [{"content": "x"}]}, "invalid_input", "input[0].type")
        self.refused({"input": [3]}, "invalid_input", "input[0]")
        self.refused({"input": []}, "invalid_input", "input")
        reasoning = {"type": "reasoning", "summary": [{"type": "reasoning_text", "text": "x"}]}
        self.refused({"input": [reasoning]}, "unsupported_content", "input[0].summary[0].type")

    def test_missing_input(self) -> None:
        """A body without input (or with instructions only) is a 400."""
        self.refused({"model": "m"}, "missing_input", "input")
        self.refused(
            {"instructions": "x", "input": [{"role": "system", "content": "y"}]}, "missing_input"
        )

    def test_bad_body(self) -> None:
        """Bad JSON and a body that is not an object are 400s."""
        self.refused(b"{", "invalid_json", "body")
        self.refused(b"[]", "not_an_object", "body")

    def test_previous_response(self) -> None:
        """
        C{previous_response_id} puts the stored conversation and its answer before the
        input; the stored instructions are not carried over.
        """
        first = self.read({"instructions": "old", "input": "one"})
        answer = self.door.answer(first, "m", 1)
        answer.body(completion("first answer"))
        request = self.read(
            {"instructions": "new", "previous_response_id": answer.response_id, "input": "two"}
        )
        self.assertEqual(
            request.messages,
            (System("new"), User("one"), Assistant("first answer"), User("two")),
        )
        alone = self.read({"previous_response_id": answer.response_id})
        self.assertEqual(alone.messages, (User("one"), Assistant("first answer")))

    def test_unknown_previous_response(self) -> None:
        """An unknown or expired id is a 400 that says so."""
        self.refused(
            {"previous_response_id": "resp_nope", "input": "x"},
            "previous_response_not_found",
            "previous_response_id",
            "resp_nope",
        )
        self.store.put("resp_old", StoredResponse((User("a"),), Assistant("b")))
        self.clock.advance(3601)
        self.refused(
            {"previous_response_id": "resp_old", "input": "x"}, "previous_response_not_found"
        )

    def test_store_false_is_not_kept(self) -> None:
        """A response whose request said C{store: false} is not stored."""
        request = self.read({"input": "x", "store": False})
        answer = self.door.answer(request, "m", 1)
        self.assertFalse(answer.body(completion())["store"])  # type: ignore[index]
        self.assertEqual(len(self.store), 0)
        self.refused(
            {"previous_response_id": answer.response_id, "input": "y"},
            "previous_response_not_found",
        )


class ReadParameterTests(DoorCase):
    """Tools, sampling, reasoning, text format and the accepted fields."""

    def test_tools(self) -> None:
        """Function tools with their description, parameters and strict."""
        request = self.read(
            {
                "input": "x",
                "tools": [
                    {
                        "type": "function",
                        "name": "f",
                        "description": "does f",
                        "parameters": {"type": "object", "properties": {}},
                        "strict": True,
                    },
                    {"type": "function", "name": "g", "parameters": None},
                ],
            }
        )
        self.assertEqual(
            request.tools,
            (
                ToolSchema("f", "does f", {"type": "object", "properties": {}}),
                ToolSchema("g", "", {"type": "object"}),
            ),
        )

    def test_other_tool_types(self) -> None:
        """Custom and unknown tools are 400s naming them (hosted ones: HostedToolTests)."""
        for kind in ("custom", "local_shell", "apply_patch"):
            self.refused(
                {"input": "x", "tools": [{"type": kind, "name": "t"}]},
                "invalid_tools",
                "tools[0].type",
                kind,
            )
        function = {"type": "function", "name": "f"}
        self.refused(
            {"input": "x", "tools": [function, function]}, "invalid_tools", "tools[1].name"
        )
        self.refused(
            {"input": "x", "tools": [{**function, "defer_loading": True}]},
            "unsupported_parameter",
            "tools[0].defer_loading",
        )

    def test_tool_choice(self) -> None:
        """The strings pass; a function names one tool, which becomes C{required}."""
        tools = [{"type": "function", "name": "f"}, {"type": "function", "name": "g"}]
        for choice in ("auto", "none", "required"):
            request = self.read({"input": "x", "tools": tools, "tool_choice": choice})
            self.assertEqual(request.tool_choice, choice)
        request = self.read(
            {"input": "x", "tools": tools, "tool_choice": {"type": "function", "name": "g"}}
        )
        self.assertEqual((request.tool_choice, request.tools), ("required", (ToolSchema("g", ""),)))
        self.refused(
            {"input": "x", "tools": tools, "tool_choice": {"type": "function", "name": "h"}},
            "invalid_parameter",
            "tool_choice.name",
        )
        self.refused(
            {"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
            "unsupported_parameter",
            "tool_choice.type",
            "allowed_tools",
        )
        self.refused({"input": "x", "tool_choice": "any"}, "invalid_parameter", "tool_choice")

    def test_sampling(self) -> None:
        """C{max_output_tokens}, C{temperature} and C{top_p}, checked."""
        request = self.read(
            {
                "input": "x",
                "max_output_tokens": 100.0,
                "temperature": 0.5,
                "top_p": 1,
                "stream": True,
            }
        )
        self.assertEqual(
            (request.max_tokens, request.temperature, request.top_p, request.stream),
            (100, 0.5, 1.0, True),
        )
        self.refused(
            {"input": "x", "max_output_tokens": 0}, "invalid_parameter", "max_output_tokens"
        )
        self.refused({"input": "x", "temperature": 3}, "invalid_parameter", "temperature")
        self.refused({"input": "x", "top_p": True}, "invalid_parameter", "top_p")
        self.refused({"input": "x", "stream": "yes"}, "invalid_parameter", "stream")

    def test_reasoning_effort(self) -> None:
        """C{none} and C{minimal} turn thinking off; the others map onto L{EFFORT_CAPS}."""
        self.assertEqual(
            dict(EFFORT_CAPS),
            {"low": 1024, "medium": 4096, "high": None, "xhigh": None, "max": None},
        )
        for effort in ("none", "minimal"):
            request = self.read({"input": "x", "reasoning": {"effort": effort}})
            self.assertEqual(
                request.thinking_switches, (ThinkingSwitch("reasoning_effort", False),)
            )
            self.assertFalse(request.thinking)
        for effort, cap in EFFORT_CAPS.items():
            request = self.read({"input": "x", "reasoning": {"effort": effort, "summary": "auto"}})
            self.assertEqual(request.thinking_switches, (ThinkingSwitch("reasoning_effort", True),))
            self.assertEqual((request.thinking, request.thinking_cap), (True, cap))
        request = self.read({"input": "x", "reasoning": {"summary": "detailed"}})
        self.assertEqual((request.thinking_switches, request.thinking_cap), ((), None))
        self.refused(
            {"input": "x", "reasoning": {"effort": "huge"}}, "invalid_parameter", "reasoning.effort"
        )
        self.refused(
            {"input": "x", "reasoning": {"summary": "long"}},
            "invalid_parameter",
            "reasoning.summary",
        )
        self.refused(
            {"input": "x", "reasoning": {"budget": 1}}, "unsupported_parameter", "reasoning.budget"
        )

    def test_text_format(self) -> None:
        """JSON mode and structured outputs become llama-server's C{response_format}."""
        self.assertEqual(self.read({"input": "x", "text": {"format": {"type": "text"}}}).fields, {})
        request = self.read({"input": "x", "text": {"format": {"type": "json_object"}}})
        self.assertEqual(request.fields, {"response_format": {"type": "json_object"}})
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        request = self.read(
            {
                "input": "x",
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "s",
                        "schema": schema,
                        "strict": True,
                    },
                    "verbosity": "medium",
                },
            }
        )
        self.assertEqual(
            request.fields,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": schema, "strict": True},
                }
            },
        )
        self.refused(
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}},
            "invalid_parameter",
            "text.format.schema",
        )
        self.refused(
            {"input": "x", "text": {"format": {"type": "grammar"}}},
            "invalid_parameter",
            "text.format.type",
        )
        self.refused(
            {"input": "x", "text": {"verbosity": "low"}}, "unsupported_parameter", "text.verbosity"
        )

    def test_parallel_tool_calls(self) -> None:
        """C{true} is the default; C{false} goes to the server."""
        self.assertEqual(self.read({"input": "x", "parallel_tool_calls": True}).fields, {})
        request = self.read({"input": "x", "parallel_tool_calls": False})
        self.assertEqual(request.fields, {"parallel_tool_calls": False})

    def test_accepted_fields(self) -> None:
        """The fields Codex and the SDK send are accepted and kept in C{extras}."""
        body = {
            "input": "x",
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "metadata": {"k": "v"},
            "user": "u",
            "safety_identifier": "s",
            "service_tier": "auto",
            "truncation": "disabled",
            "background": False,
            "stream_options": {"include_obfuscation": False},
            "prompt_cache_key": "pck",
            "client_metadata": {"thread_id": "t1", "x-codex-window-id": "t1:0"},
        }
        request = self.read(body)
        self.assertEqual(dict(request.extras), {k: v for k, v in body.items() if k != "input"})

    def test_client_metadata(self) -> None:
        """
        Codex CLI's C{client_metadata} (an object of its ids, on every request) is accepted
        whatever it holds, and neither echoed in the response nor part of the request the
        server gets: it is the client's bookkeeping.
        """
        for metadata in ({"turn_id": "u1", "thread_id": "t1"}, {}, {"n": 1}):
            request = self.read({"input": "x", "client_metadata": metadata})
            self.assertEqual(request.extras["client_metadata"], metadata)
            self.assertNotIn("client_metadata", request.fields)
            body = self.door.answer(request, "m", 1).body(completion())
            assert isinstance(body, dict)
            self.assertNotIn("client_metadata", body)

    def test_refused_fields(self) -> None:
        """Each field loopd cannot honour is a 400 naming it."""
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"include": ["message.output_text.logprobs"]}, "unsupported_parameter", "include[0]"),
            ({"include": "x"}, "invalid_parameter", "include"),
            ({"service_tier": "flex"}, "unsupported_parameter", "service_tier"),
            ({"truncation": "auto"}, "unsupported_parameter", "truncation"),
            ({"background": True}, "unsupported_parameter", "background"),
            ({"metadata": {"k": 1}}, "invalid_parameter", "metadata.k"),
            ({"user": 3}, "invalid_parameter", "user"),
            ({"store": "no"}, "invalid_parameter", "store"),
            ({"conversation": "conv_1"}, "unsupported_parameter", "conversation"),
            ({"prompt": {"id": "p"}}, "unsupported_parameter", "prompt"),
            ({"max_tool_calls": 3}, "unsupported_parameter", "max_tool_calls"),
            ({"top_logprobs": 2}, "unsupported_parameter", "top_logprobs"),
            ({"instructions": ["x"]}, "invalid_parameter", "instructions"),
            ({"model": 3}, "invalid_parameter", "model"),
            ({"stream_options": {"x": 1}}, "unsupported_parameter", "stream_options.x"),
        ]
        for extra, code, path in cases:
            self.refused({"input": "x", **extra}, code, path)
        self.assertEqual(self.read({"input": "x", "top_logprobs": None}).messages, (User("x"),))

    def test_session(self) -> None:
        """Codex's C{session-id} header names the session; else C{prompt_cache_key}."""
        request = self.read({"input": "x", "prompt_cache_key": "pck"}, {b"session-id": b"s1"})
        self.assertEqual(request.session, SessionRef("s1"))
        self.assertEqual(
            self.read({"input": "x", "prompt_cache_key": "pck"}).session, SessionRef("pck")
        )
        self.assertEqual(self.read({"input": "x"}).session, SessionRef("conn-1", anonymous=True))
        self.refused(
            {"input": "x", "prompt_cache_key": 3}, "invalid_session_id", "prompt_cache_key"
        )


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(["", "x", "function", "user"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "role",
                    "content",
                    "text",
                    "name",
                    "call_id",
                    "arguments",
                    "output",
                    "effort",
                    "format",
                    "summary",
                    "image_url",
                    "schema",
                ]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)


_bodies = st.fixed_dictionaries(
    {},
    optional={
        key: _json
        for key in (
            "model",
            "input",
            "instructions",
            "tools",
            "tool_choice",
            "reasoning",
            "text",
            "max_output_tokens",
            "temperature",
            "store",
            "include",
            "metadata",
            "previous_response_id",
        )
    },
)


#: The namespace tool Codex CLI 0.171 sends (captured; descriptions and schemas cut short).
CODEX_NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Spawn a sub-agent.",
            "strict": False,
            "parameters": {"type": "object", "properties": {"message": {"type": "string"}}},
        },
        {"type": "function", "name": "wait_agent", "strict": False, "parameters": {}},
    ],
}


class HostedToolTests(DoorCase):
    """Hosted tools (decision 43): left out and named, or refused when so configured."""

    def test_dropped(self) -> None:
        """
        Every hosted tool type is left out of what the model sees and named once in
        C{dropped}, in the order met; function tools stay.
        """
        hosted = [
            {"type": "web_search", "external_web_access": True},
            {"type": "file_search", "vector_store_ids": ["v"]},
            {"type": "function", "name": "f"},
            {"type": "code_interpreter", "container": {"type": "auto"}},
            {"type": "computer_use_preview", "display_width": 1},
            {"type": "image_generation"},
            {"type": "mcp", "server_label": "x"},
            {"type": "web_search"},
        ]
        request = self.read({"input": "x", "tools": hosted})
        self.assertEqual([tool.name for tool in request.tools], ["f"])
        self.assertEqual(
            request.dropped,
            (
                "web_search",
                "file_search",
                "code_interpreter",
                "computer_use_preview",
                "image_generation",
                "mcp",
            ),
        )
        self.assertEqual(self.read({"input": "x"}).dropped, ())

    def test_refused(self) -> None:
        """With C{hosted_tools = "refuse"} a hosted tool is a 400 naming it and the setting."""
        self.door = ResponsesDoor(self.store, "refuse")
        tools = [{"type": "function", "name": "f"}, {"type": "web_search"}]
        error = self.refused({"input": "x", "tools": tools}, "hosted_tool", "web_search")
        self.assertEqual(error.param, "tools[1].type")
        self.assertIn('hosted_tools = "refuse"', error.message)


class NamespaceToolTests(DoorCase):
    """Codex CLI's C{namespace} tools: flattened for the model, named as offered on the way out."""

    def test_flattened(self) -> None:
        """Each function tool of a namespace is offered as C{<namespace>__<name>}."""
        request = self.read(
            {"input": "x", "tools": [{"type": "function", "name": "f"}, CODEX_NAMESPACE]}
        )
        self.assertEqual(
            [tool.name for tool in request.tools],
            ["f", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait_agent"],
        )
        self.assertEqual(request.tools[1].description, "Spawn a sub-agent.")
        self.assertEqual(
            dict(request.tool_namespaces),
            {
                "multi_agent_v1__spawn_agent": ("multi_agent_v1", "spawn_agent"),
                "multi_agent_v1__wait_agent": ("multi_agent_v1", "wait_agent"),
            },
        )

    def test_bad_namespaces(self) -> None:
        """A namespace without a name or tools, a member that is not a function, a clash."""
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({**CODEX_NAMESPACE, "name": ""}, "invalid_tools", "tools[0].name"),
            ({**CODEX_NAMESPACE, "tools": None}, "invalid_tools", "tools[0].tools"),
            (
                {**CODEX_NAMESPACE, "tools": [{"type": "web_search"}]},
                "invalid_tools",
                "tools[0].tools[0].type",
            ),
            (
                {**CODEX_NAMESPACE, "defer_loading": True},
                "unsupported_parameter",
                "tools[0].defer_loading",
            ),
        ]
        for tool, code, path in cases:
            with self.subTest(path):
                self.refused({"input": "x", "tools": [tool]}, code, path)
        clash = {"type": "function", "name": "multi_agent_v1__wait_agent"}
        self.refused(
            {"input": "x", "tools": [clash, CODEX_NAMESPACE]}, "invalid_tools", "tools[1].name"
        )

    def test_history_call_reads_flat(self) -> None:
        """A C{function_call} input item with a C{namespace} is the flat name's call."""
        items = [
            {"role": "user", "content": "go"},
            {
                "type": "function_call",
                "call_id": "c1",
                "namespace": "multi_agent_v1",
                "name": "spawn_agent",
                "arguments": "{}",
            },
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ]
        request = self.read({"input": items, "tools": [CODEX_NAMESPACE]})
        self.assertEqual(
            request.messages[1],
            Assistant(None, None, (ToolCall("c1", "multi_agent_v1__spawn_agent", "{}"),)),
        )

    def test_answer_names_the_namespace(self) -> None:
        """The answer's call of a flat name is the tool's own name and its namespace."""
        request = self.read({"input": "x", "stream": True, "tools": [CODEX_NAMESPACE]})
        call = ToolCall("call_1", "multi_agent_v1__spawn_agent", "{}")
        done = completion(None, None, (call,), FinishReason.TOOL_CALLS)
        body = self.door.answer(request, "m", 1).body(done)
        assert isinstance(body, dict)
        [item] = body["output"]
        self.assertEqual(
            (item["name"], item["namespace"], item["call_id"]),
            ("spawn_agent", "multi_agent_v1", "call_1"),
        )
        answer = self.door.answer(request, "m", 1)
        data = answer.opening()
        data += answer.during(ToolCallDelta(0, "call_1", "multi_agent_v1__spawn_agent", "{}"))
        data += answer.closing(done)
        items = [e["item"] for e in events_of(data) if e["type"] == "response.output_item.done"]
        self.assertEqual(
            [(i["name"], i.get("namespace")) for i in items], [("spawn_agent", "multi_agent_v1")]
        )
        plain = self.read({"input": "x", "tools": [{"type": "function", "name": "f"}]})
        body = self.door.answer(plain, "m", 1).body(
            completion(None, None, (ToolCall("c", "f", "{}"),), FinishReason.TOOL_CALLS)
        )
        assert isinstance(body, dict)
        self.assertNotIn("namespace", body["output"][0])


class ReadPropertyTests(DoorCase):
    """Any body is a request or a 400, never another exception."""

    @settings(max_examples=300, deadline=None)
    @given(_bodies)
    def test_any_body(self, body: dict[str, Any]) -> None:
        """Reading gives a L{GatewayRequest} or raises a 400 L{GatewayError}."""
        try:
            request = self.read(body)
        except GatewayError as error:
            self.assertEqual(error.status, 400)
        else:
            self.assertIsInstance(request, GatewayRequest)
