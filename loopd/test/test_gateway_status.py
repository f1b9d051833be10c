"""
Tests for L{loopd.gateway.status}: C{GET /v1/status} through the gateway's site, against the
scripted fake llama-server on a memory clock: endpoints and their slots (running, grace,
idle), sessions and their figures, the lease queues, requests under way and mesh turns, the
last requests with no text in them.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from loopd.testing.fake_llama import CHAT, error_reply
from loopd.testing.gateway import HI, NOW, GatewayHarness, make_config
from loopd.testing.llama_replies import answer
from loopd.testing.mesh import MeshHarness, says

#: A prompt whose words must never appear in the status document.
SECRET = {"messages": [{"role": "user", "content": "the launch code is swordfish"}]}
#: Timings with a prompt speed worth measuring.
MEASURED = {
    "cache_n": 900,
    "prompt_n": 100,
    "predicted_n": 4,
    "prompt_per_second": 200.0,
    "predicted_per_second": 40.0,
}


def status(harness: GatewayHarness) -> dict[str, Any]:
    """C{GET /v1/status}, as JSON."""
    response = harness.get("/v1/status").response()
    assert response.status == 200, response.body
    document: dict[str, Any] = response.json()
    return document


class DocumentTests(SynchronousTestCase):
    """The document after requests."""

    def test_fresh(self) -> None:
        """A fresh gateway: its endpoints with idle slots, nothing else yet."""
        harness = GatewayHarness(make_config(slots=2))
        document = status(harness)
        self.assertEqual(
            sorted(document),
            [
                "endpoints",
                "in_flight",
                "leases",
                "loopd",
                "mesh_turns",
                "requests",
                "series",
                "sessions",
                "totals",
            ],
        )
        [endpoint] = document["endpoints"]
        self.assertEqual(
            endpoint,
            {
                "name": "tiny",
                "kind": "llama-server",
                "model": "tiny",
                "health": "probing",
                "why": "not probed yet",
                "prompt_tokens_per_second": None,
                "generation_tokens_per_second": None,
                "slots": [
                    {"id": 0, "state": "idle", "session": None, "tokens_cached": 0},
                    {"id": 1, "state": "idle", "session": None, "tokens_cached": 0},
                ],
            },
        )
        self.assertEqual(
            (document["sessions"], document["requests"], document["leases"]), ([], [], None)
        )
        self.assertEqual(document["loopd"]["now"], NOW)

    def test_after_a_turn(self) -> None:
        """A finished turn: its session, its request, its slot's cache, the speeds."""
        harness = GatewayHarness(make_config(slots=1))
        harness.fake.script("POST", CHAT, answer({"content": "ok"}, timings=MEASURED))
        connection = harness.connect()
        connection.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(SECRET).encode(),
            ["Content-Type: application/json", "X-Session-Id: s1", "User-Agent: pi/0.9 (x)"],
        )
        harness.advance(1)
        self.assertEqual(connection.response().status, 200)
        document = status(harness)
        self.assertNotIn("swordfish", json.dumps(document))
        [session] = document["sessions"]
        self.assertEqual(
            {k: session[k] for k in ("id", "agent", "turns", "reused_tokens", "saved_seconds")},
            # A fresh endpoint's first request is not priced (no speed measured before it).
            {"id": "s1", "agent": "pi/0.9", "turns": 1, "reused_tokens": 900, "saved_seconds": 0.0},
        )
        [request] = document["requests"]
        self.assertEqual(
            {k: request[k] for k in ("door", "session", "endpoint", "status", "outcome")},
            {"door": "chat", "session": "s1", "endpoint": "tiny", "status": 200, "outcome": "ok"},
        )
        [endpoint] = document["endpoints"]
        self.assertEqual(
            endpoint["slots"], [{"id": 0, "state": "idle", "session": "s1", "tokens_cached": 1004}]
        )
        self.assertEqual(
            (endpoint["prompt_tokens_per_second"], endpoint["generation_tokens_per_second"]),
            (200.0, 40.0),
        )
        self.assertEqual(document["totals"]["requests"], 1)

    def test_refused_request_listed(self) -> None:
        """A request refused at the door is in the list with its status and error."""
        harness = GatewayHarness()
        harness.post({**HI, "model": "nowhere"}).response()
        [request] = status(harness)["requests"]
        self.assertEqual(
            (request["status"], request["outcome"], request["endpoint"]),
            (404, "model_not_found", None),
        )
        self.assertIn("nowhere", request["error"])

    def test_server_text_left_out(self) -> None:
        """
        A model server's error text may quote the prompt: the list gives its code, not its
        text (the client still gets the whole message).
        """
        harness = GatewayHarness()
        harness.fake.script("POST", CHAT, error_reply(500, "server_error", "bad input: swordfish"))
        connection = harness.post(SECRET)
        harness.advance(1)
        self.assertIn("swordfish", connection.response().body.decode())
        document = status(harness)
        self.assertNotIn("swordfish", json.dumps(document))
        [request] = document["requests"]
        self.assertEqual(request["outcome"], "http")
        self.assertIn("(http)", request["error"])

    def test_under_way(self) -> None:
        """A running request: in flight, its slot running with its session."""
        harness = GatewayHarness(make_config(slots=1))
        harness.fake.script("POST", CHAT, answer({"content": "ok"}))
        harness.post(HI, "s1")
        document = status(harness)
        [running] = document["in_flight"]
        self.assertEqual((running["session"], running["calls"][0]["slot"]), ("s1", 0))
        self.assertEqual(document["endpoints"][0]["slots"][0]["state"], "running")
        self.assertEqual(document["mesh_turns"], 0)
        harness.advance(1)
        document = status(harness)
        self.assertEqual(document["in_flight"], [])
        self.assertEqual(document["endpoints"][0]["slots"][0]["state"], "idle")


class LeaseTests(SynchronousTestCase):
    """With leases: the grace and the queues."""

    def test_grace_then_idle(self) -> None:
        """After its turn the session's slot is in grace, then idle once the grace ends."""
        harness = GatewayHarness(make_config(slots=1), leases=True, grace_ms=5000)
        harness.fake.script("POST", CHAT, answer({"content": "ok"}))
        harness.post(HI, "s1")
        harness.advance(1)
        document = status(harness)
        self.assertEqual(document["endpoints"][0]["slots"][0]["state"], "grace")
        [queue] = document["leases"]
        self.assertEqual([h["sessionKey"] for h in queue["holders"]], ["s1"])
        harness.advance(10)
        self.assertEqual(status(harness)["endpoints"][0]["slots"][0]["state"], "idle")

    def test_slot_handed_on(self) -> None:
        """
        A waiter given the slot at once (no grace) shows there as running, under its own
        session: the call that ended is told before its lease is given back (before, the
        ended call cleared the waiter's running state and wrote its own session).
        """
        harness = GatewayHarness(make_config(slots=1), leases=True, grace_ms=0)
        harness.fake.script(
            "POST", CHAT, answer({"content": "a"}), answer({"content": "b"}, delay_s=0.1)
        )
        harness.post(HI, "a")
        harness.post(HI, "b")
        for _ in range(3):
            harness.advance(0.05)
        [slot] = status(harness)["endpoints"][0]["slots"]
        self.assertEqual((slot["state"], slot["session"]), ("running", "b"))


class MeshTests(SynchronousTestCase):
    """A mesh turn under way and done."""

    def test_mesh_turn(self) -> None:
        """A mesh turn counts while it runs; its calls are its workers'."""
        harness = MeshHarness()
        harness.script(
            llama_70b=says("Paris.", 1.0), mistral_7b=says("Paris", 0.5), qwen3_8b=says("x", 30)
        )
        harness.post({**HI, "model": "mesh"}, "m1")
        harness.advance(0.1)
        document = status(harness)
        self.assertEqual(document["mesh_turns"], 1)
        self.assertEqual({c["role"] for c in document["in_flight"][0]["calls"]}, {"worker"})
        harness.advance(2)
        document = status(harness)
        self.assertEqual(document["mesh_turns"], 0)
        [request] = document["requests"]
        self.assertEqual((request["mesh"], request["calls"], request["outcome"]), (True, 3, "ok"))
