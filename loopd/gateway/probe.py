# -*- test-case-name: loopd.test.test_gateway_probe -*-
"""
The background probe of endpoint health (DESIGN §3 decision 38): one timer per endpoint on
the injected reactor, each asking the endpoint's C{/health} through its llama client
(L{Client.health}: paced like every connection to the endpoint, shared with any check under
way) when the L{HealthBoard} says a probe is due, and telling the board what it found.

At most one probe per endpoint is in flight; the next is scheduled when it ends, one
interval of the endpoint's new state later, so probes never pile up however slow the answer.
A probe with no answer within C{[health] timeout_ms} is cancelled (which closes its
connection) and counts as failed. A probe is not sent while loopd's own connections to the
endpoint fill its inferproxy's connection limit (or wait for the pacing): the endpoint is
busy answering them, and a probe queued behind them would time out and call it down; that
probe counts as refused (no news). When a request outcome moves an endpoint's next probe (an
endpoint that just went down is probed at the down pace), its timer moves with it.
"""

from __future__ import annotations

from collections.abc import Mapping

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from loopd.gateway.health import HealthBoard, ProbeOutcome, State
from loopd.llama import Client, Health

__all__ = ["HealthProbes", "outcome_of"]

_log = Logger(namespace="loopd.gateway.health")


def outcome_of(health: Health) -> ProbeOutcome:
    """What a C{/health} answer means for the board: ok, failed, or refused (busy)."""
    if health.ok:
        return ProbeOutcome.OK
    return ProbeOutcome.BUSY if health.refused else ProbeOutcome.FAILED


class HealthProbes:
    """
    The probes of every endpoint of one gateway; see the module docstring.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        board: HealthBoard,
        clients: Mapping[str, Client],
        timeout: float,
    ) -> None:
        """
        @param reactor: the clock of every probe's timer and timeout.
        @param board: the health states the probes feed.
        @param clients: the llama client of each endpoint, by name (the board's names).
        @param timeout: seconds a probe may take.
        """
        self._reactor = reactor
        self._board = board
        self._clients = clients
        self._timeout = timeout
        self._timers: dict[str, IDelayedCall] = {}
        self._running: dict[str, Deferred[Health]] = {}
        self._started = False
        board.watch(self._changed)

    def start(self) -> None:
        """Schedule every endpoint's first probe (due at once for a new board)."""
        self._started = True
        for name in self._clients:
            self._schedule(name)

    def stop(self) -> None:
        """Cancel every timer and every probe in flight."""
        self._started = False
        timers, self._timers = self._timers, {}
        for timer in timers.values():
            if timer.active():
                timer.cancel()
        running, self._running = self._running, {}
        for probe in running.values():
            probe.cancel()

    def _changed(self, name: str) -> None:
        """Endpoint C{name}'s next probe may have moved: move its timer, unless it is probing."""
        if self._started and name not in self._running:
            self._schedule(name)

    def _schedule(self, name: str) -> None:
        """(Re)arm C{name}'s timer for its next probe."""
        delay = max(0.0, self._board.due(name) - self._reactor.seconds())
        timer = self._timers.get(name)
        if timer is not None and timer.active():
            timer.reset(delay)
            return
        self._timers[name] = self._reactor.callLater(delay, self._probe, name)

    def _probe(self, name: str) -> None:
        """The timer fired: probe C{name}, unless a probe of it is in flight already."""
        self._timers.pop(name, None)
        if not self._board.probe_started(name):
            return
        client = self._clients[name]
        if _saturated(client):
            self._board.probe_ended(name, ProbeOutcome.BUSY, self._reactor.seconds())
            return
        probe = client.health()
        probe.addTimeout(self._timeout, self._reactor)
        self._running[name] = probe
        probe.addErrback(self._no_answer)
        probe.addCallback(self._ended, name, probe)

    def _no_answer(self, reason: Failure) -> Health:
        """A probe that timed out (or was stopped): failed."""
        return Health(False, f"unreachable: no answer within {self._timeout:g} s")

    def _ended(self, health: Health, name: str, probe: Deferred[Health]) -> None:
        """The probe of C{name} ended: tell the board (which schedules the next)."""
        if self._running.get(name) is not probe:
            return  # stopped
        del self._running[name]
        before = self._board.state(name)
        outcome = outcome_of(health)
        self._board.probe_ended(name, outcome, self._reactor.seconds(), health.detail)
        after = self._board.state(name)
        if after is not before:
            log = _log.warn if after is State.DOWN else _log.info
            log(
                "endpoint {endpoint} is {state} (/health: {detail})",
                endpoint=name,
                state=after.value,
                detail=health.detail,
            )


def _saturated(client: Client) -> bool:
    """Whether loopd's own connections fill the endpoint's inferproxy limit, or wait for it."""
    pacer = client.pacer
    return pacer.waiting > 0 or pacer.open_connections >= client.endpoint.proxy_max_connections
