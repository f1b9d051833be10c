# -*- test-case-name: loopd.test.test_gateway_status -*-
"""
C{GET /v1/status}: the one document of the gateway's live state (DESIGN decision 48), behind
the status page, C{loopd status} and the tests. docs/status.md documents every field.

It joins what the gateway knows now (each endpoint's health and slots, the lease queues,
the requests under way) with what its L{StatusBoard} kept (the sessions' figures, the last
requests, the hour's series). A slot is C{running} while a request runs on it, C{grace}
while the session it served last holds its lease on the endpoint (its next turn comes
first), else C{idle}. No prompt or answer text is ever in it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from loopd import __version__
from loopd.gateway.health import HealthBoard
from loopd.gateway.leases import GatewayLeases
from loopd.gateway.status_board import StatusBoard
from loopd.settings import Config

__all__ = ["StatusHost", "status_document"]


class StatusHost(Protocol):
    """What the status document reads of a gateway."""

    @property
    def config(self) -> Config:
        """The endpoints, in config order."""

    @property
    def health(self) -> HealthBoard:
        """Each endpoint's health."""

    @property
    def leases(self) -> GatewayLeases | None:
        """The lease scheduler's gateway side; C{None} without leases."""

    @property
    def board(self) -> StatusBoard:
        """What the gateway kept of its past."""

    def slot_count(self, endpoint: str) -> int:
        """How many slots C{endpoint} has."""


def status_document(
    host: StatusHost, now: float, wall_now: float, started: float
) -> dict[str, Any]:
    """
    The status document of C{host}.

    @param now: the reactor's time (for the ages of the requests under way).
    @param wall_now: the wall clock's time (the series ends with its minute).
    @param started: the wall clock's time loopd started at.
    """
    board = host.board
    leases = host.leases
    under_way = board.under_way()
    totals = board.totals.as_json("")
    del totals["id"], totals["agent"], totals["anonymous"], totals["last_seen"], totals["home"]
    del totals["turns"]
    return {
        "loopd": {"version": __version__, "started": started, "now": wall_now},
        "endpoints": [_endpoint(host, e.name, e.kind, e.model) for e in host.config.endpoints],
        "sessions": board.session_list(),
        "leases": _leases(leases),
        "in_flight": [_under_way(r, now, leases is not None) for r in under_way],
        "mesh_turns": sum(1 for r in under_way if r.mesh),
        "requests": board.recent(),
        "totals": {"requests": board.requests, **totals},
        "series": board.series(wall_now),
    }


def _endpoint(host: StatusHost, name: str, kind: str, model: str | None) -> dict[str, Any]:
    """One endpoint's entry: health, measured speeds and slots."""
    board = host.board
    held: Callable[[str], bool]
    if host.leases is not None:
        holders = host.leases.held_sessions(name)
        held = holders.__contains__
    else:
        held = _nobody
    slots = []
    for slot in range(host.slot_count(name)):
        running, session, holder, cached = board.slot(name, slot)
        state = "running" if running else "grace" if holder and held(holder) else "idle"
        slots.append({"id": slot, "state": state, "session": session, "tokens_cached": cached})
    prompt_speed, generation_speed = board.speeds(name)
    return {
        "name": name,
        "kind": kind,
        "model": model or name,
        "health": host.health.state(name).value,
        "why": host.health.why(name) or None,
        "prompt_tokens_per_second": _rounded(prompt_speed),
        "generation_tokens_per_second": _rounded(generation_speed),
        "slots": slots,
    }


def _leases(leases: GatewayLeases | None) -> list[dict[str, Any]] | None:
    """The lease queues (holders, waiters, who is ahead), as C{/v1/queue} gives them."""
    if leases is None or leases.scheduler is None:
        return None
    return list(leases.scheduler.status())


def _under_way(record: Any, now: float, leasing: bool) -> dict[str, Any]:
    """
    A request under way: who, what, where, for how long, and its calls (a call waits for
    its lease only when the gateway leases).
    """
    return {
        "id": record.id,
        "door": record.door,
        "session": record.session or None,
        "agent": record.agent,
        "model": record.model,
        "mesh": record.mesh,
        "seconds": round(now - record.started, 3),
        "calls": [
            {
                "endpoint": c.endpoint,
                "role": c.role,
                "slot": c.slot,
                "waiting_for_lease": leasing
                and c.leased is None
                and c.sent is None
                and c.ended is None,
                "ended": c.ended is not None,
            }
            for c in record.calls
        ],
    }


def _nobody(holder: str) -> bool:
    """No lease is held by anyone (a gateway without leases)."""
    return False


def _rounded(value: float | None) -> float | None:
    """A speed to one decimal, or C{None}."""
    return None if value is None else round(value, 1)
