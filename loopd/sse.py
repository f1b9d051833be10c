"""
Server-sent events: response body bytes in, events and comments out; and back.

`SSEDecoder` is an incremental decoder for the ``text/event-stream`` format as the
WHATWG HTML standard defines it ("event stream interpretation"), specialised for
what loopd reads from llama-server and other OpenAI-compatible servers: a stream of
``data: <JSON>`` events separated by blank lines and ended by ``data: [DONE]``.
It is pure: bytes go in through `SSEDecoder.feed`, decoded items come out, and
nothing here touches a socket or a reactor.

Decisions where the standard leaves room or where loopd needs more:

- Line endings are LF, CRLF or a bare CR, and may be split anywhere across feeds,
  also between the CR and the LF of one CRLF.
- Comments (lines starting with ``:``) are returned as `SSEComment` items, in stream
  order with the events, because loopd sends its own progress notes as
  ``: loopd {...}`` comments. One space after the colon is removed, as for values.
- Text is UTF-8. Invalid UTF-8 is an `SSEError` (the standard would substitute
  U+FFFD; a server that sends broken text is broken, and loopd wants to know). One
  leading byte order mark is skipped.
- Size cap. The *length of a line* is its number of bytes without its line ending
  (and without a leading byte order mark). The *length of an event* is the number of
  bytes of its data as it would be dispatched: the UTF-8 bytes of the data values
  (after the optional space) plus one byte for each newline that joins two of them.
  Either one above ``max_line_bytes`` raises `SSELineTooLong`; exactly
  ``max_line_bytes`` is accepted. A partial line is measured while it is buffered,
  so the decoder never holds more than about ``max_line_bytes`` of one line.
- End of body. As the standard says, an event that is not followed by its blank
  line when the body ends is discarded, and so is an unterminated last line:
  `SSEDecoder.finish` dispatches nothing and records the loss in
  `SSEDecoder.discarded_at_eof`. A llama-server stream that is cut off therefore
  never yields a half-received ``[DONE]``.
- After ``[DONE]``. The event whose data is ``[DONE]`` (`SSEEvent.done`) is the
  last one. Blank lines and comments may follow it (a keep-alive ping can race the
  end); any field line after it raises `SSEAfterDone`.
- Errors. Every error is an `SSEError`; its ``items`` attribute holds what the
  failing `SSEDecoder.feed` call had decoded before the error, so nothing is lost.
  A decoder that raised stays failed: every later call raises `SSEError`.

The encoder functions build the frames loopd's gateway writes: `encode_data`,
`encode_event` (a named event, as the Anthropic and Responses streams send them) and
`encode_comment`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "DONE",
    "SSEAfterDone",
    "SSEComment",
    "SSEDecoder",
    "SSEError",
    "SSEEvent",
    "SSEItem",
    "SSELineTooLong",
    "encode_comment",
    "encode_data",
    "encode_event",
]

DONE = "[DONE]"
"""The data of the event that ends an OpenAI-style stream."""

DEFAULT_MAX_LINE_BYTES = 1 << 20
"""1 MiB: the per-line cap of the inference-path specification."""

_BOM = b"\xef\xbb\xbf"


class SSEError(Exception):
    """
    The byte stream is not a well-formed event stream, or the decoder was misused.

    @ivar items: the events and comments that the failing `SSEDecoder.feed` call
        had decoded before it met the error, in stream order (empty when the error
        was not raised by ``feed``).
    """

    items: list[SSEItem]

    def __init__(self, message: str) -> None:
        """
        @param message: a one-line reason.
        """
        super().__init__(message)
        self.items = []


class SSELineTooLong(SSEError):  # noqa: N818 (the name the design gives it)
    """A line, or the data of one event, is longer than the decoder's cap."""

    def __init__(self, what: str, length: int, limit: int) -> None:
        """
        @param what: ``"line"`` or ``"event"``.
        @param length: the length found (for a partial line: at least this long).
        @param limit: the cap in bytes.
        """
        super().__init__(f"SSE {what} of {length} bytes exceeds the {limit}-byte cap")
        self.what = what
        self.length = length
        self.limit = limit


class SSEAfterDone(SSEError):  # noqa: N818 (named like SSELineTooLong)
    """A field line arrived after the ``data: [DONE]`` event."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """
    One dispatched event.

    @ivar data: the data lines' values joined with ``\\n``.
    @ivar event: the event type from an ``event:`` field, or L{None} when the event
        had none (or an empty one), which the standard calls ``message``.
    @ivar id: the last event ID seen so far in the stream (the standard's
        ``lastEventId``, which carries over from earlier events), or L{None} when it
        is empty.
    """

    data: str
    event: str | None = None
    id: str | None = None

    @property
    def done(self) -> bool:
        """
        Whether this is the ``data: [DONE]`` marker that ends an OpenAI stream.
        """
        return self.data == DONE


@dataclass(frozen=True, slots=True)
class SSEComment:
    """
    One comment line (``:text``), without the colon and one following space.

    @ivar text: the comment's text; ``""`` for a bare ``:`` keep-alive ping.
    """

    text: str


SSEItem = SSEEvent | SSEComment
"""What `SSEDecoder.feed` returns: events and comments, in stream order."""


# The decoder builds events by filling SSEEvent's slots through their descriptors:
# the frozen dataclass __init__ goes through object.__setattr__ once per field, which
# makes it the most expensive step of decoding a llama-server chunk.
_new_event = object.__new__
_set_data: Callable[[SSEEvent, str], None] = SSEEvent.__dict__["data"].__set__
_set_event: Callable[[SSEEvent, str | None], None] = SSEEvent.__dict__["event"].__set__
_set_id: Callable[[SSEEvent, str | None], None] = SSEEvent.__dict__["id"].__set__


class SSEDecoder:
    """
    An incremental event-stream decoder; see the module docstring for its rules.

    Feed it body bytes as they arrive with `feed`, then call `finish` once at the
    end of the body.
    """

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        """
        @param max_line_bytes: the cap on the length of a line and of an event's
            data, in bytes (see the module docstring for how length is counted).
        @raise ValueError: if the cap is not positive.
        """
        if max_line_bytes < 1:
            raise ValueError(f"max_line_bytes must be positive (got {max_line_bytes})")
        self._limit = max_line_bytes
        # Pieces of the current unterminated line, and their total length.
        self._partial: list[bytes] = []
        self._partial_len = 0
        # The first bytes of the stream while they could still be a BOM.
        self._head: bytes | None = b""
        # The last byte handled was a CR: an LF that comes next ends its CRLF.
        self._skip_lf = False
        # The current event: its data values, their length as dispatched in bytes
        # (-1 for none), its type; and the stream's last event ID.
        self._values: list[str] = []
        self._data_len = -1
        self._event: str | None = None
        self._last_id: str | None = None
        self._done = False
        self._closed = False
        self._failed = False
        # True while none of the rare states above needs the careful path.
        self._plain = False
        self.discarded_at_eof = False
        """Whether `finish` dropped an incomplete event or line."""

    @property
    def done(self) -> bool:
        """
        Whether the ``data: [DONE]`` event has been decoded.
        """
        return self._done

    def feed(self, data: bytes) -> list[SSEItem]:
        """
        Decode the next piece of the body.

        @param data: any number of bytes, split anywhere.
        @return: the events and comments completed by these bytes, in order.
        @raise SSELineTooLong: a line or an event exceeds the cap.
        @raise SSEAfterDone: a field line follows ``data: [DONE]``.
        @raise SSEError: invalid UTF-8, or the decoder has failed or finished.
        """
        out: list[SSEItem] = []
        try:
            if self._plain and data[-1:] == b"\n" and len(data) <= self._limit:
                # The common case: whole lines, nothing pending, nothing odd.
                self._complete(data, out)
            else:
                self._feed_careful(data, out)
        except SSEError as e:
            self._failed = True
            self._plain = False
            e.items = out
            raise
        return out

    def finish(self) -> list[SSEItem]:
        """
        Mark the end of the body.

        Following the WHATWG standard, an event without its closing blank line and
        an unterminated last line are discarded (see `discarded_at_eof`), so this
        dispatches nothing; it returns a list so that callers can treat it like
        `feed`.

        @return: an empty list.
        @raise SSEError: if the decoder has failed or already finished.
        """
        self._check_usable()
        self.discarded_at_eof = bool(self._partial or self._values or self._head)
        self._closed = True
        self._plain = False
        self._partial = []
        self._values = []
        return []

    def _check_usable(self) -> None:
        """
        Raise if the decoder may not take more input.
        """
        if self._failed:
            raise SSEError("SSE decoder used after an error")
        if self._closed:
            raise SSEError("SSE decoder used after finish()")

    def _feed_careful(self, data: bytes, out: list[SSEItem]) -> None:
        """
        Feed bytes when something is pending: a partial line, a possible BOM, a CR
        whose LF may follow, the end of the stream, or an oversized piece.
        """
        if self._failed or self._closed:
            self._check_usable()
        if self._head is not None:
            head = self._head + data
            if len(head) < len(_BOM) and _BOM.startswith(head):
                self._head = head
                return
            self._head = None
            data = head[len(_BOM) :] if head.startswith(_BOM) else head
        if self._skip_lf:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        partial = self._partial
        limit = self._limit
        cut = data.rfind(b"\n")
        cut = max(cut, data.rfind(b"\r", cut + 1))
        if cut < 0:
            if data:
                self._plain = False
                partial.append(data)
                self._partial_len += len(data)
                if self._partial_len > limit:
                    raise SSELineTooLong("line", self._partial_len, limit)
            return
        self._skip_lf = data[-1] == 13
        rest = data[cut + 1 :]
        whole = data[: cut + 1] if rest else data
        if partial:
            partial.append(whole)
            whole = b"".join(partial)
            partial.clear()
        if len(whole) > limit:
            self._check_line_lengths(whole, out)
        self._complete(whole, out)
        self._partial_len = len(rest)
        if rest:
            self._plain = False
            partial.append(rest)
            if len(rest) > limit:
                raise SSELineTooLong("line", len(rest), limit)
        else:
            self._plain = self._head is None and not (self._skip_lf or self._done)

    def _check_line_lengths(self, whole: bytes, out: list[SSEItem]) -> None:
        """
        Raise for the first over-long line of ``whole``, after interpreting the
        lines before it, so that the outcome does not depend on how the stream
        was split into feeds.
        """
        pieces = whole.splitlines(keepends=True)
        if max(map(len, pieces)) <= self._limit:
            return
        offset = 0
        for piece in pieces:
            length = len(piece.rstrip(b"\r\n"))
            if length > self._limit:
                if offset:
                    self._complete(whole[:offset], out)
                raise SSELineTooLong("line", length, self._limit)
            offset += len(piece)

    def _complete(self, whole: bytes, out: list[SSEItem]) -> None:
        """
        Interpret complete lines, appending what they make to ``out``.

        @param whole: lines, each with its line ending, none over the cap.
        """
        try:
            text = whole.decode()
        except UnicodeDecodeError as e:
            # Interpret the lines before the bad one first, as a split feed would.
            good = whole[: e.start]
            cut = good.rfind(b"\n")
            cut = max(cut, good.rfind(b"\r", cut + 1))
            if cut >= 0:
                self._complete(good[: cut + 1], out)
            raise SSEError(f"invalid UTF-8 in SSE stream: {e.reason}") from None
        if "\r" in text:
            # bytes.splitlines breaks at exactly CR, LF and CRLF (str.splitlines
            # also at other characters), and beats str.replace for CRLF.
            lines = list(map(bytes.decode, whole.splitlines()))
        else:
            lines = text.split("\n")
            lines.pop()
        if self._done:
            self._lines_after_done(lines, out)
            return
        # A value's length in bytes is its length in characters if all is ASCII.
        ascii_only = text.isascii()
        values = self._values
        data_len = self._data_len
        limit = self._limit
        remaining = iter(lines)
        for line in remaining:
            if line.startswith("data: "):
                value = line[6:]
            elif line:
                found = self._field(line, out)
                if found is None:
                    continue
                value = found
            else:
                if values:
                    data = values[0] if len(values) == 1 else "\n".join(values)
                    event = _new_event(SSEEvent)
                    _set_data(event, data)
                    _set_event(event, self._event)
                    _set_id(event, self._last_id)
                    out.append(event)
                    values = self._values = []
                    data_len = -1
                    if data == DONE:
                        self._done = True
                        self._plain = False
                        self._event = None
                        self._data_len = -1
                        self._lines_after_done(remaining, out)
                        return
                self._event = None
                continue
            data_len += (len(value) if ascii_only else len(value.encode())) + 1
            if data_len > limit:
                raise SSELineTooLong("event", data_len, limit)
            values.append(value)
        self._data_len = data_len

    def _field(self, line: str, out: list[SSEItem]) -> str | None:
        """
        Interpret a non-blank line other than ``data: ...``.

        @return: the value if the line is a data field, else L{None}.
        """
        name, _, value = line.partition(":")
        if value[:1] == " ":
            value = value[1:]
        if not name:
            out.append(SSEComment(value))
        elif name == "data":
            return value
        elif name == "event":
            self._event = value or None
        elif name == "id":
            if "\0" not in value:
                self._last_id = value or None
        # Anything else, such as retry, does not concern a client that never
        # reconnects by itself, and the standard says to ignore unknown fields.
        return None

    def _lines_after_done(self, lines: Iterable[str], out: list[SSEItem]) -> None:
        """
        Interpret lines after ``[DONE]``: comments pass, blank lines are ignored.
        """
        for line in lines:
            if not line:
                continue
            if not line.startswith(":"):
                raise SSEAfterDone(f"SSE field line after [DONE]: {line[:40]!r}")
            self._field(line, out)


def encode_data(payload: str) -> bytes:
    """
    Frame ``payload`` as one event: a ``data: `` line per line of it, then a
    blank line.

    @param payload: any text; a ``\\n`` in it becomes a line break that the
        decoder joins back with ``\\n``.
    @raise ValueError: if ``payload`` contains ``\\r``, which an event stream
        cannot carry (every decoder reads it as a line break).
    """
    if "\r" in payload:
        raise ValueError("SSE data cannot contain a carriage return")
    if "\n" in payload:
        payload = payload.replace("\n", "\ndata: ")
    return ("data: " + payload + "\n\n").encode()


def encode_event(name: str, payload: str) -> bytes:
    """
    Frame ``payload`` as one event of type ``name``: an ``event: `` line, then the
    data lines as `encode_data` writes them.

    @param name: the event's type (``message_start``, ``response.created`` ...).
    @param payload: as for `encode_data`.
    @raise ValueError: if ``name`` is empty or has a line break, or ``payload`` has a
        carriage return.
    """
    if not name or "\n" in name or "\r" in name:
        raise ValueError("an SSE event name is one non-empty line: no CR or LF")
    return b"event: " + name.encode() + b"\n" + encode_data(payload)


def encode_comment(text: str) -> bytes:
    """
    Frame ``text`` as a comment line (``: text``) followed by a blank line.

    @param text: one line of text.
    @raise ValueError: if ``text`` contains ``\\r`` or ``\\n``: a comment is one line.
    """
    if "\n" in text or "\r" in text:
        raise ValueError("an SSE comment is one line: no CR or LF")
    return (": " + text + "\n\n").encode()
