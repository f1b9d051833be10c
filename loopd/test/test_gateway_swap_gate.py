"""
Tests for L{loopd.gateway.swap_gate}: a request for a router's model waits at its router's
gate on the reactor's clock, its client told it is queued; the evicted model's sessions are
saved before the evicting request goes; the load time is learned; and, through the gateway,
two agents on two models of a one-model router are grouped, each one's cache saved and
restored across the swap, and never starved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.swap_gate import PRIOR_LOAD_SECONDS, ModelSwaps, RouterStart, router_starts
from loopd.llama.router import model_endpoints
from loopd.llama.types import ChatEvent, Queued, Timings
from loopd.settings import Endpoint
from loopd.testing.fake_llama import CHAT, SlotFiles
from loopd.testing.gateway import HI, GatewayHarness, make_config
from loopd.testing.llama_replies import answer
from loopd.testing.reactor import MemoryLoopdReactor

ROUTER = Endpoint(name="gpu", socket="/tmp/ld-gw/gpu.sock", kind="llama-server-router")
A, B = model_endpoints(ROUTER, ["a", "b"])
PLAIN = Endpoint(name="tiny", socket="/tmp/ld-gw/tiny.sock")


class GateCase(SynchronousTestCase):
    """A one-model router with a loaded, a 30 s bound and a 5 s grace."""

    reprefill = 100.0

    def setUp(self) -> None:
        self.reactor = MemoryLoopdReactor()
        self.evicted: list[str] = []
        self.saving: Deferred[None] | None = None
        self.swaps = ModelSwaps(
            self.reactor,
            {"gpu": RouterStart(1, ("a",), 30_000)},
            5_000,
            lambda endpoint: self.reprefill,
            self.before_evict,
        )
        self.events: list[ChatEvent] = []

    def before_evict(self, endpoint: str) -> Deferred[None]:
        """Record the model evicted; hold the request until C{saving} fires, if set."""
        self.evicted.append(endpoint)
        return self.saving if self.saving is not None else succeed(None)

    def admit(self, endpoint: Endpoint) -> Deferred[Hashable]:
        """Ask for C{endpoint}, its events recorded."""
        return self.swaps.admit(endpoint, self.events.append)


class GateTests(GateCase):
    """The gate on the clock."""

    def test_not_a_router_model(self) -> None:
        """An endpoint that is no router's model passes at once."""
        self.assertIsNone(self.successResultOf(self.admit(PLAIN)))

    def test_waits_then_evicts(self) -> None:
        """
        b waits while a is mid-task (told it is queued), then goes when a's grace is over,
        after a's sessions were saved.
        """
        key = self.successResultOf(self.admit(A))
        self.reactor.advance(1.0)
        self.swaps.done(A, key, None)
        waiting = self.admit(B)
        self.assertNoResult(waiting)
        self.assertEqual(self.events, [Queued(ahead=0)])
        self.reactor.advance(4.9)
        self.assertNoResult(waiting)
        self.reactor.advance(0.1)
        self.successResultOf(waiting)
        self.assertEqual(self.evicted, ["a"])
        self.assertEqual(self.swaps.board("gpu").loaded, ("b",))

    def test_goes_when_the_saves_end(self) -> None:
        """The evicting request goes only once the evicted model's sessions are saved."""
        self.saving = Deferred()
        waiting = self.admit(B)
        self.assertNoResult(waiting)
        self.assertEqual(self.evicted, ["a"])
        self.saving.callback(None)
        self.successResultOf(waiting)

    def test_held_while_saving(self) -> None:
        """
        A request for the model being loaded, let go while the evicted model's saves run,
        waits for them too: sent sooner, it would make the router swap before the saves
        reached it (and the saves would load the evicted model again).
        """
        self.saving = Deferred()
        evicting = self.admit(B)
        following = self.admit(B)
        self.assertEqual(self.swaps.board("gpu").in_flight("b"), 2)
        self.assertNoResult(evicting)
        self.assertNoResult(following)
        self.saving.callback(None)
        self.successResultOf(evicting)
        self.successResultOf(following)
        self.assertEqual(self.evicted, ["a"])

    def test_cancel_while_held(self) -> None:
        """A request cancelled while held for the saves ends: it is no longer in flight."""
        self.saving = Deferred()
        evicting = self.admit(B)
        following = self.admit(B)
        following.cancel()
        self.failureResultOf(following, CancelledError)
        self.assertEqual(self.swaps.board("gpu").in_flight("b"), 1)
        evicting.cancel()
        self.failureResultOf(evicting, CancelledError)
        self.assertEqual(self.swaps.board("gpu").in_flight("b"), 0)
        self.saving.callback(None)
        self.successResultOf(self.admit(B))

    def test_cancel_withdraws(self) -> None:
        """A cancelled wait leaves the board; the next request is not behind it."""
        key = self.successResultOf(self.admit(A))
        waiting = self.admit(B)
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
        self.assertEqual(self.swaps.board("gpu").waiting(), ())
        self.swaps.done(A, key, None)
        self.successResultOf(self.admit(A))

    def test_bound(self) -> None:
        """
        a's session runs turn after turn (each 0.5 s, 0.5 s apart) and a swap is dearer than
        any wait: b waits, a's turns pass it, until b has waited the 30 s bound; then a's
        next turn waits, the one running ends, and b goes.
        """
        running = self.successResultOf(self.admit(A))
        waiting = self.admit(B)
        held = None
        while not waiting.called:
            self.reactor.advance(0.5)
            self.swaps.done(A, running, None)
            self.reactor.advance(0.5)
            turn = self.admit(A)
            if not turn.called:
                held = turn
                break
            running = self.successResultOf(turn)
        self.assertEqual(self.reactor.seconds(), 30.0)
        self.swaps.done(A, running, None)
        self.successResultOf(waiting)
        assert held is not None
        self.assertNoResult(held)

    def test_stop(self) -> None:
        """Stopping cancels the waits and leaves no timer behind."""
        key = self.successResultOf(self.admit(A))
        self.swaps.done(A, key, None)
        waiting = self.admit(B)
        self.assertTrue(self.reactor.getDelayedCalls())
        self.swaps.stop()
        self.failureResultOf(waiting, CancelledError)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_load_time_learned(self) -> None:
        """A request that loaded its model: its time less the server's is the load time."""
        self.assertEqual(self.swaps.load_seconds["gpu"], PRIOR_LOAD_SECONDS)
        key = self.successResultOf(self.admit(B))
        self.reactor.advance(12.0)
        timings = Timings(
            prompt_n=100, prompt_per_second=50.0, predicted_n=10, predicted_per_second=10.0
        )
        self.swaps.done(B, key, timings)
        self.assertEqual(self.swaps.load_seconds["gpu"], 9.0)

    def test_router_starts(self) -> None:
        """Each router its models come from, with the bound its models inherited."""
        slow = dataclasses.replace(ROUTER, swap_wait_ms=5000)
        starts = router_starts([*model_endpoints(slow, ["a"]), PLAIN], {"gpu": 2}, {"gpu": ["a"]})
        self.assertEqual(starts, {"gpu": RouterStart(2, ("a",), 5000)})


class CheapSwapTests(GateCase):
    """A swap that costs little is not waited for."""

    reprefill = 0.0

    def test_cheap_swap(self) -> None:
        """Price = load time (5 s prior) + nothing: b waits 5 s although a stays mid-task."""
        key = self.successResultOf(self.admit(A))
        self.swaps.done(A, key, None)
        self.swaps._boards["gpu"].grace = 60.0  # a stays mid-task throughout
        waiting = self.admit(B)
        self.reactor.advance(4.9)
        self.assertNoResult(waiting)
        self.reactor.advance(0.1)
        self.successResultOf(waiting)


def two_model_harness(slot_save: bool = True) -> tuple[GatewayHarness, dict[str, SlotFiles]]:
    """
    A gateway over a router's models a and b (a fake each; one model loaded at once, a
    loaded), with leases, a 2 s grace, one slot each and slot files.
    """
    config = make_config(slots=1)
    base = dataclasses.replace(config.endpoints[0], slot_save=slot_save, swap_wait_ms=20_000)
    router = dataclasses.replace(base, name="gpu", kind="llama-server-router")
    a, b = model_endpoints(router, ["a", "b"])
    b = dataclasses.replace(b, socket="/tmp/ld-gw/b.sock")
    config = dataclasses.replace(config, endpoints=(a, b))
    harness = GatewayHarness(
        config,
        leases=True,
        grace_ms=2000,
        router_starts={"gpu": RouterStart(1, ("a",), 20_000)},
    )
    files = {name: SlotFiles(fake, 1) for name, fake in harness.fakes.items()}
    return harness, files


class GatewayTests(SynchronousTestCase):
    """Two agents on two models of a one-model router, through the gateway."""

    def turn(self, harness: GatewayHarness, model: str, session: str) -> Any:
        """Start one turn of C{session} on C{model}."""
        harness.fakes[model].script(
            "POST",
            CHAT,
            answer({"content": model}, timings={"cache_n": 0, "prompt_n": 900, "predicted_n": 2}),
        )
        return harness.post({**HI, "model": model}, session=session)

    def test_grouped_saved_and_restored(self) -> None:
        """
        s1 on a, then s2 asks b: s2 waits while s1 is in its grace and s1's next turn goes
        first; when s1's grace ends, a's slot is saved and b is loaded for s2; s1's next
        turn then waits for b's grace, and a's slot file is restored before it runs.
        """
        harness, files = two_model_harness()
        first = self.turn(harness, "a", "s1")
        harness.advance(0.5)
        files["a"].tokens[0] = 900
        self.assertEqual(first.response().status, 200)
        second = self.turn(harness, "b", "s2")
        harness.advance(0.5)
        self.assertEqual(second.responses(), [])
        again = self.turn(harness, "a", "s1")
        harness.advance(0.5)
        self.assertEqual(again.response().status, 200)
        self.assertEqual(second.responses(), [])
        harness.advance(3.0)
        self.assertEqual(second.response().status, 200)
        self.assertEqual(files["a"].actions, [("save", 0, files["a"].actions[0][2])])
        # Then a was unloaded by name, so that b's load evicts a and nothing else.
        (unload,) = harness.fakes["a"].requests_to("POST", "/models/unload")
        self.assertEqual(unload.json, {"model": "a"})
        board = harness.gateway.upstreams.swaps.board("gpu")  # type: ignore[union-attr]
        self.assertEqual((board.loaded, board.swaps), (("b",), 1))
        scraped = harness.scrape()
        self.assertEqual(scraped[("loopd_router_swaps_total", frozenset({("router", "gpu")}))], 1.0)
        self.assertEqual(
            scraped[("loopd_router_swap_waiting", frozenset({("router", "gpu")}))], 0.0
        )
        back = self.turn(harness, "a", "s1")
        harness.advance(3.0)
        self.assertEqual(back.response().status, 200)
        self.assertEqual([a for a, _, _ in files["a"].actions], ["save", "restore"])
        self.assertEqual(board.swaps, 2)

    def test_never_starved(self) -> None:
        """s1 keeps a busy without a pause; s2's request for b goes at the 20 s bound."""
        harness, _ = two_model_harness(slot_save=False)
        waiting = None
        for step in range(60):
            turn = self.turn(harness, "a", "s1")
            if step == 1:
                waiting = self.turn(harness, "b", "s2")
            harness.advance(0.5)
            if waiting is not None and waiting.responses():
                break
            self.assertEqual(turn.response().status, 200) if step < 38 else None
        assert waiting is not None
        self.assertEqual(waiting.response().status, 200)
        self.assertLessEqual(harness.reactor.seconds(), 21.0)
