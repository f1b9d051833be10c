# -*- test-case-name: loopd.test.test_gateway_chat,loopd.test.test_gateway_mesh -*-
"""
Which slot of an endpoint a session's next request goes to, inside the gateway.

A slot is busy while a request runs on it and, under leases, while another session that
holds a lease on the endpoint calls it home: that session's next turn finds its KV cache
where it left it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["pick_slot"]


def pick_slot(gateway: Any, endpoint: str, session: str, lease_session: str | None = None) -> int:
    """
    The slot of C{endpoint} for C{session}'s next request (L{Sessions.choose_slot} with
    the busy rule above).

    @param gateway: the L{loopd.gateway.site.Gateway}.
    @param session: the key the session's slot history is kept under.
    @param lease_session: the key the session's leases are held under, when it differs
        from C{session}; its own home slots are not reserved against it.
    """
    client = gateway.clients[endpoint]
    # Gates other than SlotGate may not say which slots are taken.
    in_flight = getattr(client.gate, "in_flight", lambda slot: False)
    sessions = gateway.sessions
    own = lease_session if lease_session is not None else session
    reserved: set[int | None] = set()
    if gateway.leases is not None:
        holders = gateway.leases.held_sessions(endpoint)
        reserved = {sessions.last_slot(s) for s in holders if s != own}
    return int(
        sessions.choose_slot(
            session, gateway.slot_count(endpoint), lambda s: s in reserved or in_flight(s)
        )
    )
