"""
Tests for the transcripts in fixtures/transcripts, recorded from a real llama.cpp server
by L{loopd.test.support.record_fixtures}: every file fixtures/README.md lists exists,
each stream decodes with loopd's SSE decoder and shows what the README says it shows;
and the recorder's HTTP response reader parses a response however it is split.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

import loopd
from loopd.demo.tiny_model import ANSWER, THOUGHT
from loopd.sse import SSEDecoder, SSEEvent
from loopd.test.support.record_fixtures import (
    RecordError,
    ResponseReader,
    Transcript,
    read_transcript,
    request_bytes,
)

FIXTURES = Path(loopd.__file__).resolve().parent.parent / "fixtures"
TRANSCRIPTS = FIXTURES / "transcripts"
STREAMS = ("plain", "thinking", "tool-call", "progress", "reasoning-end", "error")
# A table row of the README whose first cell names a transcript file: | `name.sse` | ...
ROW = re.compile(r"^\|\s*`([^`/]+\.(?:sse|json|http))`\s*\|", re.MULTILINE)


def listed() -> list[str]:
    """The transcript files the README's table lists, in order."""
    return ROW.findall((FIXTURES / "README.md").read_text(encoding="utf-8"))


def raw(name: str) -> bytes:
    """The bytes of one transcript file."""
    return (TRANSCRIPTS / name).read_bytes()


def transcript(name: str) -> Transcript:
    """The folded chunks of ``<name>.sse``."""
    return read_transcript(raw(f"{name}.sse"))


def request(name: str) -> dict[str, Any]:
    """The request body recorded for ``name``."""
    body: dict[str, Any] = json.loads(raw(f"{name}.request.json"))
    return body


def parse(pieces: list[bytes]) -> ResponseReader:
    """Feed the pieces to a fresh reader, then mark the end of the connection."""
    reader = ResponseReader()
    for piece in pieces:
        reader.feed(piece)
    reader.finish()
    return reader


class ReadmeTests(SynchronousTestCase):
    """fixtures/README.md and fixtures/transcripts agree."""

    def test_listed_files_exist(self) -> None:
        """Every file the README lists is in fixtures/transcripts."""
        missing = [name for name in listed() if not (TRANSCRIPTS / name).is_file()]
        self.assertEqual(missing, [])

    def test_files_are_listed(self) -> None:
        """Every file in fixtures/transcripts is in the README, and every case is there."""
        names = set(listed())
        self.assertEqual(sorted(p.name for p in TRANSCRIPTS.iterdir() if p.name not in names), [])
        for case in STREAMS:
            self.assertIn(f"{case}.sse", names)
            self.assertIn(f"{case}.request.json", names)
        self.assertIn("chunked-response.http", names)
        self.assertIn("reasoning-end.control.json", names)


class StreamTests(SynchronousTestCase):
    """Each recorded stream decodes and shows its case."""

    def test_streams_end_with_done(self) -> None:
        """Every listed stream but the error one decodes and ends with [DONE]."""
        for name in listed():
            if not name.endswith(".sse") or name == "error.sse":
                continue
            decoder = SSEDecoder()
            items = decoder.feed(raw(name)) + decoder.finish()
            last = items[-1]
            self.assertTrue(isinstance(last, SSEEvent) and last.done, name)
            self.assertFalse(decoder.discarded_at_eof, name)
            t = transcript(name[: -len(".sse")])
            self.assertIsNone(t.error, name)
            self.assertEqual(len({chunk["id"] for chunk in t.chunks}), 1, name)

    def test_plain(self) -> None:
        """Thinking off: only content, the scripted answer, finish_reason stop."""
        t = transcript("plain")
        self.assertEqual((t.phases, t.content, t.reasoning), (["content"], ANSWER, ""))
        self.assertEqual(t.finish_reason, "stop")
        self.assertEqual(request("plain")["chat_template_kwargs"], {"enable_thinking": False})

    def test_thinking(self) -> None:
        """Thinking on: the whole thought first, then the answer."""
        t = transcript("thinking")
        self.assertEqual(t.phases, ["reasoning", "content"])
        self.assertEqual((t.reasoning, t.content, t.finish_reason), (THOUGHT, ANSWER, "stop"))

    def test_tool_call(self) -> None:
        """One tool offered: one streamed call with an id, its name and JSON arguments."""
        t = transcript("tool-call")
        self.assertEqual(t.phases, ["reasoning", "tool_call"])
        self.assertEqual(t.finish_reason, "tool_calls")
        self.assertEqual(list(t.tool_calls), [0])
        call = t.tool_calls[0]
        self.assertTrue(call["id"])
        self.assertEqual(call["name"], "get_weather")
        self.assertIsInstance(json.loads(call["arguments"]), dict)
        pieces = [
            c
            for chunk in t.chunks
            for ch in chunk["choices"]
            for c in ch["delta"].get("tool_calls", [])
        ]
        self.assertGreater(len(pieces), 1)
        tools = request("tool-call")["tools"]
        self.assertEqual([tool["function"]["name"] for tool in tools], ["get_weather"])

    def test_progress(self) -> None:
        """A long prompt: several progress events, processed rising to the total."""
        t = transcript("progress")
        progress = t.progress
        self.assertGreaterEqual(len(progress), 2)
        processed = [p["processed"] for p in progress]
        self.assertEqual(processed, sorted(set(processed)))
        self.assertEqual({(p["total"], p["cache"]) for p in progress}, {(progress[0]["total"], 0)})
        self.assertEqual(processed[-1], progress[0]["total"])
        self.assertGreater(progress[0]["total"], 2000)
        self.assertEqual((t.phases, t.content), (["reasoning", "content"], ANSWER))

    def test_reasoning_end(self) -> None:
        """A never-ending thought, cut by the control call: reasoning, then the answer."""
        t = transcript("reasoning-end")
        self.assertEqual(t.phases, ["reasoning", "content"])
        # The model repeats its thought until the server forces </think>.
        self.assertTrue(((THOUGHT + " ") * 100).startswith(t.reasoning))
        self.assertNotEqual(t.reasoning, THOUGHT)
        self.assertEqual((t.content, t.finish_reason), (ANSWER, "stop"))
        self.assertEqual(json.loads(raw("reasoning-end.control.json")), {"success": True})
        self.assertIs(request("reasoning-end")["reasoning_control"], True)

    def test_error(self) -> None:
        """The pool runs out mid-stream: reasoning, then an error event and no [DONE]."""
        decoder = SSEDecoder()
        items = decoder.feed(raw("error.sse")) + decoder.finish()
        self.assertFalse(decoder.discarded_at_eof)
        self.assertFalse(any(isinstance(i, SSEEvent) and i.done for i in items))
        t = transcript("error")
        self.assertEqual((t.phases, t.done, t.finish_reason), (["reasoning"], False, None))
        self.assertEqual(t.chunks[-1], {"error": t.error})
        assert t.error is not None
        self.assertEqual(t.error["type"], "server_error")
        self.assertEqual(t.error["message"], "Context size has been exceeded.")

    def test_requests_carry_loopd_fields(self) -> None:
        """Each request has the fields loopd sends; reasoning_control when thinking."""
        for name in STREAMS:
            body = request(name)
            for flag in ("stream", "cache_prompt", "return_progress", "timings_per_token"):
                self.assertIs(body[flag], True, (name, flag))
            self.assertIsInstance(body["id_slot"], int, name)
            self.assertIsInstance(body["max_tokens"], int, name)
            thinking = "chat_template_kwargs" not in body
            self.assertEqual(body.get("reasoning_control", False), thinking, name)

    def test_chunked_response(self) -> None:
        """The raw response is 200, chunked SSE, and de-chunks to thinking.sse."""
        data = raw("chunked-response.http")
        self.assertTrue(data.startswith(b"HTTP/1.1 200 "))
        self.assertTrue(data.endswith(b"\r\n0\r\n\r\n"))
        reader = parse([data])
        self.assertTrue(reader.chunked)
        self.assertEqual(reader.headers["content-type"], "text/event-stream")
        self.assertEqual(bytes(reader.body), raw("thinking.sse"))


class ResponseReaderTests(SynchronousTestCase):
    """The recorder's HTTP response reader."""

    @given(st.lists(st.integers(min_value=0, max_value=10000), max_size=12))
    def test_any_split(self, cuts: list[int]) -> None:
        """The recorded response parses the same however it is split into reads."""
        data = raw("chunked-response.http")
        edges = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
        reader = parse([data[a:b] for a, b in zip(edges, edges[1:], strict=False)])
        whole = parse([data])
        self.assertEqual((reader.status, reader.headers), (whole.status, whole.headers))
        self.assertEqual((reader.body, reader.raw), (whole.body, bytearray(data)))

    def test_sized_body(self) -> None:
        """A Content-Length body is read to its length; feed returns what is new."""
        reader = ResponseReader()
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 16\r\n\r\n"
        self.assertEqual(reader.feed(head + b'{"success"'), b'{"success"')
        self.assertEqual(reader.feed(b":true}"), b":true}")
        reader.finish()
        self.assertEqual((reader.status, bytes(reader.body)), (200, b'{"success":true}'))

    def test_body_to_close(self) -> None:
        """Without a length or chunking, the body runs to the end of the connection."""
        reader = parse([b"HTTP/1.1 503 Busy\r\nX: y\r\n\r\nno", b" slot"])
        self.assertEqual((reader.status, bytes(reader.body)), (503, b"no slot"))

    def test_cut_chunked_body(self) -> None:
        """A chunked body cut before its last chunk is a RecordError."""
        data = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
        self.assertRaises(RecordError, parse, [data])

    def test_chunk_extension_and_trailer(self) -> None:
        """Chunk extensions are ignored and a trailer is skipped."""
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        data = head + b"3;x=1\r\nabc\r\n0\r\nT: 1\r\n\r\n"
        self.assertEqual(bytes(parse([data]).body), b"abc")

    def test_request_bytes(self) -> None:
        """A request is HTTP/1.1 with Connection: close and a sized JSON body."""
        self.assertEqual(
            request_bytes("POST", "/x", b"{}"),
            b"POST /x HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
        )
