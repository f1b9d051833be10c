# -*- test-case-name: loopd.test.test_gateway_chat,loopd.test.test_gateway_translate -*-
"""
The OpenAI chat-completions front door, C{POST /v1/chat/completions} (DESIGN.md §3,
decisions 15 to 19): L{ChatDoor} reads a body with L{parse_request} and writes the answer as
a C{chat.completion} or a stream of C{chat.completion.chunk}s (L{loopd.gateway.render}),
errors in OpenAI's shape. The way between is L{loopd.gateway.exchange}'s, as for every door.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from loopd.gateway.door import Answer, Header, loopd_comment
from loopd.gateway.errors import GatewayError
from loopd.gateway.render import ChunkStream, completion_json, new_completion_id
from loopd.gateway.request import GatewayRequest, read_session
from loopd.gateway.translate import parse_request
from loopd.gateway.web import comment_line, compact_json, data_line, done_line
from loopd.llama.types import ChatEvent, Completion, Content, Reasoning

__all__ = ["ChatDoor"]

#: The body fields of a chat request that name its session, after the headers (decision 36).
_BODY_SESSION_IDS = ("user",)


class ChatDoor:
    """
    The chat-completions door: OpenAI's request, OpenAI's answers and error shape.
    """

    name = "chat"

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

    def body(self, completion: Completion) -> object:
        """The C{chat.completion} object."""
        chunks = self._chunks
        return completion_json(
            completion,
            completion_id=chunks.completion_id,
            model=chunks.model,
            created=chunks.created,
        )
