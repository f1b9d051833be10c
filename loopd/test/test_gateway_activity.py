"""
Tests for L{loopd.gateway.activity}: the records, their steps as watchers hear them, a
watcher that fails, the text kept only on request, and the agent's name from headers.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.activity import (
    AGENT_NAME_MAX,
    Activity,
    ActivityWatcher,
    CallRecord,
    RequestRecord,
    agent_name,
)
from loopd.llama.types import Completion, FinishReason, Timings

WALL = 1_700_000_000.0


def completion(cache_n: int = 3, prompt_n: int = 10, predicted_n: int = 2) -> Completion:
    """A completion with these counts."""
    timings = Timings(cache_n, prompt_n, predicted_n)
    return Completion("c1", "hi", None, (), FinishReason.STOP, timings, thinking_capped=True)


class Steps(ActivityWatcher):
    """A watcher that writes down every step it hears."""

    def __init__(self, wants_text: bool = False) -> None:
        self.steps: list[tuple[str, int, str]] = []
        self.wants_text = wants_text

    def request_started(self, record: RequestRecord) -> None:
        self.steps.append(("request_started", record.id, ""))

    def call_started(self, record: RequestRecord, call: CallRecord) -> None:
        self.steps.append(("call_started", record.id, call.endpoint))

    def call_sent(self, record: RequestRecord, call: CallRecord) -> None:
        self.steps.append(("call_sent", record.id, call.endpoint))

    def call_ended(self, record: RequestRecord, call: CallRecord) -> None:
        self.steps.append(("call_ended", record.id, call.endpoint))

    def request_ended(self, record: RequestRecord) -> None:
        self.steps.append(("request_ended", record.id, record.outcome or ""))


class Broken(ActivityWatcher):
    """A watcher that raises at every step."""

    def request_started(self, record: RequestRecord) -> None:
        raise RuntimeError("broken watcher")

    def request_ended(self, record: RequestRecord) -> None:
        raise RuntimeError("broken watcher")


class ActivityTests(SynchronousTestCase):
    """One request's record through its steps."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.steps = Steps()
        self.activity = Activity(self.clock.seconds, lambda: WALL, [self.steps])

    def test_steps_in_order(self) -> None:
        """Each step reaches the watcher in order, with the times of the clock."""
        record = self.activity.begin("chat", b"{}")
        self.activity.started(record)
        call = self.activity.call(record, "tiny", holder="s1")
        self.clock.advance(2)
        self.activity.leased(call)
        self.activity.sent(record, call, 1)
        self.clock.advance(3)
        self.activity.first_token(record)
        self.clock.advance(1)
        self.activity.first_token(record)
        self.activity.call_completed(record, call, completion())
        self.activity.end(record, 200, "ok")
        self.assertEqual(
            self.steps.steps,
            [
                ("request_started", 1, ""),
                ("call_started", 1, "tiny"),
                ("call_sent", 1, "tiny"),
                ("call_ended", 1, "tiny"),
                ("request_ended", 1, "ok"),
            ],
        )
        self.assertEqual(
            (call.lease_wait, call.slot, call.sent, call.ended, call.holder),
            (2.0, 1, 2.0, 6.0, "s1"),
        )
        self.assertEqual((record.first_token, record.ended, record.status), (5.0, 6.0, 200))
        self.assertEqual((call.thinking_capped, call.timings), (True, Timings(3, 10, 2)))

    def test_numbered(self) -> None:
        """Records are numbered from 1 in arrival order, with the wall clock's time."""
        first = self.activity.begin("chat", b"")
        second = self.activity.begin("messages", b"")
        self.assertEqual((first.id, second.id, second.wall_started), (1, 2, WALL))

    def test_ended_once(self) -> None:
        """A record ends once: a second end changes nothing and tells nobody."""
        record = self.activity.begin("chat", b"")
        self.activity.end(record, 200, "ok")
        self.clock.advance(1)
        self.activity.end(record, 499, "client_gone")
        self.assertEqual((record.outcome, record.ended), ("ok", 0.0))
        self.assertEqual([s[0] for s in self.steps.steps], ["request_ended"])

    def test_failed_call(self) -> None:
        """A failed call keeps its error, and no lease wait when it took none."""
        record = self.activity.begin("chat", b"")
        call = self.activity.call(record, "tiny")
        self.activity.call_failed(record, call, "Connect: refused")
        self.assertEqual(
            (call.error, call.lease_wait, call.timings), ("Connect: refused", None, None)
        )

    def test_totals(self) -> None:
        """A record's totals add its completed calls' counts (a failed one adds none)."""
        record = self.activity.begin("chat", b"")
        for counts in ((1, 2, 3), (10, 20, 30)):
            self.activity.call_completed(
                record, self.activity.call(record, "tiny"), completion(*counts)
            )
        self.activity.call_failed(record, self.activity.call(record, "big"), "gone")
        self.assertEqual(record.totals(), Timings(11, 22, 33))
        self.assertEqual(record.endpoint, "big")

    def test_no_text_unless_asked(self) -> None:
        """Without a watcher that wants text, neither the body nor the answer is kept."""
        record = self.activity.begin("chat", b'{"secret": 1}')
        self.activity.end(record, 200, "ok", completion=completion())
        self.assertEqual((record.body, record.completion), (None, None))

    def test_text_when_asked(self) -> None:
        """A watcher that wants text gets the body and the answer on the record."""
        self.activity.watch(Steps(wants_text=True))
        record = self.activity.begin("chat", b'{"secret": 1}')
        answer = completion()
        self.activity.end(record, 200, "ok", completion=answer)
        self.assertEqual((record.body, record.completion), (b'{"secret": 1}', answer))

    def test_broken_watcher(self) -> None:
        """A watcher that raises is logged; the others still hear every step."""
        activity = Activity(self.clock.seconds, lambda: WALL, [Broken(), self.steps])
        with capturedLogs() as events:
            record = activity.begin("chat", b"")
            activity.started(record)
            activity.end(record, 200, "ok")
        self.assertEqual([s[0] for s in self.steps.steps], ["request_started", "request_ended"])
        failures = [e for e in events if "log_failure" in e]
        self.assertEqual(len(failures), 2)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)


def headers(**values: str) -> dict[bytes, bytes]:
    """Request headers by lower-case name, C{_} for C{-}."""
    return {k.replace("_", "-").encode(): v.encode() for k, v in values.items()}


class AgentNameTests(SynchronousTestCase):
    """L{agent_name}: which header names the agent."""

    def test_user_agent_product(self) -> None:
        """The first product of the User-Agent."""
        found = headers(user_agent="claude-cli/2.0.1 (external, cli)")
        self.assertEqual(agent_name(found.get), "claude-cli/2.0.1")

    def test_precedence(self) -> None:
        """X-Loopd-Agent, then X-Title, then originator, then User-Agent."""
        every = headers(
            x_loopd_agent="mine", x_title="Aider", originator="codex_cli_rs", user_agent="ua/1"
        )
        order = [b"x-loopd-agent", b"x-title", b"originator", b"user-agent"]
        seen = []
        for name in order:
            seen.append(agent_name(every.get))
            del every[name]
        self.assertEqual(seen, ["mine", "Aider", "codex_cli_rs", "ua/1"])

    def test_none(self) -> None:
        """No header names an agent: None; nor does an empty or unprintable one."""
        nothing: dict[bytes, bytes] = {}
        self.assertIsNone(agent_name(nothing.get))
        self.assertIsNone(agent_name(headers(user_agent="").get))
        self.assertIsNone(agent_name({b"x-title": b"\x01\x02"}.get))

    @given(st.binary(max_size=300))
    def test_any_bytes(self, value: bytes) -> None:
        """Any header value: None or printable ASCII within the bound."""
        name = agent_name({b"user-agent": value}.get)
        if name is not None:
            self.assertTrue(0 < len(name) <= AGENT_NAME_MAX)
            self.assertTrue(all(" " <= c <= "~" for c in name), name)
