# -*- test-case-name: loopd.test.test_status_show -*-
"""
C{loopd status}'s text: the status document (C{GET /v1/status}, L{loopd.gateway.status})
as a terminal shows it, a section a part:

 - the header: loopd's version and how long it has run;
 - each endpoint with its health (and why, when it is not up) and measured speeds, then a
   line per slot: its state (C{running}, C{grace}, C{idle}), the session it serves or
   served last, and the tokens its cache holds;
 - the sessions, the most recently seen first (at most L{SESSIONS_SHOWN}): agent, turns,
   prompt tokens reused and evaluated, the share reused, the prefill time that saved,
   thinking caps, errors, when last seen and the home endpoint;
 - the lease queues, as C{loopd queue status} prints them;
 - the requests under way, and how many are mesh turns;
 - the last requests (at most L{REQUESTS_SHOWN}), the newest first, a failed one's error
   on a line of its own;
 - the totals since loopd started.

Pure: a document in, text out. A field missing or of another type (a loopd older or newer
than this command) shows as C{-}, never as an error. Times are shown relative to the
document's own C{now}, so the text does not depend on the clock of the machine showing it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from loopd.queue.show import render_status

__all__ = ["REQUESTS_SHOWN", "SESSIONS_SHOWN", "render_document"]

#: How many of the last requests are shown.
REQUESTS_SHOWN: Final = 10
#: How many sessions are shown, the most recently seen first.
SESSIONS_SHOWN: Final = 20
#: The widest an identifier (a session, an agent) is shown, in characters.
NAME_WIDTH: Final = 24
#: The widest an error is shown.
ERROR_WIDTH: Final = 90
_NONE: Final = "-"


def render_document(document: object) -> str:
    """The text of a status document, every section, ending in a newline."""
    doc = _mapping(document)
    now = _number(_mapping(doc.get("loopd")).get("now"))
    sections = [
        _header(_mapping(doc.get("loopd"))),
        _endpoints(_list(doc.get("endpoints"))),
        _sessions(_list(doc.get("sessions")), now),
        _leases(doc.get("leases")),
        _in_flight(_list(doc.get("in_flight")), doc.get("mesh_turns")),
        _requests(_list(doc.get("requests")), now),
        _totals(_mapping(doc.get("totals"))),
    ]
    return "\n".join(section for section in sections if section)


# -- sections --------------------------------------------------------------------------


def _header(loopd: Mapping[str, Any]) -> str:
    """C{loopd 1.2.0, up 2h03m}."""
    version = _text(loopd.get("version"))
    started, now = _number(loopd.get("started")), _number(loopd.get("now"))
    up = f", up {_duration(now - started)}" if started is not None and now is not None else ""
    return f"loopd {version}{up}\n"


def _endpoints(endpoints: Sequence[Any]) -> str:
    """Each endpoint's line, then its slots' lines."""
    lines = ["endpoints"]
    if not endpoints:
        lines.append("  none")
    for item in endpoints:
        endpoint = _mapping(item)
        health = _text(endpoint.get("health"))
        why = endpoint.get("why")
        if health != "up" and isinstance(why, str) and why:
            health += f" ({_cut(why, ERROR_WIDTH)})"
        speeds = []
        for key, name in (
            ("prompt_tokens_per_second", "prompt"),
            ("generation_tokens_per_second", "generation"),
        ):
            speed = _number(endpoint.get(key))
            if speed is not None:
                speeds.append(f"{name} {speed:,.1f} tokens/s")
        parts = [
            _text(endpoint.get("name")),
            _text(endpoint.get("kind")),
            f"model {_text(endpoint.get('model'))}",
            health,
            *speeds,
        ]
        lines.append("  " + "  ".join(parts))
        slots = [_mapping(slot) for slot in _list(endpoint.get("slots"))]
        rows = [
            [
                f"slot {_text(slot.get('id'))}",
                _text(slot.get("state")),
                _cut(_text(slot.get("session")), NAME_WIDTH),
                f"{_count(slot.get('tokens_cached'))} tokens cached",
            ]
            for slot in slots
        ]
        lines += _table(None, rows, "llll", indent=4)
    return "\n".join(lines) + "\n"


def _sessions(sessions: Sequence[Any], now: float | None) -> str:
    """The sessions' table, the most recently seen first."""
    lines = [f"sessions ({len(sessions)})"]
    if not sessions:
        return lines[0] + "\n  none yet\n"
    header = [
        "SESSION",
        "AGENT",
        "TURNS",
        "REUSED",
        "EVAL",
        "REUSE",
        "SAVED",
        "CAPS",
        "ERRORS",
        "SEEN",
        "HOME",
    ]
    rows = []
    for item in sessions[:SESSIONS_SHOWN]:
        session = _mapping(item)
        name = _text(session.get("id"))
        if session.get("anonymous") is True:
            name += " (anonymous)"
        rows.append(
            [
                _cut(name, NAME_WIDTH),
                _cut(_text(session.get("agent")), NAME_WIDTH),
                _count(session.get("turns")),
                _count(session.get("reused_tokens")),
                _count(session.get("evaluated_tokens")),
                _percent(session.get("reuse")),
                _seconds(session.get("saved_seconds"), 1),
                _count(session.get("thinking_capped")),
                _count(session.get("errors")),
                _ago(session.get("last_seen"), now),
                _text(session.get("home")),
            ]
        )
    lines += _table(header, rows, "llrrrrrrrll")
    if len(sessions) > SESSIONS_SHOWN:
        lines.append(f"  ... and {len(sessions) - SESSIONS_SHOWN} more")
    return "\n".join(lines) + "\n"


def _leases(leases: object) -> str:
    """The lease queues, as C{loopd queue status} prints them."""
    if not isinstance(leases, list):
        return "lease queues\n  none: this loopd takes no leases\n"
    text = render_status([_queue(_mapping(queue)) for queue in leases])
    return "lease queues\n" + "".join(f"  {line}\n" for line in text.splitlines())


def _queue(queue: Mapping[str, Any]) -> dict[str, Any]:
    """A lease queue's entry with only the types L{render_status} reads."""
    limit = queue.get("maxStreams")
    return {
        "queueKey": _text(queue.get("queueKey")),
        "maxStreams": limit if isinstance(limit, int) and not isinstance(limit, bool) else None,
        "switches": _count(queue.get("switches")),
        "holders": [_entry(_mapping(h)) for h in _list(queue.get("holders"))],
        "waiting": [_entry(_mapping(w)) for w in _list(queue.get("waiting"))],
    }


def _entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A holder's or waiter's entry, its text made safe for a terminal."""
    group = entry.get("group")
    return {
        "sessionKey": _cut(_text(entry.get("sessionKey")), NAME_WIDTH),
        "role": _text(entry.get("role", "parent")),
        "group": None if group is None else _text(group),
    }


def _in_flight(requests: Sequence[Any], mesh_turns: object) -> str:
    """The requests under way: who, where, for how long, and each call's state."""
    mesh = _count(mesh_turns)
    lines = [f"in flight ({len(requests)}; mesh turns {mesh})"]
    if not requests:
        return lines[0] + "\n  nothing\n"
    rows = []
    for item in requests:
        request = _mapping(item)
        calls = ", ".join(_call(_mapping(call)) for call in _list(request.get("calls")))
        rows.append(
            [
                f"#{_text(request.get('id'))}",
                _text(request.get("door")),
                _cut(_text(request.get("session")), NAME_WIDTH),
                _text(request.get("model") or "auto"),
                _seconds(request.get("seconds"), 1),
                calls or "no call yet",
            ]
        )
    lines += _table(None, rows, "lllrrl")
    return "\n".join(lines) + "\n"


def _call(call: Mapping[str, Any]) -> str:
    """One call under way: C{tiny slot 0}, C{tiny waiting for a lease}, ..."""
    where = _text(call.get("endpoint"))
    if call.get("role") not in (None, "answer"):
        where += f" ({_text(call.get('role'))})"
    if call.get("ended") is True:
        return f"{where} ended"
    if call.get("waiting_for_lease") is True:
        return f"{where} waiting for a lease"
    slot = call.get("slot")
    return f"{where} slot {slot}" if isinstance(slot, int) else f"{where} starting"


def _requests(requests: Sequence[Any], now: float | None) -> str:
    """The last requests, the newest first."""
    shown = requests[:REQUESTS_SHOWN]
    lines = [f"last requests ({len(shown)} of {len(requests)} kept)"]
    if not requests:
        return lines[0] + "\n  none yet\n"
    header = [
        "ID",
        "AGO",
        "DOOR",
        "SESSION",
        "MODEL",
        "STATUS",
        "REUSED",
        "EVAL",
        "GEN",
        "TIME",
        "OUTCOME",
    ]
    rows, errors = [], []
    for item in shown:
        request = _mapping(item)
        outcome = _text(request.get("outcome"))
        if request.get("thinking_capped") is True:
            outcome += ", thinking capped"
        error = request.get("error")
        errors.append(_text(error) if error else None)
        rows.append(
            [
                _text(request.get("id")),
                _ago(request.get("started"), now),
                _text(request.get("door")),
                _cut(_text(request.get("session")), NAME_WIDTH),
                _model(request.get("model"), request.get("endpoint")),
                _text(request.get("status")),
                _count(request.get("reused_tokens")),
                _count(request.get("evaluated_tokens")),
                _count(request.get("generated_tokens")),
                _seconds(request.get("seconds"), 2),
                _cut(outcome, NAME_WIDTH),
            ]
        )
    table = _table(header, rows, "rrlllrrrrrl")
    lines.append(table[0])
    for line, error in zip(table[1:], errors, strict=True):
        lines.append(line)
        if error is not None:
            lines.append(f"        {_cut(error, ERROR_WIDTH)}")
    return "\n".join(lines) + "\n"


def _model(model: object, endpoint: object) -> str:
    """The endpoint that served a request, and the model asked for when it was another
    (C{tiny (auto)}); the model alone before an endpoint was chosen."""
    asked = _text(model or "auto")
    served = _text(endpoint)
    return asked if served in (asked, _NONE) else f"{served} ({asked})"


def _totals(totals: Mapping[str, Any]) -> str:
    """The totals since loopd started, in one sentence."""
    if not totals:
        return ""
    return (
        "totals\n"
        f"  requests {_count(totals.get('requests'))}, errors {_count(totals.get('errors'))}, "
        f"thinking caps {_count(totals.get('thinking_capped'))}\n"
        f"  prompt tokens {_count(totals.get('reused_tokens'))} reused, "
        f"{_count(totals.get('evaluated_tokens'))} evaluated ({_percent(totals.get('reuse'))} "
        f"reused); generated {_count(totals.get('generated_tokens'))}; prefill saved "
        f"{_seconds(totals.get('saved_seconds'), 1)}\n"
    )


# -- cells -----------------------------------------------------------------------------


def _table(
    header: Sequence[str] | None, rows: Sequence[Sequence[str]], align: str, indent: int = 2
) -> list[str]:
    """
    C{rows} (and C{header}) in columns as wide as their widest cell, each aligned by
    C{align} (C{l} or C{r} per column), two spaces apart; trailing spaces dropped.
    """
    every = ([list(header)] if header else []) + [list(row) for row in rows]
    if not every:
        return []
    widths = [max(len(row[i]) for row in every) for i in range(len(every[0]))]
    justify: Callable[[str, int], str]
    lines = []
    for row in every:
        cells = []
        for cell, width, side in zip(row, widths, align, strict=True):
            justify = str.rjust if side == "r" else str.ljust
            cells.append(justify(cell, width))
        lines.append((" " * indent + "  ".join(cells)).rstrip())
    return lines


def _mapping(value: object) -> Mapping[str, Any]:
    """C{value} if it is a JSON object, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Any]:
    """C{value} if it is a JSON array, else an empty one."""
    return value if isinstance(value, list) else []


def _number(value: object) -> float | None:
    """C{value} if it is a number (not a boolean), else C{None}."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if value == value and abs(value) != float("inf") else None


def _text(value: object) -> str:
    """C{value} as a cell: a string as it is, a number, or C{-} for nothing."""
    if value is None or isinstance(value, (Mapping, list)):
        return _NONE
    if isinstance(value, bool):
        return "yes" if value else "no"
    text = str(value)
    # A cell is one line of plain text: what a terminal would not print as it is (a
    # newline, an escape sequence in an agent's session id) is shown as a space.
    return "".join(c if c.isprintable() else " " for c in text) or _NONE


def _cut(text: str, width: int) -> str:
    """C{text} cut to C{width} characters, the cut marked with C{...}."""
    return text if len(text) <= width else text[: width - 3] + "..."


def _count(value: object) -> str:
    """A count with thousands separators, or C{-}."""
    number = _number(value)
    return _NONE if number is None else f"{round(number):,}"


def _percent(value: object) -> str:
    """A share (0 to 1) as a whole percentage, or C{-}."""
    number = _number(value)
    return _NONE if number is None else f"{number * 100:.0f}%"


def _seconds(value: object, places: int) -> str:
    """Seconds to C{places} decimals, C{s} after them, or C{-}."""
    number = _number(value)
    return _NONE if number is None else f"{number:,.{places}f}s"


def _ago(value: object, now: float | None) -> str:
    """How long before C{now} the wall-clock time C{value} was: C{5s ago}, or C{-}."""
    then = _number(value)
    if then is None or now is None:
        return _NONE
    return f"{_duration(max(0.0, now - then))} ago"


def _duration(seconds: float) -> str:
    """C{42s}, C{3m07s}, C{2h03m}, C{4d01h}: two units at most."""
    whole = int(max(0.0, seconds))
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"
