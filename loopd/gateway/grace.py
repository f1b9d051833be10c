# -*- test-case-name: loopd.test.test_gateway_grace -*-
"""
What a session's grace is worth (DESIGN §3 decision 37): the pure rule and what it learns.

The grace is a bet that the session's next turn comes before a re-prefill would cost more
than the waiting. While nobody waits for the slot, a session keeps it for the whole grace;
once a request waits, the holder keeps it only until the slot has idled beside that request
for the holder's expected re-prefill time (L{release_at}, the ski-rental rule: a slot never
idles beside a waiter longer than the switch would have cost):

    expected re-prefill = context tokens / prompt tokens per second x cache-loss share

 - B{context tokens}: the holder's last completion on the endpoint, C{prompt_n + cache_n +
   predicted_n} (L{Timings.total}): what the server would evaluate again if the session came
   back to a slot that lost it.
 - B{prompt tokens per second}: the endpoint's measured prefill speed, from the
   C{prompt_per_second} of its completions that evaluated at least L{MIN_PROMPT_TOKENS}
   tokens (a shorter prompt's time is the batch's overhead, not its throughput), averaged
   with their token counts as weights and the older ones fading by L{SPEED_WEIGHT} a sample.
 - B{cache-loss share}: of the endpoint's returning sessions, the share that lost their
   cache (the session table's L{CacheOutcome}), over the last L{LOSS_WINDOW}. A server
   whose host-RAM prompt cache restores a switched-out session shows hits here, so the
   share is small and a switch cheap; one without shows losses, and the grace is kept.

A B{returning session} is a completion of a session that had a completion on the endpoint
before (the table returned an outcome) and ran on a slot whose last completion was another
session's (or none): only then could the server have lost the session's cache. A session
that kept its slot always hits, and says nothing about the server's caches.

B{Before anything is measured} (a fresh endpoint): prompt speed
L{PRIOR_PROMPT_TOKENS_PER_SECOND} (a small CPU machine; faster hardware makes the first
graces longer than they are worth, never shorter), replaced by the first sample. The loss
share is B{learned first}: until L{LEARN_SAMPLES} returning sessions were seen it is unknown
(C{None}) and a switch is priced at nothing, so a waiter takes the slot as soon as the
holder's request ends. Only switches show what a switch costs (loopd cannot see the server's
C{--cache-ram}); a grace priced as a loss while learning would, on one slot whose sessions
come back within their re-prefill time, never let a switch happen and so never learn, and
on a server whose RAM cache makes switches free it would idle the slot beside every waiter.
Learning costs one re-prefill for each session switched out while it lasts (where the
server loses switched-out sessions), once per endpoint and start.

Pure: no reactor, no I/O; times are passed in (seconds).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from loopd.llama.info import CacheOutcome
from loopd.llama.types import Timings

__all__ = [
    "LEARN_SAMPLES",
    "LOSS_WINDOW",
    "MIN_PROMPT_TOKENS",
    "PRIOR_PROMPT_TOKENS_PER_SECOND",
    "SPEED_WEIGHT",
    "EndpointCosts",
    "PrefillSpeed",
    "SwitchCosts",
    "release_at",
]

#: The prompt speed of an endpoint with no sample yet, in tokens per second.
PRIOR_PROMPT_TOKENS_PER_SECOND: Final = 1000.0
#: How many returning sessions an endpoint must show before its loss share is known.
LEARN_SAMPLES: Final = 2
#: How many of the latest returning sessions the loss share is taken over.
LOSS_WINDOW: Final = 32
#: The weight of each new speed sample (the older ones keep the rest).
SPEED_WEIGHT: Final = 0.2
#: The fewest evaluated prompt tokens whose speed is a sample.
MIN_PROMPT_TOKENS: Final = 32


class PrefillSpeed:
    """
    An endpoint's measured prompt speed (module docstring): the prompt tokens its
    completions evaluated over the seconds the server says they took, each completion that
    evaluated at least L{MIN_PROMPT_TOKENS} at a known speed counted, the older ones fading
    by L{SPEED_WEIGHT} a sample, so a long prompt weighs as much as its tokens.

    @ivar samples: how many completions were counted.
    """

    def __init__(self) -> None:
        """No sample yet."""
        self._tokens = 0.0
        self._seconds = 0.0
        self.samples = 0

    def add(self, timings: Timings) -> None:
        """Take C{timings}' prompt speed as a sample when it is one."""
        speed = timings.prompt_per_second
        if speed is None or not 0 < speed < math.inf or timings.prompt_n < MIN_PROMPT_TOKENS:
            return
        keep = 1.0 - SPEED_WEIGHT
        self._tokens = self._tokens * keep + timings.prompt_n
        self._seconds = self._seconds * keep + timings.prompt_n / speed
        self.samples += 1

    @property
    def value(self) -> float | None:
        """Tokens per second; C{None} before a sample."""
        return self._tokens / self._seconds if self._seconds > 0 else None


@dataclass
class EndpointCosts:
    """
    One endpoint's learned figures.

    @ivar speed: its measured prompt speed.
    @ivar losses: the latest returning sessions' outcomes, C{True} for a loss, oldest first.
    @ivar occupants: each slot's session of its last completion.
    """

    losses: deque[bool] = field(default_factory=lambda: deque(maxlen=LOSS_WINDOW))
    occupants: dict[int, str] = field(default_factory=dict)
    speed: PrefillSpeed = field(default_factory=PrefillSpeed)

    @property
    def speed_samples(self) -> int:
        """How many prompt speeds were measured."""
        return self.speed.samples

    @property
    def prompt_tokens_per_second(self) -> float:
        """The measured prefill speed, or the prior before any sample."""
        measured = self.speed.value
        return PRIOR_PROMPT_TOKENS_PER_SECOND if measured is None else measured

    @property
    def loss_share(self) -> float | None:
        """
        The share of the latest returning sessions that lost their cache; C{None} while
        fewer than L{LEARN_SAMPLES} were seen (still learning).
        """
        seen = len(self.losses)
        if seen < LEARN_SAMPLES:
            return None
        return sum(self.losses) / seen

    def reprefill_seconds(self, context_tokens: int) -> float:
        """
        The expected cost, in seconds, of switching out a session of C{context_tokens}:
        nothing while the loss share is still learned.

        @raise ValueError: C{context_tokens} is negative.
        """
        if context_tokens < 0:
            raise ValueError(f"context_tokens must be >= 0, got {context_tokens}")
        share = self.loss_share
        if share is None:
            return 0.0
        return context_tokens / self.prompt_tokens_per_second * share

    def observe_speed(self, timings: Timings) -> None:
        """Take C{timings}' prompt speed as a sample when it is one (module docstring)."""
        self.speed.add(timings)


class SwitchCosts:
    """
    Every endpoint's L{EndpointCosts}, learned from the completions the gateway accounts.
    """

    def __init__(self) -> None:
        """No endpoint measured yet."""
        self._endpoints: dict[str, EndpointCosts] = {}

    def observe(
        self,
        endpoint: str,
        slot: int,
        session: str,
        timings: Timings,
        outcome: CacheOutcome | None,
    ) -> None:
        """
        Learn from one completion of C{session} on C{endpoint}'s C{slot}.

        @param outcome: its cache outcome against the session's previous completion
            (L{loopd.gateway.sessions.Sessions.record}), C{None} for a session's first.
        """
        costs = self._endpoints.setdefault(endpoint, EndpointCosts())
        costs.observe_speed(timings)
        if outcome is not None and costs.occupants.get(slot) != session:
            costs.losses.append(outcome.loss)
        costs.occupants[slot] = session

    def costs(self, endpoint: str) -> EndpointCosts:
        """C{endpoint}'s figures; the priors (a fresh, unstored record) when it has none."""
        return self._endpoints.get(endpoint) or EndpointCosts()

    def endpoints(self) -> list[str]:
        """The endpoints with something learned, in the order they were first seen."""
        return list(self._endpoints)

    def reprefill_seconds(self, endpoint: str, context_tokens: int) -> float:
        """L{EndpointCosts.reprefill_seconds} of C{endpoint}."""
        return self.costs(endpoint).reprefill_seconds(context_tokens)


def release_at(
    grace_began: float,
    grace_ends: float,
    waiting_since: float | None,
    reprefill_seconds: float,
) -> float:
    """
    When a holder in its grace gives its slot back.

    The slot idles beside a waiter from the later of the grace's start and the wait's: a
    request that waited through the holder's last turn is not owed that turn, which was
    work, not the grace.

    @param grace_began: when its grace began (its last request ended).
    @param grace_ends: when its grace (C{grace_ms} after that) ends.
    @param waiting_since: when the longest-waiting request for its slot began to wait;
        C{None} when nobody waits.
    @param reprefill_seconds: its expected re-prefill time (L{EndpointCosts.reprefill_seconds}).
    @return: the grace's end while nobody waits, else the earlier of it and the moment the
        slot has idled beside the waiter for the expected re-prefill time (which may be
        past: give it back now).
    """
    if waiting_since is None:
        return grace_ends
    return min(grace_ends, max(grace_began, waiting_since) + reprefill_seconds)
