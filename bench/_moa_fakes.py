"""A fake OpenAI chat endpoint for bench/moa.py, and the helpers that start one.

Run as ``python bench/_moa_fakes.py --socket PATH --delay-ms N --text TEXT`` it serves
``POST /v1/chat/completions`` with twisted.web on a Unix socket (mode 0600, through
`loopd.unixsocket.listen_unix`) until it is signalled. Every request is answered after
``--delay-ms`` with ``--text`` as the whole reply: a streaming request (``"stream":
true``, what loopd's client sends upstream) as SSE chunks (the content, the
``finish_reason``, a usage chunk when ``stream_options.include_usage`` asks for one) and
``data: [DONE]``; any other as one ``chat.completion`` body. With ``--status 500`` every
request gets an HTTP 500 error body at once instead. A client that leaves before the
delay is over cancels its answer.

Imported, it gives bench/moa.py `start_fake` (a fake as a child process) and
`refusing_socket` (a socket path that exists but where nobody listens).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any

from _servers import Children, wait_socket

CHAT_PATH = b"/v1/chat/completions"
"""The one path the fake serves."""


def _json(payload: object) -> bytes:
    """Encode compact JSON."""
    return json.dumps(payload, separators=(",", ":")).encode()


def sse_reply(name: str, text: str, usage: bool) -> bytes:
    """Return the whole SSE body of a streamed reply of text, ending in ``[DONE]``."""
    base: dict[str, Any] = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": name,
    }
    delta = {"role": "assistant", "content": text}
    chunks: list[dict[str, Any]] = [
        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    if usage:
        counts = {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}
        chunks.append({**base, "choices": [], "usage": counts})
    events = [b"data: " + _json(chunk) + b"\n\n" for chunk in chunks]
    return b"".join(events) + b"data: [DONE]\n\n"


def json_reply(name: str, text: str) -> bytes:
    """Return the ``chat.completion`` body of a reply of text (no streaming)."""
    message = {"role": "assistant", "content": text}
    return _json(
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": name,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
        }
    )


def serve(reactor: Any, path: str, delay: float, text: str, status: int) -> None:
    """Listen on path and answer every chat request as the module docstring says."""
    from twisted.internet.interfaces import IDelayedCall
    from twisted.web.resource import Resource
    from twisted.web.server import NOT_DONE_YET, Request, Site

    from loopd.unixsocket import listen_unix

    name = os.path.basename(path)

    class Chat(Resource):
        """``/v1/chat/completions``: the fixed reply after the fixed delay."""

        isLeaf = True

        def render_POST(self, request: Request) -> bytes | int:
            """Answer 500 at once, or schedule the reply and leave the request open."""
            if request.path != CHAT_PATH:
                request.setResponseCode(404)
                return b""
            if status != 200:
                request.setResponseCode(status)
                request.setHeader(b"content-type", b"application/json")
                error = {"message": "fake failure", "type": "server_error"}
                return _json({"error": error})
            content = request.content
            document = json.loads(content.read() if content is not None else b"{}")
            stream = document.get("stream") is True
            options = document.get("stream_options") or {}
            usage = bool(options.get("include_usage"))
            call: IDelayedCall = reactor.callLater(delay, answer, request, stream, usage)
            request.notifyFinish().addErrback(lambda _: call.cancel() if call.active() else None)
            return NOT_DONE_YET

    def answer(request: Request, stream: bool, usage: bool) -> None:
        """Write the whole reply and finish the request."""
        if stream:
            request.setHeader(b"content-type", b"text/event-stream")
            request.write(sse_reply(name, text, usage))
        else:
            request.setHeader(b"content-type", b"application/json")
            request.write(json_reply(name, text))
        request.finish()

    site = Site(Chat())
    site.displayTracebacks = False
    site.log = lambda request: None  # type: ignore[method-assign]
    listen_unix(reactor, path, site)


def start_fake(children: Children, name: str, delay_ms: float, text: str, status: int = 200) -> str:
    """Start a fake endpoint named name as a child; return its socket path once ready."""
    path = os.path.join(children.dir, f"{name}.sock")
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--socket",
        path,
        "--delay-ms",
        str(delay_ms),
        "--text",
        text,
        "--status",
        str(status),
    ]
    proc = children.spawn(name, argv, log=True)
    wait_socket(children, proc, name, path)
    return path


def refusing_socket(children: Children, name: str) -> str:
    """Return a Unix socket path that exists but refuses connections (nobody listens)."""
    path = os.path.join(children.dir, f"{name}.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)  # bound, never listening: the file stays, connect() is refused
    os.chmod(path, 0o600)
    return path


def main(argv: list[str] | None = None) -> int:
    """Parse the options and serve until signalled."""
    parser = argparse.ArgumentParser(description="A fake OpenAI chat endpoint on a Unix socket.")
    parser.add_argument("--socket", required=True, help="the Unix socket to listen on")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="wait before answering")
    parser.add_argument("--text", default="Paris", help="the whole reply")
    parser.add_argument("--status", type=int, default=200, help="500: fail every request")
    args = parser.parse_args(argv)
    from twisted.internet import reactor

    serve(reactor, args.socket, args.delay_ms / 1000.0, args.text, args.status)
    reactor.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
