# -*- test-case-name: loopd.test.test_gateway_translate -*-
"""
The gateway's answers in OpenAI's shapes: L{completion_json}, a C{chat.completion} object;
L{ChunkStream}, C{chat.completion.chunk}s; L{loopd_comment}, loopd's own events for the SSE
comment lines that OpenAI clients ignore. Pure: no I/O, no reactor, no twisted.web.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from loopd.llama.request import render_messages
from loopd.llama.types import (
    ChatEvent,
    Completion,
    Content,
    Progress,
    Queued,
    Reasoning,
    Retrying,
    ThinkingCapped,
    Timings,
    ToolCallDelta,
    Waiting,
)

__all__ = ["ChunkStream", "completion_json", "loopd_comment", "new_completion_id"]


def new_completion_id() -> str:
    """A fresh completion id: C{chatcmpl-} and 24 random hex digits."""
    return "chatcmpl-" + os.urandom(12).hex()


def _usage(timings: Timings) -> dict[str, Any]:
    """OpenAI's C{usage}: the prompt counts both the reused and the evaluated tokens."""
    prompt = timings.cache_n + timings.prompt_n
    return {
        "prompt_tokens": prompt,
        "completion_tokens": timings.predicted_n,
        "total_tokens": prompt + timings.predicted_n,
        "prompt_tokens_details": {"cached_tokens": timings.cache_n},
    }


def completion_json(
    completion: Completion, *, completion_id: str, model: str, created: int
) -> dict[str, Any]:
    """
    A finished completion as OpenAI's C{chat.completion} object: one choice whose message
    has C{content}, C{reasoning_content} when set and C{tool_calls} when any, its
    C{finish_reason}, C{usage} (with C{prompt_tokens_details.cached_tokens}) and the
    upstream's C{timings} (C{cache_n}, C{prompt_n}, C{predicted_n} and, when known,
    C{predicted_per_second}).
    """
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": render_messages([completion.as_message()])[0],
                "finish_reason": completion.finish_reason.value,
            }
        ],
        "usage": _usage(completion.timings),
        "timings": {k: v for k, v in asdict(completion.timings).items() if v is not None},
    }


@dataclass(frozen=True)
class ChunkStream:
    """
    Renders one streamed answer as C{chat.completion.chunk} dicts, each with the same id,
    created time and model, and a real C{choices[0]} (the usage chunk excepted, which has
    C{choices: []} as in OpenAI's API).

    @ivar include_usage: L{finish_chunks} ends with a usage chunk.
    """

    completion_id: str
    model: str
    created: int
    include_usage: bool

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """The envelope every chunk shares."""
        return {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _delta(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        """A chunk whose C{choices[0]} carries C{delta}."""
        return self._chunk([{"index": 0, "delta": delta, "finish_reason": finish_reason}])

    def role_chunk(self) -> dict[str, Any]:
        """The first chunk: the assistant role, with empty content."""
        return self._delta({"role": "assistant", "content": ""})

    def chunks_for(self, event: ChatEvent) -> list[dict[str, Any]]:
        """
        The chunks for one event: thinking text as a C{reasoning_content} delta, answer
        text as a C{content} delta, a piece of a tool call as a C{tool_calls} delta (with
        C{id} and C{type} when the id first shows, C{name} when the name does). Empty
        pieces and every other event give none.
        """
        if isinstance(event, Reasoning) and event.text:
            return [self._delta({"reasoning_content": event.text})]
        if isinstance(event, Content) and event.text:
            return [self._delta({"content": event.text})]
        if isinstance(event, ToolCallDelta) and (event.id or event.name or event.arguments):
            call: dict[str, Any] = {"index": event.index}
            if event.id is not None:
                call.update(id=event.id, type="function")
            name = {} if event.name is None else {"name": event.name}
            call["function"] = {**name, "arguments": event.arguments}
            return [self._delta({"tool_calls": [call]})]
        return []

    def finish_chunks(self, completion: Completion) -> list[dict[str, Any]]:
        """
        The closing chunks: the finish chunk (an empty delta and the C{finish_reason}), then
        the usage chunk when the client asked for it.
        """
        chunks = [self._delta({}, completion.finish_reason.value)]
        if self.include_usage:
            chunks.append({**self._chunk([]), "usage": _usage(completion.timings)})
        return chunks


def loopd_comment(event: ChatEvent) -> dict[str, Any] | None:
    """
    loopd's own events, for the C{: loopd {...}} comment lines of a stream: C{queued}
    (C{ahead}), C{waiting} (C{slot_busy}, C{loading}), C{progress} (C{total}, C{cache},
    C{processed}), C{thinking_capped} (C{tokens}), C{retrying} (C{attempt}, C{after_ms},
    C{error}). None for the events that are chunks.
    """
    name = _COMMENTS.get(type(event))
    if name is None:
        return None
    return {"event": name, **asdict(event)}


# The comment's fields are exactly the event's, in the same order.
_COMMENTS: dict[type[ChatEvent], str] = {
    Queued: "queued",
    Waiting: "waiting",
    Progress: "progress",
    ThinkingCapped: "thinking_capped",
    Retrying: "retrying",
}
