"""Tests for L{loopd.llama.request}: messages, tools and the chat-completions body."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.config import SENT_FIELDS
from loopd.llama.request import (
    LLAMA_ONLY_FIELDS,
    PRIORITY_HEADER,
    affinity_headers,
    chat_body,
    encode,
    render_messages,
    render_tools,
)
from loopd.llama.types import (
    Assistant,
    ChatMessage,
    ChatRequest,
    System,
    Tool,
    ToolCall,
    ToolSchema,
    User,
)
from loopd.settings import Config, Endpoint, Sampling

LLAMA = Endpoint(name="local", socket="/tmp/ld-infer.sock", model="tiny")
OPENAI = Endpoint(name="remote", socket="/tmp/ld-remote.sock", kind="openai", model="gpt-x")
CONFIG = Config(endpoints=(LLAMA, OPENAI))
WEATHER = ToolSchema(
    name="get_weather",
    description="The weather in a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
MESSAGES: tuple[ChatMessage, ...] = (System("Be brief."), User("Hi"))
SAMPLING_FIELDS = frozenset(f.name for f in fields(Sampling))


def request(**changes: Any) -> ChatRequest:
    """A two-message request on slot 0, with the given fields changed."""
    values: dict[str, Any] = {"slot": 0, "messages": MESSAGES}
    values.update(changes)
    return ChatRequest(**values)


class RenderMessagesTests(SynchronousTestCase):
    """L{render_messages} gives the OpenAI shape of each message kind."""

    def test_system_and_user(self) -> None:
        """System and user messages become a role and their content."""
        self.assertEqual(
            render_messages([System("rules"), User("question")]),
            [{"role": "system", "content": "rules"}, {"role": "user", "content": "question"}],
        )

    def test_assistant_content_only(self) -> None:
        """An assistant message with only content has neither reasoning nor tool_calls."""
        self.assertEqual(
            render_messages([Assistant("answer")]),
            [{"role": "assistant", "content": "answer"}],
        )

    def test_assistant_without_content_is_null(self) -> None:
        """An assistant message whose content is None sends content null."""
        rendered = render_messages([Assistant(None)])
        self.assertEqual(rendered, [{"role": "assistant", "content": None}])
        self.assertIn(b'"content":null', encode({"m": rendered}))

    def test_assistant_reasoning_when_set(self) -> None:
        """reasoning_content is sent when it is set, even when it is empty."""
        self.assertEqual(
            render_messages([Assistant("a", "thought"), Assistant("b", "")]),
            [
                {"role": "assistant", "content": "a", "reasoning_content": "thought"},
                {"role": "assistant", "content": "b", "reasoning_content": ""},
            ],
        )

    def test_assistant_tool_calls(self) -> None:
        """Tool calls become function calls with their id, name and argument text."""
        calls = (ToolCall("c1", "get_weather", '{"city":"Oslo"}'), ToolCall("c2", "noop", "{}"))
        self.assertEqual(
            render_messages([Assistant(None, "plan", calls)]),
            [
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "plan",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                        },
                        {
                            "id": "c2",
                            "type": "function",
                            "function": {"name": "noop", "arguments": "{}"},
                        },
                    ],
                }
            ],
        )

    def test_tool_result(self) -> None:
        """A tool result carries the id of its call and its content."""
        self.assertEqual(
            render_messages([Tool("c1", "sunny")]),
            [{"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        )

    def test_order_kept(self) -> None:
        """Messages are rendered in the order given."""
        messages = [User("1"), Assistant("2"), User("3")]
        self.assertEqual([m["content"] for m in render_messages(messages)], ["1", "2", "3"])

    def test_unknown_kind(self) -> None:
        """A message of no known kind is a TypeError."""
        self.assertRaises(TypeError, render_messages, [ChatMessage()])


class RenderToolsTests(SynchronousTestCase):
    """L{render_tools} gives OpenAI function tools."""

    def test_tool(self) -> None:
        """A tool becomes a function with its name, description and parameters."""
        self.assertEqual(
            render_tools([WEATHER]),
            [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "The weather in a city.",
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                        },
                    },
                }
            ],
        )

    def test_default_parameters(self) -> None:
        """A tool without a schema offers an object of any shape."""
        rendered = render_tools([ToolSchema("noop", "Does nothing.")])
        self.assertEqual(rendered[0]["function"]["parameters"], {"type": "object"})


class ChatBodyTests(SynchronousTestCase):
    """L{chat_body} for a llama-server endpoint."""

    def test_whole_body(self) -> None:
        """Every field, in a fixed order, for a thinking request with tools."""
        body = chat_body(request(slot=1, tools=(WEATHER,)), CONFIG, LLAMA)
        self.assertEqual(
            body,
            {
                "model": "tiny",
                "messages": render_messages(MESSAGES),
                "tools": render_tools([WEATHER]),
                "stream": True,
                "max_tokens": 8192,
                "id_slot": 1,
                "cache_prompt": True,
                "return_progress": True,
                "timings_per_token": True,
                "chat_template_kwargs": {"enable_thinking": True},
                "reasoning_control": True,
            },
        )
        self.assertEqual(
            list(body),
            [
                "model",
                "messages",
                "tools",
                "stream",
                "max_tokens",
                "id_slot",
                "cache_prompt",
                "return_progress",
                "timings_per_token",
                "chat_template_kwargs",
                "reasoning_control",
            ],
        )

    def test_model_only_when_set(self) -> None:
        """An endpoint without a model id sends no model field."""
        endpoint = Endpoint(name="local", socket="/tmp/ld-infer.sock")
        self.assertNotIn("model", chat_body(request(), CONFIG, endpoint))

    def test_slot(self) -> None:
        """id_slot is the request's slot, -1 included."""
        self.assertEqual(chat_body(request(slot=3), CONFIG, LLAMA)["id_slot"], 3)
        self.assertEqual(chat_body(request(slot=-1), CONFIG, LLAMA)["id_slot"], -1)

    def test_tools_absent_when_none(self) -> None:
        """A request without tools sends no tools field."""
        self.assertNotIn("tools", chat_body(request(), CONFIG, LLAMA))

    def test_thinking_off(self) -> None:
        """Thinking off: enable_thinking false, reasoning_effort none, no control."""
        body = chat_body(request(thinking=False), CONFIG, LLAMA)
        self.assertEqual(body["chat_template_kwargs"], {"enable_thinking": False})
        self.assertEqual(body["reasoning_effort"], "none")
        self.assertNotIn("reasoning_control", body)

    def test_thinking_on(self) -> None:
        """Thinking on: enable_thinking true, reasoning control armed, no effort field."""
        body = chat_body(request(thinking=True), CONFIG, LLAMA)
        self.assertIs(body["chat_template_kwargs"]["enable_thinking"], True)
        self.assertIs(body["reasoning_control"], True)
        self.assertNotIn("reasoning_effort", body)

    def test_max_tokens_from_config(self) -> None:
        """max_tokens is the configured backstop."""
        config = Config(endpoints=(LLAMA,), max_tokens=123)
        self.assertEqual(chat_body(request(), config, LLAMA)["max_tokens"], 123)

    def test_sampling_unset(self) -> None:
        """With no sampling settings, no sampling field is sent."""
        body = chat_body(request(), CONFIG, LLAMA)
        self.assertEqual(set(body) & SAMPLING_FIELDS, set())

    def test_sampling_set(self) -> None:
        """The sampling settings that are set are sent under their own names, only those."""
        sampling = Sampling(temperature=0.0, top_k=40, seed=7, repeat_last_n=-1)
        config = Config(endpoints=(LLAMA,), sampling=sampling)
        body = chat_body(request(), config, LLAMA)
        sent = {key: body[key] for key in body if key in SAMPLING_FIELDS}
        self.assertEqual(sent, {"temperature": 0.0, "top_k": 40, "repeat_last_n": -1, "seed": 7})

    def test_not_streaming(self) -> None:
        """stream=False asks for a plain answer."""
        self.assertIs(chat_body(request(), CONFIG, LLAMA, stream=False)["stream"], False)

    def test_same_bytes_every_time(self) -> None:
        """Building a body twice gives the same bytes: a retry resends exactly."""
        req = request(tools=(WEATHER,))
        self.assertEqual(
            encode(chat_body(req, CONFIG, LLAMA)), encode(chat_body(req, CONFIG, LLAMA))
        )


class OverrideTests(SynchronousTestCase):
    """A request's own settings override the configured ones, within the config's ceiling."""

    def test_max_tokens_never_above_config(self) -> None:
        """A lower max_tokens is sent; a higher one is cut to the config's."""
        self.assertEqual(chat_body(request(max_tokens=100), CONFIG, LLAMA)["max_tokens"], 100)
        body = chat_body(request(max_tokens=10**6), CONFIG, LLAMA)
        self.assertEqual(body["max_tokens"], CONFIG.max_tokens)

    def test_sampling_overrides(self) -> None:
        """temperature and top_p from the request win over the config's sampling."""
        config = Config(endpoints=(LLAMA,), sampling=Sampling(temperature=0.7, top_p=0.9))
        body = chat_body(request(temperature=0.0, top_p=0.5), config, LLAMA)
        self.assertEqual((body["temperature"], body["top_p"]), (0.0, 0.5))

    def test_stop(self) -> None:
        """Stop strings are sent as a list, and only when there are some."""
        self.assertEqual(chat_body(request(stop=("END",)), CONFIG, LLAMA)["stop"], ["END"])
        self.assertNotIn("stop", chat_body(request(), CONFIG, LLAMA))

    def test_tool_choice_only_with_tools(self) -> None:
        """tool_choice goes with the tools it chooses among, never alone."""
        body = chat_body(request(tools=(WEATHER,), tool_choice="required"), CONFIG, LLAMA)
        self.assertEqual(body["tool_choice"], "required")
        self.assertNotIn("tool_choice", chat_body(request(tool_choice="required"), CONFIG, LLAMA))


class MediaTests(SynchronousTestCase):
    """A user turn with media parts is sent with its parts."""

    def test_parts_sent(self) -> None:
        """The parts replace the joined text as the content array."""
        parts = (
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        )
        rendered = render_messages([User("What is this?", parts)])
        self.assertEqual(rendered, [{"role": "user", "content": list(parts)}])


class OpenAIBodyTests(SynchronousTestCase):
    """L{chat_body} for an endpoint of kind openai (DESIGN §3.6)."""

    def test_whole_body(self) -> None:
        """No llama.cpp-only field; stream_options asks for usage."""
        config = Config(endpoints=(OPENAI,), sampling=Sampling(top_p=0.9))
        body = chat_body(request(slot=2, tools=(WEATHER,)), config, OPENAI)
        self.assertEqual(
            body,
            {
                "model": "gpt-x",
                "messages": render_messages(MESSAGES),
                "tools": render_tools([WEATHER]),
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": 8192,
                "top_p": 0.9,
            },
        )

    def test_no_llama_fields(self) -> None:
        """Thinking on or off, no field only llama.cpp's server knows is sent."""
        for thinking in (True, False):
            body = chat_body(request(thinking=thinking), CONFIG, OPENAI)
            self.assertEqual(set(body) & LLAMA_ONLY_FIELDS, set())

    def test_thinking_off(self) -> None:
        """Thinking off still sends reasoning_effort none, an OpenAI field."""
        body = chat_body(request(thinking=False), CONFIG, OPENAI)
        self.assertEqual(body["reasoning_effort"], "none")

    def test_template_thinking(self) -> None:
        """A request with template_thinking carries its thinking choice as a template kwarg."""
        for thinking in (True, False):
            body = chat_body(request(thinking=thinking, template_thinking=True), CONFIG, OPENAI)
            self.assertEqual(body["chat_template_kwargs"], {"enable_thinking": thinking})
            self.assertEqual(set(body) & LLAMA_ONLY_FIELDS, {"chat_template_kwargs"})

    def test_not_streaming(self) -> None:
        """Without streaming there are no stream options."""
        body = chat_body(request(), CONFIG, OPENAI, stream=False)
        self.assertIs(body["stream"], False)
        self.assertNotIn("stream_options", body)


class AffinityTests(SynchronousTestCase):
    """The session's id and tier for an openai endpoint's own affinity (decision 42)."""

    def test_engine_headers(self) -> None:
        """Each engine's header carries the session's id, as configured."""
        for header in ("x-smg-routing-key", "X-Dynamo-Session-ID", "x-session-token"):
            endpoint = replace(OPENAI, affinity_header=header)
            sent = affinity_headers(request(session="s-1"), endpoint)
            self.assertEqual(sent, {header: "s-1"})

    def test_priority(self) -> None:
        """With affinity_priority the tier goes as Dynamo's priority: parent 1, child 0."""
        endpoint = replace(OPENAI, affinity_header="X-Dynamo-Session-ID", affinity_priority=True)
        for tier, priority in (("parent", "1"), ("child", "0")):
            sent = affinity_headers(request(session="s", tier=tier), endpoint)
            self.assertEqual(sent, {"X-Dynamo-Session-ID": "s", PRIORITY_HEADER: priority})

    def test_no_session_no_id(self) -> None:
        """A request without a session sends no id, the priority still."""
        endpoint = replace(OPENAI, affinity_header="x-session-token", affinity_priority=True)
        self.assertEqual(affinity_headers(request(), endpoint), {PRIORITY_HEADER: "1"})
        field = replace(OPENAI, affinity_field="user")
        self.assertNotIn("user", chat_body(request(), CONFIG, field))

    def test_utf8_id_as_bytes(self) -> None:
        """A non-ASCII id goes out as its UTF-8 bytes (each a latin-1 character here)."""
        endpoint = replace(OPENAI, affinity_header="x-smg-routing-key")
        (value,) = affinity_headers(request(session="sé"), endpoint).values()
        self.assertEqual(value.encode("latin-1"), "sé".encode())

    def test_body_field(self) -> None:
        """affinity_field puts the session's id in the body, after loopd's own fields."""
        endpoint = replace(OPENAI, affinity_field="user")
        body = chat_body(request(session="agent-7"), CONFIG, endpoint)
        self.assertEqual(list(body)[-1], "user")
        self.assertEqual(body["user"], "agent-7")

    def test_not_for_llama_server(self) -> None:
        """A llama-server endpoint gets neither, even when its fields are set."""
        endpoint = replace(
            LLAMA, affinity_header="x-a", affinity_field="user", affinity_priority=True
        )
        self.assertEqual(affinity_headers(request(session="s"), endpoint), {})
        self.assertNotIn("user", chat_body(request(session="s"), CONFIG, endpoint))

    @given(st.booleans(), st.booleans(), st.booleans())
    def test_field_never_loopds_own(self, thinking: bool, stream: bool, tools: bool) -> None:
        """Every field loopd sends an openai endpoint is one affinity_field may not name."""
        full = Config(
            endpoints=(OPENAI,),
            sampling=Sampling(
                temperature=0.5,
                top_p=0.9,
                top_k=4,
                min_p=0.1,
                typical_p=1.0,
                repeat_penalty=1.1,
                repeat_last_n=64,
                presence_penalty=0.0,
                frequency_penalty=0.0,
                seed=1,
            ),
        )
        asked = request(
            thinking=thinking,
            tools=(WEATHER,) if tools else (),
            tool_choice="auto",
            stop=("x",),
            temperature=0.1,
            template_thinking=True,
        )
        body = chat_body(asked, full, OPENAI, stream=stream)
        self.assertLessEqual(set(body), SENT_FIELDS)


class EncodeTests(SynchronousTestCase):
    """L{encode} writes compact UTF-8 JSON."""

    def test_compact(self) -> None:
        """No whitespace between tokens, keys in their order."""
        self.assertEqual(encode({"b": [1, 2], "a": {"x": None}}), b'{"b":[1,2],"a":{"x":null}}')

    def test_utf8(self) -> None:
        """Text outside ASCII is written as UTF-8, not escaped."""
        self.assertEqual(encode({"t": "é😀"}), '{"t":"é😀"}'.encode())

    def test_body_round_trip(self) -> None:
        """A whole body decodes back to itself."""
        req = request(messages=(User("x"), Assistant(None, "r", (ToolCall("i", "n", "{}"),))))
        body = chat_body(req, CONFIG, LLAMA)
        self.assertEqual(json.loads(encode(body)), body)

    def test_nan(self) -> None:
        """NaN and the infinities are a ValueError."""
        for value in (math.nan, math.inf, -math.inf):
            self.assertRaises(ValueError, encode, {"x": value})

    def test_not_json(self) -> None:
        """A value JSON has no form for is a ValueError."""
        self.assertRaises(ValueError, encode, {"x": object()})

    def test_lone_surrogate(self) -> None:
        """Text that is not valid Unicode is a ValueError."""
        self.assertRaises(ValueError, encode, {"x": "\ud800"})

    @given(st.lists(st.tuples(st.sampled_from(["system", "user", "tool"]), st.text()), max_size=5))
    def test_text_faithful(self, specs: list[tuple[str, str]]) -> None:
        """Any message text reaches the wire unchanged."""
        kinds: dict[str, Callable[[str], ChatMessage]] = {
            "system": System,
            "user": User,
            "tool": lambda text: Tool("id", text),
        }
        messages = tuple(kinds[kind](text) for kind, text in specs)
        sent = json.loads(encode(chat_body(request(messages=messages), CONFIG, LLAMA)))
        self.assertEqual([m["content"] for m in sent["messages"]], [text for _, text in specs])
