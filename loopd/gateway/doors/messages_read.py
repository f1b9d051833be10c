# -*- test-case-name: loopd.test.test_doors_messages_read -*-
"""
The reader of the Anthropic Messages front door (L{loopd.gateway.doors.messages}):
L{parse_messages} turns a C{POST /v1/messages} body into the gateway's one request model.

What is read, and how:

  - C{system}, a string or text blocks (joined with a blank line), becomes the first,
    L{System}, message. Claude Code's attribution line (C{x-anthropic-billing-header: ...},
    whose C{cch} changes every request) is removed from it first, wherever a system text
    line starts with it, so that two turns of one session share their cached prefix.
  - C{messages}: C{user}, C{assistant} and C{system} turns, content a string or blocks (an
    empty array too: the system prompt alone, which llama-server answers). A C{system} turn
    (Claude Code sends one after the first user turn) is a L{System} message where it stands
    (what an endpoint does with it: L{loopd.gateway.late_system}). A user turn's
    C{text} and C{image} blocks (C{base64} and C{url} sources, as OpenAI C{image_url}
    parts) make one L{User}; each of its C{tool_result} blocks becomes a L{Tool} message
    before it, its content a string or text blocks (joined), C{is_error: true} noted by
    the prefix L{TOOL_ERROR_PREFIX}; images in a tool result follow it as a L{User} turn
    of those images (a L{Tool} message carries text only). An assistant turn's C{text}
    blocks are its content (joined), its C{thinking} blocks its C{reasoning_content}
    (joined; the signature is not checked: no local model can), its C{tool_use} blocks its
    tool calls, the input JSON-encoded as the arguments (C{json.dumps}' default spacing,
    the way models write it, so that the prefix stays cacheable).
  - C{tools} (C{name}, C{description}, C{input_schema}); C{tool_choice} C{auto}, C{any}
    (C{required}), C{tool} (C{required}, the tools narrowed to the one named), C{none};
    C{disable_parallel_tool_use: true} sends C{parallel_tool_calls: false}.
  - C{max_tokens} (required, a positive integer; optional for C{count_tokens}),
    C{stop_sequences}, C{temperature} and C{top_p} (0 to 1), C{top_k} (sent as llama.cpp's
    C{top_k}), C{stream}.
  - C{thinking}: C{enabled} turns thinking on with C{budget_tokens} as this request's
    thinking cap; C{adaptive} turns it on; C{disabled} turns it off; absent, the server's
    default (on).
  - C{output_config.format} (C{json_schema}) as llama-server's C{response_format}.
  - C{metadata.user_id}: the session id after the headers (decision 36).

Accepted and ignored, because they are hints that change nothing loopd can honour or not:
C{cache_control} everywhere (llama-server caches every prompt prefix by itself),
C{context_management} (server-side context editing; loopd never edits the context, the
client's own compaction still works), C{output_config.effort}, C{service_tier} C{auto} or
C{standard_only}, C{speed} C{standard}, a custom tool's C{eager_input_streaming}. Server
tools (C{web_search_*}, C{web_fetch_*}, C{code_execution_*} ...) are left out of what the
model sees and named in the request's C{dropped} (or refused with C{[doors] hosted_tools =
"refuse"}), L{loopd.gateway.doors.hosted_tools}. Anything
else is a 400 C{invalid_request_error} naming it, as Anthropic's API answers fields it does
not know: the top-level fields loopd cannot honour (C{container}, C{mcp_servers}, ...),
client tools with Anthropic's own schemas (C{bash_*}, C{text_editor_*}: a local model does
not know them; C{tools[0].type}), blocks loopd does not translate
(C{messages[2].content[1].type}: C{document}, C{search_result}, C{server_tool_use},
C{redacted_thinking}, whose encrypted thinking no local model can read), C{file} image
sources. Nothing is dropped silently. Any field whose value is C{null} reads as absent.

Pure: no I/O, no reactor, no twisted.web.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from loopd.gateway.doors.fields import Fields, decode_body, fail, show
from loopd.gateway.doors.hosted_tools import HostedTools, dropped_hosted, hosted_messages_tool
from loopd.gateway.doors.tools import narrowed, offered_tool
from loopd.gateway.request import (
    NO_SESSION,
    GatewayRequest,
    SessionRef,
    ThinkingSwitch,
)
from loopd.llama.types import (
    Assistant,
    ChatMessage,
    System,
    Tool,
    ToolCall,
    ToolSchema,
    User,
)

__all__ = [
    "ATTRIBUTION_PREFIX",
    "TOOL_ERROR_PREFIX",
    "parse_messages",
    "without_attribution",
]

ATTRIBUTION_PREFIX: Final = "x-anthropic-billing-header:"
"""How Claude Code's per-request attribution line starts (removed from the system prompt)."""

TOOL_ERROR_PREFIX: Final = "Error: "
"""What a tool result with C{is_error: true} starts with in the model's prompt."""

_MSG = "invalid_message"
_PARAM = "invalid_parameter"
_TOOLS = "invalid_tools"
_FIELDS = Fields(_MSG, _PARAM)
_UNSUPPORTED = "unsupported_content"
_UNKNOWN = "unsupported_parameter"

#: The top-level fields the reader models.
_MODELLED: Final = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "metadata",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "thinking",
        "tool_choice",
        "tools",
        "output_config",
    }
)
#: Top-level hints accepted and ignored (the module docstring says why), with the values
#: each may have (C{None}: any value).
_HINTS: Final[Mapping[str, frozenset[str] | None]] = {
    "cache_control": None,
    "context_management": None,
    "service_tier": frozenset({"auto", "standard_only"}),
    "speed": frozenset({"standard"}),
}
#: The fields of each block kind, by where it may appear; other kinds are refused.
_USER_BLOCKS: Final = {
    "text": frozenset({"text", "cache_control"}),
    "image": frozenset({"source", "cache_control"}),
    "tool_result": frozenset({"tool_use_id", "content", "is_error", "cache_control"}),
}
_ASSISTANT_BLOCKS: Final = {
    "text": frozenset({"text", "cache_control"}),
    "thinking": frozenset({"thinking", "signature", "cache_control"}),
    "tool_use": frozenset({"id", "name", "input", "cache_control"}),
}
_RESULT_BLOCKS: Final = {
    "text": frozenset({"text", "cache_control"}),
    "image": frozenset({"source", "cache_control"}),
}
_SYSTEM_BLOCKS: Final = {"text": frozenset({"text", "cache_control"})}
_WHY_REFUSED: Final = {
    "redacted_thinking": "redacted_thinking blocks hold Anthropic's encrypted thinking, which "
    "no local model can read; remove them",
    "document": "document blocks are not translated; send the text as a text block",
}
_IMAGE_TYPES: Final = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
_TOOL_FIELDS: Final = frozenset(
    {"name", "description", "input_schema", "type", "cache_control", "eager_input_streaming"}
)


def parse_messages(
    body: bytes,
    session: SessionRef = NO_SESSION,
    *,
    counting: bool = False,
    hosted_tools: HostedTools = "drop",
) -> GatewayRequest:
    """
    Decode, check and translate a C{POST /v1/messages} body (the module docstring says
    how), for C{session}. C{metadata} is kept in C{extras}.

    @param counting: the body is a C{count_tokens} one: C{max_tokens} is optional.
    @param hosted_tools: what a server tool (C{web_search_*} ...) does to the request: it
        is left out and named in C{dropped} (C{drop}) or refused (C{refuse}).
    @raise GatewayError: 400 C{invalid_request_error}, the message naming the field; codes
        C{invalid_json}, C{not_an_object}, C{missing_messages}, C{missing_max_tokens},
        C{invalid_message}, C{unsupported_content}, C{invalid_tools}, C{invalid_parameter},
        C{unsupported_parameter}.
    """
    document = {key: value for key, value in decode_body(body).items() if value is not None}
    _check_top_level(document)
    model = document.get("model")
    if model is not None and not isinstance(model, str):
        fail(_PARAM, "model", "expected a string")
    messages = (*_system(document.get("system")), *_messages(document.get("messages")))
    tools, dropped = _tools(document.get("tools"), hosted_tools)
    tool_choice, tools, parallel = _tool_choice(document.get("tool_choice"), tools)
    max_tokens = _max_tokens(document.get("max_tokens"), required=not counting)
    switches, cap = _thinking(document.get("thinking"))
    fields: dict[str, Any] = {}
    top_k = document.get("top_k")
    if top_k is not None:
        fields["top_k"] = _FIELDS.count(top_k, "top_k", low=0)
    if parallel is False:
        fields["parallel_tool_calls"] = False
    fields.update(_output_config(document.get("output_config")))
    _metadata(document.get("metadata"))
    return GatewayRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=max_tokens,
        temperature=_FIELDS.number(document.get("temperature"), "temperature", 1),
        top_p=_FIELDS.number(document.get("top_p"), "top_p", 1),
        stop=_stop_sequences(document.get("stop_sequences")),
        thinking_switches=switches,
        stream=_FIELDS.flag(document.get("stream"), "stream"),
        session=session,
        thinking_cap=cap,
        fields=fields,
        extras={key: document[key] for key in ("metadata",) if key in document},
        dropped=dropped,
    )


def without_attribution(text: str) -> str:
    """
    C{text} without its lines that start (after spaces) with L{ATTRIBUTION_PREFIX}, each
    with its line break: Claude Code's per-request attribution, which would change every
    request's prompt prefix.
    """
    if ATTRIBUTION_PREFIX not in text:
        return text
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not line.lstrip().startswith(ATTRIBUTION_PREFIX))


def _asks_nothing(value: object) -> bool:
    """Whether a field's value asks for nothing: C{null}, C{false} or empty."""
    return value is None or value is False or value == [] or value == {}


def _check_top_level(document: dict[str, Any]) -> None:
    """
    Refuse the top-level fields loopd neither models nor accepts as hints, and a hint's
    value that asks for more than it can be ignored for.
    """
    for key, value in document.items():
        if key in _MODELLED:
            continue
        if key not in _HINTS:
            fail(_UNKNOWN, key, "not supported by loopd")
        allowed = _HINTS[key]
        if allowed is not None and (not isinstance(value, str) or value not in allowed):
            choices = " or ".join(show(choice) for choice in sorted(allowed))
            fail(_UNKNOWN, key, f"only {choices} is supported by loopd")


def _only(block: dict[str, Any], allowed: frozenset[str], path: str) -> None:
    """Refuse the fields of C{block} other than C{type} and C{allowed} that ask for something."""
    for key, value in block.items():
        if key != "type" and key not in allowed and not _asks_nothing(value):
            fail(_UNKNOWN, f"{path}.{key}", "not supported by loopd")


def _max_tokens(value: object, *, required: bool) -> int | None:
    """C{max_tokens}: a positive integer, required unless counting."""
    if value is None:
        if required:
            fail("missing_max_tokens", "max_tokens", "required: a positive integer")
        return None
    return _FIELDS.count(value, "max_tokens", low=1)


def _stop_sequences(value: object) -> tuple[str, ...]:
    """C{stop_sequences}: an array of non-empty strings."""
    if value is None:
        return ()
    if not isinstance(value, list):
        fail(_PARAM, "stop_sequences", "expected an array of strings")
    for j, item in enumerate(value):
        if not isinstance(item, str) or not item:
            fail(_PARAM, f"stop_sequences[{j}]", "expected a non-empty string")
    return tuple(value)


def _thinking(value: object) -> tuple[tuple[ThinkingSwitch, ...], int | None]:
    """
    C{thinking}: the switch it sets (as C{reasoning_effort}, the switch the plain path
    honours) and the thinking cap of C{enabled}'s C{budget_tokens}.
    """
    if value is None:
        return (), None
    config = _FIELDS.mapping(value, "thinking", _PARAM)
    kind = config.get("type")
    if kind == "disabled":
        _only(config, frozenset(), "thinking")
        return (ThinkingSwitch("reasoning_effort", False),), None
    if kind not in ("enabled", "adaptive"):
        fail(_PARAM, "thinking.type", 'expected "enabled", "adaptive" or "disabled"')
    if config.get("display") not in (None, "summarized"):
        fail(_UNKNOWN, "thinking.display", 'only "summarized" is supported by loopd')
    _only(config, frozenset({"budget_tokens", "display"}), "thinking")
    cap = None
    if kind == "enabled":
        budget = config.get("budget_tokens")
        if budget is None:
            fail(_PARAM, "thinking.budget_tokens", 'required when thinking.type is "enabled"')
        cap = _FIELDS.count(budget, "thinking.budget_tokens", low=1)
    return (ThinkingSwitch("reasoning_effort", True),), cap


def _output_config(value: object) -> dict[str, Any]:
    """
    The server fields of C{output_config}: its C{format} (C{json_schema}) as
    C{response_format}; C{effort} is accepted and ignored.
    """
    if value is None:
        return {}
    config = _FIELDS.mapping(value, "output_config", _PARAM)
    _only(config, frozenset({"format", "effort"}), "output_config")
    effort = config.get("effort")
    if effort is not None:
        _FIELDS.string(effort, "output_config.effort", _PARAM)
    form = config.get("format")
    if form is None:
        return {}
    form = _FIELDS.mapping(form, "output_config.format", _PARAM)
    if form.get("type") != "json_schema":
        fail(_PARAM, "output_config.format.type", 'expected "json_schema"')
    _only(form, frozenset({"schema"}), "output_config.format")
    schema = _FIELDS.mapping(form.get("schema"), "output_config.format.schema", _PARAM)
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema},
        }
    }


def _metadata(value: object) -> None:
    """Check C{metadata}: an object whose only field is C{user_id}."""
    if value is not None:
        _only(_FIELDS.mapping(value, "metadata", _PARAM), frozenset({"user_id"}), "metadata")


def _system(value: object) -> tuple[ChatMessage, ...]:
    """C{system} as the first message, without Claude Code's attribution; none if empty."""
    if value is None:
        return ()
    if isinstance(value, str):
        text = without_attribution(value)
    elif isinstance(value, list):
        text = _system_text(value, "system")
    else:
        fail(_MSG, "system", "expected a string or an array of text blocks")
    return (System(text),) if text else ()


def _system_text(blocks: list[Any], path: str) -> str:
    """System text blocks joined with a blank line, without Claude Code's attribution."""
    texts = (
        without_attribution(_block_text(block, f"{path}[{j}]", _SYSTEM_BLOCKS))
        for j, block in enumerate(blocks)
    )
    return "\n\n".join(text for text in texts if text)


def _block(value: object, path: str, kinds: Mapping[str, frozenset[str]]) -> dict[str, Any]:
    """
    One content block of one of C{kinds}, its fields checked against that kind's.

    @raise GatewayError: 400 C{unsupported_content} naming C{<path>.type} for another kind.
    """
    block = _FIELDS.mapping(value, path)
    kind = block.get("type")
    if not isinstance(kind, str):
        fail(_MSG, f"{path}.type", "expected a string")
    if kind not in kinds:
        expected = ", ".join(sorted(kinds))
        why = _WHY_REFUSED.get(kind, f"{show(kind)} blocks are not translated by loopd")
        fail(_UNSUPPORTED, f"{path}.type", f"{why} (here: {expected})")
    _only(block, kinds[kind], path)
    return block


def _block_text(value: object, path: str, kinds: Mapping[str, frozenset[str]]) -> str:
    """The text of a block that must be a C{text} block."""
    block = _block(value, path, kinds)
    if block["type"] != "text":
        fail(_UNSUPPORTED, f"{path}.type", "expected a text block here")
    return _FIELDS.string(block.get("text"), f"{path}.text")


def _messages(value: object) -> tuple[ChatMessage, ...]:
    """
    The C{messages} array, in order, each turn as one or more messages; a C{system} turn
    (Claude Code sends one after the first user turn: the agent types of its C{Agent} tool)
    is a L{System} message where it stands. An empty array is a conversation of the system
    prompt alone, which llama-server answers too.
    """
    if value is None:
        fail("missing_messages", "messages", "required: an array of messages")
    if not isinstance(value, list):
        fail(_MSG, "messages", "expected an array of messages")
    out: list[ChatMessage] = []
    for i, item in enumerate(value):
        path = f"messages[{i}]"
        message = _FIELDS.mapping(item, path)
        _only(message, frozenset({"role", "content"}), path)
        role = message.get("role")
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif not isinstance(content, list):
            fail(_MSG, f"{path}.content", "expected a string or an array of content blocks")
        if role == "user":
            out.extend(_user(content, f"{path}.content"))
        elif role == "assistant":
            out.append(_assistant(content, f"{path}.content"))
        elif role == "system":
            out.append(System(_system_text(content, f"{path}.content")))
        else:
            fail(_MSG, f"{path}.role", 'expected "user", "assistant" or "system"')
    return tuple(out)


def _image_part(block: dict[str, Any], path: str) -> dict[str, Any]:
    """An image block as the OpenAI C{image_url} part llama-server reads."""
    source = _FIELDS.mapping(block.get("source"), f"{path}.source")
    kind = source.get("type")
    if kind == "base64":
        _only(source, frozenset({"media_type", "data"}), f"{path}.source")
        media = _FIELDS.string(source.get("media_type"), f"{path}.source.media_type")
        if media not in _IMAGE_TYPES:
            kinds = ", ".join(sorted(_IMAGE_TYPES))
            fail(_MSG, f"{path}.source.media_type", f"expected one of {kinds}")
        data = _FIELDS.string(source.get("data"), f"{path}.source.data")
        url = f"data:{media};base64,{data}"
    elif kind == "url":
        _only(source, frozenset({"url"}), f"{path}.source")
        url = _FIELDS.string(source.get("url"), f"{path}.source.url")
    else:
        fail(_UNSUPPORTED, f"{path}.source.type", 'expected "base64" or "url"')
    return {"type": "image_url", "image_url": {"url": url}}


def _user_turn(parts: list[dict[str, Any]]) -> User:
    """A user turn of OpenAI parts: text only is plain content, with images it keeps parts."""
    text = "".join(part["text"] for part in parts if part["type"] == "text")
    if any(part["type"] == "image_url" for part in parts):
        return User(text, tuple(parts))
    return User(text)


def _user(blocks: list[Any], path: str) -> list[ChatMessage]:
    """
    A user turn: its tool results first, as L{Tool} messages (each followed by a user turn
    of its images, if it has any), then its text and images as one L{User}, if any.
    """
    results: list[ChatMessage] = []
    parts: list[dict[str, Any]] = []
    for j, value in enumerate(blocks):
        where = f"{path}[{j}]"
        block = _block(value, where, _USER_BLOCKS)
        kind = block["type"]
        if kind == "text":
            parts.append(
                {"type": "text", "text": _FIELDS.string(block.get("text"), f"{where}.text")}
            )
        elif kind == "image":
            parts.append(_image_part(block, where))
        else:
            results.extend(_tool_result(block, where))
    if parts or not results:
        results.append(_user_turn(parts))
    return results


def _tool_result(block: dict[str, Any], path: str) -> list[ChatMessage]:
    """A C{tool_result} block as a L{Tool} message, and a user turn of its images."""
    call_id = _FIELDS.string(block.get("tool_use_id"), f"{path}.tool_use_id")
    content = block.get("content")
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for k, value in enumerate(content):
            where = f"{path}.content[{k}]"
            item = _block(value, where, _RESULT_BLOCKS)
            if item["type"] == "text":
                texts.append(_FIELDS.string(item.get("text"), f"{where}.text"))
            else:
                images.append(_image_part(item, where))
    elif content is not None:
        fail(_MSG, f"{path}.content", "expected a string or an array of text and image blocks")
    text = "".join(texts)
    if _FIELDS.flag(block.get("is_error"), f"{path}.is_error"):
        text = TOOL_ERROR_PREFIX + text
    out: list[ChatMessage] = [Tool(call_id, text)]
    if images:
        out.append(User("", tuple(images)))
    return out


def _assistant(blocks: list[Any], path: str) -> Assistant:
    """An earlier assistant turn: its text, its thinking and its tool calls."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for j, value in enumerate(blocks):
        where = f"{path}[{j}]"
        block = _block(value, where, _ASSISTANT_BLOCKS)
        kind = block["type"]
        if kind == "text":
            texts.append(_FIELDS.string(block.get("text"), f"{where}.text"))
        elif kind == "thinking":
            thoughts.append(_FIELDS.string(block.get("thinking"), f"{where}.thinking"))
            signature = block.get("signature")
            if signature is not None:
                _FIELDS.string(signature, f"{where}.signature")
        else:
            arguments = _FIELDS.mapping(block.get("input"), f"{where}.input")
            calls.append(
                ToolCall(
                    _FIELDS.string(block.get("id"), f"{where}.id"),
                    _FIELDS.string(block.get("name"), f"{where}.name"),
                    json.dumps(arguments, ensure_ascii=False),
                )
            )
    content = "".join(texts) if texts or not calls else None
    return Assistant(content, "".join(thoughts) if thoughts else None, tuple(calls))


def _tools(value: object, hosted: HostedTools) -> tuple[tuple[ToolSchema, ...], tuple[str, ...]]:
    """
    The C{tools}: custom tools C{{name, description?, input_schema}}; and the server tools
    left out (L{loopd.gateway.doors.hosted_tools}), by type, each once (refused when C{hosted}
    says so).
    """
    if value is None:
        return (), ()
    if not isinstance(value, list):
        fail(_TOOLS, "tools", "expected an array of tools")
    tools: list[ToolSchema] = []
    dropped: list[str] = []
    for i, item in enumerate(value):
        path = f"tools[{i}]"
        tool = _FIELDS.mapping(item, path, _TOOLS)
        kind = tool.get("type")
        if dropped_hosted(kind, f"{path}.type", hosted, dropped, hosted_messages_tool):
            continue
        if kind not in (None, "custom"):
            shown = show(kind) if isinstance(kind, str) else "this type"
            fail(_TOOLS, f"{path}.type", f"{shown}: only custom tools are supported by loopd")
        _only(tool, _TOOL_FIELDS, path)
        schema = offered_tool(tool, path, tools, schema_key="input_schema", schema_required=True)
        tools.append(schema)
    return tuple(tools), tuple(dropped)


def _tool_choice(
    value: object, tools: tuple[ToolSchema, ...]
) -> tuple[str | None, tuple[ToolSchema, ...], bool | None]:
    """
    C{tool_choice}: the OpenAI choice, the tools it leaves on offer, and C{False} when
    C{disable_parallel_tool_use} is set (else C{None}: the server's default).
    """
    if value is None:
        return None, tools, None
    choice = _FIELDS.mapping(value, "tool_choice", _PARAM)
    kind = choice.get("type")
    if kind == "none":
        _only(choice, frozenset(), "tool_choice")
        return "none", tools, None
    if not isinstance(kind, str) or kind not in _CHOICES:
        fail(_PARAM, "tool_choice.type", 'expected "auto", "any", "tool" or "none"')
    allowed = (
        {"disable_parallel_tool_use", "name"} if kind == "tool" else {"disable_parallel_tool_use"}
    )
    _only(choice, frozenset(allowed), "tool_choice")
    path = "tool_choice.disable_parallel_tool_use"
    parallel = False if _FIELDS.flag(choice.get("disable_parallel_tool_use"), path) else None
    if kind == "tool":
        tools = narrowed(tools, choice.get("name"), "tool_choice.name", _PARAM)
    return _CHOICES[kind], tools, parallel


#: The OpenAI C{tool_choice} of each Anthropic one that offers tools.
_CHOICES: Final = {"auto": "auto", "any": "required", "tool": "required"}
