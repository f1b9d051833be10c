# -*- test-case-name: loopd.test.test_status_command -*-
"""
C{loopd status}: ask the running loopd for its status document (C{GET /v1/status}, DESIGN
decision 48) over its Unix socket and print it for a terminal (L{loopd.status_show}), or as
loopd sent it (C{--json}); with C{--watch}, again every L{STATUS_INTERVAL} seconds on the
reactor's clock until Ctrl-C. A status that cannot be had is one line saying why.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

from loopd import http, strict_json
from loopd.errors import Connect
from loopd.reactor import IUnixReactor
from loopd.status_show import render_document
from loopd.unixsocket import UnixSocketError, check_peer_socket

__all__ = [
    "CLEAR_SCREEN",
    "INTERRUPTED",
    "STATUS_INTERVAL",
    "StatusError",
    "fetch_status",
    "status_command",
]

Write = Callable[[str], None]

#: The exit status of a command cut short by Ctrl-C (128 + SIGINT).
INTERRUPTED = 130
#: How often C{loopd status --watch} asks again, in seconds.
STATUS_INTERVAL = 2.0
#: The status document's route.
STATUS_PATH = "/v1/status"
#: The most of a status document read.
STATUS_BODY_LIMIT = 16 << 20
#: Moves the cursor home and clears the screen, before each of C{--watch}'s frames.
CLEAR_SCREEN = "\x1b[H\x1b[2J"


# -- status --------------------------------------------------------------------------------


class StatusError(Exception):
    """
    loopd's status could not be had: nothing listens, the socket is unsafe or not loopd's,
    or it did not answer in time; the message is one line that says which.
    """


def fetch_status(
    reactor: IUnixReactor, socket_path: str, timeout: float = 5.0
) -> Deferred[tuple[bytes, Any]]:
    """
    Ask the loopd at C{socket_path} for C{GET /v1/status}.

    @return: fires with the document's bytes and the document; fails with L{StatusError}.
    """
    try:
        check_peer_socket(socket_path)
    except UnixSocketError as e:
        failed: Deferred[tuple[bytes, Any]] = Deferred()
        failed.errback(StatusError(f"not connecting to {socket_path}: {e}"))
        return failed
    asking = http.request(reactor, socket_path, "GET", STATUS_PATH, connect_timeout=timeout)

    def answered(response: http.HttpResponse) -> Deferred[tuple[bytes, Any]]:
        """Read the body; anything but a 200 with a JSON object is not loopd's status."""

        def document(raw: bytes) -> tuple[bytes, Any]:
            if response.status != 200:
                raise StatusError(
                    f"{socket_path} is not a loopd gateway with a status document: GET "
                    f"{STATUS_PATH} answered HTTP {response.status}"
                )
            try:
                decoded = strict_json.decode(raw)
            except ValueError:
                decoded = None
            if not isinstance(decoded, dict):
                raise StatusError(f"{socket_path} answered GET {STATUS_PATH} with no JSON object")
            return raw, decoded

        return response.read_body(STATUS_BODY_LIMIT).addCallback(document)

    def failed_(reason: Failure) -> Failure:
        """Any failure as a L{StatusError} that says what was (not) found."""
        if reason.check(StatusError):
            return reason
        if reason.check(Connect):
            # The message names the socket and what is (not) there.
            why = (
                f"cannot reach loopd: {reason.getErrorMessage()}; is twist loopd running? "
                "(or pass --socket)"
            )
        elif reason.check(CancelledError, DeferredTimeout):
            why = f"{socket_path} did not answer GET {STATUS_PATH} within {timeout:g} s"
        else:
            why = (
                f"{socket_path} is not a loopd gateway: it does not answer HTTP "
                f"({reason.getErrorMessage()})"
            )
        return Failure(StatusError(why))

    fetching: Deferred[tuple[bytes, Any]] = asking.addCallback(answered)
    fetching.addTimeout(timeout, reactor)
    return fetching.addErrback(failed_)


def status_command(
    reactor: IUnixReactor,
    socket_path: str,
    write: Write,
    err: Write,
    *,
    watch: bool = False,
    as_json: bool = False,
    clear: bool = True,
    interval: float = STATUS_INTERVAL,
) -> Deferred[int]:
    """
    C{loopd status}: print the status of the loopd at C{socket_path} for a terminal
    (L{render_document}), or with C{as_json} the document as loopd sent it.

    @param watch: print it again every C{interval} seconds (on C{reactor}'s clock) until
        the reactor stops (Ctrl-C) or the returned Deferred is cancelled: each time after
        clearing the screen when C{clear} (a terminal), else after a blank line; with
        C{as_json}, one document a line. A failure is shown in its place, and asked again.
    @return: fires with 0, or with 1 after one line on C{err} saying why the status could
        not be had; with C{watch} only when cancelled (with L{INTERRUPTED}).
    """
    if not watch:

        def show(fetched: tuple[bytes, Any]) -> int:
            raw, document = fetched
            if as_json:
                write(raw.decode("utf-8") + ("" if raw.endswith(b"\n") else "\n"))
            else:
                write(render_document(document))
            return 0

        def failed(reason: Failure) -> int:
            reason.trap(StatusError)
            err(f"loopd status: {reason.getErrorMessage()}\n")
            return 1

        return fetch_status(reactor, socket_path).addCallbacks(show, failed)
    return _watch_status(reactor, socket_path, write, err, as_json, clear, interval)


def _watch_status(
    reactor: IUnixReactor,
    socket_path: str,
    write: Write,
    err: Write,
    as_json: bool,
    clear: bool,
    interval: float,
) -> Deferred[int]:
    """C{loopd status --watch}: see L{status_command}."""
    frames = [0]

    def frame(text: str) -> None:
        if as_json:
            write(text)
            return
        top = CLEAR_SCREEN if clear else ("\n" if frames[0] else "")
        note = f"every {interval:g} s; Ctrl-C to stop\n\n"
        write(top + note + text)
        frames[0] += 1

    def show(fetched: tuple[bytes, Any]) -> None:
        raw, document = fetched
        if as_json:
            frame(json.dumps(document, separators=(",", ":")) + "\n")
        else:
            frame(render_document(document))

    def failed(reason: Failure) -> None:
        reason.trap(StatusError)
        line = f"loopd status: {reason.getErrorMessage()}\n"
        if as_json:
            err(line)
        else:
            frame(line)

    def ask() -> Deferred[None]:
        return fetch_status(reactor, socket_path).addCallbacks(show, failed)

    loop = LoopingCall(ask)
    loop.clock = reactor

    def cancel(d: Deferred[int]) -> None:
        if loop.running:
            loop.stop()
        d.callback(INTERRUPTED)

    watching: Deferred[int] = Deferred(cancel)
    loop.start(interval, now=True).addErrback(watching.errback)
    return watching
