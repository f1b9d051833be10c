"""
Tests for L{loopd.gateway.health}: which failures say an endpoint is down, the up / down /
probing state machine (by example and by hypothesis over event sequences), the pace of
its probes, C{Retry-After} and the 503 it answers for.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.errors import (
    Busy,
    Connect,
    Http,
    LoadTimeout,
    Protocol,
    ProxyRefused,
    Stalled,
    StreamClosedEarly,
    WaitTimeout,
)
from loopd.gateway.health import (
    EndpointUnavailableError,
    HealthBoard,
    ProbeOutcome,
    ProbePace,
    State,
    describe,
    means_down,
)
from loopd.settings import HealthProbe

PACE = ProbePace(up=5.0, down=1.0)
LOADING = '{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'


def board(*names: str, now: float = 0.0) -> HealthBoard:
    """A board over C{names} (default: C{tiny}) at L{PACE}."""
    return HealthBoard(names or ("tiny",), PACE, now)


def probed(health: HealthBoard, now: float = 0.0) -> HealthBoard:
    """C{health} after a successful first probe of each endpoint at C{now}."""
    for name in health.states():
        health.probe_started(name)
        health.probe_ended(name, ProbeOutcome.OK, now)
    return health


class MeansDownTests(SynchronousTestCase):
    """Which failures of a request put its endpoint down."""

    def test_down(self) -> None:
        """No connection, a close before the headers, a 502 or a 503 that is not loading."""
        for error in (
            Connect("connection refused"),
            StreamClosedEarly("closed", before_headers=True),
            Http(502, "bad gateway"),
            Http(503, '{"error":{"message":"unavailable"}}'),
        ):
            self.assertTrue(means_down(error), error)

    def test_not_down(self) -> None:
        """
        A refusal by the inferproxy (busy), a 503 while the model loads, an answer cut in its
        body, any other status, a timeout, a stall or a broken protocol: the server is there.
        """
        for error in (
            ProxyRefused(ProxyRefused.CONNECTIONS, 1.0),
            Http(503, LOADING),
            StreamClosedEarly("closed during the body"),
            Http(500, "oops"),
            Http(400, "bad"),
            Http(429, "slow down"),
            WaitTimeout("busy"),
            LoadTimeout("loading"),
            Stalled("quiet"),
            Protocol("junk"),
            Busy("full"),
            ValueError("a bug"),
        ):
            self.assertFalse(means_down(error), error)

    def test_describe_names_no_path(self) -> None:
        """A connect failure is described by its kind, not by its socket's path."""
        error = Connect("connection refused", path="/secret/infer.sock")
        self.assertEqual(describe(error), "connection refused")
        self.assertEqual(describe(Http(502, "x" * 100)), "HTTP 502")


class TransitionTests(SynchronousTestCase):
    """The state machine, step by step."""

    def test_starts_probing_with_a_probe_due(self) -> None:
        """Every endpoint starts probing (it takes requests), its first probe due at once."""
        health = board("tiny", "big", now=7.0)
        self.assertEqual(health.states(), {"tiny": State.PROBING, "big": State.PROBING})
        self.assertTrue(health.eligible("tiny"))
        self.assertEqual(health.due("tiny"), 7.0)
        self.assertEqual(health.why("tiny"), "not probed yet")

    def test_request_failure_puts_down_at_once(self) -> None:
        """A failure that means down: down now, the next probe at the down pace."""
        health = board()
        health.probe_started("tiny")
        health.probe_ended("tiny", ProbeOutcome.OK, 0.0)
        health.probe_ended("tiny", ProbeOutcome.OK, 0.5)
        self.assertEqual((health.state("tiny"), health.due("tiny")), (State.UP, 5.5))
        self.assertTrue(health.request_failed("tiny", Connect("connection refused"), 2.0))
        self.assertEqual(health.state("tiny"), State.DOWN)
        self.assertFalse(health.eligible("tiny"))
        self.assertEqual(health.due("tiny"), 3.0)
        self.assertEqual(health.why("tiny"), "connection refused")

    def test_second_failure_not_news(self) -> None:
        """A failure while down changes nothing and is not reported as going down."""
        health = probed(board())
        health.request_failed("tiny", Connect("refused"), 0.0)
        self.assertFalse(health.request_failed("tiny", Connect("refused again"), 0.5))
        self.assertEqual((health.due("tiny"), health.why("tiny")), (1.0, "refused"))

    def test_busy_failure_changes_nothing(self) -> None:
        """A refusal by the inferproxy leaves the endpoint as it was."""
        health = board()
        self.assertFalse(health.request_failed("tiny", ProxyRefused("connections"), 0.0))
        self.assertEqual(health.state("tiny"), State.PROBING)

    def test_recovery_only_by_probe(self) -> None:
        """
        Down → probing on a successful probe → up on the next (or on an answered request);
        an answered request does not lift down by itself.
        """
        health = board()
        health.request_failed("tiny", Connect("refused"), 0.0)
        health.request_answered("tiny", 0.1)
        self.assertEqual(health.state("tiny"), State.DOWN)
        health.probe_started("tiny")
        health.probe_ended("tiny", ProbeOutcome.OK, 1.0, "ok")
        self.assertEqual((health.state("tiny"), health.due("tiny")), (State.PROBING, 2.0))
        self.assertEqual(health.why("tiny"), "/health: ok")
        health.request_answered("tiny", 1.5)
        self.assertEqual(health.state("tiny"), State.UP)

    def test_answer_defers_the_up_probe(self) -> None:
        """An answered request of an up endpoint moves its next probe an up interval on."""
        health = probed(board())
        self.assertEqual(health.due("tiny"), 5.0)
        heard: list[str] = []
        health.watch(heard.append)
        health.request_answered("tiny", 3.0)
        self.assertEqual((health.due("tiny"), heard), (8.0, ["tiny"]))
        health.request_failed("tiny", Connect("refused"), 4.0)
        health.request_answered("tiny", 4.5)
        self.assertEqual((health.state("tiny"), health.due("tiny")), (State.DOWN, 5.0))

    def test_probe_failure_puts_down(self) -> None:
        """A failed probe puts an up endpoint down; a refused one tells nothing."""
        health = board()
        health.probe_ended("tiny", ProbeOutcome.OK, 0.0)
        health.probe_ended("tiny", ProbeOutcome.BUSY, 5.0, "refused by its inferproxy: x")
        self.assertEqual((health.state("tiny"), health.due("tiny")), (State.UP, 10.0))
        health.probe_ended("tiny", ProbeOutcome.FAILED, 10.0, "HTTP 503")
        self.assertEqual((health.state("tiny"), health.due("tiny")), (State.DOWN, 11.0))
        self.assertEqual(health.why("tiny"), "/health: HTTP 503")

    def test_one_probe_in_flight(self) -> None:
        """A second probe is refused while one is in flight, allowed once it has ended."""
        health = board()
        self.assertTrue(health.probe_started("tiny"))
        self.assertFalse(health.probe_started("tiny"))
        health.probe_ended("tiny", ProbeOutcome.OK, 0.2)
        self.assertTrue(health.probe_started("tiny"))

    def test_listeners_hear_changes(self) -> None:
        """A listener hears each change of an endpoint's state or next probe."""
        health = board("tiny", "big")
        heard: list[str] = []
        health.watch(heard.append)
        health.request_failed("big", Connect("refused"), 0.0)
        health.request_failed("big", Connect("refused"), 0.1)
        health.probe_ended("tiny", ProbeOutcome.OK, 0.2)
        self.assertEqual(heard, ["big", "tiny"])

    def test_pace_from_settings(self) -> None:
        """The pace is [health]'s intervals in seconds."""
        settings = HealthProbe(up_interval_ms=4000, down_interval_ms=250)
        self.assertEqual(ProbePace.from_settings(settings), ProbePace(4.0, 0.25))


class ConfirmedTests(SynchronousTestCase):
    """Down, and found down by a probe since: the sign a waiting retry gives up on."""

    def test_a_request_failure_alone_is_not_confirmed(self) -> None:
        """A request's failure puts the endpoint down; only a failed probe confirms it."""
        health = probed(board())
        health.request_failed("tiny", Connect("refused"), 1.0)
        self.assertFalse(health.confirmed_down("tiny"))
        health.probe_started("tiny")
        health.probe_ended("tiny", ProbeOutcome.BUSY, 2.0)
        self.assertFalse(health.confirmed_down("tiny"))
        health.probe_started("tiny")
        health.probe_ended("tiny", ProbeOutcome.FAILED, 3.0)
        self.assertTrue(health.confirmed_down("tiny"))

    def test_a_probe_that_answers_clears_it(self) -> None:
        """Once a probe answers the endpoint is probing, and a new fall starts unconfirmed."""
        health = probed(board())
        health.probe_started("tiny")
        health.probe_ended("tiny", ProbeOutcome.FAILED, 1.0)
        self.assertTrue(health.confirmed_down("tiny"))
        health.probe_started("tiny")
        health.probe_ended("tiny", ProbeOutcome.OK, 2.0)
        self.assertFalse(health.confirmed_down("tiny"))
        health.request_failed("tiny", Connect("refused"), 3.0)
        self.assertFalse(health.confirmed_down("tiny"))

    def test_listeners_hear_the_confirming_probe(self) -> None:
        """The failed probe that confirms a down endpoint is told to the listeners."""
        health = probed(board())
        health.request_failed("tiny", Connect("refused"), 1.0)
        heard: list[bool] = []
        health.watch(lambda name: heard.append(health.confirmed_down(name)))
        health.probe_started("tiny")
        health.probe_ended("tiny", ProbeOutcome.FAILED, 2.0)
        self.assertEqual(heard, [True])


class UnavailableTests(SynchronousTestCase):
    """C{Retry-After} and the 503 body."""

    def test_retry_after_until_next_probe(self) -> None:
        """Whole seconds until the next probe, rounded up, at least 1."""
        health = probed(HealthBoard(("tiny",), ProbePace(up=5.0, down=3.0), 0.0), 9.5)
        health.request_failed("tiny", Connect("refused"), 10.0)
        self.assertEqual(health.retry_after("tiny", 10.0), 3)
        self.assertEqual(health.retry_after("tiny", 10.5), 3)
        self.assertEqual(health.retry_after("tiny", 11.2), 2)
        self.assertEqual(health.retry_after("tiny", 13.0), 1)
        self.assertEqual(health.retry_after("tiny", 20.0), 1)

    def test_one_endpoint(self) -> None:
        """One endpoint: 503 endpoint_unavailable naming it and why."""
        health = board()
        health.request_failed("tiny", Connect("connection refused"), 0.0)
        error = health.unavailable(["tiny"], 0.0)
        self.assertIsInstance(error, EndpointUnavailableError)
        self.assertEqual(
            error.body(),
            {
                "error": {
                    "message": "endpoint tiny is down: connection refused; retry after 1 s",
                    "type": "server_error",
                    "code": "endpoint_unavailable",
                    "param": None,
                }
            },
        )
        self.assertEqual((error.status, error.retry_after), (503, 1))

    def test_several(self) -> None:
        """Several: each named with why; Retry-After the soonest of their probes."""
        health = probed(HealthBoard(("a", "b"), ProbePace(up=5.0, down=4.0), 0.0))
        health.request_failed("a", Connect("refused"), 0.0)
        health.request_failed("b", Http(502, "bad gateway"), 2.0)
        error = health.unavailable(["a", "b"], 2.0)
        self.assertEqual(
            error.message,
            "every candidate endpoint is down (a: refused; b: HTTP 502); retry after 2 s",
        )
        self.assertEqual(
            health.unavailable(["a", "b"], 3.5).message,
            "every candidate endpoint is down (a: refused; b: HTTP 502); retry after 1 s",
        )


#: One event of the state machine: a request outcome, or a probe's start and end.
events = st.one_of(
    st.tuples(st.just("failed"), st.sampled_from(["connect", "busy", "loading", "closed"])),
    st.tuples(st.just("answered"), st.none()),
    st.tuples(st.just("probe"), st.sampled_from(list(ProbeOutcome))),
)
ERRORS = {
    "connect": Connect("refused"),
    "busy": ProxyRefused("connections"),
    "loading": Http(503, LOADING),
    "closed": StreamClosedEarly("closed", before_headers=True),
}


class PropertyTests(SynchronousTestCase):
    """Invariants over any sequence of events."""

    @given(st.lists(st.tuples(events, st.floats(0, 10)), max_size=40))
    def test_invariants(self, steps: list[tuple[tuple[str, object], float]]) -> None:
        """
        Only a successful probe leaves down, and only to probing; a failure that means down
        always ends in down; a busy refusal or a loading 503 never changes the state; the
        next probe is never more than one interval of the state away, and Retry-After is at
        least 1 and at most the down interval rounded up.
        """
        health = board()
        now = 0.0
        for (kind, what), gap in steps:
            now += gap
            before = health.state("tiny")
            if kind == "failed":
                assert isinstance(what, str)
                health.request_failed("tiny", ERRORS[what], now)
                if what in ("connect", "closed"):
                    self.assertEqual(health.state("tiny"), State.DOWN)
                else:
                    self.assertEqual(health.state("tiny"), before)
            elif kind == "answered":
                health.request_answered("tiny", now)
                expected = State.UP if before is State.PROBING else before
                self.assertEqual(health.state("tiny"), expected)
            else:
                assert isinstance(what, ProbeOutcome)
                self.assertTrue(health.probe_started("tiny"))
                health.probe_ended("tiny", what, now)
                if before is State.DOWN and health.state("tiny") is not State.DOWN:
                    self.assertEqual((what, health.state("tiny")), (ProbeOutcome.OK, State.PROBING))
            after = health.state("tiny")
            if health.confirmed_down("tiny"):
                self.assertIs(after, State.DOWN)
            interval = PACE.up if after is State.UP else PACE.down
            self.assertLessEqual(health.due("tiny"), now + interval)
            if after is State.DOWN:
                self.assertGreaterEqual(health.retry_after("tiny", now), 1)
                self.assertLessEqual(health.retry_after("tiny", now), 1)
