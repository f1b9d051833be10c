# -*- test-case-name: loopd.test.test_replay -*-
"""
C{loopd replay FILE --session ID}: send a captured session's requests
(L{loopd.gateway.capture}) to loopd again, one after the other in the order they came,
and print what each did, beside what the capture says it did then, to reproduce what an
agent did.

 - B{Reading} (L{read_capture}): FILE is a capture file, or a capture directory whose
   capture files are read oldest first. The session's lines are taken in the order their
   requests arrived (by the wall clock, then by their number in loopd's run). A line that
   is not a capture line (a line cut short when a disk was full, another format) is passed
   over and counted. A session captured without C{prompts = true} has no bodies and
   cannot be replayed: that is said in one line.
 - B{Sending} (L{replay_session}): each request goes to the path of the front door it came
   through, with the body as the agent sent it (or, with C{--model}, with its C{model}
   changed), under a session id of the replay's own (C{replay-} and 12 hex digits, so the
   replay does not continue the captured session in a loopd that still knows it), named
   in C{X-Session-Id}; its agent is C{loopd-replay}. The next request goes when the answer
   before it has ended, as an agent's next turn does.
 - B{Printing}: per request its HTTP status, the prompt tokens the server reused and
   evaluated (loopd's C{X-Loopd-Cache} header of a whole answer, or the cache comment at
   the end of a stream) and the seconds it took; and the captured figures beside them.

Exit status: 0 when every request was answered with a 2xx, 1 when one was not (or loopd
could not be reached), 2 when the capture cannot be replayed.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.python.failure import Failure

from loopd import http, strict_json
from loopd.errors import Connect
from loopd.gateway.capture import CAPTURE_FORMAT
from loopd.gateway.capture_files import capture_file_names
from loopd.reactor import IUnixReactor
from loopd.unixsocket import UnixSocketError, check_peer_socket

__all__ = [
    "AGENT",
    "CapturedRequest",
    "ReplayError",
    "Replayed",
    "CommentLines",
    "cache_figures",
    "captured_request",
    "read_capture",
    "replay_session",
    "request_bodies",
]

Write = Callable[[str], None]

#: The agent name a replayed request carries (C{X-Loopd-Agent}).
AGENT: Final = "loopd-replay"
#: The longest line of an answer kept to look for loopd's cache comment, in bytes.
COMMENT_LIMIT: Final = 1 << 16
_CACHE_COMMENT: Final = b": loopd "


class ReplayError(Exception):
    """The capture cannot be replayed; the message is one line that says why."""


@dataclass(frozen=True)
class CapturedRequest:
    """
    One request of a capture, as L{replay_session} sends it again.

    @ivar door: the front door it came through (C{chat}, C{messages}, C{responses}).
    @ivar path: the front door's path.
    @ivar body: the body as the agent sent it; C{None} when captured without prompts.
    @ivar started: when it arrived (the wall clock), for the order.
    @ivar status: the HTTP status it was answered with then.
    @ivar reused: the prompt tokens the server reused for it then.
    @ivar evaluated: the prompt tokens the server evaluated for it then.
    @ivar seconds: how long its answer took then; C{None} if unknown.
    @ivar model: the model it asked for.
    @ivar id: its number in its run of loopd (which orders requests that arrived in the
        same instant).
    """

    door: str
    path: str
    body: bytes | None
    started: float
    status: int | None = None
    reused: int = 0
    evaluated: int = 0
    seconds: float | None = None
    model: str | None = None
    id: int = 0


@dataclass(frozen=True)
class Replayed:
    """
    What one request did when sent again.

    @ivar status: the HTTP status, or C{None} when no answer came (its C{error} then).
    @ivar reused: the prompt tokens the server reused, if loopd said.
    @ivar evaluated: the prompt tokens it evaluated, if loopd said.
    @ivar seconds: from sending it to the end of its answer.
    @ivar error: why no whole answer came, if none did.
    """

    status: int | None
    reused: int | None
    evaluated: int | None
    seconds: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether it was answered with a 2xx."""
        return self.status is not None and 200 <= self.status < 300


# -- reading -------------------------------------------------------------------------------


def captured_request(raw: bytes) -> tuple[str | None, CapturedRequest] | None:
    """
    One line of a capture file: its session and request, or C{None} for a line that is not
    a capture line (not JSON, not an object, another format, a field of the wrong type).
    """
    try:
        line = strict_json.decode(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(line, dict) or line.get("capture") != CAPTURE_FORMAT:
        return None
    door, path, started = line.get("door"), line.get("path"), line.get("started")
    session = line.get("session")
    if not (isinstance(door, str) and isinstance(path, str) and path.startswith("/")):
        return None
    arrived = _number(started)
    if arrived is None or not (session is None or isinstance(session, str)):
        return None
    try:
        body = _body(line)
    except ValueError:
        return None
    status = line.get("status")
    model = line.get("model")
    request = CapturedRequest(
        door=door,
        path=path,
        body=body,
        started=arrived,
        status=status if _is_int(status) else None,
        reused=_int(line.get("reused_tokens")),
        evaluated=_int(line.get("evaluated_tokens")),
        seconds=_number(line.get("seconds")),
        model=model if isinstance(model, str) else None,
        id=_int(line.get("id")),
    )
    return session, request


def read_capture(path: str, session: str) -> tuple[list[CapturedRequest], int]:
    """
    The requests of C{session} in the capture at C{path} (a capture file, or a capture
    directory), in the order they arrived, and the number of lines passed over.

    @raise ReplayError: C{path} cannot be read or holds no capture file; the session is not
        in it (the message names some that are); or it was captured without prompts.
    """
    files = _files(path)
    needle = json.dumps(session, ensure_ascii=False).encode("utf-8")
    found: list[CapturedRequest] = []
    skipped = 0
    for raw in _lines(files):
        if needle not in raw:
            continue
        parsed = captured_request(raw)
        if parsed is None:
            skipped += 1
        elif parsed[0] == session:
            found.append(parsed[1])
    if not found:
        others = _sessions(files)
        named = ", ".join(others[:10]) + (", ..." if len(others) > 10 else "")
        raise ReplayError(
            f"no request of session {session!r} in {path}"
            + (f" (its sessions: {named})" if others else " (it has no capture lines)")
        )
    without = sum(1 for request in found if request.body is None)
    if without:
        some = "" if without == len(found) else f"{without} of its {len(found)} requests were "
        raise ReplayError(
            f"session {session!r} in {path} cannot be replayed: {some}captured without "
            "prompts, so the requests' bodies are not there (set prompts = true in [capture] "
            "to capture what a replay needs)"
        )
    found.sort(key=lambda request: (request.started, request.id))
    return found, skipped


def _files(path: str) -> list[str]:
    """The capture files of C{path}: itself, or a directory's, oldest first."""
    if os.path.isdir(path):
        try:
            names = capture_file_names(os.listdir(path))
        except OSError as e:
            raise ReplayError(f"cannot read {path}: {e.strerror}") from None
        if not names:
            raise ReplayError(f"{path} holds no capture file (loopd-capture-*.jsonl)")
        return [os.path.join(path, name) for name in names]
    if not os.path.exists(path):
        raise ReplayError(f"{path} does not exist")
    return [path]


def _lines(files: Iterable[str]) -> Iterable[bytes]:
    """Every line of C{files}, in order."""
    for name in files:
        try:
            with open(name, "rb") as f:
                yield from f
        except OSError as e:
            raise ReplayError(f"cannot read {name}: {e.strerror}") from None


def _sessions(files: Sequence[str]) -> list[str]:
    """The sessions the capture files hold, each once, in the order first seen."""
    seen: dict[str, None] = {}
    for raw in _lines(files):
        parsed = captured_request(raw)
        if parsed is not None and parsed[0] is not None:
            seen.setdefault(parsed[0])
    return list(seen)


def _body(line: dict[str, Any]) -> bytes | None:
    """
    A line's body as the agent sent it; C{None} without prompts.

    @raise ValueError: the line's body is not readable.
    """
    body, encoded = line.get("body"), line.get("body_base64")
    if isinstance(body, str):
        # A lone surrogate (JSON allows one) is no UTF-8: UnicodeEncodeError, a ValueError.
        return body.encode("utf-8")
    if isinstance(encoded, str):
        try:
            return base64.b64decode(encoded, validate=True)
        except binascii.Error as e:
            raise ValueError(str(e)) from None
    if body is None and encoded is None:
        return None
    raise ValueError("the body is neither text nor base64")


def _is_int(value: object) -> bool:
    """An integer, not a boolean."""
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> float | None:
    """A number (not a boolean) as a float, else C{None}."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _int(value: object) -> int:
    """An integer field, 0 when it is not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# -- sending ---------------------------------------------------------------------------------


def request_bodies(requests: Sequence[CapturedRequest], model: str | None) -> list[bytes]:
    """
    The bodies to send for C{requests}: as captured, or with their C{model} set to
    C{model}.

    @raise ReplayError: a request has no body, or C{model} is given and a body is not a
        JSON object.
    """
    bodies = []
    for number, request in enumerate(requests, 1):
        if request.body is None:
            raise ReplayError(f"request {number} was captured without its body")
        if model is None:
            bodies.append(request.body)
            continue
        try:
            document = strict_json.decode(request.body)
        except (ValueError, UnicodeDecodeError):
            document = None
        if not isinstance(document, dict):
            raise ReplayError(f"--model needs a JSON object to change; request {number} is not")
        document["model"] = model
        bodies.append(json.dumps(document, ensure_ascii=False).encode("utf-8"))
    return bodies


def cache_figures(header: str | None, comments: Sequence[bytes]) -> tuple[int | None, int | None]:
    """
    The prompt tokens reused and evaluated that loopd reported for an answer: from its
    C{X-Loopd-Cache} header (C{reused=N; evaluated=M; saved_ms=S}), else from the last
    C{: loopd {"event":"cache", ...}} comment of its stream; C{None}s when it has neither.
    """
    if header:
        fields = dict(part.strip().partition("=")[::2] for part in header.split(";"))
        said = fields.get("reused", ""), fields.get("evaluated", "")
        if all(text.isascii() and text.isdigit() for text in said):
            return int(said[0]), int(said[1])
    for line in reversed(comments):
        try:
            event = strict_json.decode(line[len(_CACHE_COMMENT) :])
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(event, dict) and event.get("event") == "cache":
            reused, evaluated = event.get("reused"), event.get("evaluated")
            if isinstance(reused, int) and isinstance(evaluated, int):
                if not isinstance(reused, bool) and not isinstance(evaluated, bool):
                    return reused, evaluated
    return None, None


class CommentLines:
    """
    Keeps the C{: loopd} comment lines of an answer, whatever its pieces' boundaries; any
    other line (a stream's events, a whole JSON answer) is passed over as it comes, never
    kept.

    @ivar comments: the comment lines so far, without their line ends.
    """

    def __init__(self) -> None:
        self.comments: list[bytes] = []
        self._line = b""
        self._passing = False

    def feed(self, data: bytes) -> None:
        """Take one piece of the body."""
        start = 0
        while True:
            end = data.find(b"\n", start)
            piece = data[start:] if end < 0 else data[start:end]
            if not self._passing:
                self._line += piece
                head = self._line[: len(_CACHE_COMMENT)]
                if not _CACHE_COMMENT.startswith(head) or len(self._line) > COMMENT_LIMIT:
                    self._line, self._passing = b"", True
            if end < 0:
                return
            if not self._passing and self._line.startswith(_CACHE_COMMENT):
                self.comments.append(self._line.rstrip(b"\r"))
            self._line, self._passing = b"", False
            start = end + 1

    def finish(self) -> None:
        """The body ended: its last line counts too."""
        self.feed(b"\n")


def _send(
    reactor: IUnixReactor, socket_path: str, request: CapturedRequest, body: bytes, session: str
) -> Deferred[Replayed]:
    """Send one request and read its answer to the end."""
    started = reactor.seconds()
    headers = {
        "Content-Type": "application/json",
        "X-Session-Id": session,
        "X-Loopd-Agent": AGENT,
    }
    sending = http.request(reactor, socket_path, "POST", request.path, body, headers)

    def answered(response: http.HttpResponse) -> Deferred[Replayed]:
        lines = CommentLines()

        def ended(_: None) -> Replayed:
            lines.finish()
            reused, evaluated = cache_figures(response.headers.get("x-loopd-cache"), lines.comments)
            return Replayed(response.status, reused, evaluated, reactor.seconds() - started)

        return response.deliver(lines.feed).addCallback(ended)

    def failed(reason: Failure) -> Replayed:
        if reason.check(Connect):
            raise ReplayError(f"cannot reach loopd: {reason.getErrorMessage()}")
        return Replayed(None, None, None, reactor.seconds() - started, reason.getErrorMessage())

    return sending.addCallback(answered).addErrback(failed)


def replay_session(
    reactor: IUnixReactor,
    socket_path: str,
    requests: Sequence[CapturedRequest],
    bodies: Sequence[bytes],
    write: Write,
    err: Write,
    *,
    session_id: str,
    captured_as: str = "",
) -> Deferred[int]:
    """
    Send C{requests} to the loopd at C{socket_path}, one after the other, and write a line
    for each (module docstring).

    @param bodies: each request's body to send (L{request_bodies}).
    @param session_id: the replay's session id, sent as C{X-Session-Id}.
    @param captured_as: the captured session's id, for the first line.
    @return: fires with the exit status: 0 when every request got a 2xx, else 1 (after a
        line on C{err} when loopd could not be reached).
    """
    return _replay(reactor, socket_path, requests, bodies, write, err, session_id, captured_as)


@inlineCallbacks
def _replay(
    reactor: IUnixReactor,
    socket_path: str,
    requests: Sequence[CapturedRequest],
    bodies: Sequence[bytes],
    write: Write,
    err: Write,
    session_id: str,
    captured_as: str,
) -> Any:
    """L{replay_session}, one request at a time."""
    try:
        check_peer_socket(socket_path)
    except UnixSocketError as e:
        err(f"loopd replay: not connecting: {e}\n")
        return 1
    count = len(requests)
    write(
        f"replaying {count} request{'s' if count != 1 else ''} of session {captured_as} as "
        f"session {session_id}, to {socket_path}\n"
    )
    width = len(str(count))
    failures = 0
    for number, (request, body) in enumerate(zip(requests, bodies, strict=True), 1):
        try:
            replayed = yield _send(reactor, socket_path, request, body, session_id)
        except ReplayError as e:
            err(f"loopd replay: {e}\n")
            return 1
        failures += not replayed.ok
        write(f"{number:>{width}}/{count} {_line(request, replayed)}\n")
    write(f"{count - failures} of {count} answered\n")
    return 0 if failures == 0 else 1


def _line(request: CapturedRequest, replayed: Replayed) -> str:
    """What one request did now, then (in brackets) what it did when captured."""
    now = (
        f"{request.door:<9} {_status(replayed.status)}  reused {_tokens(replayed.reused)}  "
        f"evaluated {_tokens(replayed.evaluated)}  {replayed.seconds:6.2f} s"
    )
    then_seconds = "-" if request.seconds is None else f"{request.seconds:.2f} s"
    then = (
        f"(captured: {_status(request.status)}, reused {request.reused:,}, evaluated "
        f"{request.evaluated:,}, {then_seconds})"
    )
    error = "" if replayed.error is None else f"  {replayed.error}"
    return f"{now}  {then}{error}"


def _status(status: int | None) -> str:
    """An HTTP status, or C{---} for no answer."""
    return "---" if status is None else str(status)


def _tokens(count: int | None) -> str:
    """A token count, right-aligned, or C{-}."""
    return f"{'-' if count is None else f'{count:,}':>7}"
