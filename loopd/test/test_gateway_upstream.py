"""
Tests for L{loopd.gateway.upstream}, the one leased upstream call: lease, slot, the robust
client's call, accounting, give-back, and cancellation of the whole, against a scripted
fake llama-server in memory with the lease scheduler in process (L{GatewayHarness}).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.trial.unittest import SynchronousTestCase

from loopd.errors import Connect, ProxyRefused, WaitTimeout
from loopd.gateway.upstream import CallKeys
from loopd.llama.types import ChatEvent, ChatRequest, Completion, Queued, User
from loopd.testing.fake_llama import CHAT, Reply
from loopd.testing.gateway import HI, LIMITS, GatewayHarness, make_config
from loopd.testing.llama_replies import answer

REQUEST = ChatRequest(slot=-1, messages=(User("Hi"),))
#: What the scripted answers report: 13 prompt tokens, 3 of them from the cache.
TIMINGS = {"cache_n": 3, "prompt_n": 10, "predicted_n": 2, "predicted_per_second": 50.0}


class UpstreamCase(SynchronousTestCase):
    """A gateway with leases (grace 1 s) over one 2-slot fake; no tests of its own."""

    slots = 2

    def setUp(self) -> None:
        self.harness = GatewayHarness(
            make_config(slots=self.slots), leases=True, slot_counts={"tiny": self.slots}
        )
        self.upstreams = self.harness.gateway.upstreams
        self.events: list[ChatEvent] = []

    def call(self, keys: CallKeys, request: ChatRequest = REQUEST) -> Deferred[Completion]:
        """One leased call to C{tiny}, its events recorded."""
        d = self.upstreams.call("tiny", request, keys, on_event=self.events.append)
        self.harness.net.pump()
        return d

    def held(self) -> set[str]:
        """The sessions holding a lease on C{tiny} now (running, or in their grace)."""
        assert self.harness.leases is not None
        return self.harness.leases.held_sessions("tiny")

    def sent_slots(self) -> list[int]:
        """The C{id_slot} of every request the fake received, in order."""
        return [json.loads(r.body)["id_slot"] for r in self.harness.fake.requests_to("POST", CHAT)]


class LifecycleTests(UpstreamCase):
    """Lease, call, accounting, then the grace or the release at once."""

    def test_completion(self) -> None:
        """The answer comes back; the lease is held through the call and its grace."""
        self.harness.fake.script("POST", CHAT, answer({"content": "Hello"}, timings=TIMINGS))
        d = self.call(CallKeys("s1"))
        self.assertEqual(self.held(), {"s1"})
        self.harness.advance(0.5)
        self.assertEqual(self.successResultOf(d).content, "Hello")
        self.assertEqual(self.held(), {"s1"})
        self.harness.advance(1.0)
        self.assertEqual(self.held(), set())

    def test_accounting(self) -> None:
        """Tokens go to the metrics, the speed to the router, the slot to the session table."""
        self.harness.fake.script("POST", CHAT, answer({"content": "Hello"}, timings=TIMINGS))
        d = self.call(CallKeys("s1"))
        self.harness.advance(0.5)
        self.successResultOf(d)
        metrics = self.harness.scrape()
        tokens = {
            dict(labels)["kind"]: value
            for (name, labels), value in metrics.items()
            if name == "loopd_tokens_total"
        }
        self.assertEqual(tokens, {"prompt": 10.0, "cached": 3.0, "completion": 2.0})
        self.assertEqual(self.harness.gateway.router.speeds["tiny"].current(0.5), (50.0,))
        self.assertEqual(self.harness.gateway.sessions.last_slot("s1"), self.sent_slots()[0])

    def test_cache_loss_counted(self) -> None:
        """A turn that reuses far less than the session's last context is a counted loss."""
        long = {"cache_n": 0, "prompt_n": 500, "predicted_n": 100}
        self.harness.fake.script("POST", CHAT, answer({"content": "a"}, timings=long))
        self.harness.fake.script("POST", CHAT, answer({"content": "b"}, timings=long))
        for _ in range(2):
            d = self.call(CallKeys("s1"))
            self.harness.advance(0.5)
            self.successResultOf(d)
        losses = self.harness.scrape()[
            ("loopd_cache_losses_total", frozenset({("endpoint", "tiny")}))
        ]
        self.assertEqual(losses, 1.0)

    def test_session_end_releases_at_once(self) -> None:
        """A session that says it ends gives its lease back as soon as the call ends."""
        self.harness.fake.script("POST", CHAT, answer({"content": "Bye"}))
        d = self.call(CallKeys("s1", ends=True))
        self.harness.advance(0.5)
        self.successResultOf(d)
        self.assertEqual(self.held(), set())

    def test_refused_connection_no_grace(self) -> None:
        """Nothing is cached where nothing answered: a refused call keeps no grace."""
        self.harness.net.stop_listening(self.harness.config.endpoints[0].socket)
        d = self.call(CallKeys("s1"))
        self.harness.advance(0.1)
        self.failureResultOf(d, Connect)
        self.assertEqual(self.held(), set())

    def test_proxy_refusal_no_grace(self) -> None:
        """A call the inferproxy refused at its cap reached no server: no grace either."""
        refused = Reply(status=503, headers=[(ProxyRefused.HEADER, ProxyRefused.CONNECTIONS)])
        self.harness.fake.script("POST", CHAT, refused)
        d = self.call(CallKeys("s1"))
        self.harness.advance(0.1)
        self.failureResultOf(d, ProxyRefused)
        self.assertEqual(self.held(), set())

    def test_keeps_its_slot(self) -> None:
        """A session's next call goes to the slot it used last."""
        for text in ("a", "b"):
            self.harness.fake.script("POST", CHAT, answer({"content": text}))
            d = self.call(CallKeys("s1"))
            self.harness.advance(0.5)
            self.successResultOf(d)
        first, second = self.sent_slots()
        self.assertEqual(first, second)

    def test_other_holders_home_reserved(self) -> None:
        """
        A slot that another lease-holding session calls home is not given to a newcomer,
        even when it is the slot used longest ago.
        """
        for session, ends in (("s1", False), ("s3", True)):
            self.harness.fake.script("POST", CHAT, answer({"content": session}))
            d = self.call(CallKeys(session, ends=ends))
            self.harness.advance(0.5)
            self.successResultOf(d)
        # Both slots are homes now; s1 holds its lease (grace), s3 has given its back.
        self.assertEqual(self.held(), {"s1"})
        self.harness.fake.script("POST", CHAT, answer({"content": "s2"}))
        d = self.call(CallKeys("s2"))
        self.harness.advance(0.5)
        self.successResultOf(d)
        s1_slot, s3_slot, s2_slot = self.sent_slots()
        self.assertNotEqual(s1_slot, s3_slot)
        self.assertEqual(s2_slot, s3_slot)


class OneSlotTests(UpstreamCase):
    """A queue of one stream: the second session waits for the lease."""

    slots = 1

    def test_queued_then_granted(self) -> None:
        """A waiting call hears Queued, and goes upstream only once the first lease ends."""
        self.harness.fake.set_default("POST", CHAT, answer({"content": "x"}))
        first = self.call(CallKeys("s1", ends=True))
        second = self.call(CallKeys("s2"))
        self.assertIn(Queued(0), self.events)
        self.harness.advance(1.0)
        self.successResultOf(first)
        self.successResultOf(second)
        earlier, later = self.harness.fake.connections
        assert earlier.reply_ended_at is not None
        self.assertGreaterEqual(later.opened_at, earlier.reply_ended_at)

    def test_lease_wait_times_out(self) -> None:
        """No lease within busy_wait_ms is WaitTimeout, and the wait is withdrawn."""
        # s1 streams for 0.5 s, each piece within the liveness limit.
        slow = answer(*[{"content": "x"}] * 10, delay_s=0.05)
        self.harness.fake.set_default("POST", CHAT, slow)
        holding = self.call(CallKeys("s1"))
        waiting = self.call(CallKeys("s2"))
        self.harness.advance(LIMITS.busy_wait_ms / 1000.0 - 0.001)
        self.assertNoResult(waiting)
        self.harness.advance(0.001)
        self.failureResultOf(waiting, WaitTimeout)
        self.assertEqual(self.harness.host.scheduler.status()[0]["waiting"], [])  # type: ignore[union-attr]
        self.harness.advance(1.0)
        self.successResultOf(holding)

    def test_cancel_while_waiting(self) -> None:
        """Cancelling a call that waits for the lease withdraws it; nothing goes upstream."""
        self.harness.fake.set_default("POST", CHAT, answer({"content": "x"}))
        holding = self.call(CallKeys("s1"))
        waiting = self.call(CallKeys("s2"))
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
        self.assertEqual(self.harness.host.scheduler.status()[0]["waiting"], [])  # type: ignore[union-attr]
        self.harness.advance(1.0)
        self.successResultOf(holding)
        self.assertEqual(len(self.harness.fake.requests_to("POST", CHAT)), 1)


class CancelTests(UpstreamCase):
    """Cancelling the call as a whole."""

    def test_cancel_mid_call(self) -> None:
        """The upstream connection closes (llama-server stops) and the lease goes back."""
        self.harness.fake.script("POST", CHAT, answer({"content": "x"}, delay_s=5))
        d = self.call(CallKeys("s1"))
        self.harness.advance(0.01)
        d.cancel()
        self.harness.net.pump()
        self.failureResultOf(d, CancelledError)
        (connection,) = self.harness.fake.connections
        self.assertTrue(connection.client_closed)
        self.harness.advance(1.0)
        self.assertEqual(self.held(), set())

    def test_events_reach_the_sink(self) -> None:
        """The client's events (the answer's deltas) reach the caller's sink."""
        self.harness.fake.script("POST", CHAT, answer({"content": "Hel"}, {"content": "lo"}))
        d = self.call(CallKeys("s1"))
        self.harness.advance(0.5)
        self.successResultOf(d)
        texts: list[Any] = [getattr(e, "text", None) for e in self.events]
        self.assertEqual([t for t in texts if t], ["Hel", "lo"])


class AffinityTests(SynchronousTestCase):
    """
    What reaches an openai endpoint's engine for its own session affinity (decision 42):
    the fake records every request's headers and body.
    """

    def harness(self, **affinity: Any) -> GatewayHarness:
        """A gateway over one openai endpoint C{tiny} with these affinity fields."""
        config = make_config()
        (tiny,) = config.endpoints
        endpoint = replace(tiny, kind="openai", **affinity)
        harness = GatewayHarness(replace(config, endpoints=(endpoint,)))
        harness.fake.set_default("POST", CHAT, answer({"content": "Hello"}))
        return harness

    def arrived(self, harness: GatewayHarness, *headers: str, body: object = HI) -> Any:
        """POST C{body} with these header lines; the one request the fake received."""
        connection = harness.connect()
        lines = ["Content-Type: application/json", *headers]
        connection.request("POST", CHAT, json.dumps(body).encode(), lines)
        harness.advance(1)
        self.assertEqual(connection.response().status, 200)
        (received,) = harness.fake.requests_to("POST", CHAT)
        return received

    def test_each_engine_header(self) -> None:
        """SGLang's, Dynamo's and llm-d's headers each carry the session's id."""
        for header in ("x-smg-routing-key", "X-Dynamo-Session-ID", "x-session-token"):
            harness = self.harness(affinity_header=header)
            received = self.arrived(harness, "X-Session-Id: agent-1")
            self.assertEqual(received.header(header), "agent-1", header)

    def test_user_field(self) -> None:
        """affinity_field user (mesh-llm, vLLM's router) carries it in the body."""
        harness = self.harness(affinity_field="user")
        received = self.arrived(harness, "x-claude-code-session-id: cc-9")
        self.assertEqual(received.json["user"], "cc-9")

    def test_dynamo_priority(self) -> None:
        """With affinity_priority, a parent goes as priority 1 and a child as 0."""
        for role, priority in (("parent", "1"), ("child", "0")):
            harness = self.harness(affinity_header="X-Dynamo-Session-ID", affinity_priority=True)
            received = self.arrived(harness, "X-Session-Id: s", f"X-Session-Role: {role}")
            self.assertEqual(received.header("x-dynamo-request-priority"), priority)
            self.assertEqual(received.header("x-dynamo-session-id"), "s")

    def test_anonymous_sends_no_id(self) -> None:
        """A request naming no session sends no id: the engine's prefix routing decides."""
        harness = self.harness(affinity_header="x-smg-routing-key", affinity_field="user")
        received = self.arrived(harness)
        self.assertIsNone(received.header("x-smg-routing-key"))
        self.assertNotIn("user", received.json)

    def test_nothing_unasked(self) -> None:
        """Without affinity settings no id goes upstream, nor the client's user field."""
        harness = self.harness()
        received = self.arrived(harness, body={**HI, "user": "u-1"})
        self.assertNotIn("user", received.json)
        names = {name.lower() for name, _ in received.headers}
        self.assertEqual(names, {"host", "content-type", "content-length", "connection"})
