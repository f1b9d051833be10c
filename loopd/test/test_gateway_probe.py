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
from loopd.testing.fake_llama import (
    CHAT,
    LOADING,
    FakeLlama,
    RecordedRequest,
    Reply,
    ReplySource,
    json_reply,
    sse_reply,
)
from loopd.testing.gateway import HI, LIMITS, PATH, GatewayHarness, make_config
from loopd.testing.llama_replies import answer, chunk, template_reply

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


#: The connect retries of the probe's measured case: 2, 8 and 30 s, no jitter.
SLOW_RETRIES = Retry(attempts=4, backoff_ms=(2000, 8000, 30000), jitter=0.0, total_ms=60_000)


def retrying_harness(endpoints: tuple[str, ...] = ("tiny",), up_ms: int = 5000) -> GatewayHarness:
    """
    A gateway with L{SLOW_RETRIES}, its probes started (down every 1 s, up every C{up_ms})
    and every endpoint up after its first probe.
    """
    config = make_config(
        endpoints=endpoints,
        retry=SLOW_RETRIES,
        health=HealthProbe(up_interval_ms=up_ms, down_interval_ms=1000),
    )
    harness = GatewayHarness(config)
    for fake in harness.fakes.values():
        fake.set_default(*HEALTH, OK)
    harness.gateway.start()
    harness.advance(0.01)
    return harness


class GiveUpTests(SynchronousTestCase):
    """
    A request waiting in a retry's backoff hears its endpoint confirmed down by the probe
    and ends at once (issue 26, item 9: before, it waited out 2 + 8 + 30 s for its 503).
    """

    def test_named_request_ends_at_the_failed_probe(self) -> None:
        """
        The server dies: a named request's attempt is refused (the endpoint goes down, the
        retry waits 2 s); the probe 1 s later fails too, and the request is answered 503
        endpoint_unavailable then, not after the whole schedule; one attempt was made.
        """
        harness = retrying_harness()
        harness.net.stop_listening(PATH)
        connection = harness.post({**HI, "model": "tiny"})
        harness.advance(0.5)
        self.assertEqual(harness.gateway.health.state("tiny"), State.DOWN)
        self.assertFalse(harness.gateway.health.confirmed_down("tiny"))
        self.assertEqual(connection.responses(), [])
        harness.advance(0.6)
        self.assertTrue(harness.gateway.health.confirmed_down("tiny"))
        response = connection.response()
        self.assertEqual(response.status, 503)
        self.assertEqual(response.json()["error"]["code"], "endpoint_unavailable")
        self.assertEqual(response.headers["retry-after"], "1")

    def test_a_server_that_answers_the_probe_is_retried(self) -> None:
        """
        The attempt failed but the probe finds the server answering: the retry goes on
        after its backoff, and is answered.
        """
        harness = retrying_harness()
        harness.fake.script("POST", CHAT, Reply(head=b""), answer({"content": "back"}))
        connection = harness.post({**HI, "model": "tiny"})
        harness.advance(1.5)
        self.assertEqual(harness.gateway.health.state("tiny"), State.PROBING)
        self.assertEqual(connection.responses(), [])
        harness.advance(1.0)
        self.assertEqual(connection.response().status, 200)
        self.assertEqual(len(harness.fake.requests_to("POST", CHAT)), 2)

    def test_a_started_answer_keeps_waiting(self) -> None:
        """
        A stream cut after its first piece is resumed, not abandoned: the probe's failure
        while it waits leaves it waiting, and once the server is back its continuation
        completes the stream (a restarting server must not cost the answer).
        """
        harness = retrying_harness()
        harness.fake.set_default("POST", "/apply-template", template_reply())
        cut = sse_reply([chunk({"reasoning_content": "Let me "})], end="cut")
        harness.fake.script("POST", CHAT, cut)
        connection = harness.post({**HI, "model": "tiny", "stream": True})
        harness.advance(0.5)
        harness.net.stop_listening(PATH)
        # The retry at 2 s is refused (down), the probe a second later fails (confirmed).
        harness.advance(3.5)
        self.assertTrue(harness.gateway.health.confirmed_down("tiny"))
        self.assertFalse(connection.response().complete)
        harness.net.listen(PATH, harness.fake)
        harness.fake.script("POST", CHAT, answer({"reasoning_content": "think."}))
        harness.advance(8.0)
        response = connection.response()
        self.assertEqual((response.status, response.complete), (200, True))
        self.assertEqual(response.data()[-1], "[DONE]")

    def test_auto_fails_over_when_its_choice_is_confirmed_down(self) -> None:
        """
        Under C{auto} a stream cut before its first piece (not a sign of a dead server, so
        it is retried) on an endpoint the probe then finds dead fails over to the other
        endpoint at the probe, not after the backoff.
        """
        harness = retrying_harness(("tiny", "big"), up_ms=1000)
        cut: list[str] = []

        def first_cut(name: str) -> ReplySource:
            """The first chat anywhere is cut before its first piece; the others answer."""

            def reply(request: RecordedRequest, fake: FakeLlama) -> Reply:
                if not cut:
                    cut.append(name)
                    return sse_reply([], end="cut")
                return answer({"content": name})

            return reply

        for name, fake in harness.fakes.items():
            fake.set_default("POST", CHAT, first_cut(name))
        connection = harness.post({**HI, "model": "auto"})
        harness.advance(0.1)
        (chosen,) = cut
        (other,) = set(harness.fakes) - {chosen}
        harness.net.stop_listening(harness.config.endpoint(chosen).socket)
        self.assertEqual(connection.responses(), [])
        # The endpoint's next probe (1 s after its first) finds it dead, inside the retry's
        # 2 s wait: the request goes to the other endpoint then.
        harness.advance(0.95)
        self.assertTrue(harness.gateway.health.confirmed_down(chosen))
        harness.advance(0.5)
        response = connection.response()
        self.assertEqual(response.status, 200)
        self.assertEqual(response.json()["model"], other)
        self.assertEqual(len(harness.fakes[chosen].requests_to("POST", CHAT)), 1)
