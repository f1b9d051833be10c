# -*- test-case-name: loopd.test.test_gateway_capture -*-
"""
Request capture (C{[capture]}, DESIGN decision 48): a watcher of the gateway's activity
(L{loopd.gateway.activity}) that writes one JSON line per finished request to the capture
files (L{loopd.gateway.capture_files}), for a person to read and for C{loopd replay} to send
again.

B{Prompts are never captured unless C{prompts = true}.} Without it a line has what the
request was and what loopd did for it, and no text from the request or the answer:

 - C{capture} (the format, 1), C{id} (the request's number in this run of loopd),
   C{door} and C{path} (the front door it came through: C{chat} at
   C{/v1/chat/completions}, C{messages} at C{/v1/messages}, C{responses} at
   C{/v1/responses}), C{session}, C{anonymous}, C{agent}, C{model}, C{stream}, C{mesh};
 - C{started} (the wall clock, seconds since the epoch) and C{time} (the same, ISO 8601
   UTC), C{seconds} (to the answer's end) and C{first_token_seconds};
 - C{status} (HTTP), C{outcome} (C{ok}, the error's code, or C{client_gone});
 - C{reused_tokens}, C{evaluated_tokens}, C{generated_tokens} (every call's sum);
 - C{calls}: each upstream call's C{endpoint}, C{role} (C{answer}, C{worker},
   C{reducer}), C{holder} (its lease and slot key), C{slot}, C{lease_wait_seconds},
   C{sent_seconds} (from the request's start), C{seconds}, C{retries},
   C{thinking_capped}, C{reasoning_tokens}, C{timings} (the server's C{cache_n},
   C{prompt_n}, C{predicted_n} and speeds; C{null} for a call that did not complete) and
   C{error}, the kind of its failure (C{Http}, C{WaitTimeout}, C{cancelled}, ...);
 - C{prompts}: C{false}.

An error's message is text that may quote the request or the model's output (a door
names the value it refused, llama-server quotes the output it could not parse), so it is
only in a line with prompts. With C{prompts = true} a line also has C{error} (the
request's error message) and each call's whole C{error}, C{body} (the request body as the
agent sent it, as text; C{body_base64} for one that is not UTF-8) and C{answer} (the
answer's C{content}, C{reasoning}, C{tool_calls} as the model made them, C{finish_reason};
C{null} for a request without one), and C{prompts}: C{true}.

L{capture_line} is pure; the watcher writes, and a failure to write loses the line, never
the request (L{loopd.gateway.capture_files}).
"""

from __future__ import annotations

import base64
import json
import math
import time
from collections.abc import Mapping
from typing import Any, Final

from loopd.gateway.activity import ActivityWatcher, CallRecord, RequestRecord
from loopd.gateway.capture_files import CaptureFiles
from loopd.llama.types import Completion, Timings

__all__ = ["CAPTURE_FORMAT", "CaptureWatcher", "capture_line", "encode_line"]

#: The version of a line's fields, its C{capture} field.
CAPTURE_FORMAT: Final = 1


def capture_line(record: RequestRecord, path: str | None, prompts: bool) -> dict[str, Any]:
    """
    The capture line of the finished request C{record} (module docstring).

    @param path: the path of its front door.
    @param prompts: add the request's body, the answer and the error messages.
    """
    started = record.started

    def since(at: float | None) -> float | None:
        return None if at is None else round(at - started, 3)

    totals = record.totals()
    line: dict[str, Any] = {
        "capture": CAPTURE_FORMAT,
        "id": record.id,
        "door": record.door,
        "path": path,
        "session": record.session or None,
        "anonymous": record.anonymous,
        "agent": record.agent,
        "model": record.model,
        "stream": record.stream,
        "mesh": record.mesh,
        "started": round(record.wall_started, 3),
        "time": _iso(record.wall_started),
        "seconds": since(record.ended),
        "first_token_seconds": since(record.first_token),
        "status": record.status,
        "outcome": record.outcome,
        "reused_tokens": totals.cache_n,
        "evaluated_tokens": totals.prompt_n,
        "generated_tokens": totals.predicted_n,
        "calls": [_call(call, started, prompts) for call in record.calls],
        "prompts": prompts,
    }
    if prompts:
        line["error"] = record.error
        line.update(_body(record.body))
        line["answer"] = _answer(record.completion)
    return line


def encode_line(line: Mapping[str, Any]) -> bytes:
    """C{line} as one line of compact JSON (UTF-8), its newline included."""
    text = json.dumps(line, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8") + b"\n"


class CaptureWatcher(ActivityWatcher):
    """
    Writes each finished request's L{capture_line} to the capture files.

    @ivar files: where the lines go.
    @ivar prompts: lines carry the bodies, answers and error messages; the gateway then
        keeps them on its records (C{wants_text}, the same).
    """

    def __init__(
        self, files: CaptureFiles, prompts: bool, paths: Mapping[str, bytes | str]
    ) -> None:
        """
        @param paths: each front door's path by the door's name.
        """
        self.files = files
        self.prompts = prompts
        self.wants_text = prompts
        self._paths = {
            name: path.decode("ascii") if isinstance(path, bytes) else path
            for name, path in paths.items()
        }

    def request_ended(self, record: RequestRecord) -> None:
        """Write C{record}'s line; a failure to write is the files' to say, once."""
        line = capture_line(record, self._paths.get(record.door), self.prompts)
        self.files.write(encode_line(line))


def _call(call: CallRecord, started: float, prompts: bool) -> dict[str, Any]:
    """One upstream call's entry: figures, and its error's kind (its message with prompts)."""

    def since(at: float | None) -> float | None:
        return None if at is None else round(at - started, 3)

    error = call.error
    if error is not None and not prompts:
        error = error.split(":", 1)[0]
    wait = call.lease_wait
    return {
        "endpoint": call.endpoint,
        "role": call.role,
        "holder": call.holder or None,
        "slot": call.slot,
        "lease_wait_seconds": None if wait is None else round(wait, 3),
        "sent_seconds": since(call.sent),
        "seconds": None if call.ended is None else round(call.ended - call.started, 3),
        "retries": call.retries,
        "thinking_capped": call.thinking_capped,
        "reasoning_tokens": call.reasoning_tokens,
        "timings": _timings(call.timings),
        "error": error,
    }


def _timings(timings: Timings | None) -> dict[str, Any] | None:
    """The server's counts and speeds of a completed call."""
    if timings is None:
        return None
    return {
        "cache_n": timings.cache_n,
        "prompt_n": timings.prompt_n,
        "predicted_n": timings.predicted_n,
        "prompt_per_second": _finite(timings.prompt_per_second),
        "predicted_per_second": _finite(timings.predicted_per_second),
    }


def _finite(value: float | None) -> float | None:
    """A speed as JSON can say it: C{None} for none, or for one that is not finite."""
    return value if value is not None and math.isfinite(value) else None


def _body(body: bytes | None) -> dict[str, Any]:
    """The request body: C{body} as text, or C{body_base64} when it is not UTF-8."""
    if body is None:
        return {"body": None}
    try:
        return {"body": body.decode("utf-8")}
    except UnicodeDecodeError:
        return {"body": None, "body_base64": base64.b64encode(body).decode("ascii")}


def _answer(completion: Completion | None) -> dict[str, Any] | None:
    """The answer's text, reasoning and tool calls, as the model made them."""
    if completion is None:
        return None
    return {
        "content": completion.content,
        "reasoning": completion.reasoning_content,
        "tool_calls": [
            {"id": c.id, "name": c.name, "arguments": c.arguments} for c in completion.tool_calls
        ],
        "finish_reason": completion.finish_reason.value,
    }


def _iso(wall: float) -> str:
    """A wall-clock time as ISO 8601 UTC to the millisecond."""
    whole = int(wall // 1)
    millis = int(round((wall - whole) * 1000))
    if millis == 1000:
        whole, millis = whole + 1, 0
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"
