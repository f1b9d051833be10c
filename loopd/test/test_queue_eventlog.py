"""
L{loopd.queue.eventlog}: the C{logFile} lines, their fields and timestamps, the path read per
event, and every failure to write swallowed.
"""

from __future__ import annotations

import calendar
import json
import os
import shutil
import stat
import tempfile
from datetime import datetime, timezone

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.eventlog import EventLog, event_record, iso_timestamp
from loopd.queue.scheduler_types import QueueEvent

#: 2026-11-29T22:40:01.123Z as POSIX seconds.
WALL = calendar.timegm((2026, 11, 29, 22, 40, 1)) + 0.123


class TimestampTests(SynchronousTestCase):
    """
    C{ts} is ISO 8601 UTC with milliseconds, as JavaScript's C{toISOString} writes it.
    """

    def test_example(self) -> None:
        """A wall time renders as C{YYYY-MM-DDTHH:MM:SS.mmmZ}."""
        self.assertEqual(iso_timestamp(WALL), "2026-11-29T22:40:01.123Z")
        self.assertEqual(iso_timestamp(0.0), "1970-01-01T00:00:00.000Z")

    @given(st.integers(min_value=0, max_value=4_102_444_800_000))
    def test_matches_datetime(self, millis: int) -> None:
        """For any millisecond up to the year 2100 the stamp is datetime's ISO form with a C{Z}."""
        moment = datetime.fromtimestamp(millis // 1000, timezone.utc)
        expected = moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{millis % 1000:03d}Z"
        self.assertEqual(iso_timestamp(millis / 1000), expected)


class RecordTests(SynchronousTestCase):
    """
    A record has C{event}, C{queueKey} and C{ts}, then only the fields the event has.
    """

    def test_scheduler_event(self) -> None:
        """A grant carries C{sessionKey} and C{role}; absent fields are left out."""
        record = event_record(QueueEvent("grant", "zen", "s1", "child"), WALL)
        self.assertEqual(
            record,
            {
                "event": "grant",
                "queueKey": "zen",
                "ts": "2026-11-29T22:40:01.123Z",
                "sessionKey": "s1",
                "role": "child",
            },
        )
        self.assertEqual(list(record)[:3], ["event", "queueKey", "ts"])

    def test_reason(self) -> None:
        """An eviction carries its C{reason}."""
        record = event_record(QueueEvent("evict", "zen", "s1", "parent", "ttl"), WALL)
        self.assertEqual(record["reason"], "ttl")

    def test_config_event(self) -> None:
        """A C{config} event carries C{reason}, C{holders} and C{maxStreams}, and no session."""
        event = QueueEvent("config", "one-gpu", reason="over-capacity", holders=2, max_streams=1)
        record = event_record(event, WALL)
        self.assertEqual(
            record,
            {
                "event": "config",
                "queueKey": "one-gpu",
                "ts": "2026-11-29T22:40:01.123Z",
                "reason": "over-capacity",
                "holders": 2,
                "maxStreams": 1,
            },
        )


class WriteTests(SynchronousTestCase):
    """
    L{EventLog.write} appends one JSON line per event to the path of the moment.
    """

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.path: str | None = os.path.join(self.directory, "queue.log")
        self.log = EventLog(lambda: self.path, lambda: WALL)

    def lines(self, path: str) -> list[dict[str, object]]:
        with open(path, encoding="utf-8") as stream:
            return [json.loads(line) for line in stream.read().splitlines()]

    def test_appends_lines(self) -> None:
        """Each event is one line, appended after what the file already holds."""
        assert self.path is not None
        with open(self.path, "w", encoding="utf-8") as stream:
            stream.write('{"event":"old"}\n')
        self.log.write(QueueEvent("queued", "k", "s1", "parent"))
        self.log.write(QueueEvent("grant", "k", "s2", "child"))
        events = [line["event"] for line in self.lines(self.path)]
        self.assertEqual(events, ["old", "queued", "grant"])
        self.assertEqual(self.lines(self.path)[2]["sessionKey"], "s2")

    def test_created_private(self) -> None:
        """A log file the daemon creates is readable by its owner only (it names sessions)."""
        assert self.path is not None
        self.log.write(QueueEvent("grant", "k", "s1", "parent"))
        self.assertEqual(stat.S_IMODE(os.stat(self.path).st_mode), 0o600)

    def test_no_path_no_file(self) -> None:
        """With no path nothing is written anywhere."""
        self.path = None
        self.log.write(QueueEvent("grant", "k", "s1", "parent"))
        self.assertEqual(os.listdir(self.directory), [])

    def test_path_read_per_event(self) -> None:
        """The path is read per event: a reload turns the log on, moves it, turns it off."""
        first = os.path.join(self.directory, "a.log")
        second = os.path.join(self.directory, "b.log")
        self.path = None
        self.log.write(QueueEvent("grant", "k", "s0", "parent"))
        self.path = first
        self.log.write(QueueEvent("grant", "k", "s1", "parent"))
        self.path = second
        self.log.write(QueueEvent("release", "k", "s1", "parent"))
        self.path = None
        self.log.write(QueueEvent("grant", "k", "s3", "parent"))
        self.assertEqual([line["sessionKey"] for line in self.lines(first)], ["s1"])
        self.assertEqual([line["event"] for line in self.lines(second)], ["release"])
        self.assertEqual(sorted(os.listdir(self.directory)), ["a.log", "b.log"])

    def test_unwritable_paths_swallowed(self) -> None:
        """A missing dir, a dir, a NUL in the path and a full disk are skipped."""
        paths = [
            os.path.join(self.directory, "missing", "queue.log"),
            self.directory,
            os.path.join(self.directory, "nul\0.log"),
        ]
        if os.path.exists("/dev/full"):
            paths.append("/dev/full")
        for path in paths:
            self.path = path
            self.log.write(QueueEvent("grant", "k", "s1", "parent"))
        self.assertEqual(os.listdir(self.directory), [])

    def test_lone_surrogate(self) -> None:
        """A lone surrogate in a session key still makes one valid JSON line."""
        assert self.path is not None
        self.log.write(QueueEvent("grant", "k", "\ud800x", "parent"))
        self.log.write(QueueEvent("grant", "k", "né", "parent"))
        keys = [line["sessionKey"] for line in self.lines(self.path)]
        self.assertEqual(keys, ["\ud800x", "né"])
