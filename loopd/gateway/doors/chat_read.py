# -*- test-case-name: loopd.test.test_doors_chat_read,loopd.test.test_gateway_errors -*-
"""
The chat-completions front door's reader: L{parse_request} decodes and checks a
C{POST /v1/chat/completions} body once and makes it the gateway's one request model, a
L{GatewayRequest}, or raises a 400 L{GatewayError} naming the field. The way back out is
L{loopd.gateway.doors.chat}. Pure: no I/O, no reactor, no twisted.web.
"""

from __future__ import annotations

from typing import Any, Final

from loopd.gateway.doors.fields import Fields, decode_body, fail, show
from loopd.gateway.doors.params import split_fields
from loopd.gateway.doors.tools import offered_tool, openai_tool_choice
from loopd.gateway.request import NO_SESSION, GatewayRequest, SessionRef, ThinkingSwitch
from loopd.llama.types import (
    Assistant,
    ChatMessage,
    System,
    Tool,
    ToolCall,
    ToolSchema,
    User,
)

__all__ = ["THINKING_ALIASES", "parse_request"]

MAX_STOP = 4
"""The most stop strings a request may give, as in OpenAI's API."""

_TEXT_PARTS = "expected a string or an array of text parts"
_CHOICES = 'expected "auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
_MSG = "invalid_message"
#: The media part kinds a user turn may carry, with the string fields each must have.
_MEDIA: dict[str, tuple[str, ...]] = {"image_url": ("url",), "input_audio": ("data", "format")}
_PARAM = "invalid_parameter"
_TOOLS = "invalid_tools"
_FIELDS = Fields(_MSG, _PARAM)


THINKING_ALIASES: Final = (
    "enable_thinking",
    "enableThinking",
    "enable_reasoning",
    "use_reasoning",
    "reasoning_enabled",
    "use_thinking",
    "thinking_enabled",
    "enable_think",
    "think_enabled",
)
"""The boolean spellings of "thinking on", in the order they are read (reference §1.6)."""

#: The top-level fields this reader models; every other one goes through
#: L{loopd.gateway.doors.params.split_fields}.
_MODELLED: Final = frozenset(
    {
        "model",
        "messages",
        "tools",
        "tool_choice",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "stop",
        "stream",
        "stream_options",
        "reasoning",
        "reasoning_effort",
        "thinking_budget",
        "chat_template_kwargs",
        *THINKING_ALIASES,
    }
)


def parse_request(body: bytes, session: SessionRef = NO_SESSION) -> GatewayRequest:
    """
    Decode, check and translate a C{POST /v1/chat/completions} body for C{session}.

    The body is UTF-8 JSON in the interoperable profile of L{loopd.strict_json} (no
    C{NaN}, no number too large for a double, no lone surrogate) and an object. Unknown keys
    are L{loopd.gateway.doors.params.split_fields}'s: the fields for the server become
    C{fields}, the ones loopd reads itself or ignores stay in C{extras}
    (C{return_progress} and C{timings_per_token} are read from them), and any other is a
    400 naming it; C{null}
    reads as absent. C{developer}
    messages are system messages; content may be a string or an array of text parts
    (joined); a user turn may also carry C{image_url} and C{input_audio} parts, kept as
    sent; an assistant's content may be C{null} when it has C{tool_calls} or
    C{reasoning_content}. The object form of C{tool_choice} becomes C{"required"} with the
    tools narrowed to the one named. Of C{max_tokens} and C{max_completion_tokens}, the
    lower counts; C{stop} is one string or up to four, none empty. Booleans are not numbers;
    an integral number such as C{2.0} is an integer. The thinking switches are read as
    L{GatewayRequest.thinking_switches} says; C{reasoning_effort} must be a string and
    C{chat_template_kwargs.enable_thinking} a boolean.

    @raise GatewayError: 400 C{invalid_request_error}, the message naming the field; codes
        C{invalid_json}, C{not_an_object}, C{missing_messages}, C{invalid_message},
        C{unsupported_content}, C{invalid_tools}, C{invalid_parameter},
        C{unsupported_parameter} (a field loopd does not pass, L{split_fields}).
    """
    document = decode_body(body)
    messages = _messages(document.get("messages"))
    tool_choice, tools = _tool_choice(document.get("tool_choice"), _tools(document.get("tools")))
    # Checked in this order, so that of two bad fields the same one is named as ever.
    switches = _thinking_switches(document)
    max_tokens = _max_tokens(document)
    temperature = _FIELDS.number(document.get("temperature"), "temperature", 2)
    top_p = _FIELDS.number(document.get("top_p"), "top_p", 1)
    stop = _stop(document.get("stop"))
    model = document.get("model")
    if model is not None and not isinstance(model, str):
        fail(_PARAM, "model", "expected a string")
    options = _FIELDS.mapping(
        document.get("stream_options"), "stream_options", _PARAM, optional=True
    )
    fields, extras = split_fields(
        {key: value for key, value in document.items() if key not in _MODELLED}
    )
    return GatewayRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=stop,
        thinking_switches=switches,
        stream=_FIELDS.flag(document.get("stream"), "stream"),
        include_usage=_FIELDS.flag(options.get("include_usage"), "stream_options.include_usage"),
        session=session,
        fields=fields,
        return_progress=extras.get("return_progress") is True,
        return_timings=extras.get("timings_per_token") is True,
        extras=extras,
    )


def _messages(value: object) -> tuple[ChatMessage, ...]:
    """The C{messages} array, in order."""
    if value is None or value == []:
        fail("missing_messages", "messages", "required: a non-empty array of messages")
    if not isinstance(value, list):
        fail(_MSG, "messages", "expected a non-empty array of messages")
    return tuple(_message(message, f"messages[{i}]") for i, message in enumerate(value))


def _message(value: object, path: str) -> ChatMessage:
    """One message, by its role."""
    message = _FIELDS.mapping(value, path)
    role = message.get("role")
    if role == "assistant":
        return _assistant(message, path)
    if role == "tool":
        call_id = _FIELDS.string(message.get("tool_call_id"), f"{path}.tool_call_id")
        return Tool(call_id, _content(message.get("content"), f"{path}.content"))
    if role == "user":
        return _user(message.get("content"), f"{path}.content")
    if role in ("system", "developer"):
        return System(_content(message.get("content"), f"{path}.content"))
    fail(_MSG, f"{path}.role", 'expected "system", "developer", "user", "assistant" or "tool"')


def _content(value: object, path: str) -> str:
    """Content as a string, or an array of text parts joined together."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        fail(_MSG, path, _TEXT_PARTS)
    return "".join(_text_part(part, f"{path}[{j}]") for j, part in enumerate(value))


def _user(value: object, path: str) -> User:
    """
    A user turn: text as for every role, and also image and audio parts, which are kept as
    sent (the endpoint decides whether it takes them; the C{auto} router sends them only to
    an endpoint with C{vision} or C{audio}).
    """
    if not isinstance(value, list) or not any(_is_media(part) for part in value):
        return User(_content(value, path))
    texts = []
    for j, part in enumerate(value):
        if _is_media(part):
            _media_part(part, f"{path}[{j}]")
        else:
            texts.append(_text_part(part, f"{path}[{j}]"))
    return User("".join(texts), tuple(value))


def _is_media(part: object) -> bool:
    """Whether a content part is an image or audio part (by its C{type})."""
    if not isinstance(part, dict):
        return False
    kind = part.get("type")
    return isinstance(kind, str) and kind in _MEDIA


def _media_part(part: dict[str, Any], path: str) -> None:
    """Check an image part (C{image_url.url}) or audio part (C{input_audio.data, format})."""
    kind = part["type"]
    body = _FIELDS.mapping(part.get(kind), f"{path}.{kind}")
    for field in _MEDIA[kind]:
        _FIELDS.string(body.get(field), f"{path}.{kind}.{field}")


def _text_part(part: object, path: str) -> str:
    """The text of one content part; other part kinds (files, refusals ...) are refused."""
    if isinstance(part, dict):
        kind = part.get("type")
        if kind == "text":
            return _FIELDS.string(part.get("text"), f"{path}.text")
        if isinstance(kind, str):
            unsupported = f"only text parts are supported, not {show(kind)}"
            fail("unsupported_content", f"{path}.type", unsupported)
    fail(_MSG, path, 'expected a text part {"type": "text", "text": ...}')


def _assistant(message: dict[str, Any], path: str) -> Assistant:
    """An earlier assistant turn: content, reasoning and tool calls."""
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        fail(_MSG, f"{path}.tool_calls", "expected an array of tool calls")
    tool_calls = tuple(
        _tool_call(call, f"{path}.tool_calls[{k}]") for k, call in enumerate(calls or ())
    )
    reasoning = message.get("reasoning_content")
    if reasoning is not None:
        reasoning = _FIELDS.string(reasoning, f"{path}.reasoning_content")
    content = message.get("content")
    if content is None and not tool_calls and reasoning is None:
        fail(_MSG, f"{path}.content", _TEXT_PARTS + " (null only with tool_calls)")
    if content is not None:
        content = _content(content, f"{path}.content")
    return Assistant(content, reasoning, tool_calls)


def _tool_call(value: object, path: str) -> ToolCall:
    """One tool call of an assistant: C{{id, type: "function", function: {name, arguments}}}."""
    call = _FIELDS.mapping(value, path)
    if call.get("type") not in (None, "function"):
        fail(_MSG, f"{path}.type", 'expected "function"')
    function = _FIELDS.mapping(call.get("function"), f"{path}.function")
    return ToolCall(
        _FIELDS.string(call.get("id"), f"{path}.id"),
        _FIELDS.string(function.get("name"), f"{path}.function.name"),
        _FIELDS.string(function.get("arguments"), f"{path}.function.arguments"),
    )


def _tools(value: object) -> tuple[ToolSchema, ...]:
    """The C{tools}: C{[{type: "function", function: {name, description?, parameters?}}]}."""
    if value is None:
        return ()
    if not isinstance(value, list):
        fail(_TOOLS, "tools", "expected an array of tools")
    tools: list[ToolSchema] = []
    for i, item in enumerate(value):
        path = f"tools[{i}]"
        tool = _FIELDS.mapping(item, path, _TOOLS)
        if tool.get("type") != "function":
            fail(_TOOLS, f"{path}.type", 'expected "function"')
        function = _FIELDS.mapping(tool.get("function"), f"{path}.function", _TOOLS)
        tools.append(offered_tool(function, f"{path}.function", tools))
    return tuple(tools)


def _tool_choice(
    value: object, tools: tuple[ToolSchema, ...]
) -> tuple[str | None, tuple[ToolSchema, ...]]:
    """C{tool_choice} and the tools it leaves on offer (L{openai_tool_choice})."""
    chosen = openai_tool_choice(
        value, tools, name_of=_function_name, path="tool_choice.function.name", code=_PARAM
    )
    if chosen is None:
        fail(_PARAM, "tool_choice", _CHOICES)
    return chosen


def _function_name(choice: dict[str, Any]) -> object:
    """The tool a chat C{tool_choice} names: C{function.name}."""
    function = choice.get("function")
    return function.get("name") if isinstance(function, dict) else None


def _thinking_switches(document: dict[str, Any]) -> tuple[ThinkingSwitch, ...]:
    """
    Every thinking switch of the body, in the order of reference C{mesh-moa.md} §1.6:

      1. C{reasoning}, when an object: off when C{enabled} is false, C{effort} is
         C{"none"} or C{max_tokens} is 0; else on when C{enabled} is true or C{effort} or
         C{max_tokens} is present (any value).
      2. C{reasoning_effort} (a string, else 400): on unless it is C{"none"}.
      3. Each of L{THINKING_ALIASES} at the top level that is a boolean, in that order.
      4. C{thinking_budget} of 0: off (another value sets nothing).
      5. Each of L{THINKING_ALIASES} in C{chat_template_kwargs} (an object, else 400) that is
         a boolean, in that order; C{enable_thinking} there must be a boolean (else 400).
    """
    switches: list[ThinkingSwitch] = []
    reasoning = document.get("reasoning")
    if isinstance(reasoning, dict):
        if (
            reasoning.get("enabled") is False
            or reasoning.get("effort") == "none"
            or _is_zero(reasoning.get("max_tokens"))
        ):
            switches.append(ThinkingSwitch("reasoning", False))
        elif reasoning.get("enabled") is True or "effort" in reasoning or "max_tokens" in reasoning:
            switches.append(ThinkingSwitch("reasoning", True))
    effort = document.get("reasoning_effort")
    if effort is not None:
        on = _FIELDS.string(effort, "reasoning_effort", _PARAM) != "none"
        switches.append(ThinkingSwitch("reasoning_effort", on))
    switches.extend(_aliases(document, ""))
    if _is_zero(document.get("thinking_budget")):
        switches.append(ThinkingSwitch("thinking_budget", False))
    kwargs = _FIELDS.mapping(
        document.get("chat_template_kwargs"), "chat_template_kwargs", _PARAM, optional=True
    )
    if kwargs.get("enable_thinking") is not None:
        _FIELDS.flag(kwargs["enable_thinking"], "chat_template_kwargs.enable_thinking")
    switches.extend(_aliases(kwargs, "chat_template_kwargs."))
    return tuple(switches)


def _aliases(fields: dict[str, Any], prefix: str) -> list[ThinkingSwitch]:
    """The L{THINKING_ALIASES} of C{fields} that are booleans, in alias order."""
    return [
        ThinkingSwitch(prefix + alias, value)
        for alias in THINKING_ALIASES
        if isinstance(value := fields.get(alias), bool)
    ]


def _is_zero(value: object) -> bool:
    """Whether a JSON value is the number 0 (C{0.0} too; C{false} is not a number)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value == 0


def _max_tokens(document: dict[str, Any]) -> int | None:
    """The lower of C{max_tokens} and C{max_completion_tokens}, each a positive integer."""
    keys = ("max_tokens", "max_completion_tokens")
    limits = [_FIELDS.count(document[key], key) for key in keys if document.get(key) is not None]
    return min(limits) if limits else None


def _stop(value: object) -> tuple[str, ...]:
    """C{stop}: a string or an array of up to L{MAX_STOP} strings, none empty."""
    if value is None:
        return ()
    if isinstance(value, str) and value:
        return (value,)
    if not isinstance(value, list) or len(value) > MAX_STOP:
        fail(_PARAM, "stop", f"expected a non-empty string or an array of up to {MAX_STOP}")
    for j, item in enumerate(value):
        if not isinstance(item, str) or not item:
            fail(_PARAM, f"stop[{j}]", "expected a non-empty string")
    return tuple(value)
