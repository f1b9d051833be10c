# -*- test-case-name: loopd.test.test_gateway_cache_report -*-
"""
What loopd tells an agent its cache did for one answer (DESIGN decision 48): the prompt
tokens the server reused from its cache, the ones it evaluated, and the prefill time the
reuse saved (L{loopd.gateway.status_board.saved_seconds}, at the endpoint's measured prompt
speed before the answer).

Every door's usage fields already carry the counts in its API's own names (chat's
C{prompt_tokens_details.cached_tokens}, Messages' C{cache_read_input_tokens}, Responses'
C{input_tokens_details.cached_tokens}). Besides them, a whole answer carries the header
C{X-Loopd-Cache: reused=N; evaluated=M; saved_ms=S}, and a streamed one, whose headers left
before the answer existed, ends with the comment line
C{: loopd {"event":"cache","reused":N,"evaluated":M,"saved_ms":S}} after its text, just
before the door's closing events (the finish and usage chunks and C{[DONE]},
C{message_delta} and C{message_stop}, C{response.completed}); SSE clients skip comments. A
door whose stream is not SSE (L{loopd.gateway.doors.door.Door.stream_type}) carries no
comment. A mesh turn counts every worker's and the reducer's calls.
"""

from __future__ import annotations

from loopd.gateway.activity import RequestRecord

__all__ = ["CACHE_HEADER", "cache_header", "cache_report"]

#: The header of a whole answer's cache report.
CACHE_HEADER = b"x-loopd-cache"


def cache_report(record: RequestRecord) -> dict[str, int]:
    """
    C{record}'s completed calls' reused and evaluated prompt tokens and the milliseconds the
    reuse saved, as the status board estimated each call's (C{CallRecord.saved_seconds}, at
    its endpoint's prompt speed before the call), so the answer and C{/v1/status} agree.
    """
    reused = evaluated = 0
    saved = 0.0
    for call in record.calls:
        timings = call.timings
        if timings is None:
            continue
        reused += timings.cache_n
        evaluated += timings.prompt_n
        saved += call.saved_seconds
    return {"reused": reused, "evaluated": evaluated, "saved_ms": round(saved * 1000)}


def cache_header(report: dict[str, int]) -> tuple[bytes, bytes]:
    """The C{X-Loopd-Cache} header of C{report}."""
    value = "; ".join(f"{name}={report[name]}" for name in ("reused", "evaluated", "saved_ms"))
    return CACHE_HEADER, value.encode("ascii")
