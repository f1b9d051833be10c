# -*- test-case-name: loopd.test.test_queue_eventlog -*-
"""
The daemon's C{logFile}: one JSON line per queue event, appended, best effort.

Every line carries C{event}, C{queueKey} and C{ts} (ISO 8601 UTC with milliseconds, as
JavaScript's C{toISOString} writes it), plus C{sessionKey}, C{role}, C{reason}, C{holders} and
C{maxStreams} when the event has them (seed, "logFile"; DESIGN §3 decision 26).

The path is asked for on every event, so a hot reload can turn the log on, off or move it,
and the file is opened in append mode for each line, so a rotated file is picked up at the
next event. Observability must never become an availability risk: every failure to write
(an unwritable path, a missing directory, a full disk) is swallowed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from loopd.queue.scheduler_types import QueueEvent

__all__ = ["EventLog", "event_record", "iso_timestamp"]

# Log lines name sessions: only their owner reads them.
_FILE_MODE = 0o600
_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)


def iso_timestamp(seconds: float) -> str:
    """
    Return the POSIX time C{seconds} as C{YYYY-MM-DDTHH:MM:SS.mmmZ} (UTC, milliseconds
    truncated).
    """
    # Rounded to the microsecond first, so 0.123 stored as 0.12299999... still reads .123.
    whole, micros = divmod(round(seconds * 1_000_000), 1_000_000)
    millis = micros // 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def event_record(event: QueueEvent, seconds: float) -> dict[str, object]:
    """
    Return the log record of C{event} stamped with the wall time C{seconds}: C{event},
    C{queueKey}, C{ts}, then each optional field the event has.
    """
    record: dict[str, object] = {
        "event": event.event,
        "queueKey": event.queue_key,
        "ts": iso_timestamp(seconds),
    }
    optional = (
        ("sessionKey", event.session_key),
        ("role", event.role),
        ("reason", event.reason),
        ("holders", event.holders),
        ("maxStreams", event.max_streams),
    )
    record.update((name, value) for name, value in optional if value is not None)
    return record


def _encode_line(record: dict[str, object]) -> bytes:
    """
    Return C{record} as one UTF-8 JSON line; text that UTF-8 cannot carry (a lone surrogate
    from a client's JSON) is written as an escape instead.
    """
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        return json.dumps(record, separators=(",", ":")).encode("ascii") + b"\n"


class EventLog:
    """
    Appends queue events to the file the current policy names; the scheduler's C{on_event}.
    """

    def __init__(self, path_of: Callable[[], str | None], wall_time: Callable[[], float]) -> None:
        """
        @param path_of: returns the log path for the next event, or C{None} for no file.
        @param wall_time: returns the POSIX time for C{ts} (C{time.time} in the daemon).
        """
        self._path_of = path_of
        self._wall_time = wall_time

    def write(self, event: QueueEvent) -> None:
        """
        Append one line for C{event} to the current log file, if there is one. Never raises
        for a path that cannot be written.
        """
        path = self._path_of()
        if path is None:
            return
        line = _encode_line(event_record(event, self._wall_time()))
        try:
            fd = os.open(path, _FLAGS, _FILE_MODE)
        except (OSError, ValueError):
            # ValueError: a path with a NUL byte or one the filesystem encoding cannot carry.
            return
        try:
            view = memoryview(line)
            while view:
                written = os.write(fd, view)
                if written <= 0:
                    break
                view = view[written:]
        except OSError:
            pass
        finally:
            os.close(fd)
