# -*- test-case-name: loopd.test.test_gateway_mesh -*-
"""
The gateway's side of a mesh turn's upstream calls: the worker pool from the configured
endpoints, and one worker or reducer call (issue 6, DESIGN §3 decisions 28 and 29).

Each call takes a C{child}-tier lease on its endpoint's queue for the session (when the
gateway leases), picks the session's slot there, and goes through the endpoint's robust
llama client (its slot gate, bounded waits and retries, but for a refused connection: a
worker whose endpoint is down fails at once, DESIGN decision 29, rather than hold the turn
through the client's backoff). The client streams upstream; the
call's result is the finished reply as a C{chat.completion} body, which is what the mesh
normalizer reads. An HTTP 429 fails the call with L{RateLimited} (and its C{Retry-After}),
which the fan-out retries once. Cancelling a call withdraws its lease wait or aborts its
request, closing the upstream connection.

An endpoint whose socket could not be connected to is left out of the pool for
L{RECHECK_S} seconds, then tried again; any answer from it puts it back at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Final

from twisted.internet.defer import CancelledError, Deferred
from twisted.python.failure import Failure

from loopd.errors import Connect, Http
from loopd.gateway.classify import classify
from loopd.gateway.render import completion_json
from loopd.gateway.router import media_filter
from loopd.gateway.slot_choice import pick_slot
from loopd.gateway.translate import parse_document
from loopd.llama.retry import is_retryable
from loopd.llama.types import ChatEvent, Completion
from loopd.moa.fanout import RateLimited
from loopd.moa.roles import Worker, build_pool

__all__ = ["RECHECK_S", "MeshCalls", "Reachability", "mesh_pool"]

RECHECK_S: Final = 30.0
"""Seconds an endpoint that refused a connection stays out of the mesh pool."""

CHILD: Final = "child"
"""The lease tier of every mesh call: the session's own requests go first."""


class Reachability:
    """
    Which endpoints the mesh may count on: those that have not failed to connect within
    the last C{recheck} seconds.
    """

    def __init__(self, recheck: float = RECHECK_S) -> None:
        """
        @param recheck: seconds an endpoint stays out after a connection failure.
        """
        self._recheck = recheck
        self._down_since: dict[str, float] = {}

    def failed(self, name: str, now: float) -> None:
        """Endpoint C{name} could not be connected to at C{now}."""
        self._down_since[name] = now

    def answered(self, name: str) -> None:
        """Endpoint C{name} answered: it is reachable."""
        self._down_since.pop(name, None)

    def up(self, name: str, now: float) -> bool:
        """Whether C{name} counts as reachable at C{now}."""
        since = self._down_since.get(name)
        return since is None or now - since >= self._recheck


def mesh_pool(gateway: Any, document: Mapping[str, object]) -> tuple[Worker, ...]:
    """
    The mesh's workers for the request C{document} now: every configured endpoint that
    takes the request's images or audio (C{vision}, C{audio}, as for C{auto}) and counts
    as reachable, deduplicated by canonical name (L{build_pool}). When none counts as
    reachable, every endpoint that takes the media is tried again rather than none.

    @raise loopd.gateway.router.MediaUnsupportedError: no endpoint takes the media (400).
    """
    takes = {c.name for c in media_filter(gateway.router.candidates, classify(document))}
    workers = [Worker(e.name, e.size_b) for e in gateway.config.endpoints if e.name in takes]
    now = gateway.reactor.seconds()
    pool = build_pool(workers, reachable=lambda name: gateway.reachability.up(name, now))
    return pool if pool else build_pool(workers)


class MeshCalls:
    """
    The upstream calls of one mesh turn, for one session.
    """

    def __init__(self, gateway: Any, session: str, final: bool = False) -> None:
        """
        @param gateway: the L{loopd.gateway.site.Gateway}.
        @param session: the session the turn belongs to (its lease key).
        @param final: the session said this is its last request (C{X-Session-End}).
        """
        self._gateway = gateway
        self._session = session
        self._final = final

    def call(self, name: str, body: dict[str, Any]) -> Deferred[Any]:
        """
        Send C{body} (an OpenAI chat request) to endpoint C{name}; fire with the reply's
        C{chat.completion} body. See the module docstring for leases, 429 and cancelling.
        """
        return _Call(self._gateway, self._session, self._final, name, body).start()


class _Call:
    """One upstream call: lease, slot, the client's request, the lease back."""

    def __init__(
        self, gateway: Any, session: str, final: bool, name: str, body: dict[str, Any]
    ) -> None:
        self._gateway = gateway
        self._lease_session = session
        # The slot history is kept per endpoint: a mesh session calls several at once.
        self._slot_session = f"{session} mesh:{name}"
        self._final = final
        self._name = name
        self._body = body
        self._hold: Any = None
        self._step: Deferred[Any] | None = None
        self._slot = -1
        self._result: Deferred[Any] = Deferred(self._cancel)

    def start(self) -> Deferred[Any]:
        leases = self._gateway.leases
        if leases is None:
            self._go()
        else:
            self._step = leases.acquire(self._name, self._lease_session, CHILD)
            self._step.addCallbacks(self._leased, self._failed)
        return self._result

    def _leased(self, hold: Any) -> None:
        self._step = None
        self._hold = hold
        if self._result.called:
            self._give_back()
            return
        self._go()

    def _go(self) -> None:
        try:
            chat = parse_document(self._body).chat
        except Exception:
            self._failed(Failure())
            return
        gateway = self._gateway
        self._slot = pick_slot(gateway, self._name, self._slot_session, self._lease_session)
        chat = replace(chat, slot=self._slot, template_thinking=True)
        client = gateway.clients[self._name]
        self._step = client.chat_with_retry(chat, _ignore, _retry_but_connect)
        self._step.addCallbacks(self._answered, self._failed)

    def _answered(self, completion: Completion) -> None:
        self._step = None
        self._give_back()
        gateway, name = self._gateway, self._name
        gateway.reachability.answered(name)
        gateway.metrics.observe_completion(name, completion.timings)
        gateway.record_speed(name, completion.timings.predicted_per_second)
        gateway.sessions.record(
            self._slot_session, self._slot, completion.timings, gateway.config.cache_loss_tokens
        )
        if not self._result.called:
            body = completion_json(completion, completion_id=completion.id, model=name, created=0)
            self._result.callback(body)

    def _failed(self, reason: Failure) -> None:
        self._step = None
        self._give_back()
        if self._result.called:
            return
        if reason.check(Connect):
            self._gateway.reachability.failed(self._name, self._gateway.reactor.seconds())
        elif isinstance(reason.value, Http) and reason.value.status == 429:
            reason = Failure(RateLimited(reason.value.retry_after))
        elif not reason.check(CancelledError) and isinstance(reason.value, Http):
            self._gateway.reachability.answered(self._name)
        self._result.errback(reason)

    def _cancel(self, result: Deferred[Any]) -> None:
        step, self._step = self._step, None
        if step is not None:
            step.cancel()
        self._give_back()

    def _give_back(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            self._gateway.leases.done(hold, self._final)


def _retry_but_connect(error: BaseException) -> bool:
    """
    The robust client's retries, but for a refused connection: a worker whose endpoint is
    down has failed at once (DESIGN decision 29), so the turn does not wait on its backoff.
    """
    return not isinstance(error, Connect) and is_retryable(error)


def _ignore(event: ChatEvent) -> None:
    """A mesh call's own events (queued, retrying ...) stay inside the turn."""
