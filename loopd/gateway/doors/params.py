# -*- test-case-name: loopd.test.test_doors_params -*-
"""
The chat parameters loopd passes to the server as they are (issue 14, Deliver 0): which body
fields of a chat-completions request reach the server, which loopd reads itself, which it
accepts and ignores, and which it refuses. Nothing that changes the answer is dropped
silently: a field loopd cannot honour is a 400 that names it.

  - L{OPENAI_FIELDS}: OpenAI's own (C{response_format}, C{seed}, C{logprobs}, ...), which
    llama-server and every OpenAI-compatible engine understand; passed as sent.
  - L{LLAMA_FIELDS}: llama.cpp's own (its README's list: C{top_k}, C{min_p}, C{grammar},
    C{json_schema}, C{ignore_eos}, C{n_probs}, C{samplers}, ...); passed as sent to a
    llama-server, refused for an C{openai}-kind endpoint (L{refused_fields}).
  - L{LOOPD_FIELDS}: what loopd reads itself and never passes (C{user}, the session id;
    C{return_progress}, whether the client gets the server's C{prompt_progress} chunks;
    C{timings_per_token}, whether its chunks carry the server's per-token C{timings};
    C{cache_prompt}, which loopd always sets).
  - L{IGNORED_FIELDS}: fields SDKs and agents send that change nothing in the answer
    (C{store}, C{metadata}, C{service_tier}, C{prediction}, ...); accepted and ignored.
  - L{MANAGED_FIELDS}: fields loopd sets itself on every upstream request (C{id_slot},
    C{reasoning_control}, ...): a client's value is a 400 naming it.
  - L{UNSUPPORTED_FIELDS}: fields whose answer loopd cannot give (C{audio},
    C{web_search_options}, C{functions}, ...): a 400 naming them.
  - Any other field is unknown: a 400 C{unsupported_parameter} naming it.

Only light type checks are made (a number, an integer, a boolean, an object, a string, an
array), where the type is obvious; what a value means is the server's to judge, and its 400
reaches the client unchanged (L{loopd.gateway.errors}). A C{null} reads as absent.

Pure: values and functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

from loopd.gateway.doors.fields import integral
from loopd.gateway.errors import GatewayError

__all__ = [
    "IGNORED_FIELDS",
    "LLAMA_FIELDS",
    "LOOPD_FIELDS",
    "MANAGED_FIELDS",
    "OPENAI_FIELDS",
    "UNSUPPORTED_FIELDS",
    "Kind",
    "refusal",
    "refused_fields",
    "split_fields",
]

Kind = Literal["number", "integer", "boolean", "object", "string", "array", "json"]
"""The JSON type a passed field must have; C{json} is any value (the server checks it)."""

OPENAI_FIELDS: Final[Mapping[str, Kind]] = {
    "response_format": "object",
    "seed": "integer",
    "logprobs": "boolean",
    "top_logprobs": "integer",
    "presence_penalty": "number",
    "frequency_penalty": "number",
    "logit_bias": "json",
    "parallel_tool_calls": "boolean",
    "n": "integer",
}
"""
OpenAI's chat fields that loopd passes as sent, by the type each must have. llama-server
takes C{response_format} itself (C{json_object} with an optional C{schema}, C{json_schema}
with C{json_schema.schema}, C{text}); C{logprobs} becomes its C{n_probs} (C{top_logprobs},
default 20), and the answer's C{logprobs} come back in loopd's answer and chunks.
"""

LLAMA_FIELDS: Final[Mapping[str, Kind]] = {
    # sampling
    "top_k": "integer",
    "min_p": "number",
    "typical_p": "number",
    "top_n_sigma": "number",
    "xtc_probability": "number",
    "xtc_threshold": "number",
    "dynatemp_range": "number",
    "dynatemp_exponent": "number",
    "repeat_last_n": "integer",
    "repeat_penalty": "number",
    "dry_multiplier": "number",
    "dry_base": "number",
    "dry_allowed_length": "integer",
    "dry_penalty_last_n": "integer",
    "dry_sequence_breakers": "array",
    "mirostat": "integer",
    "mirostat_tau": "number",
    "mirostat_eta": "number",
    "adaptive_target": "number",
    "adaptive_decay": "number",
    "min_keep": "integer",
    "samplers": "json",
    "backend_sampling": "boolean",
    # constrained output
    "grammar": "string",
    "json_schema": "object",
    "ignore_eos": "boolean",
    # probabilities
    "n_probs": "integer",
    "post_sampling_probs": "boolean",
    # generation limits and context
    "t_max_predict_ms": "integer",
    "n_indent": "integer",
    "n_keep": "integer",
    "n_discard": "integer",
    "n_cache_reuse": "integer",
    # adapters
    "lora": "array",
    # the chat template and the reasoning parser
    "reasoning_format": "string",
    "add_generation_prompt": "boolean",
    "continue_final_message": "json",
    "reasoning_budget_tokens": "integer",
    "thinking_budget_tokens": "integer",
    "reasoning_budget_message": "string",
}
"""llama.cpp's own chat fields (its server README's list) that loopd passes to a llama-server."""

LOOPD_FIELDS: Final = frozenset({"user", "return_progress", "timings_per_token", "cache_prompt"})
"""
Fields loopd reads itself and never passes: C{user} names the session (DESIGN decision 36);
C{return_progress} (a boolean) asks for the server's C{prompt_progress} chunks in the
stream, which loopd always asks the server for; C{timings_per_token} (a boolean) asks for
the server's C{timings} on every chunk, which loopd always asks the server for (its
thinking cap counts tokens from them); C{cache_prompt} may only be C{true}, which loopd
always sends.
"""

IGNORED_FIELDS: Final = frozenset(
    {
        "store",
        "metadata",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "prediction",
        "modalities",
    }
)
"""
Fields accepted and ignored, because ignoring them changes nothing in the answer: OpenAI's
stored completions (C{store}, C{metadata}), its billing tier (C{service_tier}), its cache
and abuse hints (C{prompt_cache_key}, C{safety_identifier}), Predicted Outputs
(C{prediction}, a speed-up only), and C{modalities} when it asks for text alone (asking for
audio is a 400).
"""

MANAGED_FIELDS: Final[Mapping[str, str]] = {
    "id_slot": "loopd pins each session to its slot itself",
    "reasoning_control": "loopd arms the reasoning-end control itself (its thinking cap)",
    "sse_ping_interval": "loopd keeps the client's stream alive with its own comments",
    "n_predict": "use max_tokens, which loopd bounds by its configured max_tokens",
    "n_cmpl": "use n",
}
"""Fields loopd sets itself on every upstream request, each with why a client's is a 400."""

UNSUPPORTED_FIELDS: Final[Mapping[str, str]] = {
    "audio": "loopd answers in text only",
    "web_search_options": "loopd has no web search",
    "functions": "use tools",
    "function_call": "use tool_choice",
    "verbosity": "not supported by llama-server",
    "return_tokens": "loopd does not relay the server's token ids",
    "response_fields": "loopd does not relay the server's own response fields",
    "verbose": "loopd does not relay the server's debug output",
}
"""Fields whose answer loopd cannot give, each with why a client's is a 400."""

_CODE = "unsupported_parameter"
_TYPES: Final[Mapping[Kind, str]] = {
    "number": "a number",
    "integer": "an integer",
    "boolean": "true or false",
    "object": "an object",
    "string": "a string",
    "array": "an array",
}


def split_fields(extras: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """
    Split the top-level body fields a front door does not model itself into the fields for
    the server and the rest.

    @param extras: the body's fields the door does not model, as sent.
    @return: the fields for the server (L{OPENAI_FIELDS} and L{LLAMA_FIELDS}, as sent, in
        the body's order; an integral number such as C{2.0} is sent as the integer), and
        the rest that loopd keeps (L{LOOPD_FIELDS} and L{IGNORED_FIELDS}). A C{null} is
        dropped as absent, and so is C{n} of 1.
    @raise GatewayError: 400 C{invalid_parameter} for a value of the wrong type (the first,
        in the body's order); 400 C{unsupported_parameter} naming every field of
        L{MANAGED_FIELDS}, L{UNSUPPORTED_FIELDS} and every unknown one (C{modalities} other
        than C{["text"]}, C{cache_prompt} other than C{true} among them).
    """
    fields: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    refused: list[tuple[str, str]] = []
    for name, value in extras.items():
        if value is None:
            continue
        kind = OPENAI_FIELDS.get(name) or LLAMA_FIELDS.get(name)
        if kind is not None:
            checked = _checked(name, value, kind)
            if name != "n" or checked != 1:
                fields[name] = checked
        elif name in LOOPD_FIELDS:
            rest[name] = _loopd_field(name, value, refused)
        elif name in IGNORED_FIELDS:
            if name == "modalities" and value != ["text"]:
                refused.append((name, 'loopd answers in text only (["text"])'))
            rest[name] = value
        elif name in MANAGED_FIELDS:
            refused.append((name, MANAGED_FIELDS[name]))
        elif name in UNSUPPORTED_FIELDS:
            refused.append((name, UNSUPPORTED_FIELDS[name]))
        else:
            refused.append((name, "unknown parameter"))
    if refused:
        raise _refusal(refused)
    return fields, rest


def refused_fields(fields: Mapping[str, Any], endpoint_kind: str) -> tuple[str, ...]:
    """
    The fields of C{fields} (a request's L{split_fields} fields for the server) that an
    endpoint of C{endpoint_kind} cannot take, sorted: L{LLAMA_FIELDS} for an C{openai}
    endpoint; every one for C{mesh} (its workers and reducer are loopd's own requests);
    none for a C{llama-server}.
    """
    if endpoint_kind == "mesh":
        return tuple(sorted(fields))
    if endpoint_kind == "openai":
        return tuple(sorted(name for name in fields if name in LLAMA_FIELDS))
    return ()


def refusal(names: tuple[str, ...], where: str) -> GatewayError:
    """
    The 400 C{unsupported_parameter} that refuses C{names} (from L{refused_fields})
    C{where} they cannot apply (C{"on an openai endpoint"}, C{"on model mesh"}).
    """
    return GatewayError(
        400,
        f"{', '.join(names)}: not supported {where}",
        "invalid_request_error",
        _CODE,
        param=names[0] if names else None,
    )


def _loopd_field(name: str, value: object, refused: list[tuple[str, str]]) -> object:
    """A field loopd reads itself, checked; a bad value adds to C{refused}."""
    if name in ("return_progress", "timings_per_token"):
        return _checked(name, value, "boolean")
    if name == "cache_prompt":
        _checked(name, value, "boolean")
        if value is not True:
            refused.append((name, "loopd always reuses the cached prompt (only true)"))
    return value


def _checked(name: str, value: object, kind: Kind) -> object:
    """
    C{value} if it has the JSON type C{kind} (an integral float as an int for C{integer});
    booleans are not numbers.

    @raise GatewayError: 400 C{invalid_parameter} naming the field.
    """
    if kind == "json":
        return value
    if kind in ("number", "integer"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad_type(name, kind)
        if kind == "integer":
            value = integral(value)
            if not isinstance(value, int):
                raise _bad_type(name, kind)
        return value
    expected = {"boolean": bool, "object": dict, "string": str, "array": list}[kind]
    if not isinstance(value, expected):
        raise _bad_type(name, kind)
    return value


def _bad_type(name: str, kind: Kind) -> GatewayError:
    """The 400 of a field whose value has the wrong type."""
    return GatewayError(
        400,
        f"{name}: expected {_TYPES[kind]}",
        "invalid_request_error",
        "invalid_parameter",
        param=name,
    )


def _refusal(refused: list[tuple[str, str]]) -> GatewayError:
    """The 400 that names every refused field and why: C{name: why; name: why}."""
    reasons = "; ".join(f"{name}: {why}" for name, why in refused)
    return GatewayError(400, reasons, "invalid_request_error", _CODE, param=refused[0][0])
