# -*- test-case-name: loopd.test.test_moa_knobs -*-
"""
The request knobs of a mesh turn: sampling per role, the caller's thinking choice and the
thinking injection (reference C{mesh-moa.md} §1.6), and the upstream body of one worker or
reducer call (DESIGN decision 28).

Thinking is off unless the caller's request turns it on with one of the knobs that
L{extract_override} reads (v1's host policy; v2 forces it off, the issue keeps v1's escape
hatch). Pure functions: a body passed in is never changed, a new one is returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from loopd.moa.context import Packed
from loopd.moa.roles import Role

__all__ = [
    "REDUCER_SAMPLING",
    "THINKING_ALIASES",
    "WORKER_SAMPLING",
    "SamplingParams",
    "apply_enable_thinking",
    "effective_enable_thinking",
    "extract_override",
    "sampling_for",
    "upstream_body",
]

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
"""The boolean spellings of "thinking on", in the order they are checked (last found wins)."""


@dataclass(frozen=True)
class SamplingParams:
    """The sampling of one upstream call."""

    temperature: float
    """Sent as C{temperature}."""
    top_p: float
    """Sent as C{top_p}."""


WORKER_SAMPLING: Final = SamplingParams(temperature=0.8, top_p=0.95)
"""Workers sample widely, for diverse drafts."""
REDUCER_SAMPLING: Final = SamplingParams(temperature=0.3, top_p=0.9)
"""The reducer samples narrowly, for a precise synthesis."""


def sampling_for(role: Role) -> SamplingParams:
    """L{REDUCER_SAMPLING} for the reducer, L{WORKER_SAMPLING} for every worker role."""
    return REDUCER_SAMPLING if role is Role.REDUCER else WORKER_SAMPLING


def _is_zero(value: object) -> bool:
    """Whether a JSON value is the number 0 (C{0.0} too; C{false} is not a number)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value == 0


def _aliases(fields: Mapping[str, Any]) -> bool | None:
    """The last of L{THINKING_ALIASES} present in C{fields} as a JSON boolean, or None."""
    found = None
    for alias in THINKING_ALIASES:
        value = fields.get(alias)
        if isinstance(value, bool):
            found = value
    return found


def extract_override(body: object) -> bool | None:
    """
    The caller's thinking choice, or None when it expressed none. Rules, in order, each
    later one overwriting an earlier result:

      1. C{reasoning} is an object: off when C{enabled} is false, C{effort} is C{"none"} or
         C{max_tokens} is 0; else on when C{enabled} is true or C{effort} or C{max_tokens}
         is present (any value).
      2. C{reasoning_effort} is a string: on unless it is C{"none"}.
      3. The top-level L{THINKING_ALIASES} that are JSON booleans, the last found winning.
      4. C{thinking_budget} is 0: off (another value sets nothing).
      5. The same aliases inside C{chat_template_kwargs}.
    """
    if not isinstance(body, Mapping):
        return None
    choice: bool | None = None
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping):
        if (
            reasoning.get("enabled") is False
            or reasoning.get("effort") == "none"
            or _is_zero(reasoning.get("max_tokens"))
        ):
            choice = False
        elif reasoning.get("enabled") is True or "effort" in reasoning or "max_tokens" in reasoning:
            choice = True
    effort = body.get("reasoning_effort")
    if isinstance(effort, str):
        choice = effort != "none"
    top = _aliases(body)
    if top is not None:
        choice = top
    if _is_zero(body.get("thinking_budget")):
        choice = False
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, Mapping):
        nested = _aliases(kwargs)
        if nested is not None:
            choice = nested
    return choice


def effective_enable_thinking(body: object) -> bool:
    """The host policy: the caller's L{extract_override}, else off."""
    choice = extract_override(body)
    return False if choice is None else choice


def apply_enable_thinking(body: Any, enable: bool | None) -> Any:
    """
    C{body} with the thinking choice injected, as a new object (§1.6): C{enable} goes to
    C{chat_template_kwargs.enable_thinking}, merged into an existing object or into C{{}}
    when the field is missing or not an object; when it is false C{reasoning_effort} is
    C{"none"} too, when true C{reasoning_effort} is left alone. With None, or a body that is
    not an object, C{body} itself is returned.
    """
    if enable is None or not isinstance(body, Mapping):
        return body
    injected = dict(body)
    kwargs = injected.get("chat_template_kwargs")
    merged = dict(kwargs) if isinstance(kwargs, Mapping) else {}
    merged["enable_thinking"] = enable
    injected["chat_template_kwargs"] = merged
    if not enable:
        injected["reasoning_effort"] = "none"
    return injected


def upstream_body(
    packed: Packed,
    *,
    model: str | None,
    sampling: SamplingParams,
    enable_thinking: bool,
    stream: bool = False,
) -> dict[str, Any]:
    """
    The body of one worker or reducer call (DESIGN decision 28): C{model} when the endpoint
    names one, C{messages}, C{max_tokens} (the role's budget), C{temperature}, C{top_p},
    C{stream}, C{tools} when the packing sends any, then L{apply_enable_thinking}:
    C{chat_template_kwargs.enable_thinking} and, when thinking is off,
    C{reasoning_effort: "none"}.
    """
    body: dict[str, Any] = {}
    if model is not None:
        body["model"] = model
    body["messages"] = list(packed.messages)
    body["max_tokens"] = packed.max_tokens
    body["temperature"] = sampling.temperature
    body["top_p"] = sampling.top_p
    body["stream"] = stream
    if packed.tools is not None:
        body["tools"] = list(packed.tools)
    injected: dict[str, Any] = apply_enable_thinking(body, enable_thinking)
    return injected
