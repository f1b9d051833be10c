# -*- test-case-name: loopd.test.test_gateway_translate -*-
"""
The gateway's answers in OpenAI's shapes: L{completion_json}, a C{chat.completion} object;
L{ChunkStream}, C{chat.completion.chunk}s. Pure: no I/O, no reactor, no twisted.web.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from loopd.gateway.request import GatewayRequest
from loopd.llama.request import render_messages
from loopd.llama.types import (
    ChatEvent,
    Choice,
    Completion,
    Content,
    Logprobs,
    Progress,
    Reasoning,
    Timings,
    ToolCallDelta,
)

__all__ = ["ChunkStream", "completion_json", "new_completion_id"]


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
    A finished completion as OpenAI's C{chat.completion} object: its choices (one, or
    every choice of a request for C{n}, by index), each a message with C{content},
    C{reasoning_content} when set and C{tool_calls} when any, its C{finish_reason}, and
    C{logprobs} (C{{"content": [...]}}, the server's entries) when the server sent them;
    then C{usage} (with C{prompt_tokens_details.cached_tokens}) and the upstream's
    C{timings} (C{cache_n}, C{prompt_n}, C{predicted_n} and, when known,
    C{predicted_per_second}).
    """
    first = Choice(
        0,
        completion.content,
        completion.reasoning_content,
        completion.tool_calls,
        completion.finish_reason,
        completion.logprobs,
    )
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [_choice_json(choice) for choice in (first, *completion.choices)],
        "usage": _usage(completion.timings),
        "timings": {k: v for k, v in asdict(completion.timings).items() if v is not None},
    }


def _choice_json(choice: Choice) -> dict[str, Any]:
    """One choice of a C{chat.completion}."""
    rendered: dict[str, Any] = {
        "index": choice.index,
        "message": render_messages([choice.as_message()])[0],
        "finish_reason": choice.finish_reason.value,
    }
    if choice.logprobs is not None:
        rendered["logprobs"] = {"content": list(choice.logprobs)}
    return rendered


@dataclass(frozen=True)
class ChunkStream:
    """
    Renders one streamed answer as C{chat.completion.chunk} dicts, each with the same id,
    created time and model, and a real C{choices[0]} (the usage chunk excepted, which has
    C{choices: []} as in OpenAI's API).

    @ivar include_usage: L{finish_chunks} ends with a usage chunk.
    @ivar return_progress: a L{Progress} event is also a chunk with the server's
        C{prompt_progress}, as llama-server's own stream has when the client asked for
        C{return_progress}.
    @ivar return_timings: a piece's chunk carries the server's C{timings} of its own chunk,
        as llama-server's own stream has when the client asked for C{timings_per_token}.
    """

    completion_id: str
    model: str
    created: int
    include_usage: bool
    return_progress: bool = False
    return_timings: bool = False

    @classmethod
    def for_request(
        cls, request: GatewayRequest, completion_id: str, model: str, created: int
    ) -> ChunkStream:
        """
        The chunks of C{request}'s answer: its C{include_usage}, C{return_progress} and
        C{return_timings}.
        """
        return cls(
            completion_id,
            model,
            created,
            request.include_usage,
            request.return_progress,
            request.return_timings,
        )

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """The envelope every chunk shares."""
        return {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _delta(
        self,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        *,
        index: int = 0,
        logprobs: tuple[Any, ...] = (),
    ) -> dict[str, Any]:
        """A chunk whose C{choices[0]} carries C{delta} (and C{logprobs} when any)."""
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason}
        if logprobs:
            choice["logprobs"] = {"content": list(logprobs)}
        return self._chunk([choice])

    def role_chunk(self) -> dict[str, Any]:
        """The first chunk: the assistant role, with C{content} null as llama-server's."""
        return self._delta({"role": "assistant", "content": None})

    def keepalive_chunk(self) -> dict[str, Any]:
        """A chunk that says nothing: the first choice with an empty delta."""
        return self._delta({})

    def chunks_for(self, event: ChatEvent) -> list[dict[str, Any]]:
        """
        The chunks for one event: thinking text as a C{reasoning_content} delta, answer
        text as a C{content} delta, a piece of a tool call as a C{tool_calls} delta (with
        C{id} and C{type} when the id first shows, C{name} when the name does), each with
        its choice's index and its chunk's C{logprobs} when the server sent them (and its
        C{timings} with L{return_timings}); token
        entries without a piece (L{Logprobs}) as an empty delta with them; with
        L{return_progress}, prompt progress as the server's C{prompt_progress} chunk (a
        role delta, C{prompt_progress} C{{total, cache, processed, time_ms}}). Empty
        pieces and every other event give none.
        """
        if isinstance(event, Reasoning) and event.text:
            delta: dict[str, Any] = {"reasoning_content": event.text}
            return [self._piece(delta, event)]
        if isinstance(event, Content) and event.text:
            delta = {"content": event.text}
            return [self._piece(delta, event)]
        if isinstance(event, ToolCallDelta) and (event.id or event.name or event.arguments):
            call: dict[str, Any] = {"index": event.index}
            if event.id is not None:
                call.update(id=event.id, type="function")
            name = {} if event.name is None else {"name": event.name}
            call["function"] = {**name, "arguments": event.arguments}
            delta = {"tool_calls": [call]}
            return [self._piece(delta, event)]
        if isinstance(event, Logprobs) and event.entries:
            return [self._delta({}, index=event.choice, logprobs=event.entries)]
        if isinstance(event, Progress) and self.return_progress:
            progress = {"total": event.total, "cache": event.cache, "processed": event.processed}
            if event.time_ms is not None:
                progress["time_ms"] = event.time_ms
            return [{**self.role_chunk(), "prompt_progress": progress}]
        return []

    def _piece(
        self, delta: dict[str, Any], event: Reasoning | Content | ToolCallDelta
    ) -> dict[str, Any]:
        """A piece's chunk: its delta, its logprobs, and its timings when they were asked for."""
        chunk = self._delta(delta, index=event.choice, logprobs=event.logprobs)
        if self.return_timings and event.timings is not None:
            chunk["timings"] = event.timings
        return chunk

    def finish_chunks(self, completion: Completion) -> list[dict[str, Any]]:
        """
        The closing chunks: a finish chunk (an empty delta and the C{finish_reason}) for
        each choice, by index, then the usage chunk when the client asked for it.
        """
        chunks = [self._delta({}, completion.finish_reason.value)]
        chunks += [
            self._delta({}, choice.finish_reason.value, index=choice.index)
            for choice in completion.choices
        ]
        if self.include_usage:
            chunks.append({**self._chunk([]), "usage": _usage(completion.timings)})
        return chunks
