"""Tests for L{loopd.sse}: the incremental event-stream decoder and the encoders."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hypothesis import assume, given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

import loopd
from loopd.sse import (
    DONE,
    SSEAfterDone,
    SSEComment,
    SSEDecoder,
    SSEError,
    SSEEvent,
    SSEItem,
    SSELineTooLong,
    encode_comment,
    encode_data,
    encode_event,
)

FIXTURES = Path(loopd.__file__).resolve().parent.parent / "fixtures" / "sse"


def decode(pieces: Iterable[bytes], limit: int = 1 << 20) -> list[SSEItem]:
    """Feed every piece to a fresh decoder, finish it, and return all it decoded."""
    decoder = SSEDecoder(limit)
    items: list[SSEItem] = []
    for piece in pieces:
        items.extend(decoder.feed(piece))
    items.extend(decoder.finish())
    return items


def outcome(
    pieces: Iterable[bytes], limit: int
) -> tuple[list[SSEItem], type[SSEError] | None, bool]:
    """
    Decode the pieces and return what came out, the error class (if any) and
    whether finish() discarded something; items include the failing call's.
    """
    decoder = SSEDecoder(limit)
    items: list[SSEItem] = []
    try:
        for piece in pieces:
            items.extend(decoder.feed(piece))
        decoder.finish()
    except SSEError as e:
        return items + e.items, type(e), False
    return items, None, decoder.discarded_at_eof


def bytewise(data: bytes) -> list[bytes]:
    """Split data into one-byte pieces."""
    return [data[i : i + 1] for i in range(len(data))]


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    """Split data at the given offsets (taken modulo its length, sorted)."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def reference(body: bytes) -> tuple[list[SSEItem], bool]:
    """
    The WHATWG event-stream algorithm read literally, one line at a time, with
    loopd's choices (comments kept, UTF-8 errors and lines after [DONE] fatal):
    the items decoded, and whether the stream was accepted.
    """
    items: list[SSEItem] = []
    if body.startswith(b"\xef\xbb\xbf"):
        body = body[3:]
    data: list[str] = []
    event_type = ""
    last_id = ""
    done = False
    # The last piece is unterminated, so it is discarded.
    for raw in re.split(b"\r\n|\r|\n", body)[:-1]:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            return items, False
        if done and line and not line.startswith(":"):
            return items, False
        if not line:
            if data:
                event = SSEEvent("\n".join(data), event_type or None, last_id or None)
                items.append(event)
                done = event.data == "[DONE]"
            data, event_type = [], ""
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if not name:
            items.append(SSEComment(value))
        elif name == "data":
            data.append(value)
        elif name == "event":
            event_type = value
        elif name == "id" and "\0" not in value:
            last_id = value
    return items, True


class FramingTests(SynchronousTestCase):
    """Lines, line endings, fields and events."""

    def test_single_event(self) -> None:
        """A data line and a blank line make one event."""
        self.assertEqual(decode([b'data: {"a":1}\n\n']), [SSEEvent('{"a":1}')])

    def test_several_events_in_one_feed(self) -> None:
        """One feed may complete several events, returned in order."""
        self.assertEqual(decode([b"data: a\n\ndata: b\n\n"]), [SSEEvent("a"), SSEEvent("b")])

    def test_line_endings(self) -> None:
        """LF, CRLF and bare CR all end lines, also mixed in one stream."""
        expected = [SSEEvent("a\nb"), SSEEvent("c")]
        for body in [
            b"data: a\ndata: b\n\ndata: c\n\n",
            b"data: a\r\ndata: b\r\n\r\ndata: c\r\n\r\n",
            b"data: a\rdata: b\r\rdata: c\r\r",
            b"data: a\r\ndata: b\r\rdata: c\n\r\n",
        ]:
            self.assertEqual(decode([body]), expected, body)

    def test_cr_at_end_of_feed(self) -> None:
        """A feed's last CR pairs with the next feed's LF, or ends its line alone."""
        pieces = [b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"]
        self.assertEqual(decode(pieces), [SSEEvent("a\nb")])
        decoder = SSEDecoder()
        self.assertEqual(decoder.feed(b"data: a\r"), [])
        self.assertEqual(decoder.feed(b"\r"), [SSEEvent("a")])

    def test_event_dispatched_as_soon_as_blank_line_arrives(self) -> None:
        """An event comes out of the feed that completes its blank line."""
        decoder = SSEDecoder()
        self.assertEqual(decoder.feed(b"data: a\n"), [])
        self.assertEqual(decoder.feed(b"\n"), [SSEEvent("a")])

    def test_bytewise_feeding(self) -> None:
        """Feeding one byte at a time, also inside UTF-8 characters, changes nothing."""
        body = "data: é€😀\r\n: ça\r\ndata: ok\r\n\r\n".encode()
        expected = [SSEComment("ça"), SSEEvent("é€😀\nok")]
        self.assertEqual(decode([body]), expected)
        self.assertEqual(decode(bytewise(body)), expected)

    def test_multiline_data(self) -> None:
        """Data lines of one event are joined with a newline."""
        self.assertEqual(decode([b"data: a\ndata:\ndata: c\n\n"]), [SSEEvent("a\n\nc")])

    def test_optional_space(self) -> None:
        """One space after the colon is dropped; no space or a second one is kept."""
        self.assertEqual(
            decode([b"data:x\n\ndata:  y\n\ndata: \n\n"]),
            [SSEEvent("x"), SSEEvent(" y"), SSEEvent("")],
        )

    def test_field_without_colon(self) -> None:
        """A field name alone is that field with an empty value."""
        self.assertEqual(decode([b"data\ndata\n\n"]), [SSEEvent("\n")])

    def test_unknown_fields_ignored(self) -> None:
        """retry, unknown and wrongly cased fields change nothing."""
        self.assertEqual(
            decode([b"retry: 10\nfoo: bar\nData: no\nx\ndata: yes\n\n"]), [SSEEvent("yes")]
        )

    def test_event_type_and_id(self) -> None:
        """event: applies to one event; the last id carries over until reset."""
        body = b"event: note\nid: 7\ndata: a\n\ndata: b\n\n"
        body += b"id: x\x00y\ndata: c\n\nid\nevent:\ndata: d\n\n"
        expected = [SSEEvent("a", "note", "7"), SSEEvent("b", None, "7"), SSEEvent("c", None, "7")]
        self.assertEqual(decode([body]), [*expected, SSEEvent("d", None, None)])

    def test_blank_lines_without_data(self) -> None:
        """Blank lines and an event with no data dispatch nothing."""
        self.assertEqual(decode([b"\n\n\nevent: x\n\ndata: a\n\n"]), [SSEEvent("a")])

    def test_comments(self) -> None:
        """Comment lines come out as SSEComment items, in order with events."""
        body = b":\n: loopd {}\n:  two\n:x\ndata: a\n: inside\ndata: b\n\n"
        comments = [SSEComment(t) for t in ["", "loopd {}", " two", "x", "inside"]]
        self.assertEqual(decode([body]), [*comments, SSEEvent("a\nb")])

    def test_bom(self) -> None:
        """One leading BOM is skipped, also when split; a second one is not."""
        body = b"\xef\xbb\xbfdata: a\n\n"
        self.assertEqual(decode([body]), [SSEEvent("a")])
        self.assertEqual(decode(bytewise(body)), [SSEEvent("a")])
        self.assertEqual(decode([b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\n"]), [])

    def test_empty_feed(self) -> None:
        """Feeding no bytes returns nothing and breaks nothing."""
        decoder = SSEDecoder()
        self.assertEqual(decoder.feed(b""), [])
        self.assertEqual(decoder.feed(b"data: a\n\n"), [SSEEvent("a")])
        self.assertEqual(decoder.feed(b""), [])

    def test_events_are_frozen_values(self) -> None:
        """Decoded events equal, hash like and are as frozen as constructed ones."""
        (event,) = decode([b"event: e\nid: 1\ndata: a\n\n"])
        self.assertEqual(event, SSEEvent(data="a", event="e", id="1"))
        self.assertEqual(hash(event), hash(SSEEvent("a", "e", "1")))
        self.assertRaises(dataclasses.FrozenInstanceError, setattr, event, "data", "")


class EndTests(SynchronousTestCase):
    """[DONE], the end of the body and what may follow."""

    def test_done(self) -> None:
        """data: [DONE] is an event marked done, and the decoder knows it."""
        decoder = SSEDecoder()
        (event,) = decoder.feed(b"data:[DONE]\n\n")
        assert isinstance(event, SSEEvent)
        self.assertTrue(event.done)
        self.assertEqual(event.data, DONE)
        self.assertTrue(decoder.done)
        self.assertFalse(SSEEvent("[DONE] ").done)

    def test_comments_and_blank_lines_after_done(self) -> None:
        """Keep-alive comments and blank lines may follow [DONE]."""
        decoder = SSEDecoder()
        items = decoder.feed(b"data: [DONE]\n\n:\n\n")
        self.assertEqual(items, [SSEEvent(DONE), SSEComment("")])
        self.assertEqual(decoder.feed(b": late\n\n\n"), [SSEComment("late")])
        self.assertEqual(decoder.finish(), [])

    def test_data_after_done_same_feed(self) -> None:
        """A field line after [DONE] raises, keeping the items before it."""
        decoder = SSEDecoder()
        e = self.assertRaises(SSEAfterDone, decoder.feed, b"data: a\n\ndata: [DONE]\n\ndata: b\n\n")
        self.assertEqual(e.items, [SSEEvent("a"), SSEEvent(DONE)])

    def test_field_after_done_later_feed(self) -> None:
        """Any field line in a later feed after [DONE] raises SSEAfterDone."""
        for line in [b"data: b\n", b"event: x\n", b"id: 1\n", b"\nretry: 5\r"]:
            decoder = SSEDecoder()
            decoder.feed(b"data: [DONE]\n\n")
            self.assertRaises(SSEAfterDone, decoder.feed, line)

    def test_incomplete_event_discarded(self) -> None:
        """finish() drops an event without its blank line, and says so."""
        for tail in [b"data: b\n", b"data: b", b"data: [DONE]\n", b":"]:
            decoder = SSEDecoder()
            self.assertEqual(decoder.feed(b"data: a\n\n" + tail), [SSEEvent("a")])
            self.assertEqual(decoder.finish(), [])
            self.assertTrue(decoder.discarded_at_eof, tail)
            self.assertFalse(decoder.done)

    def test_clean_end(self) -> None:
        """A stream that ends after a blank line loses nothing at finish()."""
        decoder = SSEDecoder()
        decoder.feed(b"data: a\n\n")
        self.assertEqual(decoder.finish(), [])
        self.assertFalse(decoder.discarded_at_eof)

    def test_error_event_without_done(self) -> None:
        """A mid-stream error is an ordinary event and the stream is not done."""
        decoder = SSEDecoder()
        body = b'data: {"error":{"code":500,"message":"Context size"}}\n\n'
        (event,) = decoder.feed(body)
        assert isinstance(event, SSEEvent)
        self.assertEqual(json.loads(event.data)["error"]["code"], 500)
        self.assertEqual(decoder.finish(), [])
        self.assertFalse(decoder.done)
        self.assertFalse(decoder.discarded_at_eof)

    def test_use_after_finish(self) -> None:
        """feed() or finish() after finish() raises SSEError."""
        decoder = SSEDecoder()
        decoder.finish()
        self.assertRaises(SSEError, decoder.feed, b"data: a\n\n")
        self.assertRaises(SSEError, decoder.finish)


class ErrorTests(SynchronousTestCase):
    """Size caps, invalid text and the failed state."""

    def test_line_of_exactly_the_cap(self) -> None:
        """A line as long as the cap (line ending excluded) is accepted."""
        for ending in [b"\n", b"\r\n", b"\r"]:
            line = b"data: " + b"x" * 10
            body = line + ending + ending
            self.assertEqual(decode([body], 16), [SSEEvent("x" * 10)])
            self.assertEqual(decode(bytewise(body), 16), [SSEEvent("x" * 10)])

    def test_line_over_the_cap(self) -> None:
        """A line one byte over the cap raises SSELineTooLong."""
        e = self.assertRaises(
            SSELineTooLong, SSEDecoder(16).feed, b"data: a\n\ndata: " + b"x" * 11 + b"\n"
        )
        self.assertEqual((e.what, e.length, e.limit), ("line", 17, 16))
        self.assertEqual(e.items, [SSEEvent("a")])

    def test_cap_checked_before_newline(self) -> None:
        """The cap triggers while a line is buffered, before any newline arrives."""
        decoder = SSEDecoder(16)
        for _ in range(16):
            self.assertEqual(decoder.feed(b"x"), [])
        self.assertRaises(SSELineTooLong, decoder.feed, b"x")

    def test_comment_over_the_cap(self) -> None:
        """Comment lines are capped like any other line."""
        self.assertRaises(SSELineTooLong, decode, [b":" + b"c" * 16 + b"\n"], 16)

    def test_event_of_exactly_the_cap(self) -> None:
        """An event whose data (values plus joining newlines) fills the cap passes."""
        body = b"data: aaaaaaa\ndata: bbbbbbbb\n\n"
        self.assertEqual(decode([body], 16), [SSEEvent("aaaaaaa\nbbbbbbbb")])

    def test_event_over_the_cap(self) -> None:
        """An event whose data exceeds the cap raises, even with short lines."""
        e = self.assertRaises(SSELineTooLong, decode, [b"data: aaaaaaaa\ndata: bbbbbbbb\n"], 16)
        self.assertEqual((e.what, e.length), ("event", 17))

    def test_event_cap_counts_bytes(self) -> None:
        """An event's length is counted in UTF-8 bytes, not in characters."""
        line = "data: éé\n".encode()
        self.assertEqual(decode([line * 2 + b"\n"], 10), [SSEEvent("éé\néé")])
        self.assertRaises(SSELineTooLong, decode, [line * 3 + b"\n"], 10)

    def test_invalid_utf8(self) -> None:
        """Invalid UTF-8 anywhere, even in ignored lines, raises SSEError."""
        for body in [b"data: \xff\n\n", b": \xc3\n", b"foo: \xe2\x82\n", b"\xef\xbbdata: a\n\n"]:
            e = self.assertRaises(SSEError, decode, [body])
            self.assertNotIsInstance(e, SSELineTooLong)
            self.assertRaises(SSEError, decode, bytewise(body))

    def test_invalid_utf8_keeps_earlier_items(self) -> None:
        """The error carries the items decoded before the bad line."""
        e = self.assertRaises(SSEError, SSEDecoder().feed, b"data: a\n\n: c\ndata: \xff\n\n")
        self.assertEqual(e.items, [SSEEvent("a"), SSEComment("c")])

    def test_failed_decoder_stays_failed(self) -> None:
        """After raising, every later call raises SSEError."""
        decoder = SSEDecoder(8)
        self.assertRaises(SSELineTooLong, decoder.feed, b"x" * 9)
        self.assertRaises(SSEError, decoder.feed, b"\n\n")
        self.assertRaises(SSEError, decoder.finish)

    def test_bad_cap(self) -> None:
        """A cap below one byte is refused."""
        self.assertRaises(ValueError, SSEDecoder, 0)


class CaptureTests(SynchronousTestCase):
    """Real llama-server streams."""

    def check(self, name: str, count: int) -> list[Any]:
        """Decode a capture in several ways; return its chunks parsed as JSON."""
        body = (FIXTURES / name).read_bytes()
        items = decode([body])
        for pieces in [split_at(body, list(range(0, len(body), 7))), bytewise(body)]:
            self.assertEqual(decode(pieces), items)
        self.assertEqual(decode([body.replace(b"\n", b"\r\n")]), items)
        self.assertEqual(len(items), count)
        self.assertTrue(all(isinstance(i, SSEEvent) for i in items))
        *chunks, last = items
        assert isinstance(last, SSEEvent)
        self.assertTrue(last.done)
        parsed = [json.loads(c.data) for c in chunks if isinstance(c, SSEEvent)]
        for chunk in parsed:
            self.assertEqual(chunk["object"], "chat.completion.chunk")
        return parsed

    def test_plain_answer(self) -> None:
        """A plain answer: 8 chunks and [DONE], spelling the model's reply."""
        chunks = self.check("chat-nothink-stream.sse", 9)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        text = "".join(d.get("content") or "" for d in deltas)
        self.assertEqual(text, "Hello from the tiny model!")

    def test_progress(self) -> None:
        """A long prompt: 3 progress chunks among 8 chunks, then [DONE]."""
        chunks = self.check("progress-3k-prompt.sse", 9)
        self.assertEqual(sum("prompt_progress" in c for c in chunks), 3)

    def test_tool_call(self) -> None:
        """A streamed tool call: 14 chunks and [DONE]."""
        chunks = self.check("tools-required-stream.sse", 15)
        (choice,) = chunks[-1]["choices"]
        self.assertEqual(choice["finish_reason"], "tool_calls")


class EncoderTests(SynchronousTestCase):
    """encode_data and encode_comment."""

    def test_encode_data(self) -> None:
        """Payload lines become data lines and a blank line ends the event."""
        self.assertEqual(encode_data('{"a":1}'), b'data: {"a":1}\n\n')
        self.assertEqual(encode_data("a\nb"), b"data: a\ndata: b\n\n")
        self.assertEqual(encode_data(""), b"data: \n\n")
        self.assertEqual(encode_data("é"), "data: é\n\n".encode())

    def test_encode_data_refuses_cr(self) -> None:
        """A carriage return cannot travel in SSE data."""
        self.assertRaises(ValueError, encode_data, "a\rb")

    def test_encode_event(self) -> None:
        """A named event is an event line, its data lines and a blank line."""
        frame = encode_event("response.created", '{"a":1}')
        self.assertEqual(frame, b'event: response.created\ndata: {"a":1}\n\n')
        self.assertEqual(decode([frame]), [SSEEvent('{"a":1}', "response.created")])
        self.assertEqual(encode_event("e", "a\nb"), b"event: e\ndata: a\ndata: b\n\n")

    def test_encode_event_refuses_bad_names(self) -> None:
        """An empty name, a line break in the name and a CR in the data are refused."""
        self.assertRaises(ValueError, encode_event, "", "{}")
        self.assertRaises(ValueError, encode_event, "a\nb", "{}")
        self.assertRaises(ValueError, encode_event, "a\rb", "{}")
        self.assertRaises(ValueError, encode_event, "e", "a\rb")

    def test_encode_comment(self) -> None:
        """A comment is one colon-prefixed line and a blank line."""
        self.assertEqual(encode_comment('loopd {"e":1}'), b': loopd {"e":1}\n\n')
        self.assertEqual(decode([encode_comment("")]), [SSEComment("")])

    def test_encode_comment_refuses_line_breaks(self) -> None:
        """A comment with a line break is refused."""
        self.assertRaises(ValueError, encode_comment, "a\nb")
        self.assertRaises(ValueError, encode_comment, "a\rb")


_text = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=12)
_ending = st.sampled_from([b"\n", b"\r", b"\r\n"])
_line = st.one_of(
    _text.map(lambda t: ("data: " + t).encode()),
    _text.map(lambda t: ("data:" + t).encode()),
    _text.map(lambda t: (":" + t).encode()),
    _text.map(lambda t: ("event: " + t).encode()),
    _text.map(lambda t: ("id:" + t).encode()),
    _text.map(lambda t: ("retry: " + t).encode()),
    st.sampled_from([b"", b"", b"", b"data", b"data: [DONE]", b":"]),
    st.binary(max_size=6).filter(lambda b: b"\r" not in b and b"\n" not in b),
)
_stream = st.builds(
    lambda bom, lines: bom + b"".join(line + end for line, end in lines),
    st.sampled_from([b"", b"\xef\xbb\xbf"]),
    st.lists(st.tuples(_line, _ending), max_size=25),
)
_tail = st.one_of(st.just(b""), _line)


class PropertyTests(SynchronousTestCase):
    """Properties over generated streams."""

    @given(
        _stream,
        _tail,
        st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
        st.sampled_from([8, 16, 64, 1 << 20]),
    )
    def test_any_split_same_outcome(self, stream, tail, cuts, limit) -> None:
        """Any split into feeds gives the same items, error and end as one feed."""
        body = stream + tail
        self.assertEqual(outcome(split_at(body, cuts), limit), outcome([body], limit))

    @given(_stream, _tail)
    def test_matches_reference(self, stream, tail) -> None:
        """The decoder agrees with a literal line-by-line reading of the standard."""
        items, error, _ = outcome([stream + tail], 1 << 20)
        self.assertEqual((items, error is None), reference(stream + tail))

    @given(st.lists(st.tuples(st.booleans(), _text), max_size=8), st.data())
    def test_round_trip(self, frames, data) -> None:
        """Encoded payloads (with newlines) and comments decode to themselves."""
        expected: list[SSEItem] = []
        body = b""
        for is_data, text in frames:
            if is_data:
                payload = "\n".join(data.draw(st.lists(_text, min_size=1, max_size=3)))
                assume(payload != DONE)  # [DONE] ends a stream: tested on its own
                body += encode_data(payload)
                expected.append(SSEEvent(payload))
            else:
                body += encode_comment(text)
                expected.append(SSEComment(text))
        self.assertEqual(decode([body]), expected)
        self.assertEqual(decode(bytewise(body)), expected)

    @given(
        st.integers(min_value=1, max_value=64),
        st.integers(min_value=0, max_value=80),
        st.integers(min_value=1, max_value=9),
    )
    def test_cap_in_small_pieces(self, limit, length, piece) -> None:
        """A line longer than the cap raises as soon as its bytes pass the cap."""
        line = b"x" * length
        decoder = SSEDecoder(limit)
        received = 0
        for chunk in split_at(line, list(range(0, length, piece))):
            received += len(chunk)
            if received > limit:
                self.assertRaises(SSELineTooLong, decoder.feed, chunk)
                self.assertGreater(length, limit)
                return
            self.assertEqual(decoder.feed(chunk), [])
        self.assertLessEqual(length, limit)
        self.assertEqual(decoder.feed(b"\n"), [])
