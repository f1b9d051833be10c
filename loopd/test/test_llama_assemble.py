"""
Tests for L{loopd.llama.assemble}: streamed chunks folded into a L{Completion}.

The recorded captures are the C{*.sse} files under C{fixtures/sse/} and C{fixtures/transcripts/}.
What each must assemble to comes from L{EXPECTED}, L{TRANSCRIPTS}, the recorder's
C{recording.json} beside it, and an optional sidecar C{<name>.expected.json}: a subset of
what L{summary} gives (a completion's fields, or C{{"error": <kind>, "status": <Http status>}}).
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

import loopd
from loopd.errors import Http, InferError, Protocol, StreamClosedEarly
from loopd.llama.assemble import Assembler, parse_chunk
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
from loopd.sse import SSEDecoder, SSEError, SSEEvent, encode_data

FIXTURES = Path(loopd.__file__).resolve().parent.parent / "fixtures"
ID = "chatcmpl-0123456789abcdefghijklmnopqrstuv"


def answer(
    id: str, content: str | None, finish: FinishReason, timings: Timings, *calls: ToolCall
) -> Completion:
    """A completion without reasoning."""
    return Completion(id, content, None, calls, finish, timings)


# Read from the files in fixtures/sse/ (the last chunk before [DONE] has the timings).
EXPECTED: dict[str, Completion] = {
    "sse/chat-nothink-stream.sse": answer(
        "chatcmpl-OiHLLzOdB6ClysIo6sjMBG6DNfIMXLHZ",
        "Hello from the tiny model!",
        FinishReason.STOP,
        Timings(22, 3, 7, 5623.242736644799, 4559.270516717325),
    ),
    "sse/progress-3k-prompt.sse": answer(
        "chatcmpl-2av1G6a2c0FdHlxhJb5TyZR7uKSuBDcb",
        "Hello from the",
        FinishReason.LENGTH,
        Timings(6, 3018, 3, 609.0133982947625, 16296.072311796022),
    ),
    "sse/tools-required-stream.sse": answer(
        "chatcmpl-KeqtvCTnzVCoRWb8YvW4GIOQvgMH4wVt",
        None,
        FinishReason.TOOL_CALLS,
        Timings(544, 3, 51, 1880.9013279163378, 1807.2289156626507),
        ToolCall("fESDz9mJT5tZH3ujV6gJGHnxeUZ3tV5C", "get_weather", '{"city":"test"}'),
    ),
}


HELLO, THOUGHT = "Hello from the tiny model!", "Let me think about this..."
STABLE = ("reasoning_content", "content", "finish_reason", "reasoning_tokens")
# What stays the same when fixtures/transcripts/ is re-recorded (see fixtures/README.md):
# the texts, the finish reason and the reasoning tokens; ids and timings change.
TRANSCRIPTS: dict[str, tuple[str | None, str | None, str, int]] = {
    "transcripts/plain.sse": (None, HELLO, "stop", 0),
    "transcripts/thinking.sse": (THOUGHT, HELLO, "stop", 7),
    "transcripts/progress.sse": (THOUGHT, HELLO, "stop", 7),
    "transcripts/tool-call.sse": (THOUGHT, None, "tool_calls", 7),
}


def captures() -> list[Path]:
    """Every recorded stream: the *.sse files under fixtures/sse/ and fixtures/transcripts/."""
    found: list[Path] = []
    for folder in ("sse", "transcripts"):
        found.extend(sorted((FIXTURES / folder).rglob("*.sse")))
    return found


def expectations(path: Path) -> list[dict[str, Any]]:
    """What a capture must assemble to, from each source that has something to say."""
    found: list[dict[str, Any]] = []
    sidecar = path.with_name(path.stem + ".expected.json")
    if sidecar.exists():
        found.append(json.loads(sidecar.read_text(encoding="utf-8")))
    name = path.relative_to(FIXTURES).as_posix()
    if name in EXPECTED:
        found.append(summary(EXPECTED[name]))
    if name in TRANSCRIPTS:
        found.append(dict(zip(STABLE, TRANSCRIPTS[name], strict=True)))
    recording = path.parent / "recording.json"
    if recording.exists():
        case = json.loads(recording.read_text(encoding="utf-8"))["cases"].get(path.stem)
        if case and case["error"]:
            found.append({"error": "Http", "status": case["error"].get("code", 500)})
        elif case:
            keys = ("finish_reason", "tool_calls")
            found.append({"content": case["content"] or None, **{k: case[k] for k in keys}})
    return found


def summary(result: Completion | Exception) -> dict[str, Any]:
    """A completion, or the error that ended the stream, as plain JSON values."""
    if isinstance(result, Exception):
        status = {"status": result.status} if isinstance(result, Http) else {}
        return {"error": type(result).__name__, **status}
    value = asdict(result)
    del value["thinking_capped"]
    value["tool_calls"] = list(value["tool_calls"])
    value["finish_reason"] = result.finish_reason.value
    return value


def run(pieces: list[bytes]) -> tuple[list[ChatEvent], dict[str, Any]]:
    """Decode pieces as separate reads, assemble: the events, the summary of the outcome."""
    decoder = SSEDecoder()
    assembler = Assembler()
    events: list[ChatEvent] = []
    try:
        for piece in [*pieces, None]:
            items = decoder.finish() if piece is None else decoder.feed(piece)
            for item in items:
                if isinstance(item, SSEEvent) and not item.done:
                    events.extend(assembler.feed(parse_chunk(item.data), item.data))
        return events, summary(assembler.completion())
    except (InferError, SSEError) as error:
        return events, summary(error)


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    """Split data at the given offsets (taken modulo its length plus one)."""
    bounds = [0, *sorted({cut % (len(data) + 1) for cut in cuts}), len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def chunk(delta: dict[str, Any] | None = None, finish: Any = None, **extra: Any) -> Any:
    """A chat.completion.chunk as llama-server shapes it, with extra top-level keys."""
    value = {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta or {}}],
        "created": 1795978728,
        "id": ID,
        "model": "tiny",
        "object": "chat.completion.chunk",
    }
    value.update(extra)
    return value


def timed(predicted_n: int, **extra: Any) -> dict[str, Any]:
    """Per-token timings with C{predicted_n} generated tokens."""
    return {"timings": {"cache_n": 0, "prompt_n": 21, "predicted_n": predicted_n, **extra}}


def call(index: Any, arguments: Any = None, id: Any = None, name: Any = None) -> dict[str, Any]:
    """A delta with one tool-call entry; the id and name only when given."""
    function = {"arguments": arguments} if arguments is not None else {}
    if name is not None:
        function["name"] = name
    entry = {"index": index} if id is None else {"index": index, "id": id}
    return {"tool_calls": [{**entry, "function": function}]}


def assemble(chunks: list[Any]) -> tuple[Assembler, list[ChatEvent]]:
    """Feed the chunks to a fresh assembler; return it and all the events."""
    assembler = Assembler()
    events: list[ChatEvent] = []
    for value in chunks:
        events.extend(assembler.feed(value))
    return assembler, events


def body(chunks: list[Any]) -> bytes:
    """The SSE body that carries the chunks, ended by [DONE]."""
    events = [encode_data(json.dumps(value)) for value in chunks]
    return b"".join(events) + encode_data("[DONE]")


# Thinking, then an answer, then a usage chunk: the shape of a real llama-server stream
# with return_progress, timings_per_token and include_usage (reference §1.2, §2).
ROLE = {"role": "assistant", "content": None}
THINKING = [
    chunk(ROLE, **timed(0), prompt_progress={"total": 21, "cache": 0, "processed": 21}),
    chunk(ROLE, **timed(1)),
    chunk({"reasoning_content": "Let"}, **timed(2)),
    chunk({"reasoning_content": " me"}, **timed(3)),
    chunk({"reasoning_content": " think"}, **timed(4)),
    chunk({"content": "Hello"}, **timed(6)),
    chunk({"content": "!"}, **timed(7)),
    chunk(finish="stop"),
    {"choices": [], "id": ID, "usage": {"completion_tokens": 8}, **timed(8)},
]


class CaptureTests(SynchronousTestCase):
    """The recorded llama-server streams reassemble to what they carry."""

    def test_expected_outcomes(self) -> None:
        """Every capture with an expectation assembles to exactly it."""
        missing = []
        for path in captures():
            _, got = run([path.read_bytes()])
            wanted = expectations(path)
            if not wanted:
                missing.append(path.name)
            for expected in wanted:
                self.assertTrue(expected, path.name)
                self.assertEqual({key: got.get(key) for key in expected}, expected, path.name)
        named = {path.relative_to(FIXTURES).as_posix() for path in captures()}
        self.assertTrue(set(EXPECTED) <= named and set(TRANSCRIPTS) <= named)
        if missing:
            self.skipTest(f"no expected outcome for {', '.join(missing)}")

    def test_plain_answer_events(self) -> None:
        """A plain answer is one Content event per piece, in order."""
        events, _ = run([(FIXTURES / "sse" / "chat-nothink-stream.sse").read_bytes()])
        texts = ["Hello", " from", " the", " tiny", " model", "!"]
        self.assertEqual(events, [Content(text) for text in texts])

    def test_progress_events(self) -> None:
        """prompt_progress chunks become Progress events before the answer."""
        events, _ = run([(FIXTURES / "sse" / "progress-3k-prompt.sse").read_bytes()])
        progress = [Progress(total=3024, cache=6, processed=n) for n in (6, 2054, 3024)]
        self.assertEqual(events, progress + [Content(t) for t in ("Hello", " from", " the")])

    def test_tool_call_events(self) -> None:
        """A streamed tool call: id and name on the first delta, then argument pieces."""
        events, _ = run([(FIXTURES / "sse" / "tools-required-stream.sse").read_bytes()])
        first = ToolCallDelta(0, "fESDz9mJT5tZH3ujV6gJGHnxeUZ3tV5C", "get_weather", "{")
        pieces = ['"', "c", "i", "t", "y", '"', ":", '"', "test", '"', "}"]
        self.assertEqual(events, [first] + [ToolCallDelta(0, None, None, p) for p in pieces])

    @given(st.lists(st.integers(min_value=0), max_size=40))
    def test_any_split(self, cuts: list[int]) -> None:
        """However a stream's bytes are split into reads, events and outcome are the same."""
        for data in [path.read_bytes() for path in captures()] + [body(THINKING)]:
            self.assertEqual(run(split_at(data, cuts)), run([data]))

    def test_byte_by_byte(self) -> None:
        """Reading every stream one byte at a time changes nothing."""
        for data in [path.read_bytes() for path in captures()] + [body(THINKING)]:
            self.assertEqual(run([bytes([byte]) for byte in data]), run([data]))


class AssembleTests(SynchronousTestCase):
    """Reasoning, content, timings and the reasoning-token count."""

    def test_thinking_then_answer(self) -> None:
        """Reasoning and content pieces reassemble; the usage chunk's timings are kept."""
        assembler, events = assemble(THINKING)
        self.assertEqual(
            events,
            [Progress(21, 0, 21), Reasoning("Let"), Reasoning(" me"), Reasoning(" think")]
            + [Content("Hello"), Content("!")],
        )
        expected = Completion(
            ID, "Hello!", "Let me think", (), FinishReason.STOP, Timings(0, 21, 8)
        )
        self.assertEqual(assembler.completion(), replace(expected, reasoning_tokens=4))

    def test_reasoning_tokens_live(self) -> None:
        """reasoning_tokens follows predicted_n until the answer begins, then stays."""
        assembler = Assembler()
        counts = []
        for value in THINKING:
            assembler.feed(value)
            counts.append((assembler.reasoning_tokens, assembler.in_reasoning))
        self.assertEqual([n for n, _ in counts], [0, 1, 2, 3, 4, 4, 4, 4, 4])
        self.assertEqual([a for _, a in counts], [True] * 5 + [False] * 4)

    def test_pieces_carry_their_timings(self) -> None:
        """
        Each piece carries its chunk's C{timings} object as sent (a client may ask for
        them), and a piece of a chunk without one carries none.
        """
        reasoning = chunk({"reasoning_content": "hm"}, **timed(5))
        tool = chunk(call(0, "{}", id="c", name="f"), **timed(9))
        _, events = assemble([reasoning, tool, chunk({"content": "x"}), chunk(finish="stop")])
        self.assertEqual(
            [getattr(event, "timings", None) for event in events],
            [reasoning["timings"], tool["timings"], None],
        )

    def test_tool_call_ends_reasoning(self) -> None:
        """A tool-call piece ends the reasoning phase as content does."""
        reasoning = chunk({"reasoning_content": "hm"}, **timed(5))
        tool = chunk(call(0, "{}", id="c", name="f"), **timed(9))
        assembler, _ = assemble([reasoning, tool, chunk(finish="tool_calls", **timed(10))])
        self.assertEqual(assembler.completion().reasoning_tokens, 5)

    def test_length_while_reasoning(self) -> None:
        """A stream cut by max_tokens while reasoning counts up to its last chunk."""
        assembler, _ = assemble(
            [chunk({"reasoning_content": "a"}, **timed(1)), chunk(finish="length", **timed(2))]
        )
        got = assembler.completion(thinking_capped=True)
        self.assertEqual(
            (got.content, got.reasoning_content, got.reasoning_tokens, got.finish_reason),
            (None, "a", 2, FinishReason.LENGTH),
        )
        self.assertTrue(got.thinking_capped)

    def test_latest_timings(self) -> None:
        """The latest timings are kept, with the generation speed when reported."""
        assembler, _ = assemble([chunk({"content": "a"}, **timed(1, predicted_per_second=2))])
        self.assertEqual(assembler.timings, Timings(0, 21, 1, 2.0))
        assembler.feed(chunk({"content": "b"}, **timed(2, cache_n=9)))
        assembler.feed(chunk(finish="stop"))
        self.assertEqual(assembler.completion().timings, Timings(9, 21, 2, None))

    def test_empty_pieces(self) -> None:
        """Role deltas and empty or null pieces carry nothing; empty text is None."""
        empty = chunk({"content": "", "reasoning_content": None, "tool_calls": None})
        bare_finish = {"choices": [{"index": 0, "finish_reason": "stop"}], "id": ID}
        assembler, events = assemble([chunk(ROLE), empty, chunk(call(0)), bare_finish])
        self.assertEqual(events, [])
        completion = assembler.completion()
        self.assertEqual((completion.content, completion.reasoning_content), (None, None))
        self.assertEqual((completion.tool_calls, completion.timings), ((), Timings()))
        self.assertTrue(assembler.in_reasoning)

    def test_properties(self) -> None:
        """The id, timings and finish reason are visible while the stream runs."""
        assembler = Assembler()
        self.assertEqual((assembler.id, assembler.timings), (None, None))
        assembler.feed(chunk(**timed(0)))
        self.assertEqual(assembler.id, ID)
        self.assertEqual(assembler.timings, Timings(0, 21, 0))
        self.assertIsNone(assembler.finish_reason)
        assembler.feed(chunk(finish="stop"))
        self.assertEqual(assembler.finish_reason, FinishReason.STOP)

    def test_usage_only_updates_timings(self) -> None:
        """A usage chunk gives no event and leaves the reasoning count alone."""
        assembler, _ = assemble([chunk({"reasoning_content": "x"}, **timed(3))])
        self.assertEqual(assembler.feed({"choices": [], "id": ID, **timed(7)}), [])
        self.assertEqual((assembler.timings, assembler.reasoning_tokens), (Timings(0, 21, 7), 3))

    def test_usage_counts(self) -> None:
        """Without timings, an OpenAI usage object gives the counts; a null one is ignored."""
        details = {"cached_tokens": 3}
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": details}
        nulls = [chunk({"content": "a"}, usage=None), chunk(finish="stop", usage=None)]
        assembler, _ = assemble(nulls)
        self.assertIsNone(assembler.timings)
        assembler.feed({"choices": [], "id": ID, "usage": usage})
        self.assertEqual(assembler.completion().timings, Timings(3, 7, 5))


def entry(token: str) -> dict[str, Any]:
    """One logprobs entry as llama-server sends it."""
    return {"id": 1, "token": token, "bytes": list(token.encode()), "logprob": -0.5}


def choice(index: int, delta: dict[str, Any], finish: Any = None, **extra: Any) -> Any:
    """A chunk whose one choice has C{index}."""
    value = chunk(delta, finish)
    value["choices"][0].update(index=index, **extra)
    return value


class LogprobsTests(SynchronousTestCase):
    """The token entries of C{logprobs} ride on the events and the completion."""

    def test_on_pieces_and_completion(self) -> None:
        """
        A chunk's entries go on its piece; a chunk without a piece gives a Logprobs event;
        the completion has them all, in order.
        """
        think, hello = entry("<think>"), entry("Hello")
        assembler, events = assemble(
            [
                choice(0, ROLE, logprobs={"content": [think]}),
                choice(0, {"content": "Hello"}, logprobs={"content": [hello]}),
                chunk(finish="stop"),
            ]
        )
        self.assertEqual(events, [Logprobs((think,)), Content("Hello")])
        assert isinstance(events[1], Content)
        self.assertEqual(events[1].logprobs, (hello,))
        self.assertEqual(assembler.completion().logprobs, (think, hello))

    def test_not_asked(self) -> None:
        """Without entries the events carry none and the completion's logprobs are None."""
        assembler, events = assemble(THINKING)
        self.assertTrue(all(getattr(e, "logprobs", ()) == () for e in events))
        self.assertIsNone(assembler.completion().logprobs)


class ChoicesTests(SynchronousTestCase):
    """A request for n choices: every chunk's choice by its index."""

    def test_two_choices(self) -> None:
        """Both choices assemble; the events carry their choice; predicted_n adds up."""
        assembler, events = assemble(
            [
                choice(1, ROLE),
                choice(0, ROLE),
                choice(1, {"content": "b"}) | timed(2),
                choice(0, {"content": "a"}) | timed(3),
                choice(1, {}, "length"),
                choice(0, {}, "stop"),
            ]
        )
        self.assertEqual(events, [Content("b", choice=1), Content("a")])
        completion = assembler.completion()
        self.assertEqual((completion.content, completion.finish_reason), ("a", FinishReason.STOP))
        self.assertEqual(completion.choices, (Choice(1, "b", None, (), FinishReason.LENGTH),))
        self.assertEqual(completion.timings.predicted_n, 5)

    def test_waits_for_every_choice(self) -> None:
        """A choice without its finish_reason is a stream closed early."""
        assembler, _ = assemble([choice(1, {"content": "b"}), choice(0, {}, "stop")])
        self.assertRaises(StreamClosedEarly, assembler.completion)

    def test_after_its_finish(self) -> None:
        """A choice's chunk after its own finish_reason is a Protocol error."""
        assembler, _ = assemble([choice(1, {}, "stop")])
        self.assertEqual(assembler.feed(choice(0, {"content": "a"})), [Content("a")])
        self.assertRaises(Protocol, assembler.feed, choice(1, {"content": "late"}))


class ToolCallTests(SynchronousTestCase):
    """Tool-call deltas reassemble by index."""

    def test_interleaved(self) -> None:
        """Two calls whose pieces alternate reassemble separately, sorted by index."""
        pieces: list[Any] = [(1, "id-b", "second", '{"a"'), (0, "id-a", "first", "{")]
        pieces += [(1, None, None, ":1}"), (0, None, None, "}")]
        deltas = [call(index, args, id=i, name=n) for index, i, n, args in pieces]
        assembler, events = assemble([chunk(d) for d in deltas] + [chunk(finish="tool_calls")])
        self.assertEqual(events, [ToolCallDelta(*piece) for piece in pieces])
        self.assertEqual(
            assembler.completion().tool_calls,
            (ToolCall("id-a", "first", "{}"), ToolCall("id-b", "second", '{"a":1}')),
        )

    def test_name_resent(self) -> None:
        """A name sent again in pieces is appended; a re-sent id replaces the earlier one."""
        first, second = call(0, "", id="x1", name="get_"), call(0, '{"c', id="x2", name="weather")
        chunks = [chunk(first), chunk(second), chunk(call(0, '":1}')), chunk(finish="tool_calls")]
        assembler, events = assemble(chunks)
        self.assertEqual(events[1], ToolCallDelta(0, "x2", "weather", '{"c'))
        self.assertEqual(
            assembler.completion().tool_calls, (ToolCall("x2", "get_weather", '{"c":1}'),)
        )

    def test_without_name(self) -> None:
        """A call that has no name when the finish_reason comes is a Protocol error."""
        assembler, _ = assemble([chunk(call(0, "{}", id="x"))])
        self.assertRaises(Protocol, assembler.feed, chunk(finish="tool_calls"))

    def test_without_id(self) -> None:
        """A call whose id never came has an empty id."""
        assembler, _ = assemble([chunk(call(0, "{}", name="f")), chunk(finish="tool_calls")])
        self.assertEqual(assembler.completion().tool_calls, (ToolCall("", "f", "{}"),))


class BrokenStreamTests(SynchronousTestCase):
    """Streams that break the protocol fail with a typed error."""

    def test_error_event(self) -> None:
        """An error event is Http with its code and the event's text as the body."""
        text = json.dumps({"error": {"code": 400, "type": "exceed_context_size_error"}})
        assembler, _ = assemble([chunk({"content": "a"})])
        error = self.assertRaises(Http, assembler.feed, json.loads(text), text)
        self.assertEqual((error.status, error.body, error.context_exceeded), (400, text, True))

    def test_error_event_without_code(self) -> None:
        """An error event without a code is status 500; the chunk is encoded for the body."""
        value = {"error": {"message": "Context size has been exceeded."}}
        error = self.assertRaises(Http, Assembler().feed, value)
        self.assertEqual(error.status, 500)
        self.assertEqual(json.loads(error.body), value)
        self.assertFalse(error.context_exceeded)

    def test_error_event_in_stream(self) -> None:
        """Read from a body, an error event ends the stream as Http, not closed early."""
        data = body([chunk({"content": "a"})])[: -len(encode_data("[DONE]"))]
        data += encode_data('{"error":{"code":500,"message":"boom","type":"server_error"}}')
        self.assertEqual(run([data]), ([Content("a")], {"error": "Http", "status": 500}))

    def test_changed_id(self) -> None:
        """A chunk whose id differs from the first chunk's is a Protocol error."""
        assembler, _ = assemble([chunk({"content": "a"})])
        changed = chunk({"content": "b"}, id="chatcmpl-other")
        self.assertRaises(Protocol, assembler.feed, changed)

    def test_missing_id(self) -> None:
        """A chunk without an id keeps the id already seen."""
        later = chunk(finish="stop")
        del later["id"]
        assembler, _ = assemble([chunk({"content": "a"}), later])
        self.assertEqual(assembler.completion().id, ID)

    def test_no_finish_reason(self) -> None:
        """A stream that ends without a finish_reason is StreamClosedEarly."""
        assembler, _ = assemble([chunk({"content": "a"}), {"choices": [], "id": ID}])
        self.assertRaises(StreamClosedEarly, assembler.completion)
        data = body([chunk({"content": "a"})])
        self.assertEqual(run([data]), ([Content("a")], {"error": "StreamClosedEarly"}))

    def test_bad_finish_reason(self) -> None:
        """A finish_reason other than stop, tool_calls or length is a Protocol error."""
        for reason in ("content_filter", "", 1):
            self.assertRaises(Protocol, Assembler().feed, chunk(finish=reason))

    def test_after_finish(self) -> None:
        """After the finish_reason only a usage chunk may come."""
        assembler, _ = assemble([chunk(finish="stop"), {"choices": [], "id": ID}])
        self.assertRaises(Protocol, assembler.feed, chunk({"content": "late"}))

    def test_malformed_chunks(self) -> None:
        """Each malformed chunk is a Protocol error."""
        deltas: list[Any] = [{"content": 5}, {"reasoning_content": []}, {"tool_calls": {}}]
        deltas += [{"tool_calls": ["x"]}, {"tool_calls": [{"function": {"arguments": "{}"}}]}]
        deltas += [call(True, "{}"), call(-1, "{}"), call(0, 5), call(0, name=3)]
        deltas += [{"tool_calls": [{"index": 0, "function": "f"}]}]
        choices: list[Any] = [{}, [None], [{"index": -1, "delta": {}}], [{"delta": "text"}]]
        choices += [[{"index": "1", "delta": {}}], [{"delta": {}, "logprobs": []}]]
        choices += [[{"delta": {}, "logprobs": {"content": {}}}]]
        choices += [[{"delta": {}}, {"delta": {}}]]
        timings: list[Any] = ["fast", {"cache_n": -1}, {"predicted_n": 1.5}, {"predicted_n": True}]
        timings += [{"predicted_per_second": "fast"}, {"prompt_per_second": True}]
        chunks = [chunk(d) for d in deltas] + [{"id": ID, "choices": c} for c in choices]
        chunks += [chunk(timings=t) for t in timings] + [[], "chunk", None, {"id": ID}, chunk(id=5)]
        chunks += [chunk(prompt_progress=[]), chunk(prompt_progress={"total": "3"})]
        for value in chunks:
            self.assertRaises(Protocol, Assembler().feed, value)

    def test_parse_chunk(self) -> None:
        """parse_chunk gives the object; other JSON, bad JSON, NaN are Protocol errors."""
        self.assertEqual(parse_chunk('{"choices":[]}'), {"choices": []})
        for data in ("[1]", '"x"', "{", "", '{"a":NaN}', '{"a":-Infinity}'):
            self.assertRaises(Protocol, parse_chunk, data)


PIECES = st.lists(st.tuples(st.sampled_from(["reasoning_content", "content", 0, 1, 2]), st.text()))


class PieceProperty(SynchronousTestCase):
    """Any sequence of pieces reassembles to exactly the text it carried."""

    @given(PIECES)
    def test_reassembles_exactly(self, pieces: list[tuple[str | int, str]]) -> None:
        """Joined reasoning, content and per-index arguments equal what was sent."""
        deltas = [
            call(key, text, id=f"id{key}", name=f"f{key}") if isinstance(key, int) else {key: text}
            for key, text in pieces
        ]
        assembler, _ = assemble([chunk(d) for d in deltas] + [chunk(finish="stop")])
        completion = assembler.completion()
        joined = {key: "".join(t for k, t in pieces if k == key) for key, _ in pieces}
        self.assertEqual(completion.content, joined.get("content") or None)
        self.assertEqual(completion.reasoning_content, joined.get("reasoning_content") or None)
        indices = sorted(key for key in joined if isinstance(key, int))
        arguments = [c.arguments for c in completion.tool_calls]
        self.assertEqual(arguments, [joined[index] for index in indices])
        names = [c.name for c in completion.tool_calls]
        counts = [sum(1 for k, _ in pieces if k == index) for index in indices]
        self.assertEqual(names, [f"f{i}" * n for i, n in zip(indices, counts, strict=True)])
