# -*- test-case-name: loopd.test.test_llama_assemble -*-
"""
Streamed chat-completion chunks folded into one assistant turn.

Pure: an L{Assembler} takes the chunks of one streamed answer, already decoded from JSON
(one per SSE data event, C{[DONE]} excluded), and returns for each the events it carries;
at the end it builds the L{Completion}. The result depends only on the sequence of chunks,
never on how the bytes of the stream were split into reads.

What a chunk may carry (reference: llama-server-api.md §1-§2):

  - C{id}: the completion id, the same on every chunk; a different one is L{Protocol}.
  - C{prompt_progress} C{{total, cache, processed}}: a L{Progress} event.
  - C{choices[0].delta}: C{reasoning_content} (L{Reasoning}), C{content} (L{Content}),
    C{tool_calls} (L{ToolCallDelta}, one per entry); C{role} and empty or null pieces
    carry nothing.
  - C{choices[0].logprobs.content}: the chunk's token entries (a request that asked for
    C{logprobs}); they go on the chunk's first piece, or in a L{Logprobs} event of their
    own when it has none, and all of them, in order, on the L{Completion}.
  - C{choices[0].finish_reason}: C{stop}, C{tool_calls} or C{length} once, at the end.
  - C{choices[0].index}: a request for C{n} choices gets each chunk's one choice by its
    index (the events carry it as C{choice}); the answer is complete when every choice
    that appeared has its finish reason, and its C{predicted_n} is the sum of theirs.
  - C{timings}: the server's counts so far; the latest are kept, and its C{predicted_n}
    goes on the chunk's text pieces as their C{generated} count. A chunk without
    C{timings} but with a C{usage} object (an OpenAI-compatible server asked for
    C{include_usage}) gives counts from it instead: C{cached_tokens} as C{cache_n}, the
    rest of C{prompt_tokens} as C{prompt_n}, C{completion_tokens} as C{predicted_n}.
  - C{choices: []}: a usage chunk, which only updates the timings.
  - C{error}: the server failed mid-stream (DESIGN §3.5): L{Http}.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeGuard

from loopd import strict_json
from loopd.errors import Http, Protocol, StreamClosedEarly
from loopd.llama.types import (
    ChatEvent,
    Choice,
    Completion,
    Content,
    FinishReason,
    Logprobs,
    Progress,
    Reasoning,
    Timings,
    ToolCall,
    ToolCallDelta,
)

__all__ = ["Assembler", "parse_chunk"]

_FINISH_REASONS = {reason.value: reason for reason in FinishReason}


def parse_chunk(data: str) -> dict[str, Any]:
    """
    Decode the data of one SSE event into a chunk.

    @raise Protocol: it is not JSON (C{NaN} and C{Infinity} included), or not an object.
    """
    try:
        value = strict_json.decode(data)
    except strict_json.JSONError as error:
        raise Protocol(f"chunk is not JSON: {error}: {data[:80]!r}") from None
    if not isinstance(value, dict):
        raise Protocol(f"chunk is not a JSON object: {data[:80]!r}")
    return value


class _CallParts:
    """A tool call as far as it has arrived."""

    __slots__ = ("arguments", "id", "name")

    def __init__(self) -> None:
        """No id yet, and no piece of the name or arguments."""
        self.id: str | None = None
        self.name: list[str] = []
        self.arguments: list[str] = []


class _ChoiceParts:
    """One choice of the answer as far as it has arrived."""

    __slots__ = ("calls", "content", "finish", "logprobs", "predicted", "reasoning")

    def __init__(self) -> None:
        """Nothing received."""
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: dict[int, _CallParts] = {}
        self.finish: FinishReason | None = None
        self.logprobs: list[Any] | None = None
        self.predicted = 0

    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The tool calls, sorted by index."""
        return tuple(
            ToolCall(parts.id or "", "".join(parts.name), "".join(parts.arguments))
            for _, parts in sorted(self.calls.items())
        )


class Assembler:
    """
    Folds the chunks of one streamed chat completion into a L{Completion}.

    Feed every chunk, in order, to L{feed}; call L{completion} after the last one. An
    assembler that raised has seen a broken stream and must not be fed again.
    """

    def __init__(self) -> None:
        """Start with nothing received."""
        self._id: str | None = None
        self._choices: dict[int, _ChoiceParts] = {0: _ChoiceParts()}
        self._timings: Timings | None = None
        self._answering = False
        self._reasoning_tokens = 0

    @property
    def id(self) -> str | None:
        """
        The completion's id (the key of the reasoning-end control), once a chunk had one.
        """
        return self._id

    @property
    def in_reasoning(self) -> bool:
        """
        Whether the answer is still in its reasoning phase: no content or tool-call piece
        has arrived yet (of the first choice).
        """
        return not self._answering

    @property
    def reasoning_tokens(self) -> int:
        """
        The latest per-chunk C{timings.predicted_n} (or C{usage.completion_tokens}) seen
        while still in the reasoning phase: up to, not including, the chunk with the first
        content or tool-call piece; a usage chunk does not count (the first choice's).
        """
        return self._reasoning_tokens

    @property
    def timings(self) -> Timings | None:
        """
        The latest counts the server reported, or None before any.
        """
        return self._timings

    @property
    def finish_reason(self) -> FinishReason | None:
        """
        Why generation stopped (the first choice), once the chunk saying so has arrived.
        """
        return self._choices[0].finish

    def feed(self, chunk: object, text: str | None = None) -> list[ChatEvent]:
        """
        Take the next chunk.

        @param chunk: the decoded JSON of one SSE data event (see L{parse_chunk}).
        @param text: that event's data as received; it becomes the body of an L{Http}
            error. When None, the chunk is encoded again for it.
        @return: the events the chunk carries, in order: L{Progress} first, then
            L{Reasoning}, L{Content} and L{ToolCallDelta} pieces (or a L{Logprobs} event
            when the chunk carried token entries but no piece).
        @raise Http: the chunk is an error event; C{status} is its C{error.code}, or 500
            when it has none.
        @raise Protocol: the chunk is not what a chat-completions stream sends: not an
            object, no C{choices}, a changed C{id}, a value of the wrong type, more than one
            choice, an unknown C{finish_reason}, a C{finish_reason} while a tool call has
            no name, or a choice's chunk after its C{finish_reason}.
        """
        if not isinstance(chunk, dict):
            raise Protocol(f"chunk is not an object: {type(chunk).__name__}")
        if "error" in chunk:
            raise _http_error(chunk, text)
        self._check_id(chunk.get("id"))
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise Protocol("chunk has no choices list")
        timings = _read_timings(chunk)
        if timings is not None:
            self._timings = timings
        if not choices:
            return []
        choice = _only_choice(choices)
        index = choice.get("index", 0)
        parts = self._choices.get(index)
        if parts is None:
            parts = self._choices[index] = _ChoiceParts()
        if parts.finish is not None:
            raise Protocol("chunk after the finish_reason")
        if timings is not None:
            parts.predicted = timings.predicted_n
        events: list[ChatEvent] = []
        progress = chunk.get("prompt_progress")
        if progress is not None:
            events.append(_read_progress(progress))
        generated = None if timings is None else timings.predicted_n
        entries = _read_logprobs(choice.get("logprobs"))
        if entries is not None:
            parts.logprobs = (parts.logprobs or []) + list(entries)
        pieces = len(events)
        raw_timings = chunk.get("timings")
        self._read_delta(
            parts,
            index,
            choice.get("delta"),
            events,
            generated,
            raw_timings if isinstance(raw_timings, dict) else None,
        )
        if entries:
            if len(events) > pieces:
                first = events[pieces]
                assert isinstance(first, (Reasoning, Content, ToolCallDelta))
                events[pieces] = dataclasses.replace(first, logprobs=entries)
            else:
                events.append(Logprobs(entries, index))
        if index == 0 and not self._answering and timings is not None:
            self._reasoning_tokens = timings.predicted_n
        finish = choice.get("finish_reason")
        if finish is not None:
            reason = _FINISH_REASONS.get(finish) if isinstance(finish, str) else None
            if reason is None:
                raise Protocol(f"unknown finish_reason {finish!r}")
            _check_calls(parts)
            parts.finish = reason
        return events

    def completion(self, thinking_capped: bool = False) -> Completion:
        """
        The assembled turn: text joined, tool calls sorted by index, the latest timings
        (all zero when the server sent none), content and reasoning None when empty; the
        further choices of a request for C{n}, by index, with C{predicted_n} the sum of
        every choice's.

        @param thinking_capped: whether the thinking cap ended the reasoning.
        @raise StreamClosedEarly: a choice has not carried its C{finish_reason}.
        """
        if any(parts.finish is None for parts in self._choices.values()):
            raise StreamClosedEarly("the stream ended without a finish_reason")
        first = self._choices[0]
        assert first.finish is not None
        timings = self._timings or Timings()
        more = []
        for index, parts in sorted(self._choices.items())[1:]:
            assert parts.finish is not None
            more.append(
                Choice(
                    index=index,
                    content="".join(parts.content) or None,
                    reasoning_content="".join(parts.reasoning) or None,
                    tool_calls=parts.tool_calls(),
                    finish_reason=parts.finish,
                    logprobs=None if parts.logprobs is None else tuple(parts.logprobs),
                )
            )
        if more:
            predicted = sum(parts.predicted for parts in self._choices.values())
            timings = dataclasses.replace(timings, predicted_n=predicted)
        return Completion(
            id=self._id or "",
            content="".join(first.content) or None,
            reasoning_content="".join(first.reasoning) or None,
            tool_calls=first.tool_calls(),
            finish_reason=first.finish,
            timings=timings,
            reasoning_tokens=self._reasoning_tokens,
            thinking_capped=thinking_capped,
            logprobs=None if first.logprobs is None else tuple(first.logprobs),
            choices=tuple(more),
        )

    def _check_id(self, chunk_id: object) -> None:
        """Keep the first id; refuse a different one later."""
        if chunk_id is None:
            return
        if not isinstance(chunk_id, str):
            raise Protocol(f"chunk id is not a string: {chunk_id!r}")
        if self._id is None:
            self._id = chunk_id
        elif chunk_id != self._id:
            raise Protocol(f"chunk id changed from {self._id!r} to {chunk_id!r}")

    def _read_delta(
        self,
        parts: _ChoiceParts,
        index: int,
        delta: object,
        events: list[ChatEvent],
        generated: int | None = None,
        timings: dict[str, Any] | None = None,
    ) -> None:
        """
        Append the events of one delta of choice C{index} and keep its pieces in C{parts};
        C{generated} is the chunk's count of generated tokens, if it had one, for its text
        pieces, and C{timings} its C{timings} object as sent, for every piece.
        """
        if delta is None:
            return
        if not isinstance(delta, dict):
            raise Protocol(f"delta is not an object: {delta!r}")
        reasoning = _optional_text(delta, "reasoning_content")
        if reasoning:
            parts.reasoning.append(reasoning)
            events.append(Reasoning(reasoning, generated, choice=index, timings=timings))
        content = _optional_text(delta, "content")
        if content:
            self._answering = self._answering or index == 0
            parts.content.append(content)
            events.append(Content(content, generated, choice=index, timings=timings))
        calls = delta.get("tool_calls")
        if calls is None:
            return
        if not isinstance(calls, list):
            raise Protocol(f"tool_calls is not a list: {calls!r}")
        for call in calls:
            event = _read_call(parts, index, call, timings)
            if event is not None:
                self._answering = self._answering or index == 0
                events.append(event)


def _check_calls(parts: _ChoiceParts) -> None:
    """At a choice's finish: every tool call must have a name by now."""
    for index, call in parts.calls.items():
        if not "".join(call.name):
            raise Protocol(f"tool call {index} has no name")


def _read_call(
    choice: _ChoiceParts, index: int, call: object, timings: dict[str, Any] | None = None
) -> ToolCallDelta | None:
    """
    Keep one tool-call entry of choice C{index}: the id as the latest one sent, name
    pieces and argument pieces appended (the chunk's C{timings} go with its event). None
    for an entry that carries nothing.
    """
    if not isinstance(call, dict):
        raise Protocol(f"tool call delta is not an object: {call!r}")
    position = call.get("index")
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        raise Protocol(f"tool call delta has no valid index: {call!r}")
    call_id = _optional_text(call, "id")
    function = call.get("function")
    if function is None:
        function = {}
    elif not isinstance(function, dict):
        raise Protocol(f"tool call function is not an object: {function!r}")
    name = _optional_text(function, "name")
    arguments = _optional_text(function, "arguments") or ""
    if call_id is None and name is None and not arguments:
        return None
    parts = choice.calls.get(position)
    if parts is None:
        parts = choice.calls[position] = _CallParts()
    if call_id is not None:
        parts.id = call_id
    if name is not None:
        parts.name.append(name)
    parts.arguments.append(arguments)
    return ToolCallDelta(position, call_id, name, arguments, choice=index, timings=timings)


def _read_logprobs(logprobs: object) -> tuple[Any, ...] | None:
    """
    The token entries of a choice's C{logprobs} (C{{"content": [...]}}), as sent; None
    when it has none.
    """
    if logprobs is None:
        return None
    if not isinstance(logprobs, dict):
        raise Protocol(f"logprobs is not an object: {logprobs!r}")
    entries = logprobs.get("content")
    if entries is None:
        return None
    if not isinstance(entries, list):
        raise Protocol(f"logprobs.content is not a list: {entries!r}")
    return tuple(entries)


def _http_error(chunk: dict[str, Any], text: str | None) -> Http:
    """The L{Http} error of a mid-stream error event."""
    error = chunk["error"]
    code = error.get("code") if isinstance(error, dict) else None
    status = code if _is_count(code) and 100 <= code <= 599 else 500
    if text is None:
        text = json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)
    return Http(status, text)


def _only_choice(choices: list[Any]) -> dict[str, Any]:
    """The one choice of a non-empty choices list (its index a count, when present)."""
    if len(choices) != 1:
        raise Protocol(f"expected one choice, got {len(choices)}")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise Protocol(f"choice is not an object: {choice!r}")
    if not _is_count(choice.get("index", 0)):
        raise Protocol(f"unexpected choice index {choice.get('index')!r}")
    return choice


def _optional_text(mapping: dict[str, Any], key: str) -> str | None:
    """C{mapping[key]} when it is a string, None when absent or null."""
    value = mapping.get(key)
    if value is None or isinstance(value, str):
        return value
    raise Protocol(f"{key} is not a string: {value!r}")


def _is_count(value: object) -> TypeGuard[int]:
    """Whether a JSON value is a non-negative integer (booleans are not numbers)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count(mapping: dict[str, Any], key: str, where: str) -> int:
    """A non-negative integer field, 0 when absent or null."""
    value = mapping.get(key)
    if value is None:
        return 0
    if not _is_count(value):
        raise Protocol(f"{where}.{key} is not a count: {value!r}")
    return value


def _read_progress(progress: object) -> Progress:
    """A C{prompt_progress} object as a L{Progress} event."""
    if not isinstance(progress, dict):
        raise Protocol(f"prompt_progress is not an object: {progress!r}")
    time_ms = progress.get("time_ms")
    return Progress(
        total=_count(progress, "total", "prompt_progress"),
        cache=_count(progress, "cache", "prompt_progress"),
        processed=_count(progress, "processed", "prompt_progress"),
        time_ms=time_ms if _is_count(time_ms) else None,
    )


def _read_timings(chunk: dict[str, Any]) -> Timings | None:
    """The counts a chunk carries in C{timings} (or else C{usage}), or None."""
    timings = chunk.get("timings")
    if timings is None:
        return _usage_timings(chunk.get("usage"))
    if not isinstance(timings, dict):
        raise Protocol(f"timings is not an object: {timings!r}")
    return Timings(
        cache_n=_count(timings, "cache_n", "timings"),
        prompt_n=_count(timings, "prompt_n", "timings"),
        predicted_n=_count(timings, "predicted_n", "timings"),
        predicted_per_second=_speed(timings, "predicted_per_second"),
        prompt_per_second=_speed(timings, "prompt_per_second"),
    )


def _speed(timings: dict[str, Any], key: str) -> float | None:
    """A speed field of C{timings}: a number, or None when absent or null."""
    speed = timings.get(key)
    if speed is not None and (not isinstance(speed, (int, float)) or isinstance(speed, bool)):
        raise Protocol(f"timings.{key} is not a number: {speed!r}")
    return None if speed is None else float(speed)


def _usage_timings(usage: object) -> Timings | None:
    """
    Counts from an OpenAI C{usage} object; None when there is none or it lacks the
    counts (usage is informative, so an odd one is ignored rather than fatal).
    """
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    if not (_is_count(prompt) and _is_count(completion) and _is_count(cached)):
        return None
    return Timings(
        cache_n=min(cached, prompt), prompt_n=max(prompt - cached, 0), predicted_n=completion
    )
