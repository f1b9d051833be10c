# -*- test-case-name: loopd.test.test_gateway_chat,loopd.test.test_gateway_mesh -*-
"""
How the gateway's routes write their answers on a twisted.web request: a JSON body with
its status, and the head and lines of a server-sent event stream.
"""

from __future__ import annotations

import json

from twisted.web.server import Request

__all__ = ["comment_line", "data_line", "encode_json", "open_event_stream", "write_json"]


def encode_json(payload: object) -> bytes:
    """C{payload} as compact UTF-8 JSON, non-ASCII text kept as it is."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def write_json(request: Request, status: int, body: object) -> bytes:
    """
    Set C{status} and a JSON content type on C{request}; return the encoded C{body}.
    """
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    return json.dumps(body, separators=(",", ":")).encode()


def open_event_stream(request: Request) -> None:
    """Answer C{request} with C{200} and the headers of an unbuffered event stream."""
    request.setResponseCode(200)
    request.setHeader(b"content-type", b"text/event-stream")
    request.setHeader(b"cache-control", b"no-cache")
    request.setHeader(b"x-accel-buffering", b"no")


def data_line(payload: object) -> bytes:
    """One SSE C{data:} event carrying C{payload} as JSON."""
    return b"data: " + encode_json(payload) + b"\n\n"


def comment_line(payload: object) -> bytes:
    """One C{: loopd} comment line carrying C{payload} as JSON (OpenAI clients ignore it)."""
    return b": loopd " + encode_json(payload) + b"\n\n"
