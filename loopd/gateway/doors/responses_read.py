# -*- test-case-name: loopd.test.test_doors_responses_read -*-
"""
The reader of the OpenAI Responses front door (L{loopd.gateway.doors.responses}):
L{parse_responses} turns a C{POST /v1/responses} body into the gateway's one request model,
L{GatewayRequest}.

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
    (L{loopd.gateway.doors.responses_store}); an unknown or expired id is a 400
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
    (L{loopd.gateway.doors.hosted_tools}). Any other field, tool type, item type or content part
    is a 400 naming it: nothing is dropped silently.

Pure: values and functions, no I/O, no twisted.web.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn

from loopd.gateway.doors.door import Header
from loopd.gateway.doors.fields import Fields, decode_body, fail, show
from loopd.gateway.doors.hosted_tools import HostedTools, dropped_hosted, hosted_responses_tool
from loopd.gateway.doors.responses_store import ResponseStore
from loopd.gateway.doors.tools import offered_tool, openai_tool_choice
from loopd.gateway.request import GatewayRequest, ThinkingSwitch, read_session
from loopd.llama.types import (
    Assistant,
    ChatMessage,
    System,
    Tool,
    ToolCall,
    ToolSchema,
    User,
)

__all__ = ["EFFORT_CAPS", "THINKING_OFF", "flat_tool_name", "parse_responses"]

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


def parse_responses(
    body: bytes,
    header: Header,
    anonymous: Callable[[], str],
    store: ResponseStore,
    hosted_tools: HostedTools = "drop",
) -> GatewayRequest:
    """
    Decode and check one C{POST /v1/responses} body (the module docstring says what is
    accepted), C{previous_response_id} looked up in C{store}, a hosted tool dropped or
    refused as C{hosted_tools} says (L{loopd.gateway.doors.hosted_tools}); its session
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
    messages = _messages(document, store)
    offered = _tools(document.get("tools"), hosted_tools)
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


def _messages(document: dict[str, Any], store: ResponseStore) -> tuple[ChatMessage, ...]:
    """The conversation: instructions, the previous response's, then the input's."""
    messages: list[ChatMessage] = []
    instructions = document.get("instructions")
    if instructions is not None:
        messages.append(System(_FIELDS.string(instructions, "instructions", _INVALID)))
    previous = document.get("previous_response_id")
    if previous is not None:
        stored = store.get(_FIELDS.string(previous, "previous_response_id", _INVALID))
        if stored is None:
            fail(
                "previous_response_not_found",
                "previous_response_id",
                f"no stored response {show(previous)} (unknown, expired, stored with "
                "store: false, or evicted: loopd keeps responses in memory for an hour, the "
                "last 1,000 and 64 Mi characters of their text)",
            )
        messages.extend(stored.messages)
    if "input" in document:
        messages.extend(_input(document["input"]))
    elif previous is None:
        fail("missing_input", "input", "required: a string or an array of input items")
    if not any(not isinstance(m, System) for m in messages):
        fail("missing_input", "input", "required: at least one item besides instructions")
    return tuple(messages)


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
            messages.append(
                Tool(
                    call_id,
                    _text_content(
                        item.get("output"),
                        f"{path}.output",
                        "text parts in a function call's output",
                    ),
                )
            )
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


def _text_content(value: object, path: str, allowed: str = "text parts") -> str:
    """
    Content as a string, or C{input_text} / C{output_text} parts joined (a function call's
    output too); another part is refused naming what is C{allowed} there.
    """
    if isinstance(value, str):
        return value
    texts = []
    for j, part in enumerate(_parts(value, path)):
        body, kind = _part_kind(part, f"{path}[{j}]")
        if kind not in ("input_text", "output_text"):
            _unsupported_part(kind, f"{path}[{j}].type", allowed)
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
        if dropped_hosted(kind, f"{path}.type", hosted, dropped, hosted_responses_tool):
            continue
        if kind == "namespace":
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
    schema = offered_tool(tool, path, offered)
    _FIELDS.flag(tool.get("strict"), f"{path}.strict", True)
    _no_other_keys(tool, path, frozenset({"type", "name", "description", "parameters", "strict"}))
    return schema


def _tool_choice(
    value: object, tools: tuple[ToolSchema, ...]
) -> tuple[str | None, tuple[ToolSchema, ...]]:
    """C{tool_choice} and the tools it leaves on offer (L{openai_tool_choice})."""
    chosen = openai_tool_choice(
        value,
        tools,
        name_of=lambda choice: choice.get("name"),
        path="tool_choice.name",
        code=_INVALID,
    )
    if chosen is not None:
        return chosen
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
            if not isinstance(name, str) or name not in _INCLUDES:
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
