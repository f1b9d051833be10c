"""
One agent session as a separate process, for the two-session tracer bullet: it takes a
lease from the lease daemon before each request to a stub endpoint, streams the whole
answer, and releases the lease.

    python -m loopd.test.support.lease_session --socket Q --endpoint E --queue-key K \\
        --session S --requests N

Each finished request prints C{done <session> <n>}; the exit status is 0 when every request
was granted by the daemon (not let through by fail-open) and answered 200.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import inlineCallbacks

from loopd import http
from loopd.queue.client import LeaseClient


def _arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lease_session")
    parser.add_argument("--socket", required=True, help="the lease daemon's socket")
    parser.add_argument("--endpoint", required=True, help="the stub endpoint's socket")
    parser.add_argument("--queue-key", required=True)
    parser.add_argument("--session", required=True)
    parser.add_argument("--requests", type=int, default=4)
    return parser.parse_args(argv)


@inlineCallbacks
def run_session(reactor: Any, args: argparse.Namespace) -> Any:
    """
    Make the session's requests one after the other, each inside its own lease.
    """
    client = LeaseClient(reactor, args.socket, fail_open=False)
    failures = 0
    for number in range(args.requests):
        lease = yield client.acquire(args.queue_key, args.session)
        if not lease.queued:
            failures += 1
        response = yield http.request(
            reactor,
            args.endpoint,
            "POST",
            "/v1/chat/completions",
            b'{"stream": true}',
            {"X-Session-Id": args.session},
        )
        yield response.deliver(lambda data: None)
        if response.status != 200:
            failures += 1
        yield client.release(lease)
        sys.stdout.write(f"done {args.session} {number}\n")
        sys.stdout.flush()
    yield client.close()
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> None:
    """
    Run one session on the global reactor and exit with its status.
    """
    from twisted.internet import task

    args = _arguments(sys.argv[1:] if argv is None else argv)
    task.react(lambda reactor: run_session(reactor, args))


if __name__ == "__main__":
    main()
