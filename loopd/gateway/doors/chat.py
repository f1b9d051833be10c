# -*- test-case-name: loopd.test.test_doors_chat,loopd.test.test_doors_chat_read -*-
"""
The OpenAI chat-completions front door, C{POST /v1/chat/completions} (DESIGN.md §3,
decisions 15 to 19), and its writer: L{ChatDoor} reads a body with
L{loopd.gateway.doors.chat_read.parse_request} and writes the answer as a C{chat.completion}
(L{completion_json}) or a stream of C{chat.completion.chunk}s (L{ChunkStream}), errors in
OpenAI's shape. The way between is L{loopd.gateway.exchange}'s, as for every door.

Pure: no I/O, no reactor, no twisted.web.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from loopd.gateway.doors.chat_mesh import MeshChatAnswer
from loopd.gateway.doors.chat_read import parse_request
from loopd.gateway.doors.door import (
    EVENT_STREAM,
    Answer,
    Header,
    comment_line,
    compact_json,
    data_line,
    done_line,
    loopd_comment,
)
from loopd.gateway.errors import GatewayError
from loopd.gateway.request import GatewayRequest, read_session
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

__all__ = ["ChatDoor", "ChunkStream", "completion_json", "new_completion_id"]


def new_completion_id() -> str:
    """A fresh completion id: C{chatcmpl-} and 24 random hex digits."""
    return "chatcmpl-" + os.urandom(12).hex()


def _usage(timings: Timings) -> dict[str, Any]:
    """
    OpenAI's C{usage}: the prompt counts both the reused and the evaluated tokens, the reused
    ones in C{prompt_tokens_details.cached_tokens}; and the same split in DeepSeek's fields
    C{prompt_cache_hit_tokens} and C{prompt_cache_miss_tokens}, the ones Aider (through
    LiteLLM) reads for its "cache hit" figure, which ignores OpenAI's (docs/cache-report.md).
    """
    prompt = timings.cache_n + timings.prompt_n
    return {
        "prompt_tokens": prompt,
        "completion_tokens": timings.predicted_n,
        "total_tokens": prompt + timings.predicted_n,
        "prompt_tokens_details": {"cached_tokens": timings.cache_n},
        "prompt_cache_hit_tokens": timings.cache_n,
        "prompt_cache_miss_tokens": timings.prompt_n,
    }


def completion_json(
    completion: Completion, *, completion_id: str, model: str, created: int
) -> dict[str, Any]:
    """
    A finished completion as OpenAI's C{chat.completion} object: its choices (one, or
    every choice of a request for C{n}, by index), each a message with C{content},
    C{reasoning_content} when set and C{tool_calls} when any, its C{finish_reason}, and
    C{logprobs} (C{{"content": [...]}}, the server's entries) when the server sent them;
    then C{usage} (with C{prompt_tokens_details.cached_tokens}, and DeepSeek's
    C{prompt_cache_hit_tokens} and C{prompt_cache_miss_tokens}) and the upstream's
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


#: The body fields of a chat request that name its session, after the headers (decision 36).
_BODY_SESSION_IDS = ("user",)


class ChatDoor:
    """
    The chat-completions door: OpenAI's request, OpenAI's answers and error shape.
    """

    name = "chat"
    stream_type = EVENT_STREAM

    def read(self, body: bytes, header: Header, anonymous: Callable[[], str]) -> GatewayRequest:
        """
        The request (L{parse_request}) and its session: the headers of decision 36, then the
        body's C{user}.

        @raise GatewayError: 400 naming the field.
        """
        parsed = parse_request(body)
        session = read_session(
            header, anonymous, [(name, parsed.extras.get(name)) for name in _BODY_SESSION_IDS]
        )
        return dataclasses.replace(parsed, session=session)

    def answer(self, request: GatewayRequest, model: str, created: int) -> Answer:
        """A fresh completion id's answer, its chunks stamped with C{model} and C{created}."""
        return _ChatAnswer(ChunkStream.for_request(request, new_completion_id(), model, created))

    def mesh_answer(self, request: GatewayRequest, answer_id: str, created: int) -> Answer:
        """A mesh turn's answer in the reference's shapes (L{MeshChatAnswer})."""
        return MeshChatAnswer(answer_id, created)

    def error(self, error: GatewayError) -> tuple[int, object]:
        """
        OpenAI's error shape, C{{"error": {"message", "type", "code", "param"}}}, with its
        status (L{GatewayError.body}).
        """
        return error.status, error.body()


#: Stands for a piece's text while a text chunk's template is rendered (see L{_TextLine}).
_SAMPLE_TEXT = "\x00"


class _TextLine:
    """
    The SSE line of a plain text piece (reasoning or content, the first choice, no logprobs,
    no timings asked for)
    from a template: the bytes L{data_line} makes of L{ChunkStream}'s chunk for it, before
    and after the encoded text, so that a piece costs one encoding of its string instead of
    building and encoding the whole chunk. The template is that very rendering, cut where
    a sample text stands, so both ways give the same bytes.
    """

    __slots__ = ("_after", "_before")

    def __init__(self, chunks: ChunkStream, sample: Reasoning | Content) -> None:
        """@param sample: a piece of the kind this line carries, with L{_SAMPLE_TEXT}."""
        (chunk,) = chunks.chunks_for(sample)
        # The text is the chunk's last string: a model name equal to the sample is not cut.
        line = data_line(chunk)
        self._before, self._after = line.rsplit(compact_json(_SAMPLE_TEXT).encode(), 1)

    def __call__(self, text: str) -> bytes:
        """The line for a piece with C{text}."""
        return self._before + compact_json(text).encode() + self._after


class _ChatAnswer:
    """One chat-completions answer: L{ChunkStream}'s chunks, or the C{chat.completion}."""

    def __init__(self, chunks: ChunkStream) -> None:
        """@param chunks: renders this answer's chunks."""
        self._chunks = chunks
        # Made on a kind's first piece: an answer without thinking never needs the other.
        self._text_lines: dict[type[ChatEvent], _TextLine] = {}

    def opening(self) -> bytes:
        """The role chunk."""
        return data_line(self._chunks.role_chunk())

    def during(self, event: ChatEvent) -> bytes:
        """
        A C{: loopd} comment for loopd's own events, then the event's chunks; a plain text
        piece, nearly every event of a stream, from its template (L{_TextLine}).
        """
        if (
            isinstance(event, (Reasoning, Content))
            and event.text
            and event.choice == 0
            and not event.logprobs
            and not self._chunks.return_timings
        ):
            kind = type(event)
            text_line = self._text_lines.get(kind)
            if text_line is None:
                text_line = self._text_lines[kind] = _TextLine(self._chunks, kind(_SAMPLE_TEXT))
            return text_line(event.text)
        comment = loopd_comment(event)
        lines = [] if comment is None else [comment_line(comment)]
        lines.extend(data_line(chunk) for chunk in self._chunks.chunks_for(event))
        return b"".join(lines)

    def keepalive(self) -> bytes:
        """
        A chunk whose first choice has an empty delta: every chat client (the SDKs, the AI
        SDK, LiteLLM) takes it and adds nothing, and it has the real C{choices[0]} every
        chunk of loopd's has (decision 17).
        """
        return data_line(self._chunks.keepalive_chunk())

    def closing(self, completion: Completion) -> bytes:
        """The finish chunk (and the usage chunk when asked), then C{[DONE]}."""
        chunks = self._chunks.finish_chunks(completion)
        return b"".join(data_line(chunk) for chunk in chunks) + done_line()

    def stream_error(self, error: GatewayError) -> bytes:
        """One C{data: {"error": ...}} event (and no C{[DONE]}, decision 18)."""
        return data_line(error.body())

    def error(self, error: GatewayError) -> tuple[int, object]:
        """OpenAI's error shape, as the door's (L{ChatDoor.error})."""
        return error.status, error.body()

    def body(self, completion: Completion) -> object:
        """The C{chat.completion} object."""
        chunks = self._chunks
        return completion_json(
            completion,
            completion_id=chunks.completion_id,
            model=chunks.model,
            created=chunks.created,
        )
