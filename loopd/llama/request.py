# -*- test-case-name: loopd.test.test_llama_request -*-
"""
The body of a chat-completions request, built from typed inputs and the configuration.

Pure: values in, a JSON-ready dict (and its bytes) out. The same inputs always give the
same bytes, key order included, so a retry sends exactly what the first attempt sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

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
from loopd.settings import Config, Endpoint

__all__ = [
    "LLAMA_ONLY_FIELDS",
    "PRIORITY_HEADER",
    "affinity_headers",
    "chat_body",
    "chat_max_tokens",
    "encode",
    "render_messages",
    "render_tools",
]

LLAMA_ONLY_FIELDS = frozenset(
    {
        "id_slot",
        "cache_prompt",
        "return_progress",
        "timings_per_token",
        "reasoning_control",
        "chat_template_kwargs",
    }
)
"""The request fields only llama.cpp's server knows; an C{openai} endpoint gets none."""
PRIORITY_HEADER = "x-dynamo-request-priority"
"""Dynamo's request priority (an i32, higher goes first), sent with C{affinity_priority}."""
_PRIORITIES = {"parent": "1", "child": "0"}


def render_messages(messages: Iterable[ChatMessage]) -> list[dict[str, Any]]:
    """
    Render messages in the OpenAI chat shape, in order.

      - L{System}, L{User}: C{{"role", "content"}}; a user turn with media parts sends
        its parts as the content array.
      - L{Assistant}: C{{"role": "assistant", "content"}} with C{content} C{null} when it
        is None; C{reasoning_content} only when it is not None; C{tool_calls} only when
        there are any, each C{{"id", "type": "function", "function": {"name",
        "arguments"}}} with the arguments as the model wrote them (JSON text).
      - L{Tool}: C{{"role": "tool", "tool_call_id", "content"}}.

    @raise TypeError: a message of another kind.
    """
    return [_render_message(message) for message in messages]


def _render_message(message: ChatMessage) -> dict[str, Any]:
    """One message; see L{render_messages}."""
    if isinstance(message, System):
        return {"role": "system", "content": message.content}
    if isinstance(message, User):
        content: str | list[dict[str, Any]] = list(message.parts) or message.content
        return {"role": "user", "content": content}
    if isinstance(message, Assistant):
        rendered: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.reasoning_content is not None:
            rendered["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            rendered["tool_calls"] = [_render_tool_call(call) for call in message.tool_calls]
        return rendered
    if isinstance(message, Tool):
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    raise TypeError(f"not a chat message: {type(message).__name__}")


def _render_tool_call(call: ToolCall) -> dict[str, Any]:
    """One tool call of an assistant message."""
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def render_tools(tools: Iterable[ToolSchema]) -> list[dict[str, Any]]:
    """
    Render tool schemas as OpenAI tools, in order: C{{"type": "function", "function":
    {"name", "description", "parameters"}}}, the parameters schema passed through as is.
    """
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters,
            },
        }
        for tool in tools
    ]


def chat_body(
    request: ChatRequest, config: Config, endpoint: Endpoint, *, stream: bool = True
) -> dict[str, Any]:
    """
    The JSON body of C{POST /v1/chat/completions} for C{request}.

    Fields, in this order:

      - C{model}: C{endpoint.model}, only when it is set (a router needs it; a single-model
        server ignores it).
      - C{messages}: L{render_messages} of C{request.messages}.
      - C{tools}: L{render_tools} of C{request.tools}, only when there are any.
      - C{stream}: the C{stream} argument.
      - C{stream_options}: C{{"include_usage": true}}, only for an C{openai} endpoint when
        streaming, so that the last chunk carries the token counts.
      - C{max_tokens}: C{config.max_tokens}, the backstop on generated tokens, or the
        request's own C{max_tokens} when that is lower.
      - the sampling settings that are set in C{config.sampling} (temperature, top_p,
        top_k, min_p, typical_p, repeat_penalty, repeat_last_n, presence_penalty,
        frequency_penalty, seed), under their own names; unset ones are not sent, so the
        server's defaults apply. The request's C{temperature} and C{top_p} override them.
      - C{stop}: the request's stop strings, when there are any.
      - C{tool_choice}: the request's, when it sets one and offers tools.
      - C{id_slot}: C{request.slot}, the slot the request is pinned to (C{-1}: any).
      - C{cache_prompt}: C{true}, reuse the slot's cached prompt prefix.
      - C{return_progress}: C{true}, send C{prompt_progress} while the prompt is read.
      - C{timings_per_token}: C{true}, put C{timings} on every token's chunk (the thinking
        cap counts reasoning tokens from it).
      - C{chat_template_kwargs}: C{{"enable_thinking": request.thinking}}.
      - C{reasoning_effort}: C{"none"}, only when thinking is off (the OpenAI way to say
        it, which llama.cpp's server understands too).
      - C{reasoning_control}: C{true}, only when thinking is on: arms the server's
        C{reasoning_end} control so the thinking cap can end a thinking block.
      - the endpoint's C{affinity_field} (an C{openai} endpoint's), set to
        C{request.session}, only when the request has a session.
      - C{request.fields}, as they are, last (the front door chose and checked them).

    For an endpoint of kind C{openai}, the fields only llama.cpp's server knows
    (L{LLAMA_ONLY_FIELDS}) are left out, but for C{chat_template_kwargs} when the request's
    C{template_thinking} asks for it.

    @param stream: ask for a C{text/event-stream} answer.
    """
    llama = endpoint.kind == "llama-server"
    body: dict[str, Any] = {}
    if endpoint.model is not None:
        body["model"] = endpoint.model
    body["messages"] = render_messages(request.messages)
    if request.tools:
        body["tools"] = render_tools(request.tools)
    body["stream"] = stream
    if stream and not llama:
        body["stream_options"] = {"include_usage": True}
    body["max_tokens"] = chat_max_tokens(request, config)
    body.update(config.sampling.request_fields())
    for name in ("temperature", "top_p"):
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    if request.stop:
        body["stop"] = list(request.stop)
    if request.tool_choice is not None and request.tools:
        body["tool_choice"] = request.tool_choice
    if llama:
        body["id_slot"] = request.slot
        body["cache_prompt"] = True
        body["return_progress"] = True
        body["timings_per_token"] = True
        body["chat_template_kwargs"] = {"enable_thinking": request.thinking}
    elif request.template_thinking:
        body["chat_template_kwargs"] = {"enable_thinking": request.thinking}
    if not request.thinking:
        body["reasoning_effort"] = "none"
    elif llama:
        body["reasoning_control"] = True
    if not llama and endpoint.affinity_field is not None and request.session is not None:
        body[endpoint.affinity_field] = request.session
    body.update(request.fields)
    return body


def affinity_headers(request: ChatRequest, endpoint: Endpoint) -> dict[str, str]:
    """
    The headers that carry C{request}'s session to an C{openai} endpoint's own affinity
    (DESIGN §3 decision 42): its C{affinity_header} with C{request.session} when the request
    has one, and with C{affinity_priority} L{PRIORITY_HEADER}, 1 for a parent and 0 for a
    child. None at all for a llama-server, whose slot loopd pins itself.

    A session id is UTF-8 without control characters (L{loopd.gateway.request.session_id});
    it goes out as those bytes (a header value may carry bytes above 0x7F), each one
    spelled as the latin-1 character the HTTP client encodes back to it.
    """
    headers: dict[str, str] = {}
    if endpoint.kind != "openai":
        return headers
    if endpoint.affinity_header is not None and request.session is not None:
        raw = request.session.encode("utf-8", "surrogatepass")
        headers[endpoint.affinity_header] = raw.decode("latin-1")
    if endpoint.affinity_priority:
        headers[PRIORITY_HEADER] = _PRIORITIES[request.tier]
    return headers


def chat_max_tokens(request: ChatRequest, config: Config) -> int:
    """
    The C{max_tokens} sent for C{request}: its own, never above the config's (which is the
    default).
    """
    if request.max_tokens is None:
        return config.max_tokens
    return min(request.max_tokens, config.max_tokens)


def encode(body: dict[str, Any]) -> bytes:
    """
    Encode a request body as compact JSON (no spaces), UTF-8, keys in their order.

    @raise ValueError: the body holds something JSON cannot carry: NaN or an infinity, a
        value of a type JSON has no form for, or text that is not valid Unicode (a lone
        surrogate).
    """
    try:
        text = json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except TypeError as error:
        raise ValueError(f"not JSON: {error}") from None
    return text.encode("utf-8")
