# -*- test-case-name: loopd.test.test_ui_command -*-
"""
C{loopd ui}: a one-time login link to the status page (DESIGN decision 48).

The page is served on loopd's TCP listener (C{[server] tcp}), where every request needs
loopd's token (decision 41), which a browser cannot send. So C{loopd ui} asks the running
daemon over its Unix socket, which only its user can reach (0600 in a 0700 directory),
for a login code (C{POST /v1/ui/login}, L{loopd.gateway.page_login}), and prints the link
C{http://127.0.0.1:PORT/ui/login#CODE} on stdout, alone, so that a script can take it;
what it means goes to stderr. With C{--open} it also opens the link in a browser
(L{webbrowser}). The link is good once, for a minute; opening it signs that browser in
(a session cookie, C{HttpOnly} and C{SameSite=Strict}).

Exit status 0 with the link; 1 when loopd is not running, has no TCP listener, or answers
something else, with one line on stderr that says so and what to do.
"""

from __future__ import annotations

import json
import webbrowser
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

from loopd import http
from loopd.errors import Connect
from loopd.reactor import IUnixReactor
from loopd.unixsocket import UnixSocketError, check_peer_socket

__all__ = ["LOGIN_PATH", "open_in_browser", "ui_command"]

#: The route of the Unix socket's site that gives a login code.
LOGIN_PATH = "/v1/ui/login"
#: Seconds to wait for the daemon's answer.
TIMEOUT = 10.0

Write = Callable[[str], None]


def open_in_browser(url: str) -> bool:
    """Open C{url} in the user's browser (L{webbrowser.open}); whether one was started."""
    return webbrowser.open(url)


def ui_command(
    reactor: IUnixReactor,
    socket_path: str,
    write: Write,
    err: Write,
    *,
    open_browser: Callable[[str], bool] | None = None,
) -> Deferred[int]:
    """
    Ask the loopd at C{socket_path} for a login link; write it to C{write}, and open it
    with C{open_browser} when given.

    @return: fires with the exit status (see the module docstring).
    """
    try:
        check_peer_socket(socket_path)
    except UnixSocketError as e:
        err(f"loopd ui: not connecting: {e}\n")
        return succeed(1)

    def read(response: http.HttpResponse) -> Deferred[tuple[int, bytes]]:
        """The status and the body of the daemon's answer."""
        return response.read_body().addCallback(lambda body: (response.status, body))

    asking = http.request(reactor, socket_path, "POST", LOGIN_PATH, b"{}", connect_timeout=TIMEOUT)
    answered: Deferred[tuple[int, bytes]] = asking.addCallback(read)
    answered.addTimeout(TIMEOUT, reactor)

    def show(result: tuple[int, bytes]) -> int:
        """Write the link (and open it), or say why there is none."""
        status, body = result
        answer = _json(body)
        if status == 200 and isinstance(answer.get("url"), str):
            url = answer["url"]
            write(url + "\n")
            seconds = answer.get("expires_in", 60)
            err(
                f"loopd ui: open this link within {seconds} s; it signs one browser in to the "
                "status page, once\n"
            )
            if open_browser is not None and not open_browser(url):
                err("loopd ui: no browser could be opened here: open the link yourself\n")
            return 0
        message = _error_message(answer) or f"loopd answered {status} to {LOGIN_PATH}"
        if status == 404:
            message += " (this loopd has no status page: is it an older version?)"
        err(f"loopd ui: {message}\n")
        return 1

    def failed(reason: Failure) -> int:
        """loopd could not be asked: not running, or not answering."""
        if isinstance(reason.value, Connect):
            why = reason.value.reason
            err(
                f"loopd ui: loopd is not running: {socket_path}: {why}; start it with "
                "`twist loopd --config loopd.toml` (with [server] tcp set)\n"
            )
        elif reason.check(defer.TimeoutError):
            err(f"loopd ui: loopd did not answer on {socket_path} within {TIMEOUT:g} s\n")
        else:
            err(f"loopd ui: cannot ask loopd on {socket_path}: {reason.getErrorMessage()}\n")
        return 1

    return answered.addCallbacks(show, failed)


def _json(body: bytes) -> dict[str, Any]:
    """C{body} as a JSON object; empty when it is not one."""
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {}
    return answer if isinstance(answer, dict) else {}


def _error_message(answer: dict[str, Any]) -> str | None:
    """The C{error.message} of an error answer, if it has one."""
    error = answer.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else None
