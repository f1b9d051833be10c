"""
Tests for L{loopd.gateway.probe}: the background C{/health} probe of each endpoint, on a
C{MemoryReactorClock} with scripted fake llama-servers: its pace while up and while down, one
probe in flight at a time, its timeout, its timer moved by a request that puts the endpoint
down, recovery by the probe, and stopping.
"""

from __future__ import annotations

import dataclasses
import math

from twisted.trial.unittest import SynchronousTestCase

from loopd.errors import ProxyRefused
from loopd.gateway.health import ProbeOutcome, State
from loopd.gateway.probe import outcome_of
from loopd.llama import Health
from loopd.settings import HealthProbe, Retry
from loopd.testing.fake_llama import CHAT, LOADING, Reply, json_reply
from loopd.testing.gateway import HI, LIMITS, PATH, GatewayHarness, make_config
from loopd.testing.llama_replies import answer

OK = json_reply(200, {"status": "ok"})
HEALTH = ("GET", "/health")


def probed_harness(poll_ms: int = LIMITS.poll_ms, **health: int) -> GatewayHarness:
    """
    A one-endpoint gateway (C{tiny}, /health answering ok) with its probes started; the
    first probe runs at once (at time 0).
    """
    limits = dataclasses.replace(LIMITS, poll_ms=poll_ms)
    config = make_config(health=HealthProbe(**health), limits=limits)
    harness = GatewayHarness(config)
    harness.fake.set_default(*HEALTH, OK)
    harness.gateway.start()
    return harness


class OutcomeTests(SynchronousTestCase):
    """What a C{/health} answer means for the board."""

    def test_outcomes(self) -> None:
        """ok is OK; a refusal by the inferproxy is BUSY; anything else FAILED."""
        refused = Health(False, "refused by its inferproxy: its connection limit is reached")
        self.assertEqual(outcome_of(Health(True, "ok")), ProbeOutcome.OK)
        self.assertEqual(outcome_of(refused), ProbeOutcome.BUSY)
        self.assertEqual(outcome_of(Health(False, "HTTP 503")), ProbeOutcome.FAILED)
        self.assertEqual(outcome_of(Health(False, "unreachable: x")), ProbeOutcome.FAILED)


class PaceTests(SynchronousTestCase):
    """How often an endpoint is probed."""

    def probes(self, harness: GatewayHarness) -> int:
        """How many /health requests C{tiny} has had."""
        return len(harness.fake.requests_to(*HEALTH))

    def test_first_probe_at_start_then_up_pace(self) -> None:
        """A probe at start makes a probing endpoint up; then one every up_interval_ms."""
        harness = probed_harness(up_interval_ms=5000)
        self.assertEqual(harness.gateway.health.state("tiny"), State.PROBING)
        harness.advance(0.01)
        state = harness.gateway.health.state("tiny")
        self.assertEqual((self.probes(harness), state), (1, State.UP))
        harness.advance(4.9)
        self.assertEqual(self.probes(harness), 1)
        harness.advance(0.2)
        self.assertEqual(self.probes(harness), 2)

    def test_down_pace(self) -> None:
        """A probe that fails puts the endpoint down; it is then probed every down_interval_ms."""
        harness = probed_harness(up_interval_ms=5000, down_interval_ms=1000)
        harness.net.stop_listening(PATH)
        harness.advance(0.01)
        self.assertEqual(harness.gateway.health.state("tiny"), State.DOWN)
        self.assertEqual(
            harness.gateway.health.why("tiny"),
            "/health: unreachable: no socket (nothing is serving it)",
        )
        harness.net.listen(PATH, harness.fake)
        harness.fake.set_default(*HEALTH, LOADING)
        harness.advance(0.98)
        self.assertEqual(self.probes(harness), 0)
        harness.advance(0.02)
        self.assertEqual(self.probes(harness), 1)
        harness.advance(1.0)
        self.assertEqual(self.probes(harness), 2)
        self.assertEqual(harness.gateway.health.state("tiny"), State.DOWN)

    def test_one_in_flight_and_timeout(self) -> None:
        """
        A probe that gets no answer is the only one in flight until its timeout, which fails
        it (its connection closed); the next comes one down interval later.
        """
        harness = probed_harness(poll_ms=1000, down_interval_ms=1000, timeout_ms=300)
        silent = dataclasses.replace(OK, headers_delay=math.inf)
        harness.fake.set_default(*HEALTH, silent)
        harness.advance(0.29)
        self.assertEqual(len(harness.fake.connections), 1)
        self.assertEqual(harness.gateway.health.state("tiny"), State.PROBING)
        harness.advance(0.02)
        self.assertEqual(harness.gateway.health.state("tiny"), State.DOWN)
        self.assertFalse(harness.fake.connections[0].open)
        self.assertEqual(
            harness.gateway.health.why("tiny"), "/health: unreachable: no answer within 0.3 s"
        )
        harness.advance(0.98)
        self.assertEqual(len(harness.fake.connections), 1)
        harness.advance(0.02)
        self.assertEqual(len(harness.fake.connections), 2)

    def test_refused_probe_tells_nothing(self) -> None:
        """A probe the inferproxy refuses at its cap leaves the state as it was."""
        harness = probed_harness()
        harness.advance(0.01)
        refused = Reply(status=503, headers=[(ProxyRefused.HEADER, ProxyRefused.CONNECTIONS)])
        harness.fake.set_default(*HEALTH, refused)
        harness.advance(5.0)
        self.assertEqual(self.probes(harness), 2)
        self.assertEqual(harness.gateway.health.state("tiny"), State.UP)

    def test_no_probe_while_saturated(self) -> None:
        """
        While loopd's requests fill the inferproxy's connection limit no probe is sent (it
        would queue behind them and time out): the state stays, and the probes resume once
        a connection is free.
        """
        limits = dataclasses.replace(LIMITS, liveness_ms=10_000)
        config = make_config(health=HealthProbe(up_interval_ms=1000), limits=limits)
        endpoint = dataclasses.replace(config.endpoints[0], proxy_max_connections=1)
        harness = GatewayHarness(dataclasses.replace(config, endpoints=(endpoint,)))
        harness.fake.set_default(*HEALTH, OK)
        harness.gateway.start()
        harness.advance(0.01)
        harness.fake.script("POST", CHAT, answer({"content": "slow"}, delay_s=1.25))
        connection = harness.post({**HI, "model": "tiny"})
        harness.advance(2.0)
        self.assertEqual(self.probes(harness), 1)
        self.assertEqual(harness.gateway.health.state("tiny"), State.UP)
        harness.advance(2.1)
        self.assertEqual(connection.response().status, 200)
        # The answer said the endpoint is up: the next probe is an up interval after it.
        self.assertEqual(self.probes(harness), 1)
        harness.advance(1.0)
        self.assertEqual(self.probes(harness), 2)

    def test_request_failure_moves_the_probe(self) -> None:
        """An up endpoint put down by a request is probed one down interval later, not 5 s."""
        harness = probed_harness(up_interval_ms=5000, down_interval_ms=1000)
        harness.advance(0.01)
        harness.fake.script("POST", CHAT, Reply(head=b""))
        connection = harness.post({**HI, "model": "tiny"})
        self.assertEqual(connection.response().status, 503)
        self.assertEqual(harness.gateway.health.state("tiny"), State.DOWN)
        harness.advance(0.98)
        self.assertEqual(self.probes(harness), 1)
        harness.advance(0.04)
        self.assertEqual(self.probes(harness), 2)
        self.assertEqual(harness.gateway.health.state("tiny"), State.PROBING)

    def test_stop(self) -> None:
        """Stopping cancels the timers and the probe in flight: nothing is asked after."""
        harness = probed_harness()
        harness.fake.set_default(*HEALTH, dataclasses.replace(OK, headers_delay=math.inf))
        harness.advance(0.01)
        harness.gateway.stop()
        harness.advance(60)
        self.assertFalse(harness.fake.connections[0].open)
        self.assertEqual(self.probes(harness), 1)


class RecoveryTests(SynchronousTestCase):
    """A down endpoint comes back by its probe, and only by it."""

    def test_named_call_retries_while_others_are_refused(self) -> None:
        """
        A named request whose endpoint fails puts it down at its first failed attempt, so a
        request naming it meanwhile is 503 at once; the first request itself still retries
        (there is nowhere else to go) and is answered once the server is back.
        """
        config = make_config(retry=Retry(attempts=3, backoff_ms=(1000,), jitter=0.0))
        harness = GatewayHarness(config)
        harness.fake.script("POST", CHAT, Reply(head=b""), answer({"content": "back"}))
        first = harness.post({**HI, "model": "tiny"})
        harness.advance(0.01)
        self.assertEqual(harness.gateway.health.state("tiny"), State.DOWN)
        second = harness.post({**HI, "model": "tiny"})
        self.assertEqual(second.response().status, 503)
        self.assertEqual(first.responses(), [])
        harness.advance(1.5)
        self.assertEqual(first.response().status, 200)
        self.assertEqual(len(harness.fake.requests_to("POST", CHAT)), 2)

    def test_named_request_then_recovery(self) -> None:
        """
        A named down endpoint is 503 with Retry-After at once; when its server is back the
        next probe makes it probing, and the request is served again.
        """
        harness = probed_harness(down_interval_ms=2000)
        harness.net.stop_listening(PATH)
        harness.advance(0.01)
        connection = harness.post({**HI, "model": "tiny"})
        response = connection.response()
        self.assertEqual((response.status, response.headers["retry-after"]), (503, "2"))
        self.assertEqual(response.json()["error"]["code"], "endpoint_unavailable")
        harness.net.listen(PATH, harness.fake)
        harness.advance(2.0)
        self.assertEqual(harness.gateway.health.state("tiny"), State.PROBING)
        harness.fake.script("POST", CHAT, answer({"content": "back"}))
        connection = harness.post({**HI, "model": "tiny"})
        harness.advance(1)
        self.assertEqual(connection.response().status, 200)
        self.assertEqual(harness.gateway.health.state("tiny"), State.UP)
