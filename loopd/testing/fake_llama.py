# -*- test-case-name: loopd.test.test_fake_llama -*-
"""
A scripted fake llama-server: raw HTTP/1.1 on a stream transport, every reply byte scripted.

Public test kit (L{loopd.testing}): a program that talks to llama-server, through
L{loopd.llama.Client} or its own HTTP client, tests against L{FakeLlama} on a real Unix socket
(L{FakeLlama.listen}) or in memory (L{loopd.testing.memory_net.MemoryNet}). This module is
the server and the shapes of a reply (L{Reply}, L{sse_reply}, L{json_reply}, L{error_reply});
L{loopd.testing.llama_replies} has what llama-server answers on its routes, ready to script.

Each connection carries one request (a C{Content-Length} or chunked body). The fake records
it and picks a L{Reply} by method and path (not query): the route's FIFO of scripts, else its
default, else llama-server's 404; a script may be a callable of the request and the fake. The
reply plays on the injected clock (L{IReactorTime}): nothing at all, not even the status
line, until C{headers_delay} (llama-server is silent while a request waits for a slot;
C{math.inf} is never); then the head; then each L{Piece} after its delay from the write
before it; then the end. C{"close"} completes the framing and closes; C{"cut"} closes
mid-body (no last chunk, or a C{Content-Length} one byte longer than the body unless
C{content_length} is set); C{"silence"} sends nothing more and stays open. On a Unix socket a
cut is a close with the framing incomplete: there is no reset as on TCP. Like llama-server,
the fake is not half-close aware: a client that shuts down its writing side has closed.

L{SlotFiles} gives a fake llama-server's slot save and restore (C{POST /slots/<id>?action=...},
C{--slot-save-path}): what each slot and each file holds, and every action that arrived.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal, get_args

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IListeningPort, IReactorTime, IReactorUNIX
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure

from loopd.unixsocket import listen_unix

__all__ = [
    "CHAT",
    "CONTROL",
    "JSON_HEADERS",
    "LOADING",
    "NOT_FOUND",
    "PROPS",
    "SLOTS",
    "SSE_HEADERS",
    "TOKENIZE",
    "ConnectionRecord",
    "End",
    "FakeLlama",
    "FakeLlamaProtocol",
    "Framing",
    "Piece",
    "RecordedRequest",
    "Reply",
    "ReplySource",
    "RequestParser",
    "SlotFiles",
    "error_reply",
    "event_bytes",
    "json_reply",
    "sse_reply",
]

Framing = Literal["chunked", "length", "close"]
End = Literal["close", "cut", "silence"]

CHAT = "/v1/chat/completions"
CONTROL = "/v1/chat/completions/control"
SLOTS = "/slots"
PROPS = "/props"
TOKENIZE = "/tokenize"

_COMMON = (("Server", "llama.cpp"), ("Access-Control-Allow-Origin", ""))
#: Headers llama-server sends with a stream (framing and Connection are added per reply).
SSE_HEADERS = (*_COMMON, ("Content-Type", "text/event-stream"), ("X-Accel-Buffering", "no"))
#: Headers llama-server sends with a JSON answer.
JSON_HEADERS = (*_COMMON, ("Content-Type", "application/json; charset=utf-8"))
_PHRASES = {status.value: status.phrase for status in HTTPStatus}


@dataclass(frozen=True)
class Piece:
    """
    One write of a body: wait C{delay_s} after the previous write, then send C{data} (one
    chunk when chunked). An empty C{data} sends nothing: C{Piece(0.5, b"")} is a pause.
    """

    delay_s: float
    data: bytes


@dataclass(frozen=True)
class Reply:
    """
    The script of one reply (see the module docstring). C{Content-Length} or
    C{Transfer-Encoding: chunked}, and C{Connection: close}, are added to C{headers} by
    C{framing}; C{head}, if given, replaces the status line and headers byte for byte (blank
    line included), for replies no server should send.
    """

    status: int = 200
    headers: Sequence[tuple[str, str]] = ()
    pieces: Sequence[Piece] = ()
    framing: Framing = "length"
    end: End = "close"
    headers_delay: float = 0.0
    content_length: int | None = None
    head: bytes | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "headers", tuple(self.headers))
        object.__setattr__(self, "pieces", tuple(self.pieces))
        if self.framing not in get_args(Framing) or self.end not in get_args(End):
            raise ValueError(f"unknown framing or end: {self.framing!r}, {self.end!r}")
        if self.headers_delay < 0 or any(piece.delay_s < 0 for piece in self.pieces):
            raise ValueError("delays must not be negative")

    @property
    def body(self) -> bytes:
        """The body's bytes without framing: every piece joined."""
        return b"".join(piece.data for piece in self.pieces)

    def render_head(self) -> bytes:
        """The status line and headers as sent, ending with the blank line."""
        if self.head is not None:
            return self.head
        lines = [f"HTTP/1.1 {self.status} {_PHRASES.get(self.status, 'Unknown')}"]
        lines += [f"{name}: {value}" for name, value in self.headers]
        if self.framing == "chunked":
            lines.append("Transfer-Encoding: chunked")
        elif self.framing == "length":
            length = self.content_length
            if length is None:
                length = len(self.body) + (1 if self.end == "cut" else 0)
            lines.append(f"Content-Length: {length}")
        if not any(name.lower() == "connection" for name, _ in self.headers):
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def frame(self, data: bytes) -> bytes:
        """C{data} as it goes on the wire: one chunk when chunked, as it is otherwise."""
        if self.framing == "chunked" and data:
            return b"%x\r\n%s\r\n" % (len(data), data)
        return data


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def event_bytes(event: Mapping[str, Any] | str | bytes) -> bytes:
    """
    One SSE event as llama-server writes it: a dict is C{data: <compact JSON>\\n\\n}, a string
    C{data: <string>\\n\\n}; bytes are sent as they are (a ping is C{b":\\n\\n"}).
    """
    if isinstance(event, bytes):
        return event
    text = event if isinstance(event, str) else _compact(event).decode("utf-8")
    return b"data: " + text.encode("utf-8") + b"\n\n"


def sse_reply(
    events: Sequence[Mapping[str, Any] | str | bytes | Piece],
    *,
    delay_s: float = 0.0,
    done: bool | None = None,
    headers_delay: float = 0.0,
    end: End = "close",
    framing: Framing = "chunked",
) -> Reply:
    """
    A 200 stream: each event (L{event_bytes}) is a piece sent C{delay_s} after the one before;
    a L{Piece} is taken as it is. C{data: [DONE]} ends it if C{done}, which by default is
    true exactly when C{end} is C{"close"}. Other changes: C{dataclasses.replace}.
    """
    pieces = [e if isinstance(e, Piece) else Piece(delay_s, event_bytes(e)) for e in events]
    if done if done is not None else end == "close":
        pieces.append(Piece(delay_s, b"data: [DONE]\n\n"))
    return Reply(200, SSE_HEADERS, pieces, framing, end, headers_delay)


def json_reply(
    status: int, obj: Any, *, delay_s: float = 0.0, headers_delay: float = 0.0, end: End = "close"
) -> Reply:
    """A JSON answer with C{Content-Length}, its body one piece sent after C{delay_s}."""
    pieces = [Piece(delay_s, _compact(obj))]
    return Reply(status, JSON_HEADERS, pieces, "length", end, headers_delay)


def error_reply(status: int, type: str, message: str, **extra: Any) -> Reply:
    """
    llama-server's error shape C{{"error": {"code", "message", "type", **extra}}}, e.g.
    C{error_reply(400, "exceed_context_size_error", "...", n_prompt_tokens=9, n_ctx=8)}.
    For delays, apply C{dataclasses.replace} to the result.
    """
    error = {"code": status, "message": message, "type": type, **extra}
    return json_reply(status, {"error": error})


#: What llama-server answers on a route it does not have.
NOT_FOUND = json_reply(
    404, {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}
)
#: What every endpoint of llama-server answers while the model loads.
LOADING = error_reply(503, "unavailable_error", "Loading model")


@dataclass(eq=False)
class ConnectionRecord:
    """
    What happened on one accepted connection. C{closed_at} is the clock time of the close;
    C{client_closed} is true when the client closed it (or it was lost) before the fake did.
    C{sent} holds every byte the fake wrote; C{error} says why a request did not parse.
    """

    number: int
    opened_at: float
    request: RecordedRequest | None = None
    sent: bytearray = field(default_factory=bytearray)
    reply_ended_at: float | None = None
    closed_at: float | None = None
    client_closed: bool = False
    error: str | None = None
    protocol: FakeLlamaProtocol | None = field(default=None, repr=False)

    @property
    def open(self) -> bool:
        """Whether the connection is still open."""
        return self.closed_at is None

    def close(self, abort: bool = False) -> None:
        """Close the connection from the server side, or abort it (unsent bytes are lost)."""
        if self.protocol is not None:
            self.protocol.close(abort)


@dataclass(frozen=True)
class RecordedRequest:
    """One request as received; C{json} is parsed from C{body}, or C{None} if it is not JSON."""

    method: str
    target: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    json: Any
    received_at: float
    connection: ConnectionRecord = field(compare=False, repr=False)

    def header(self, name: str) -> str | None:
        """The value of the first header called C{name} (in any case), or C{None}."""
        values = [value for key, value in self.headers if key.lower() == name.lower()]
        return values[0] if values else None


ReplySource = Reply | Callable[[RecordedRequest, "FakeLlama"], Reply]

_HEAD_END = re.compile(rb"\r?\n\r?\n")
_Parsed = tuple[str, str, list[tuple[str, str]], bytes]


class RequestParser:
    """
    Collects bytes until one whole HTTP/1.1 request is in. Pure: no I/O. The body must have
    a C{Content-Length} (or be empty): anything malformed, chunked included, is a ValueError.
    """

    def __init__(self) -> None:
        """Nothing collected yet."""
        self._buffer = b""

    def feed(self, data: bytes) -> _Parsed | None:
        """Add C{data}: C{(method, target, headers, body)} once whole, else C{None}."""
        self._buffer += data
        match = _HEAD_END.search(self._buffer)
        if match is None:
            return None
        lines = self._buffer[: match.start()].decode("latin-1").split("\n")
        parts = lines[0].rstrip("\r").split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise ValueError(f"bad request line {lines[0]!r}")
        headers = []
        for line in lines[1:]:
            name, colon, value = line.rstrip("\r").partition(":")
            if not colon or not name.strip():
                raise ValueError(f"bad header line {line!r}")
            headers.append((name.strip(), value.strip()))
        fields = {name.lower(): value for name, value in headers}
        rest = self._buffer[match.end() :]
        if "transfer-encoding" in fields:
            raise ValueError("only Content-Length request bodies are supported")
        length = int(fields.get("content-length", "0"))
        if length < 0:
            raise ValueError("negative Content-Length")
        if len(rest) < length:
            return None
        return parts[0], parts[1], headers, rest[:length]


class FakeLlamaProtocol(Protocol):
    """One connection of the fake: parse the request, then play its L{Reply} on the clock."""

    def __init__(self, fake: FakeLlama) -> None:
        """A connection of C{fake}, not yet recorded (that happens when it is made)."""
        self._fake = fake
        self._parser = RequestParser()
        self._timer: IDelayedCall | None = None
        self._reply = Reply()
        self._closing = False
        self.record = ConnectionRecord(-1, 0.0)

    def connectionMade(self) -> None:
        """Record the new connection with the fake."""
        self.record = self._fake._opened(self)

    def dataReceived(self, data: bytes) -> None:
        """
        Feed the request parser; once the request is whole (or malformed: a 400), start
        playing its reply. Bytes after the request are ignored.
        """
        if self.record.request is not None or self.record.error is not None:
            return
        try:
            parsed = self._parser.feed(data)
        except ValueError as e:
            self.record.error = str(e)
            self._reply = error_reply(400, "invalid_request_error", f"malformed request: {e}")
        else:
            if parsed is None:
                return
            self._reply = self._fake._received(self.record, parsed)
        self._at(self._reply.headers_delay, -1)

    def _at(self, delay: float, index: int) -> None:
        if delay == 0:
            self._emit(index)
        elif delay != math.inf:
            self._timer = self._fake.clock.callLater(delay, self._emit, index)

    def _write(self, data: bytes) -> None:
        if data and not self._closing and self.transport is not None:
            self.record.sent += data
            self.transport.write(data)

    def _emit(self, index: int) -> None:
        # Writes part `index` (-1: the head), then every part due at once after it, in a loop:
        # a long stream without delays must not recurse.
        self._timer = None
        reply = self._reply
        while True:
            self._write(reply.render_head() if index < 0 else reply.frame(reply.pieces[index].data))
            index += 1
            if index == len(reply.pieces):
                break
            if reply.pieces[index].delay_s > 0:
                return self._at(reply.pieces[index].delay_s, index)
        self.record.reply_ended_at = self._fake.clock.seconds()
        if reply.end == "close" and reply.framing == "chunked":
            self._write(b"0\r\n\r\n")
        if reply.end != "silence":
            self.close(abort=False)

    def _stop_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def close(self, abort: bool) -> None:
        """End the connection from the server side: stop the script, then close or abort."""
        self._stop_timer()
        if self._closing or self.transport is None:
            return
        self._closing = True
        if abort:
            self.transport.abortConnection()  # type: ignore[attr-defined]
        else:
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Stop the script and record the close (and whether the client closed first)."""
        self._stop_timer()
        self.record.client_closed = not self._closing
        self._closing = True
        self._fake._closed(self.record)


class FakeLlama(Factory):
    """
    The fake server's routes, scripts and records, and the factory of its connections.

    @ivar requests: every request received, in order.
    @ivar connections: every connection accepted, in order.
    @ivar unscripted: the requests that found no script and no default (answered 404).
    @ivar state: free for reply callables and tests to keep state in.
    """

    noisy = False

    def __init__(self, clock: IReactorTime) -> None:
        """
        @param clock: the clock every reply plays on and every record is stamped with.
        """
        self.clock = clock
        self.requests: list[RecordedRequest] = []
        self.connections: list[ConnectionRecord] = []
        self.unscripted: list[RecordedRequest] = []
        self.state: dict[str, Any] = {}
        self._scripts: dict[tuple[str, str], deque[ReplySource]] = {}
        self._defaults: dict[tuple[str, str], ReplySource] = {}
        self._waiters: list[Deferred[None]] = []

    def script(self, method: str, path: str, *replies: ReplySource) -> None:
        """Queue C{replies} for the next requests to C{method path}, first in first out."""
        self._scripts.setdefault((method.upper(), path), deque()).extend(replies)

    def set_default(self, method: str, path: str, reply: ReplySource | None) -> None:
        """Answer C{method path} with C{reply} when its FIFO is empty; C{None} removes it."""
        if reply is None:
            self._defaults.pop((method.upper(), path), None)
        else:
            self._defaults[(method.upper(), path)] = reply

    def pending(self) -> dict[tuple[str, str], int]:
        """How many scripted replies each route has left (routes with none are left out)."""
        return {route: len(queue) for route, queue in self._scripts.items() if queue}

    def requests_to(self, method: str, path: str) -> list[RecordedRequest]:
        """The requests received for C{method path}, in order."""
        return [r for r in self.requests if (r.method, r.path) == (method.upper(), path)]

    def buildProtocol(self, addr: object) -> FakeLlamaProtocol:
        """A new connection of this fake."""
        return FakeLlamaProtocol(self)

    def listen(self, reactor: IReactorUNIX, path: str) -> IListeningPort:
        """Listen on the Unix socket C{path}, mode 0600, with L{listen_unix}."""
        return listen_unix(reactor, path, self)

    def close_all(self, abort: bool = True) -> Deferred[None]:
        """Abort (or close) every open connection; the Deferred fires once all are closed."""
        for record in self.connections:
            record.close(abort)
        return self.all_closed()

    def all_closed(self) -> Deferred[None]:
        """A Deferred that fires when no connection is open (at once if none is)."""
        if not any(record.open for record in self.connections):
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._waiters.append(waiter)
        return waiter

    def _opened(self, protocol: FakeLlamaProtocol) -> ConnectionRecord:
        record = ConnectionRecord(len(self.connections), self.clock.seconds(), protocol=protocol)
        self.connections.append(record)
        return record

    def _closed(self, record: ConnectionRecord) -> None:
        record.closed_at = self.clock.seconds()
        record.protocol = None
        if not any(r.open for r in self.connections):
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                waiter.callback(None)

    def _received(self, record: ConnectionRecord, parsed: _Parsed) -> Reply:
        method, target, headers, body = parsed
        path, _, query = target.partition("?")
        try:
            obj = json.loads(body) if body else None
        except ValueError:
            obj = None
        now = self.clock.seconds()
        request = RecordedRequest(
            method, target, path, query, tuple(headers), body, obj, now, record
        )
        record.request = request
        self.requests.append(request)
        route = (method, path)
        queue = self._scripts.get(route)
        source = queue.popleft() if queue else self._defaults.get(route)
        if source is None:
            self.unscripted.append(request)
            return NOT_FOUND
        return source if isinstance(source, Reply) else source(request, self)


#: llama-server's answer to a restore of a file it cannot load (missing, or no room).
_RESTORE_FAILED = "Unable to restore slot: No available space in KV cache or invalid slot save file"


class SlotFiles:
    """
    llama-server's slot save and restore on a L{FakeLlama}: the default reply of
    C{POST /slots/<id>} for each of its slots, answering as llama-server does (reference
    §4): a save writes what the slot holds to the file, a restore loads a file into the slot.

    Without C{--slot-save-path} (C{enabled=False}) every action is 501 C{not_supported_error};
    an action other than save and restore, a file name with a path in it, and a restore of a
    file never saved are 400 C{invalid_request_error}.

    With a C{directory} (the server's C{--slot-save-path}) a save also writes the file
    there, C{n_written} bytes with the process's umask as llama-server does, and a restore
    of a file no longer there fails as llama-server's does; so a test sees what loopd
    leaves on disk.

    @ivar tokens: how many tokens each slot holds now (tests set it, as a chat would).
    @ivar files: how many tokens each saved file holds, by name.
    @ivar actions: every action that arrived, in order: C{(action, slot, filename)}
        (C{filename} is C{None} when the body named none).
    """

    #: The bytes a saved token takes in a file (llama-server's depend on the model).
    BYTES_PER_TOKEN = 512

    def __init__(
        self, fake: FakeLlama, n_slots: int, *, enabled: bool = True, directory: str | None = None
    ) -> None:
        """
        Answer C{POST /slots/0} to C{/slots/<n_slots - 1>} on C{fake}.

        @param enabled: whether the server was started with C{--slot-save-path}.
        @param directory: where the files are written; C{None}: in memory only.
        """
        self.enabled = enabled
        self.directory = directory
        self.tokens: dict[int, int] = dict.fromkeys(range(n_slots), 0)
        self.files: dict[str, int] = {}
        self.actions: list[tuple[str, int, str | None]] = []
        for slot in range(n_slots):
            fake.set_default("POST", f"/slots/{slot}", self._answer)

    def _answer(self, request: RecordedRequest, fake: FakeLlama) -> Reply:
        """The reply to one slot action (see the class docstring)."""
        slot = int(request.path.rsplit("/", 1)[1])
        action = dict(p.partition("=")[::2] for p in request.query.split("&")).get("action", "")
        body = request.json if isinstance(request.json, dict) else {}
        filename = body.get("filename")
        self.actions.append((action, slot, filename if isinstance(filename, str) else None))
        if not self.enabled:
            message = "This server does not support slots action. Start it with `--slot-save-path`"
            return error_reply(501, "not_supported_error", message)
        if action not in ("save", "restore"):
            return error_reply(400, "invalid_request_error", "Invalid action")
        if not isinstance(filename, str) or not filename or "/" in filename or ".." in filename:
            return error_reply(400, "invalid_request_error", "Invalid filename")
        size = self.tokens[slot] * self.BYTES_PER_TOKEN
        if action == "save":
            self.files[filename] = self.tokens[slot]
            if self.directory is not None:
                with open(os.path.join(self.directory, filename), "wb") as file:
                    file.write(bytes(size))
            saved = {"id_slot": slot, "filename": filename, "n_saved": self.tokens[slot]}
            saved.update(n_written=size, timings={"save_ms": 1.5})
            return json_reply(200, saved)
        on_disk = self.directory is None or os.path.exists(os.path.join(self.directory, filename))
        if filename not in self.files or not on_disk:
            return error_reply(400, "invalid_request_error", _RESTORE_FAILED)
        self.tokens[slot] = self.files[filename]
        restored = {"id_slot": slot, "filename": filename, "n_restored": self.tokens[slot]}
        restored.update(
            n_read=self.tokens[slot] * self.BYTES_PER_TOKEN, timings={"restore_ms": 2.5}
        )
        return json_reply(200, restored)
