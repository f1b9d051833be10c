# -*- test-case-name: loopd.test.test_queue_host -*-
"""
The lease scheduler with what it runs on: its policy (from an C{llm-queue.json} and an
optional C{models.json}), its sweep timer, and reloads that keep the last good policy.

Both C{twist loopd} and C{twist llmqueue} need this much; each adds its own listener and
its own way of learning that the config file changed.

Which queues are named (L{QueueHost.names}) is decided here: those stay when idle, and every
other queue a client's key created is forgotten once it has no holder and no waiter, so keys
invented by clients cost nothing for long (only their switch counts rest, in the scheduler's
bounded table, L{loopd.queue.scheduler_rest}).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Literal

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall

from loopd.queue.catalog import EMPTY_CATALOG, ModelsCatalog, load_models_catalog
from loopd.queue.policy import DEFAULT_POLICY, Policy, load_policy, reload_policy
from loopd.queue.routing import PolicyRouter
from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_types import Grant, QueueEvent

__all__ = ["QueueHost", "ReloadOutcome"]


def _ignore(event: QueueEvent) -> None:
    """Drop a log event."""


ReloadOutcome = Literal["applied", "unchanged", "rejected"]
"""What a reload did: a new policy in force, the same one, or a bad file ignored."""


class QueueHost:
    """
    A scheduler bound to a policy file.

    @ivar policy: the policy in force (the last good one).
    @ivar catalog: the models catalog, read once.
    @ivar scheduler: the scheduler, routed through L{policy}.
    @ivar problems: what was wrong with the config file and the catalog at load, one line
        each, for the owner to print (the defaults, or an empty catalog, apply).
    @ivar config_invalid: whether the config file was unusable at load.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        on_grant: Callable[[Grant], None],
        *,
        config_path: str | None = None,
        models_json: str | None = None,
        slot_counts: Mapping[str, int] | None = None,
        sweep_ms: int = 1000,
        on_event: Callable[[QueueEvent], None] = _ignore,
    ) -> None:
        """
        Load the policy and the catalog, and build the scheduler.

        @param config_path: the C{llm-queue.json}; C{None}: the defaults, never reloaded.
        @param models_json: the provider catalog; C{None}: an empty one.
        @param slot_counts: queue key → its default C{maxStreams} (loopd's endpoints).
        @param sweep_ms: the sweep period, once L{start}ed.
        """
        self.config_path = config_path
        self._slot_counts = dict(slot_counts or {})
        self.catalog: ModelsCatalog = EMPTY_CATALOG
        catalog_problems: tuple[str, ...] = ()
        if models_json is not None:
            self.catalog, catalog_problems = load_models_catalog(models_json)
        self.policy: Policy = DEFAULT_POLICY
        config_problems: tuple[str, ...] = ()
        if config_path is not None:
            self.policy, config_problems = load_policy(config_path)
        self.config_invalid = bool(config_problems)
        self.problems = config_problems + catalog_problems
        self.scheduler = Scheduler(reactor, self._router(), on_grant, on_event, keep=self.names)
        self._sweep = LoopingCall(self.scheduler.sweep)
        self._sweep.clock = reactor
        self._sweep_seconds = sweep_ms / 1000.0

    def log_path(self) -> str | None:
        """
        Return the event log's path under the policy in force (C{logFile}, C{~} expanded),
        or C{None}; read per event, so a reload can turn the log on, off or move it.
        """
        path = self.policy.defaults.log_file
        return None if path is None else os.path.expanduser(path)

    def names(self, queue_key: str) -> bool:
        """
        Return whether the queue C{queue_key} is named, so it stays when nobody holds or
        waits for it: a key of the policy in force (an entry or a group), an endpoint of
        loopd's, or an endpoint whose settings come from a provider's entry through the
        catalog. Every other queue is forgotten once empty (the scheduler's keep rule).
        """
        policy = self.policy
        if queue_key in self._slot_counts or policy.entry(queue_key) is not None:
            return True
        return any(policy.entry(name) is not None for name in self.catalog.providers_at(queue_key))

    def _router(self) -> PolicyRouter:
        """
        A router over the policy in force, the catalog and loopd's slot counts; built afresh
        for the scheduler at start and at every applied reload.
        """
        return PolicyRouter(self.policy, self.catalog, self._slot_counts)

    def reload(self) -> tuple[ReloadOutcome, tuple[str, ...]]:
        """
        Re-read the config file and apply it to the live queues (holders and waiters move
        with their queue); an invalid or half-written file keeps the last good policy, a
        deleted one is the defaults.

        @return: what happened, and the problems of an invalid file (a half-written one
            has none: it is ignored silently).
        """
        if self.config_path is None:
            return "unchanged", ()
        policy, problems = reload_policy(self.config_path, self.policy)
        if problems:
            return "rejected", problems
        if policy == self.policy:
            return "unchanged", ()
        self.policy = policy
        self.scheduler.reload(self._router())
        return "applied", ()

    def start(self) -> None:
        """Start the sweep."""
        if not self._sweep.running:
            self._sweep.start(self._sweep_seconds, now=False)

    def stop(self) -> None:
        """Stop the sweep."""
        if self._sweep.running:
            self._sweep.stop()
