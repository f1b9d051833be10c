# -*- test-case-name: loopd.test.test_gateway_responses -*-
"""
The OpenAI Responses front door (C{POST /v1/responses}, DESIGN §3 decision 40), as Codex CLI
and the C{openai} SDK use it: L{ResponsesDoor} reads a body into the gateway's one request
model, L{GatewayRequest}, and gives a L{ResponsesAnswer} per exchange, which writes the
C{response} object or its event stream.

What the reader makes of a body:

  - C{instructions} is a system message before everything else; C{input} is one user
    message (a string) or items: C{message} (roles C{user}, C{assistant}, C{system},
    C{developer}; content a string or C{input_text} / C{output_text} parts, and on a user
    turn C{input_image} (by URL) and C{input_audio} parts, kept as chat-completions media
    parts), C{function_call}, C{function_call_output}, C{reasoning}.
  - Assistant turns: an assistant message and the C{function_call} items right after it
    are one assistant turn, as are consecutive function calls. A C{reasoning} item's text
    (its C{content}, else its C{summary}) is the C{reasoning_content} of the assistant turn
    that follows it, or an assistant turn of its own when none follows.
    C{encrypted_content} is accepted and not used: loopd never issues it and cannot read
    another server's.
  - C{previous_response_id} puts the stored conversation of that response (its input, less
    its instructions, and its answer) before this request's input
    (L{loopd.gateway.response_store}); an unknown or expired id is a 400
    C{previous_response_not_found}. A response is stored when it completes unless its
    request said C{store: false} (OpenAI's default is C{true}; Codex sends C{false} and
    sends the whole input each turn, so nothing of its is kept).
  - C{reasoning.effort}: C{none} and C{minimal} turn thinking off; C{low}, C{medium} and
    C{high} (and C{xhigh}, C{max}) turn it on with the thinking cap of L{EFFORT_CAPS}
    (C{None}: the config's own cap). C{reasoning.summary} is accepted: the answer's
    reasoning item carries the whole reasoning text as C{content} and no summary.
  - C{text.format}: C{json_object} and C{json_schema} become the C{response_format} that
    llama-server's chat completions takes; C{text.verbosity} only C{medium}.
  - C{parallel_tool_calls: false} goes to the server; C{include} may name
    C{reasoning.encrypted_content} (a no-op); C{metadata}, C{user}, C{safety_identifier},
    C{prompt_cache_key} (also the session id, decision 36), C{service_tier} C{auto} or
    C{default}, C{truncation} C{disabled}, C{background} C{false},
    C{stream_options.include_obfuscation} are accepted and echoed. C{client_metadata}
    (Codex CLI sends its thread, turn and window ids there on every request) is accepted and
    neither echoed nor sent upstream: it is the client's own bookkeeping.
    C{timings_per_token} (llama-server's own) puts the server's per-token C{timings} on
    every delta event.
  - C{tools}: function tools; a C{namespace} tool (Codex CLI's C{multi_agent_v1}) is
    flattened into its function tools, each named C{<namespace>__<name>} for the model, and
    a call of one is answered as the client offered it: C{name} the tool's own,
    C{namespace} the namespace (a C{function_call} input item with a C{namespace} reads back
    as the flat name). Hosted tools (C{web_search}, C{file_search}, C{code_interpreter},
    C{computer_use}, C{image_generation}, C{mcp}) are left out and named in the request's
    C{dropped}, or refused under C{[doors] hosted_tools = "refuse"}
    (L{loopd.gateway.hosted_tools}). Any other field, tool type, item type or content part
    is a 400 naming it: nothing is dropped silently.

The answer's stream is the SDK's: C{event: <type>} lines whose data carry C{type} and a
C{sequence_number} counting from 0; C{response.created}, C{response.in_progress}, the
output items as they arrive, and C{response.completed} (C{response.incomplete} with
C{incomplete_details.reason: max_output_tokens} when the answer hit its token bound, as
OpenAI's API does). loopd's own events are C{: loopd {...}} comment lines. A stream that
fails ends with an C{error} event (loopd's own code) and then C{response.failed}.

Pure: values and functions, no I/O, no twisted.web.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn

from loopd.gateway.body import decode_body, fail, show
from loopd.gateway.door import Header, loopd_comment
from loopd.gateway.errors import GatewayError
from loopd.gateway.fields import Fields
from loopd.gateway.hosted_tools import HostedTools, hosted_responses_tool, refuse_hosted
from loopd.gateway.request import GatewayRequest, ThinkingSwitch, read_session
from loopd.gateway.response_store import ResponseStore, StoredResponse
from loopd.gateway.web import compact_json
from loopd.llama.types import (
    Assistant,
    ChatEvent,
    ChatMessage,
    Completion,
    Content,
    FinishReason,
    Reasoning,
    System,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolSchema,
    User,
)
from loopd.sse import encode_comment, encode_event

__all__ = ["EFFORT_CAPS", "ResponsesAnswer", "ResponsesDoor", "new_response_id"]

EFFORT_CAPS: Final[Mapping[str, int | None]] = {
    "low": 1024,
    "medium": 4096,
    "high": None,
    "xhigh": None,
    "max": None,
}
"""
The thinking cap, in reasoning tokens, of each C{reasoning.effort} that turns thinking on;
C{None} leaves the config's C{thinking.cap}, which stays the ceiling of every one.
"""
THINKING_OFF: Final = frozenset({"none", "minimal"})
"""The C{reasoning.effort} values that turn thinking off."""

_INVALID = "invalid_parameter"
_UNSUPPORTED = "unsupported_parameter"
_INPUT = "invalid_input"
_CONTENT = "unsupported_content"
_TOOLS = "invalid_tools"
_FIELDS = Fields(_INPUT, _INVALID)
_TOOL_CHOICES: Final = ("auto", "none", "required")
_SUMMARIES: Final = ("auto", "concise", "detailed")
_INCLUDES: Final = frozenset({"reasoning.encrypted_content"})
_SERVICE_TIERS: Final = ("auto", "default")

#: The body fields that become fields of the request itself; every other accepted one
#: is kept in C{extras}, where the answer reads what it echoes.
_MODELLED: Final = frozenset(
    {
        "model",
        "input",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
    }
)
_ACCEPTED: Final = _MODELLED | {
    "instructions",
    "reasoning",
    "text",
    "parallel_tool_calls",
    "include",
    "store",
    "previous_response_id",
    "metadata",
    "user",
    "prompt_cache_key",
    "safety_identifier",
    "service_tier",
    "truncation",
    "background",
    "stream_options",
    "client_metadata",
    "timings_per_token",
}


def new_response_id() -> str:
    """A fresh response id: C{resp_} and 24 random hex digits."""
    return "resp_" + os.urandom(12).hex()


def _new_id(prefix: str) -> str:
    """A fresh output item id with C{prefix} (C{msg}, C{rs}, C{fc})."""
    return f"{prefix}_{os.urandom(12).hex()}"


class ResponsesDoor:
    """
    The C{POST /v1/responses} front door (L{loopd.gateway.door.Door}).

    @ivar name: C{responses}.
    """

    name = "responses"

    def __init__(self, store: ResponseStore, hosted_tools: HostedTools = "drop") -> None:
        """
        @param store: the finished responses that C{previous_response_id} continues, and
            where the answers of requests that do not say C{store: false} go.
        @param hosted_tools: what a hosted tool (C{web_search} ...) does to a request: it is
            left out (C{drop}) or refused (C{refuse}), L{loopd.gateway.hosted_tools}.
        """
        self._store = store
        self._hosted_tools = hosted_tools

    def read(self, body: bytes, header: Header, anonymous: Callable[[], str]) -> GatewayRequest:
        """
        Decode and check one body (the module docstring says what is accepted); its session
        from the headers, else C{prompt_cache_key} (decision 36). C{null} reads as absent.
        The request's C{extras} keep the accepted fields that are not fields of the request
        itself (C{instructions}, C{store}, C{metadata} ...), as sent.

        @raise GatewayError: 400 C{invalid_request_error} naming the field: C{invalid_json},
            C{not_an_object}, C{missing_input}, C{invalid_input}, C{unsupported_content},
            C{invalid_tools}, C{invalid_parameter}, C{unsupported_parameter},
            C{previous_response_not_found}; and those of L{read_session}.
        """
        document = {k: v for k, v in decode_body(body).items() if v is not None}
        for key in document:
            if key not in _ACCEPTED:
                fail(_UNSUPPORTED, key, "not supported by loopd's /v1/responses")
        model = document.get("model")
        if model is not None:
            _FIELDS.string(model, "model", _INVALID)
        messages = self._messages(document)
        offered = _tools(document.get("tools"), self._hosted_tools)
        tool_choice, tools = _tool_choice(document.get("tool_choice"), offered.tools)
        switches, cap = _reasoning(document.get("reasoning"))
        fields = _text(document.get("text"))
        if _FIELDS.flag(document.get("parallel_tool_calls"), "parallel_tool_calls", True) is False:
            fields["parallel_tool_calls"] = False
        _check_accepted(document)
        session = read_session(
            header, anonymous, [("prompt_cache_key", document.get("prompt_cache_key"))]
        )
        return GatewayRequest(
            model=model,
            messages=messages,
            tools=tools,
            tool_choice=tool_choice,
            max_tokens=_max_tokens(document.get("max_output_tokens")),
            temperature=_FIELDS.number(document.get("temperature"), "temperature", 2),
            top_p=_FIELDS.number(document.get("top_p"), "top_p", 1),
            thinking_switches=switches,
            stream=_FIELDS.flag(document.get("stream"), "stream", False),
            session=session,
            thinking_cap=cap,
            fields=fields,
            extras={k: v for k, v in document.items() if k not in _MODELLED},
            dropped=offered.dropped,
            tool_namespaces=offered.namespaces,
            return_timings=document.get("timings_per_token") is True,
        )

    def _messages(self, document: dict[str, Any]) -> tuple[ChatMessage, ...]:
        """The conversation: instructions, the previous response's, then the input's."""
        messages: list[ChatMessage] = []
        instructions = document.get("instructions")
        if instructions is not None:
            messages.append(System(_FIELDS.string(instructions, "instructions", _INVALID)))
        previous = document.get("previous_response_id")
        if previous is not None:
            stored = self._store.get(_FIELDS.string(previous, "previous_response_id", _INVALID))
            if stored is None:
                fail(
                    "previous_response_not_found",
                    "previous_response_id",
                    f"no stored response {show(previous)} (unknown, expired, or stored with "
                    "store: false; loopd keeps responses in memory for a limited time)",
                )
            messages.extend(stored.messages)
        if "input" in document:
            messages.extend(_input(document["input"]))
        elif previous is None:
            fail("missing_input", "input", "required: a string or an array of input items")
        if not any(not isinstance(m, System) for m in messages):
            fail("missing_input", "input", "required: at least one item besides instructions")
        return tuple(messages)

    def answer(self, request: GatewayRequest, model: str, created: int) -> ResponsesAnswer:
        """The answer of C{request}, a new response with its own id."""
        return ResponsesAnswer(self._store, request, model, created)

    def error(self, error: GatewayError) -> tuple[int, object]:
        """
        OpenAI's error shape: C{{"error": {"message", "type", "code", "param"}}} (C{param}
        the field the error is about, else C{null}), with the error's own status. loopd's
        C{context_exceeded} goes out as OpenAI's C{context_length_exceeded}, the code Codex
        acts on.
        """
        return error.status, {
            "error": {
                "message": error.message,
                "type": error.type,
                "code": _openai_code(error),
                "param": error.param,
            }
        }


def _openai_code(error: GatewayError) -> str:
    """The error's code as an OpenAI client knows it."""
    return "context_length_exceeded" if error.code == "context_exceeded" else error.code


# ---------------------------------------------------------------------------------------
# Reading


def _max_tokens(value: object) -> int | None:
    """C{max_output_tokens}: a positive integer (C{2.0} is one)."""
    return None if value is None else _FIELDS.count(value, "max_output_tokens")


def _one_of(value: object, path: str, choices: tuple[str, ...], code: str = _INVALID) -> str:
    """A string among C{choices}."""
    if not isinstance(value, str) or value not in choices:
        shown = ", ".join(json.dumps(c) for c in choices)
        fail(code, path, f"expected one of {shown}")
    return value


def _no_other_keys(value: dict[str, Any], path: str, known: frozenset[str]) -> None:
    """Refuse a key of C{value} (not C{null}) outside C{known}."""
    for key, item in value.items():
        if key not in known and item is not None:
            fail(_UNSUPPORTED, f"{path}.{key}", "not supported by loopd's /v1/responses")


@dataclass
class _Turn:
    """The assistant turn being gathered from consecutive items."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    has_content: bool = False

    def message(self) -> Assistant | None:
        """The turn as a message, C{None} when nothing was gathered."""
        if not (self.has_content or self.reasoning or self.calls):
            return None
        return Assistant(
            "".join(self.content) if self.has_content else None,
            "\n\n".join(self.reasoning) if self.reasoning else None,
            tuple(self.calls),
        )


def _input(value: object) -> list[ChatMessage]:
    """C{input}: a string (one user turn) or an array of items, in order."""
    if isinstance(value, str):
        return [User(value)]
    if not isinstance(value, list) or not value:
        fail(_INPUT, "input", "expected a string or a non-empty array of input items")
    messages: list[ChatMessage] = []
    turn = _Turn()

    def flush() -> _Turn:
        message = turn.message()
        if message is not None:
            messages.append(message)
        return _Turn()

    for i, raw in enumerate(value):
        path = f"input[{i}]"
        item = _FIELDS.mapping(raw, path)
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"
        if kind == "message":
            role = _one_of(
                item.get("role"),
                f"{path}.role",
                ("user", "assistant", "system", "developer"),
                _INPUT,
            )
            if role == "assistant":
                if turn.calls:
                    turn = flush()
                turn.content.append(_text_content(item.get("content"), f"{path}.content"))
                turn.has_content = True
                continue
            turn = flush()
            if role == "user":
                messages.append(_user(item.get("content"), f"{path}.content"))
            else:
                messages.append(System(_text_content(item.get("content"), f"{path}.content")))
        elif kind == "function_call":
            name = _FIELDS.string(item.get("name"), f"{path}.name")
            namespace = item.get("namespace")
            if namespace is not None:
                name = flat_tool_name(_FIELDS.string(namespace, f"{path}.namespace"), name)
            turn.calls.append(
                ToolCall(
                    _FIELDS.string(item.get("call_id"), f"{path}.call_id"),
                    name,
                    _FIELDS.string(item.get("arguments"), f"{path}.arguments"),
                )
            )
        elif kind == "function_call_output":
            turn = flush()
            call_id = _FIELDS.string(item.get("call_id"), f"{path}.call_id")
            messages.append(Tool(call_id, _output(item.get("output"), f"{path}.output")))
        elif kind == "reasoning":
            if turn.has_content or turn.calls:
                turn = flush()
            text = _reasoning_text(item, path)
            if text:
                turn.reasoning.append(text)
        elif isinstance(kind, str):
            fail(
                _INPUT,
                f"{path}.type",
                f"{show(kind)} items are not supported (message, function_call, "
                "function_call_output, reasoning)",
            )
        else:
            fail(_INPUT, f"{path}.type", 'expected an item type such as "message"')
    flush()
    return messages


def _parts(value: object, path: str) -> list[Any]:
    """Content that is not a string: a non-empty array of parts."""
    if not isinstance(value, list):
        fail(_INPUT, path, "expected a string or an array of content parts")
    return value


def _part_kind(part: object, path: str) -> tuple[dict[str, Any], str]:
    """One content part and its C{type}."""
    body = _FIELDS.mapping(part, path)
    kind = body.get("type")
    if not isinstance(kind, str):
        fail(_INPUT, f"{path}.type", 'expected a content part type such as "input_text"')
    return body, kind


def _text_content(value: object, path: str) -> str:
    """Content as a string, or C{input_text} / C{output_text} parts joined."""
    if isinstance(value, str):
        return value
    texts = []
    for j, part in enumerate(_parts(value, path)):
        body, kind = _part_kind(part, f"{path}[{j}]")
        if kind not in ("input_text", "output_text"):
            _unsupported_part(kind, f"{path}[{j}].type", "text parts")
        texts.append(_FIELDS.string(body.get("text"), f"{path}[{j}].text"))
    return "".join(texts)


def _unsupported_part(kind: str, path: str, allowed: str) -> NoReturn:
    """Refuse a content part of kind C{kind} where only C{allowed} may be."""
    fail(_CONTENT, path, f"{show(kind)} parts are not supported here, only {allowed}")


def _user(value: object, path: str) -> User:
    """
    A user turn: text, and image and audio parts kept as chat-completions parts
    (C{image_url}, C{input_audio}) for the endpoint (C{auto} picks one that takes them).
    """
    if isinstance(value, str):
        return User(value)
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    media = False
    for j, part in enumerate(_parts(value, path)):
        where = f"{path}[{j}]"
        body, kind = _part_kind(part, where)
        if kind in ("input_text", "output_text"):
            text = _FIELDS.string(body.get("text"), f"{where}.text")
            texts.append(text)
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            if body.get("file_id") is not None:
                fail(
                    _CONTENT, f"{where}.file_id", "uploaded files are not supported; give image_url"
                )
            image: dict[str, Any] = {
                "url": _FIELDS.string(body.get("image_url"), f"{where}.image_url")
            }
            detail = body.get("detail")
            if detail is not None:
                image["detail"] = _one_of(
                    detail, f"{where}.detail", ("auto", "low", "high"), _INPUT
                )
            parts.append({"type": "image_url", "image_url": image})
            media = True
        elif kind == "input_audio":
            audio = _FIELDS.mapping(body.get("input_audio"), f"{where}.input_audio")
            data = _FIELDS.string(audio.get("data"), f"{where}.input_audio.data")
            audio_format = _FIELDS.string(audio.get("format"), f"{where}.input_audio.format")
            parts.append(
                {"type": "input_audio", "input_audio": {"data": data, "format": audio_format}}
            )
            media = True
        else:
            _unsupported_part(kind, f"{where}.type", "input_text, input_image and input_audio")
    return User("".join(texts), tuple(parts) if media else ())


def _output(value: object, path: str) -> str:
    """A function call's output: a string or C{input_text} parts joined."""
    if isinstance(value, str):
        return value
    texts = []
    for j, part in enumerate(_parts(value, path)):
        body, kind = _part_kind(part, f"{path}[{j}]")
        if kind not in ("input_text", "output_text"):
            _unsupported_part(kind, f"{path}[{j}].type", "text parts in a function call's output")
        texts.append(_FIELDS.string(body.get("text"), f"{path}[{j}].text"))
    return "".join(texts)


def _reasoning_text(item: dict[str, Any], path: str) -> str:
    """A reasoning item's text: its C{content} texts, else its C{summary} texts."""
    pieces: dict[str, list[str]] = {}
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        value = item.get(key)
        if value is None:
            continue
        if not isinstance(value, list):
            fail(_INPUT, f"{path}.{key}", f'expected an array of {{"type": "{kind}", "text": ...}}')
        texts = pieces.setdefault(key, [])
        for j, part in enumerate(value):
            body, found = _part_kind(part, f"{path}.{key}[{j}]")
            if found != kind:
                fail(_CONTENT, f"{path}.{key}[{j}].type", f'expected "{kind}"')
            texts.append(_FIELDS.string(body.get("text"), f"{path}.{key}[{j}].text"))
    encrypted = item.get("encrypted_content")
    if encrypted is not None:
        _FIELDS.string(encrypted, f"{path}.encrypted_content")
    return "".join(pieces.get("content") or ()) or "\n\n".join(pieces.get("summary") or ())


@dataclass(frozen=True)
class _Offered:
    """
    What C{tools} offers the model, and what it left out.

    @ivar tools: the function tools, namespaces flattened.
    @ivar dropped: the hosted tools left out, by type, each once.
    @ivar namespaces: each flattened tool's flat name to its namespace and own name.
    """

    tools: tuple[ToolSchema, ...] = ()
    dropped: tuple[str, ...] = ()
    namespaces: Mapping[str, tuple[str, str]] = field(default_factory=dict)


def flat_tool_name(namespace: str, name: str) -> str:
    """
    The name the model sees for tool C{name} of C{namespace}: C{<namespace>__<name>}, as
    Codex CLI itself flattens a namespaced name (C{multi_agent_v1__spawn_agent}).
    """
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


def _tools(value: object, hosted: HostedTools) -> _Offered:
    """
    C{tools}: function tools (C{name}, C{description}, C{parameters}, C{strict}), the
    function tools of C{namespace} tools under their flat names, hosted tools left out (or
    refused, by C{hosted}).
    """
    if value is None:
        return _Offered()
    if not isinstance(value, list):
        fail(_TOOLS, "tools", "expected an array of tools")
    tools: list[ToolSchema] = []
    dropped: list[str] = []
    namespaces: dict[str, tuple[str, str]] = {}
    for i, item in enumerate(value):
        path = f"tools[{i}]"
        tool = _FIELDS.mapping(item, path, _TOOLS)
        kind = tool.get("type")
        if isinstance(kind, str) and hosted_responses_tool(kind):
            if hosted == "refuse":
                refuse_hosted(f"{path}.type", kind)
            if kind not in dropped:
                dropped.append(kind)
        elif kind == "namespace":
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not namespace:
                fail(_TOOLS, f"{path}.name", "expected a non-empty string")
            if tool.get("description") is not None:
                _FIELDS.string(tool["description"], f"{path}.description", _TOOLS)
            _no_other_keys(tool, path, frozenset({"type", "name", "description", "tools"}))
            members = tool.get("tools")
            if not isinstance(members, list):
                fail(_TOOLS, f"{path}.tools", "expected an array of function tools")
            for j, member in enumerate(members):
                schema = _function_tool(member, f"{path}.tools[{j}]", [])
                flat = flat_tool_name(namespace, schema.name)
                _offer(tools, ToolSchema(flat, schema.description, schema.parameters), path)
                namespaces[flat] = (namespace, schema.name)
        else:
            tools.append(_function_tool(tool, path, tools))
    return _Offered(tuple(tools), tuple(dropped), namespaces)


def _offer(tools: list[ToolSchema], tool: ToolSchema, path: str) -> None:
    """Add C{tool}, refusing a name already offered."""
    if any(offered.name == tool.name for offered in tools):
        fail(_TOOLS, f"{path}.name", f"{show(tool.name)} is offered twice")
    tools.append(tool)


def _function_tool(value: object, path: str, offered: list[ToolSchema]) -> ToolSchema:
    """One function tool, its name not among C{offered}."""
    tool = _FIELDS.mapping(value, path, _TOOLS)
    kind = tool.get("type")
    if kind != "function":
        shown = show(kind) if isinstance(kind, str) else "a tool without a type"
        fail(_TOOLS, f"{path}.type", f"only function tools are supported, not {shown}")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        fail(_TOOLS, f"{path}.name", "expected a non-empty string")
    if any(tool.name == name for tool in offered):
        fail(_TOOLS, f"{path}.name", f"{show(name)} is offered twice")
    description = tool.get("description")
    if description is not None:
        _FIELDS.string(description, f"{path}.description", _TOOLS)
    parameters = tool.get("parameters")
    if parameters is None:
        parameters = {"type": "object"}
    elif not isinstance(parameters, dict):
        fail(_TOOLS, f"{path}.parameters", "expected a JSON schema object")
    _FIELDS.flag(tool.get("strict"), f"{path}.strict", True)
    _no_other_keys(tool, path, frozenset({"type", "name", "description", "parameters", "strict"}))
    return ToolSchema(name, description or "", parameters)


def _tool_choice(
    value: object, tools: tuple[ToolSchema, ...]
) -> tuple[str | None, tuple[ToolSchema, ...]]:
    """C{tool_choice} and the tools it leaves on offer."""
    if value is None:
        return None, tools
    if isinstance(value, str) and value in _TOOL_CHOICES:
        return value, tools
    if isinstance(value, dict) and value.get("type") == "function":
        name = _FIELDS.string(value.get("name"), "tool_choice.name", _INVALID)
        chosen = tuple(tool for tool in tools if tool.name == name)
        if not chosen:
            fail(_INVALID, "tool_choice.name", f"{show(name)} is not in tools")
        return "required", chosen
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        fail(_UNSUPPORTED, "tool_choice.type", f"{show(value['type'])} is not supported")
    fail(
        _INVALID,
        "tool_choice",
        'expected "auto", "none", "required" or {"type": "function", "name": ...}',
    )


def _reasoning(value: object) -> tuple[tuple[ThinkingSwitch, ...], int | None]:
    """C{reasoning}: the thinking switch and cap of its C{effort}; C{summary} is checked."""
    if value is None:
        return (), None
    reasoning = _FIELDS.mapping(value, "reasoning", _INVALID)
    _no_other_keys(reasoning, "reasoning", frozenset({"effort", "summary", "generate_summary"}))
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) is not None:
            _one_of(reasoning[key], f"reasoning.{key}", _SUMMARIES)
    effort = reasoning.get("effort")
    if effort is None:
        return (), None
    effort = _one_of(effort, "reasoning.effort", (*sorted(THINKING_OFF), *EFFORT_CAPS))
    if effort in THINKING_OFF:
        return (ThinkingSwitch("reasoning_effort", False),), None
    return (ThinkingSwitch("reasoning_effort", True),), EFFORT_CAPS[effort]


def _text(value: object) -> dict[str, Any]:
    """C{text}: the server fields of its C{format}; C{verbosity} only C{medium}."""
    if value is None:
        return {}
    text = _FIELDS.mapping(value, "text", _INVALID)
    _no_other_keys(text, "text", frozenset({"format", "verbosity"}))
    verbosity = text.get("verbosity")
    if verbosity is not None and verbosity != "medium":
        fail(
            _UNSUPPORTED,
            "text.verbosity",
            f"{show(verbosity)} is not supported: loopd cannot make a model terser or wordier",
        )
    form = text.get("format")
    if form is None:
        return {}
    form = _FIELDS.mapping(form, "text.format", _INVALID)
    kind = _one_of(form.get("type"), "text.format.type", ("text", "json_object", "json_schema"))
    if kind == "text":
        _no_other_keys(form, "text.format", frozenset({"type"}))
        return {}
    if kind == "json_object":
        _no_other_keys(form, "text.format", frozenset({"type"}))
        return {"response_format": {"type": "json_object"}}
    _no_other_keys(
        form, "text.format", frozenset({"type", "name", "schema", "strict", "description"})
    )
    schema: dict[str, Any] = {
        "name": _FIELDS.string(form.get("name"), "text.format.name", _INVALID),
        "schema": _FIELDS.mapping(form.get("schema"), "text.format.schema", _INVALID),
    }
    if form.get("description") is not None:
        schema["description"] = _FIELDS.string(
            form["description"], "text.format.description", _INVALID
        )
    if form.get("strict") is not None:
        schema["strict"] = _FIELDS.flag(form["strict"], "text.format.strict", False)
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


def _check_accepted(document: dict[str, Any]) -> None:
    """The fields accepted without effect on the answer: checked, so a bad one is a 400."""
    _FIELDS.flag(document.get("store"), "store", True)
    include = document.get("include")
    if include is not None:
        if not isinstance(include, list):
            fail(_INVALID, "include", "expected an array of strings")
        for j, name in enumerate(include):
            if name not in _INCLUDES:
                shown = show(name) if isinstance(name, str) else "a non-string"
                fail(_UNSUPPORTED, f"include[{j}]", f"{shown} is not supported")
    metadata = document.get("metadata")
    if metadata is not None:
        for key, item in _FIELDS.mapping(metadata, "metadata", _INVALID).items():
            _FIELDS.string(item, f"metadata.{key}", _INVALID)
    for key in ("user", "safety_identifier"):
        if key in document:
            _FIELDS.string(document[key], key, _INVALID)
    if "service_tier" in document:
        _one_of(document["service_tier"], "service_tier", _SERVICE_TIERS, _UNSUPPORTED)
    if "truncation" in document:
        _one_of(document["truncation"], "truncation", ("disabled",), _UNSUPPORTED)
    if document.get("background") not in (None, False):
        fail(_UNSUPPORTED, "background", "only false: loopd answers every request at once")
    _FIELDS.flag(document.get("timings_per_token"), "timings_per_token", False)
    options = document.get("stream_options")
    if options is not None:
        options = _FIELDS.mapping(options, "stream_options", _INVALID)
        _no_other_keys(options, "stream_options", frozenset({"include_obfuscation"}))
        _FIELDS.flag(
            options.get("include_obfuscation"), "stream_options.include_obfuscation", False
        )


# ---------------------------------------------------------------------------------------
# Writing


@dataclass
class _Item:
    """One output item of a streamed answer, as it was sent so far."""

    kind: str
    id: str
    index: int
    text: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    namespace: str | None = None
    call_index: int = -1

    def json(self, status: str) -> dict[str, Any]:
        """The item as the C{response}'s C{output} has it."""
        text = "".join(self.text)
        if self.kind == "reasoning":
            return _reasoning_item(self.id, text, status)
        if self.kind == "message":
            return _message_item(self.id, text, status)
        return _call_item(self.id, self.call_id, (self.namespace, self.name), text, status)


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning item: the whole reasoning text as content, no summary."""
    content = [{"type": "reasoning_text", "text": text}] if text or status != "in_progress" else []
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": content}


def _output_text(text: str) -> dict[str, Any]:
    """An C{output_text} content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """An assistant message item with one C{output_text} part (none while it opens)."""
    content = [_output_text(text)] if status != "in_progress" else []
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call_item(
    item_id: str, call_id: str, name: tuple[str | None, str], arguments: str, status: str
) -> dict[str, Any]:
    """A function call item; C{name} is the tool's namespace (C{None}: none) and name."""
    namespace, own = name
    item = {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": own,
        "arguments": arguments,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item


def _split_name(flat: str, namespaces: Mapping[str, tuple[str, str]]) -> tuple[str | None, str]:
    """A called tool's namespace and name as the client offered it (L{flat_tool_name})."""
    namespace, own = namespaces.get(flat, (None, flat))
    return namespace, own


def _usage(completion: Completion) -> dict[str, Any]:
    """The C{usage}: input counts the reused and the evaluated prompt tokens."""
    timings = completion.timings
    prompt = timings.cache_n + timings.prompt_n
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": timings.cache_n, "cache_write_tokens": 0},
        "output_tokens": timings.predicted_n,
        "output_tokens_details": {"reasoning_tokens": completion.reasoning_tokens},
        "total_tokens": prompt + timings.predicted_n,
    }


# The SDK's Response.error.code is one of a fixed list; loopd's own code goes in the
# error event before it. Codex acts on context_length_exceeded, which the list lacks.
_FAILED_CODES: Final = {429: "rate_limit_exceeded"}


def _failed_code(error: GatewayError) -> str:
    """The C{response.error.code} of a failed response."""
    if error.code == "context_exceeded":
        return "context_length_exceeded"
    return _FAILED_CODES.get(error.status, "server_error")


class ResponsesAnswer:
    """
    One response (L{loopd.gateway.door.Answer}): its id, the output items streamed so far
    and the event sequence number; it stores the finished response in the door's store
    unless the request said C{store: false}.

    @ivar response_id: the response's id, C{resp_...}.
    """

    def __init__(
        self, store: ResponseStore, request: GatewayRequest, model: str, created: int
    ) -> None:
        """
        @param store: where the finished response goes.
        @param request: the request it answers.
        @param model: the endpoint's name (or C{mesh}), as the response names its model.
        @param created: seconds of the epoch.
        """
        self.response_id = new_response_id()
        self._store = store
        self._request = request
        self._model = model
        self._created = created
        self._sequence = 0
        self._items: list[_Item] = []
        self._open: _Item | None = None

    # -- the response object

    def _response(
        self,
        status: str,
        output: list[dict[str, Any]],
        completion: Completion | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The C{response} object with C{status} and C{output}, echoing the request."""
        request = self._request
        extras = request.extras
        reasoning = extras.get("reasoning") or {}
        text: dict[str, Any] = {
            "format": (extras.get("text") or {}).get("format") or {"type": "text"}
        }
        if (extras.get("text") or {}).get("verbosity") is not None:
            text["verbosity"] = extras["text"]["verbosity"]
        incomplete = None
        if completion is not None and completion.finish_reason is FinishReason.LENGTH:
            incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self._created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": extras.get("instructions"),
            "max_output_tokens": request.max_tokens,
            "metadata": extras.get("metadata") or {},
            "model": self._model,
            "output": output,
            "parallel_tool_calls": extras.get("parallel_tool_calls", True),
            "previous_response_id": extras.get("previous_response_id"),
            "prompt_cache_key": extras.get("prompt_cache_key"),
            "reasoning": {
                "effort": reasoning.get("effort"),
                "summary": reasoning.get("summary") or reasoning.get("generate_summary"),
            },
            "safety_identifier": extras.get("safety_identifier"),
            "service_tier": extras.get("service_tier", "default"),
            "store": self._stores,
            "temperature": request.temperature,
            "text": text,
            "tool_choice": request.tool_choice or "auto",
            "tools": [
                {
                    "type": "function",
                    "name": tool.name,
                    "description": tool.description or None,
                    "parameters": tool.parameters,
                }
                for tool in request.tools
            ],
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": None if completion is None else _usage(completion),
            "user": extras.get("user"),
        }

    @property
    def _stores(self) -> bool:
        """Whether the finished response is kept for C{previous_response_id}."""
        return self._request.extras.get("store") is not False

    def _keep(self, completion: Completion) -> None:
        """Store the finished response, unless the request said C{store: false}."""
        if not self._stores:
            return
        messages = self._request.messages
        if "instructions" in self._request.extras:
            messages = messages[1:]
        self._store.put(self.response_id, StoredResponse(messages, completion.as_message()))

    @staticmethod
    def _final_status(completion: Completion) -> str:
        """C{incomplete} for an answer cut at its token bound, else C{completed}."""
        return "incomplete" if completion.finish_reason is FinishReason.LENGTH else "completed"

    def body(self, completion: Completion) -> object:
        """
        The C{response} object: a reasoning item when the model thought, a message item
        when it answered text (or said nothing at all), a function call item per tool
        call; C{usage} with the cached tokens and the reasoning tokens.
        """
        status = self._final_status(completion)
        output: list[dict[str, Any]] = []
        if completion.reasoning_content:
            output.append(_reasoning_item(_new_id("rs"), completion.reasoning_content, status))
        if completion.content or not completion.tool_calls:
            output.append(_message_item(_new_id("msg"), completion.content or "", status))
        for call in completion.tool_calls:
            name = _split_name(call.name, self._request.tool_namespaces)
            output.append(_call_item(_new_id("fc"), call.id, name, call.arguments, status))
        self._keep(completion)
        return self._response(status, output, completion)

    # -- the stream

    def _event(self, kind: str, **fields: Any) -> bytes:
        """One event of the stream, with the next sequence number."""
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return encode_event(kind, compact_json(payload))

    def opening(self) -> bytes:
        """C{response.created} and C{response.in_progress}, with no output yet."""
        snapshot = self._response("in_progress", [])
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def keepalive(self) -> bytes:
        """
        C{response.in_progress} again, with the next sequence number and the response as
        it stands: Codex CLI's stream timer counts events with data, not comments, and the
        SDK's accumulator takes a repeated one as it takes the first.
        """
        output = [item.json("in_progress") for item in self._items]
        return self._event("response.in_progress", response=self._response("in_progress", output))

    def during(self, event: ChatEvent) -> bytes:
        """
        Text, thinking and tool call pieces as output item events (a new item when the kind
        of piece, or the tool call, changes; the previous one closed first); loopd's own
        events as C{: loopd} comment lines; C{b""} for the rest.
        """
        if isinstance(event, Reasoning) and event.text:
            item, opened = self._item("reasoning")
            return opened + self._event(
                "response.reasoning_text.delta",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                delta=self._add(item, event.text),
                **self._timings(event),
            )
        if isinstance(event, Content) and event.text:
            item, opened = self._item("message")
            return opened + self._event(
                "response.output_text.delta",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                delta=self._add(item, event.text),
                logprobs=[],
                **self._timings(event),
            )
        if isinstance(event, ToolCallDelta):
            return self._call_piece(event)
        comment = loopd_comment(event)
        return b"" if comment is None else encode_comment("loopd " + compact_json(comment))

    def _timings(self, event: Reasoning | Content | ToolCallDelta) -> dict[str, Any]:
        """The piece's server C{timings}, as an event's field, when the request asked."""
        if self._request.return_timings and event.timings is not None:
            return {"timings": event.timings}
        return {}

    @staticmethod
    def _add(item: _Item, text: str) -> str:
        """Record C{text} as sent on C{item}; give it back."""
        item.text.append(text)
        return text

    def _item(self, kind: str, call: ToolCallDelta | None = None) -> tuple[_Item, bytes]:
        """
        The open item if it is of C{kind} (and, for a call, the same call), else a new one
        opened after closing the open one: the item and the bytes that opened it.
        """
        current = self._open
        if current is not None and current.kind == kind:
            if call is None or call.index == current.call_index:
                return current, b""
        sent = self._close()
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = _Item(kind, _new_id(prefix), len(self._items))
        if call is not None:
            item.call_index = call.index
            item.call_id = call.id or _new_id("call")
            namespaces = self._request.tool_namespaces
            item.namespace, item.name = _split_name(call.name or "", namespaces)
        self._items.append(item)
        self._open = item
        sent += self._event(
            "response.output_item.added", output_index=item.index, item=item.json("in_progress")
        )
        part = None
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            part = _output_text("")
        if part is not None:
            sent += self._event(
                "response.content_part.added",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                part=part,
            )
        return item, sent

    def _call_piece(self, event: ToolCallDelta) -> bytes:
        """A piece of a tool call: its item opened on first sight, then argument deltas."""
        item, sent = self._item("function_call", event)
        if event.arguments:
            sent += self._event(
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=item.index,
                delta=self._add(item, event.arguments),
                **self._timings(event),
            )
        return sent

    def _close(self) -> bytes:
        """The C{.done} events of the open item, if any; none is open after."""
        item = self._open
        if item is None:
            return b""
        self._open = None
        text = "".join(item.text)
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            sent = self._event("response.reasoning_text.done", **where, content_index=0, text=text)
            sent += self._event("response.content_part.done", **where, content_index=0, part=part)
        elif item.kind == "message":
            sent = self._event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            )
            sent += self._event(
                "response.content_part.done", **where, content_index=0, part=_output_text(text)
            )
        else:
            sent = self._event(
                "response.function_call_arguments.done", **where, name=item.name, arguments=text
            )
        return sent + self._event(
            "response.output_item.done", output_index=item.index, item=item.json("completed")
        )

    def _missing(self, completion: Completion) -> list[ChatEvent]:
        """What C{completion} has that the stream did not carry (thinking, text, calls)."""
        kinds = {item.kind for item in self._items}
        calls = {item.call_index for item in self._items if item.kind == "function_call"}
        events: list[ChatEvent] = []
        if completion.reasoning_content and "reasoning" not in kinds:
            events.append(Reasoning(completion.reasoning_content))
        if completion.content and "message" not in kinds:
            events.append(Content(completion.content))
        for index, call in enumerate(completion.tool_calls):
            if index not in calls:
                events.append(ToolCallDelta(index, call.id, call.name, call.arguments))
        return events

    def closing(self, completion: Completion) -> bytes:
        """
        What the stream lacks of C{completion}, the C{.done} events of the open item, then
        C{response.completed} (C{response.incomplete} for an answer cut at its token
        bound) with the whole response.
        """
        sent = b"".join(self.during(event) for event in self._missing(completion))
        sent += self._close()
        status = self._final_status(completion)
        output = [item.json(status) for item in self._items]
        self._keep(completion)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return sent + self._event(kind, response=self._response(status, output, completion))

    def stream_error(self, error: GatewayError) -> bytes:
        """
        An C{error} event with loopd's own code, then C{response.failed} with the output
        sent so far (each item C{incomplete}) and C{error} (C{rate_limit_exceeded} for a
        429, C{context_length_exceeded}, else C{server_error}).
        """
        self._open = None
        sent = self._event("error", code=error.code, message=error.message, param=None)
        output = [item.json("incomplete") for item in self._items]
        failure = {"code": _failed_code(error), "message": error.message, "type": error.type}
        return sent + self._event(
            "response.failed", response=self._response("failed", output, error=failure)
        )
