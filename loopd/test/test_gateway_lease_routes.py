"""
Tests for the gateway's lease path over HTTP: C{X-Session-Role}, waiting for a lease (the
queued comment, C{busy_wait_ms}, a client that leaves), slot choice under leases,
C{GET /v1/queue} and the C{loopd_lease_*} metrics. The gateway's site runs in memory
against the scripted fake llama-server on a C{MemoryReactorClock}, with the lease scheduler
built as C{twist loopd} builds it (L{QueueHost} over the endpoints' slot counts).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from loopd.config import Config
from loopd.testing.fake_llama import CHAT
from loopd.testing.gateway import (
    HI,
    LIMITS,
    ClientConnection,
    GatewayHarness,
    Response,
    make_config,
    outcome,
)
from loopd.testing.llama_replies import answer

STREAM = {**HI, "stream": True}
#: Limits under which a lease wait never times out in these tests.
PATIENT = dataclasses.replace(LIMITS, busy_wait_ms=60_000)


def long_answer(seconds: float) -> Any:
    """An upstream answer that streams a delta every 50 ms for about C{seconds}."""
    return answer(*[{"content": "x"}] * round(seconds / 0.05 - 1))


class LeaseHarness(GatewayHarness):
    """L{GatewayHarness} whose gateway takes leases, as C{twist loopd} wires them."""

    def __init__(self, config: Config, grace_ms: int = 1000) -> None:
        """A gateway over C{config} with a lease scheduler and a grace of C{grace_ms}."""
        super().__init__(config, leases=True, grace_ms=grace_ms)

    def chat(
        self,
        document: object,
        session: str | None = None,
        role: str | None = None,
        end: str | None = None,
    ) -> ClientConnection:
        """POST C{document} on a new connection, with C{X-Session-Id}/C{-Role}/C{-End}."""
        headers = ["Content-Type: application/json"]
        if end is not None:
            headers.append(f"X-Session-End: {end}")
        if session is not None:
            headers.append(f"X-Session-Id: {session}")
        if role is not None:
            headers.append(f"X-Session-Role: {role}")
        connection = self.connect()
        connection.request("POST", CHAT, json.dumps(document).encode(), headers)
        return connection

    def status(self) -> Any:
        """C{GET /v1/queue}'s JSON body (asserting a 200)."""
        response = self.get("/v1/queue").response()
        assert response.status == 200, response
        return response.json()

    def queue(self, key: str = "tiny") -> dict[str, Any]:
        """The status entry of queue C{key}."""
        entry: dict[str, Any] = next(q for q in self.status()["queues"] if q["queueKey"] == key)
        return entry

    def waiting(self, key: str = "tiny") -> list[str]:
        """The sessions waiting on queue C{key}, by C{GET /v1/queue}."""
        return [w["sessionKey"] for w in self.queue(key)["waiting"]]

    def holders(self, key: str = "tiny") -> list[str]:
        """The sessions holding a slot of queue C{key}, by C{GET /v1/queue}."""
        return [h["sessionKey"] for h in self.queue(key)["holders"]]


class LeaseTestCase(SynchronousTestCase):
    """A lease harness per test, and the checks the tests share."""

    config = make_config(slots=1, limits=PATIENT)
    grace_ms = 1000

    def setUp(self) -> None:
        self.harness = LeaseHarness(self.config, self.grace_ms)
        self.fake = self.harness.fake

    def script(self, *replies: Any) -> None:
        """Queue upstream replies to the chat route."""
        self.fake.script("POST", CHAT, *replies)

    def chats_sent(self) -> int:
        """How many chat requests reached the fake server."""
        return len(self.fake.requests_to("POST", CHAT))

    def error_status(self, connection: ClientConnection, status: int, code: str) -> dict[str, Any]:
        """Assert a whole JSON error answer with C{status} and C{code}; return the error."""
        response = connection.response()
        self.assertEqual((response.status, response.complete), (status, True))
        error: dict[str, Any] = response.json()["error"]
        self.assertEqual(error["code"], code)
        return error


def content(response: Response) -> str:
    """The text of a streamed answer."""
    chunks = [d for d in response.data() if d != "[DONE]" and d.get("choices")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


class RoleTests(LeaseTestCase):
    """
    C{X-Session-Role} sets the lease's tier: parent (also when absent) or child.
    """

    config = make_config(slots=2, limits=PATIENT)

    def test_accepted(self) -> None:
        """parent, child, any case, or no header at all: the request is answered."""
        roles = [None, "parent", "child", "Child"]
        self.script(*[answer({"content": "ok"}) for _ in roles])
        connections = [self.harness.chat(HI, f"s{i}", role) for i, role in enumerate(roles)]
        self.harness.advance(5)
        self.assertEqual([c.response().status for c in connections], [200] * len(roles))
        self.assertEqual(self.chats_sent(), len(roles))

    def test_refused(self) -> None:
        """Any other value is 400 invalid_session_role; nothing upstream, no lease."""
        for value in ["boss", "parent, child"]:
            connection = self.harness.chat(HI, "s", value)
            error = self.error_status(connection, 400, "invalid_session_role")
            self.assertEqual(error["type"], "invalid_request_error")
        self.assertEqual(self.fake.requests, [])
        self.assertEqual(self.harness.status(), {"op": "status", "queues": []})

    def test_child_in_status(self) -> None:
        """A child's request holds its lease as a child; a parent's as a parent."""
        self.script(long_answer(1.0), long_answer(1.0))
        self.harness.chat(STREAM, "kid", "child")
        self.harness.chat(STREAM, "boss")
        self.harness.advance(0.1)
        self.assertEqual(
            self.harness.queue()["holders"],
            [
                {"sessionKey": "kid", "role": "child", "group": None},
                {"sessionKey": "boss", "role": "parent", "group": None},
            ],
        )


class WaitTests(LeaseTestCase):
    """
    A request whose endpoint's queue is full waits for a lease before it goes upstream.
    """

    def test_queued_comment(self) -> None:
        """A streamed request that waits hears a queued comment, then gets its answer."""
        self.script(answer({"content": "first"}), answer({"content": "second"}))
        self.harness.chat(STREAM, "a")
        waiting = self.harness.chat(STREAM, "b")
        response = waiting.response()
        self.assertEqual((response.status, response.complete), (200, False))
        self.assertEqual(response.comments(), [{"event": "queued", "ahead": 0}])
        self.assertEqual(content(response), "")
        self.assertEqual((self.chats_sent(), self.harness.waiting()), (1, ["b"]))
        self.harness.advance(2)
        response = waiting.response()
        self.assertEqual((response.complete, content(response)), (True, "second"))
        events = response.events()
        queued = [i for i, e in enumerate(events) if e.startswith(": loopd ")]
        answered = [i for i, e in enumerate(events) if '"content":"second"' in e]
        self.assertLess(queued[-1], answered[0])
        self.assertEqual(self.chats_sent(), 2)

    def test_second_waits_for_grace(self) -> None:
        """The waiter goes upstream only when the holder's grace has ended."""
        self.script(answer({"content": "first"}), answer({"content": "second"}))
        self.harness.chat(STREAM, "a")
        self.harness.chat(STREAM, "b")
        self.harness.advance(1.05)
        self.assertEqual(self.chats_sent(), 1)
        self.harness.advance(0.1)
        self.assertEqual(self.chats_sent(), 2)
        self.assertEqual(self.harness.queue()["switches"], 1)

    def test_session_end_skips_grace(self) -> None:
        """X-Session-End: true hands the slot on when the answer ends, with no grace."""
        self.script(answer({"content": "first"}), answer({"content": "second"}))
        self.harness.chat(STREAM, "a", end="true")
        self.harness.chat(STREAM, "b")
        self.harness.advance(0.5)
        self.assertEqual(self.chats_sent(), 2)
        self.assertEqual(self.harness.holders(), ["b"])

    def test_session_end_false_keeps_grace(self) -> None:
        """X-Session-End: 0 (or false) is an ordinary request: the grace holds the slot."""
        self.script(answer({"content": "first"}), answer({"content": "second"}))
        self.harness.chat(STREAM, "a", end="0")
        self.harness.chat(STREAM, "b")
        self.harness.advance(0.5)
        self.assertEqual((self.chats_sent(), self.harness.holders()), (1, ["a"]))

    def test_session_end_refused(self) -> None:
        """Any other X-Session-End is 400 invalid_session_end; nothing upstream, no lease."""
        connection = self.harness.chat(HI, "s", end="soon")
        self.error_status(connection, 400, "invalid_session_end")
        self.assertEqual(self.fake.requests, [])
        self.assertEqual(self.harness.status(), {"op": "status", "queues": []})

    def test_client_gone_while_waiting(self) -> None:
        """A client that leaves while waiting leaves no waiter, and nothing goes upstream."""
        self.script(answer({"content": "first"}), answer({"content": "second"}))
        self.harness.chat(STREAM, "a")
        self.harness.chat(STREAM, "b").drop()
        self.assertEqual(self.harness.waiting(), [])
        self.harness.advance(3)
        self.assertEqual(self.chats_sent(), 1)
        self.assertEqual(self.harness.scrape()[outcome("tiny", "client_gone")], 1.0)
        self.assertEqual(self.harness.gateway.in_flight, set())


class WaitTimeoutTests(LeaseTestCase):
    """
    A wait for a lease longer than C{limits.busy_wait_ms} (200 ms here) is WaitTimeout.
    """

    config = make_config(slots=1)

    def test_wait_timeout(self) -> None:
        """A non-stream wait past busy_wait_ms is 504 wait_timeout and leaves no waiter."""
        self.script(long_answer(2.0))
        self.harness.chat(STREAM, "a")
        waiting = self.harness.chat(HI, "b")
        self.harness.advance(0.15)
        self.assertEqual(waiting.responses(), [])
        self.harness.advance(0.1)
        self.assertEqual(self.error_status(waiting, 504, "wait_timeout")["type"], "timeout")
        self.assertEqual(self.harness.waiting(), [])
        self.assertEqual(self.chats_sent(), 1)
        self.assertEqual(self.harness.scrape()[outcome("tiny", "wait_timeout")], 1.0)

    def test_wait_timeout_stream(self) -> None:
        """A streamed wait past busy_wait_ms ends with one wait_timeout event after queued."""
        self.script(long_answer(2.0))
        self.harness.chat(STREAM, "a")
        waiting = self.harness.chat(STREAM, "b")
        self.harness.advance(0.25)
        response = waiting.response()
        self.assertEqual((response.status, response.complete), (200, True))
        self.assertEqual(response.comments(), [{"event": "queued", "ahead": 0}])
        self.assertEqual(response.data()[-1]["error"]["code"], "wait_timeout")
        self.assertNotIn("[DONE]", response.data())
        self.assertEqual(self.harness.waiting(), [])
        self.assertEqual(self.chats_sent(), 1)


class SlotTests(LeaseTestCase):
    """
    A session in its grace keeps its home slot: nobody else is sent there meanwhile.
    """

    config = make_config(slots=2, limits=PATIENT)

    def slots_sent(self) -> list[int]:
        """The C{id_slot} of each chat request the fake received, in order."""
        return [r.json["id_slot"] for r in self.fake.requests_to("POST", CHAT)]

    def test_home_slot_kept_in_grace(self) -> None:
        """b, whose last slot a calls home in a's grace, goes to the other slot; a keeps 0."""
        self.script(answer({"content": "b1"}))
        self.harness.chat(STREAM, "b")
        self.harness.advance(1.2)
        # b called slot 0 home, and its grace is over. c runs on slot 1, so a gets slot 0.
        self.script(long_answer(0.55), long_answer(2.05))
        self.harness.chat(STREAM, "c")
        self.harness.chat(STREAM, "a")
        self.harness.advance(2.3)
        self.assertEqual(self.harness.holders(), ["a"])
        # a is in its grace, c's is over: b's own last slot, 0, is a's home now.
        self.script(answer({"content": "b2"}), answer({"content": "a2"}))
        self.harness.chat(STREAM, "b")
        self.harness.advance(0.2)
        self.harness.chat(STREAM, "a")
        self.harness.advance(0.5)
        self.assertEqual(self.slots_sent(), [0, 1, 0, 1, 0])
        self.assertEqual(self.harness.queue()["switches"], 0)


class QueueRouteTests(LeaseTestCase):
    """
    C{GET /v1/queue} serves the lease protocol's status reply, only when there are leases.
    """

    config = make_config(slots=2, limits=PATIENT)

    def test_absent_without_leases(self) -> None:
        """A gateway without leases answers 404 not_found for /v1/queue."""
        self.error_status(GatewayHarness(self.config).get("/v1/queue"), 404, "not_found")

    def test_status(self) -> None:
        """The status reply: op status and each queue's streams, switches, holders, waiters."""
        self.assertEqual(self.harness.status(), {"op": "status", "queues": []})
        self.script(long_answer(1.0))
        self.harness.chat(STREAM, "a", "child")
        entry = {
            "queueKey": "tiny",
            "maxStreams": 2,
            "switches": 0,
            "holders": [{"sessionKey": "a", "role": "child", "group": None}],
            "waiting": [],
        }
        self.assertEqual(self.harness.status(), {"op": "status", "queues": [entry]})

    def test_get_only(self) -> None:
        """POST /v1/queue is 405 method_not_allowed."""
        connection = self.harness.connect()
        connection.request("POST", "/v1/queue", b"{}")
        self.error_status(connection, 405, "method_not_allowed")


class MetricsTests(LeaseTestCase):
    """
    C{/metrics} reads the lease scheduler: grants, switches and waiters.
    """

    def lease_samples(self) -> dict[str, float]:
        """The loopd_lease_* samples of one scrape, keyed by name and queue label."""
        return {
            name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels)): value
            for (name, labels), value in self.harness.scrape().items()
            if name.startswith("loopd_lease_")
        }

    def test_lease_metrics(self) -> None:
        """A waiter shows in waiters; its grant after the grace in grants and switches."""
        self.assertEqual(
            self.lease_samples(),
            {
                "loopd_lease_grants_total": 0.0,
                "loopd_lease_releases_total": 0.0,
                "loopd_lease_evictions_total": 0.0,
            },
        )
        self.script(answer({"content": "first"}), answer({"content": "second"}))
        self.harness.chat(STREAM, "a")
        self.harness.chat(STREAM, "b")
        samples = self.lease_samples()
        self.assertEqual(samples["loopd_lease_grants_total"], 1.0)
        self.assertEqual(samples["loopd_lease_switches_total{queue=tiny}"], 0.0)
        self.assertEqual(samples["loopd_lease_waiters{queue=tiny}"], 1.0)
        self.assertEqual(samples["loopd_lease_holders{queue=tiny}"], 1.0)
        self.harness.advance(2)
        samples = self.lease_samples()
        self.assertEqual(samples["loopd_lease_grants_total"], 2.0)
        self.assertEqual(samples["loopd_lease_releases_total"], 1.0)
        self.assertEqual(samples["loopd_lease_switches_total{queue=tiny}"], 1.0)
        self.assertEqual(samples["loopd_lease_waiters{queue=tiny}"], 0.0)
        self.assertEqual(samples["loopd_lease_holders{queue=tiny}"], 1.0)
