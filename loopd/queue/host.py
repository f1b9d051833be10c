# -*- test-case-name: loopd.test.test_queue_host -*-
"""
The lease scheduler with what it runs on: its policy (from an C{llm-queue.json} and an
optional C{models.json}), its sweep timer, and reloads that keep the last good policy.

Both C{twist loopd} and C{twist llmqueue} need this much; each adds its own listener and
its own way of learning that the config file changed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TextIO

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall

from loopd.queue.policy import (
    DEFAULT_POLICY,
    EMPTY_CATALOG,
    ModelsCatalog,
    Policy,
    load_models_catalog,
    load_policy,
    reload_policy,
)
from loopd.queue.routing import PolicyRouter
from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_types import Grant, QueueEvent

__all__ = ["QueueHost"]


def _ignore(event: QueueEvent) -> None:
    """Drop a log event."""


class QueueHost:
    """
    A scheduler bound to a policy file.

    @ivar policy: the policy in force (the last good one).
    @ivar scheduler: the scheduler, routed through L{policy}.
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
        stderr: TextIO | None = None,
    ) -> None:
        """
        Load the policy and the catalog; problems go to C{stderr} and the defaults apply.

        @param config_path: the C{llm-queue.json}; C{None}: the defaults, never reloaded.
        @param models_json: the provider catalog; C{None}: an empty one.
        @param slot_counts: queue key → its default C{maxStreams} (loopd's endpoints).
        """
        self._reactor = reactor
        self._config_path = config_path
        self._slot_counts = dict(slot_counts or {})
        self._stderr = stderr
        self.catalog: ModelsCatalog = EMPTY_CATALOG
        if models_json is not None:
            self.catalog, problems = load_models_catalog(models_json)
            self._report(problems)
        self.policy: Policy = DEFAULT_POLICY
        if config_path is not None:
            self.policy, problems = load_policy(config_path)
            self._report(problems)
        self.scheduler = Scheduler(reactor, self._router(), on_grant, on_event)
        self._sweep = LoopingCall(self.scheduler.sweep)
        self._sweep.clock = reactor
        self._sweep_seconds = sweep_ms / 1000.0

    def _router(self) -> PolicyRouter:
        return PolicyRouter(self.policy, self.catalog, self._slot_counts)

    def _report(self, problems: tuple[str, ...]) -> None:
        """Print each problem line to stderr, when there is one to print to."""
        if self._stderr is None or not problems:
            return
        for line in problems:
            self._stderr.write(line + "\n")
        self._stderr.flush()

    def reload(self) -> bool:
        """
        Re-read the config file and apply it to the live queues; an invalid or half-written
        file keeps the last good policy (an invalid one prints why).

        @return: whether a different policy is now in force.
        """
        if self._config_path is None:
            return False
        policy, problems = reload_policy(self._config_path, self.policy)
        self._report(problems)
        if policy == self.policy:
            return False
        self.policy = policy
        self.scheduler.reload(self._router())
        return True

    def start(self) -> None:
        """Start the sweep."""
        if not self._sweep.running:
            self._sweep.start(self._sweep_seconds, now=False)

    def stop(self) -> None:
        """Stop the sweep."""
        if self._sweep.running:
            self._sweep.stop()
