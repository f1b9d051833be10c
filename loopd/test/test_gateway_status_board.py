"""
Tests for L{loopd.gateway.status_board}: a session's figures, the time its cache saved,
the slots, the last requests, the hour's series, and the bounds on each.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.activity import Activity, RequestRecord
from loopd.gateway.status_board import StatusBoard, saved_seconds
from loopd.llama.types import Completion, FinishReason, Timings

WALL = 1_700_000_000.0


def completion(timings: Timings, capped: bool = False) -> Completion:
    """A completion with C{timings}."""
    return Completion("c", "hi", None, (), FinishReason.STOP, timings, thinking_capped=capped)


class Stage:
    """A board watching an activity on a clock whose wall time follows it."""

    def __init__(self, **board: int) -> None:
        self.clock = Clock()
        self.board = StatusBoard(**board)
        self.activity = Activity(
            self.clock.seconds, lambda: WALL + self.clock.seconds(), [self.board]
        )

    def turn(
        self,
        session: str,
        timings: Timings | None,
        *,
        endpoint: str = "tiny",
        slot: int = 0,
        agent: str | None = "claude-cli/2.0",
        outcome: str = "ok",
        capped: bool = False,
        seconds: float = 1.0,
    ) -> RequestRecord:
        """One request of C{session} served on C{endpoint}'s C{slot} in C{seconds}."""
        record = self.activity.begin("chat", b"")
        record.session, record.agent, record.model = session, agent, endpoint
        self.activity.started(record)
        call = self.activity.call(record, endpoint, holder=session)
        self.activity.sent(record, call, slot)
        self.clock.advance(seconds)
        if timings is None:
            self.activity.call_failed(record, call, "Http: 500")
        else:
            self.activity.call_completed(record, call, completion(timings, capped))
        self.activity.end(record, 200 if outcome == "ok" else 500, outcome)
        return record


class SavedSecondsTests(SynchronousTestCase):
    """L{saved_seconds}, and the speed it is priced at: the endpoint's before the request."""

    def test_at_speed(self) -> None:
        """The reused tokens over the speed; nothing without one."""
        self.assertEqual(saved_seconds(Timings(1000, 1, 1), 250.0), 4.0)
        self.assertEqual(saved_seconds(Timings(1000, 1, 1), None), 0.0)

    def test_speed_before_the_request(self) -> None:
        """
        A fresh endpoint's first request saves nothing it can price (its own speed, measured
        on the tokens after a reused context, would overstate it); the next is priced at the
        speed the first measured, and the call's record carries it for the cache report.
        """
        stage = Stage()
        first = stage.turn("s1", Timings(5000, 200, 1, prompt_per_second=500.0))
        second = stage.turn("s1", Timings(5200, 200, 1, prompt_per_second=100.0))
        self.assertEqual([c.saved_seconds for c in first.calls], [0.0])
        self.assertEqual([c.saved_seconds for c in second.calls], [10.4])
        self.assertEqual(stage.board.session_list()[0]["saved_seconds"], 10.4)


class SessionTests(SynchronousTestCase):
    """A session's figures."""

    def test_figures(self) -> None:
        """Turns, tokens, reuse, time saved, caps, errors, last seen and home add up."""
        stage = Stage()
        fast = Timings(0, 2000, 10, prompt_per_second=1000.0)
        stage.turn("s1", fast, endpoint="big", capped=True)
        stage.turn("s1", Timings(1990, 20, 5), endpoint="big")
        stage.turn("s1", None, outcome="server_error")
        [entry] = stage.board.session_list()
        self.assertEqual(
            entry,
            {
                "id": "s1",
                "agent": "claude-cli/2.0",
                "anonymous": False,
                "turns": 2,
                "reused_tokens": 1990,
                "evaluated_tokens": 2020,
                "generated_tokens": 15,
                "reuse": round(1990 / 4010, 4),
                "saved_seconds": 1.99,
                "thinking_capped": 1,
                "errors": 1,
                "last_seen": WALL + 2.0,
                "home": "big",
            },
        )
        self.assertEqual(stage.board.prompt_speed("big"), 1000.0)

    def test_client_gone_not_an_error(self) -> None:
        """A client that left is neither a turn nor an error."""
        stage = Stage()
        stage.turn("s1", None, outcome="client_gone")
        [entry] = stage.board.session_list()
        self.assertEqual((entry["turns"], entry["errors"]), (0, 0))

    def test_most_recent_first(self) -> None:
        """Sessions are listed the most recently seen first; the agent sticks."""
        stage = Stage()
        for session in ("a", "b", "a"):
            stage.turn(session, Timings(1, 1, 1), agent=None if session == "a" else "x")
        self.assertEqual([e["id"] for e in stage.board.session_list()], ["a", "b"])

    @settings(max_examples=30)
    @given(st.lists(st.integers(0, 40), max_size=120), st.integers(1, 8))
    def test_bounded(self, sessions: list[int], bound: int) -> None:
        """At most C{max_sessions} sessions, the least recently seen forgotten first."""
        stage = Stage(max_sessions=bound)
        for number in sessions:
            stage.turn(f"s{number}", Timings(1, 1, 1))
        listed = [e["id"] for e in stage.board.session_list()]
        recent: list[str] = []
        for number in reversed(sessions):
            if f"s{number}" not in recent:
                recent.append(f"s{number}")
        self.assertEqual(listed, recent[:bound])

    def test_totals(self) -> None:
        """The totals count every session's tokens."""
        stage = Stage()
        stage.turn("a", Timings(5, 6, 7))
        stage.turn("b", Timings(50, 60, 70))
        totals = stage.board.totals
        self.assertEqual(
            (stage.board.requests, totals.reused_tokens, totals.evaluated_tokens), (2, 55, 66)
        )


class SlotTests(SynchronousTestCase):
    """Slot states."""

    def test_running_then_idle(self) -> None:
        """A slot runs while its call does; then keeps its session and cached tokens."""
        stage = Stage()
        self.assertEqual(stage.board.slot("tiny", 0), (False, None, "", 0))
        record = stage.activity.begin("chat", b"")
        record.session = "s1"
        call = stage.activity.call(record, "tiny", holder="s1 conv")
        stage.activity.sent(record, call, 0)
        self.assertEqual(stage.board.slot("tiny", 0), (True, "s1", "s1 conv", 0))
        stage.activity.call_completed(record, call, completion(Timings(3, 10, 2)))
        self.assertEqual(stage.board.slot("tiny", 0), (False, "s1", "s1 conv", 15))


class RecentTests(SynchronousTestCase):
    """The last requests."""

    def test_entry(self) -> None:
        """A finished request's entry: figures and times, newest first, bounded."""
        stage = Stage(recent=2)
        for session in ("a", "b", "c"):
            stage.turn(session, Timings(1, 2, 3), seconds=0.5)
        entries = stage.board.recent()
        self.assertEqual([e["session"] for e in entries], ["c", "b"])
        entry = entries[0]
        self.assertEqual(
            {k: entry[k] for k in ("door", "status", "outcome", "seconds", "generated_tokens")},
            {"door": "chat", "status": 200, "outcome": "ok", "seconds": 0.5, "generated_tokens": 3},
        )
        self.assertNotIn("body", entry)

    def test_under_way(self) -> None:
        """A request is under way from its start to its end."""
        stage = Stage()
        record = stage.activity.begin("chat", b"")
        stage.activity.started(record)
        self.assertEqual(stage.board.under_way(), [record])
        stage.activity.end(record, 200, "ok")
        self.assertEqual(stage.board.under_way(), [])


class SeriesTests(SynchronousTestCase):
    """The hour's series."""

    def test_minutes(self) -> None:
        """A point per minute: tokens generated per second and the reuse share."""
        stage = Stage()
        stage.turn("a", Timings(30, 10, 120))
        series = stage.board.series(WALL + 60)
        self.assertEqual(len(series["minute_starts"]), 60)
        self.assertEqual(series["minute_starts"][-1], int((WALL + 60) // 60) * 60)
        self.assertEqual((series["tokens_per_second"][-2], series["reuse"][-2]), (2.0, 0.75))
        self.assertEqual((series["tokens_per_second"][-1], series["reuse"][-1]), (0.0, None))

    def test_old_minutes_go(self) -> None:
        """Minutes older than the hour are dropped as new ones come."""
        stage = Stage(minutes=3)
        for _ in range(10):
            stage.turn("a", Timings(1, 1, 60), seconds=60)
        self.assertEqual(stage.board.series(WALL + 600)["tokens_per_second"], [1.0, 1.0, 1.0])
