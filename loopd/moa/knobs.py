# -*- test-case-name: loopd.test.test_moa_knobs -*-
"""
The request knobs of a mesh turn: sampling per role, the host's thinking policy (reference
C{mesh-moa.md} §1.6), and the upstream request of one worker or reducer call (DESIGN
decision 28).

Thinking is off unless the caller's request turns it on (v1's host policy; v2 forces it off,
the issue keeps v1's escape hatch). The caller's choice is read once, by the front door
(L{loopd.gateway.request.GatewayRequest.thinking_override}); the injection of §1.6 is the
upstream request's C{thinking} (rendered as C{chat_template_kwargs.enable_thinking}, plus
C{reasoning_effort: "none"} when off, by L{loopd.llama.request.chat_body}). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from loopd.llama.types import ChatRequest
from loopd.moa.context import Packed
from loopd.moa.roles import Role

__all__ = [
    "REDUCER_SAMPLING",
    "WORKER_SAMPLING",
    "SamplingParams",
    "effective_enable_thinking",
    "sampling_for",
    "upstream_request",
]


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


def effective_enable_thinking(override: bool | None) -> bool:
    """The host policy: the caller's thinking choice (C{override}), else off."""
    return False if override is None else override


def upstream_request(
    packed: Packed, *, sampling: SamplingParams, enable_thinking: bool
) -> ChatRequest:
    """
    The request of one worker or reducer call (DESIGN decision 28): the packed messages,
    the role's budget as C{max_tokens}, the role's C{temperature} and C{top_p}, the tools
    when the packing sends any, and the thinking choice, sent to every kind of endpoint
    (C{template_thinking}). The slot is the gateway's to choose.
    """
    return ChatRequest(
        slot=-1,
        messages=packed.messages,
        tools=packed.tools or (),
        thinking=enable_thinking,
        max_tokens=packed.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        template_thinking=True,
    )
