# -*- test-case-name: loopd.test.test_moa_roles -*-
"""
The mesh worker pool and its roles: canonical names (reference C{mesh-moa.md} §1.2), the size
tier and the role of each worker (§1.4).

Pure functions over names and sizes; the gateway turns its configured, reachable endpoints
into L{Worker} values and calls L{build_pool}, then L{assign_roles}.

Deliberate differences from the reference, each decided by issue 6:

  - An endpoint's configured C{size_b} overrides the name rule: a size below 10 (billion
    parameters) is the small tier, 10 and above the big tier. Exactly 10 is big: v2's
    C{SMALL_TIER_MAX_B} is 10.0 and its rule reads "Big if >= 10 B" (§6), and the name rule
    agrees, since C{Qwen-10B} is not a single-digit-B name.
  - Roles still sort by tier only (v1), not by verified size inside a tier (v2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Final

__all__ = [
    "SMALL_TIER_MAX_B",
    "VIRTUAL_MODEL_NAME",
    "Assignment",
    "Role",
    "Tier",
    "Worker",
    "assign_roles",
    "build_pool",
    "canonical_name",
    "group_aliases",
    "is_single_digit_b_name",
    "is_small_tier",
    "tier_of",
]

VIRTUAL_MODEL_NAME: Final = "mesh"
"""The model name that asks for a mesh turn; it is never a worker."""

SMALL_TIER_MAX_B: Final = 10.0
"""A configured size (billions of parameters) below this is the small tier (v2, §6)."""

_DIGITS: Final = frozenset(b"0123456789")
_NON_ZERO_DIGITS: Final = frozenset(b"123456789")
_LETTERS: Final = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_NOT_BEFORE: Final = _DIGITS | _LETTERS | frozenset(b".")
_B: Final = frozenset(b"bB")
_CANONICAL_KEEP: Final = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_CANONICAL_DROP: Final = ("-gguf", "unsloth/", "meshllm/")


class Role(str, Enum):
    """What a worker is asked to do; the value is the reference's log label (§1.4)."""

    FAST = "fast"
    """The first of the small tier: the shortest context, no native tools, 256 tokens."""
    SPECIALIST = "specialist"
    """Every worker between Fast and Strong: the last 4 messages and tool summaries."""
    STRONG = "strong"
    """The last of the big tier: the deepest context and the native tools."""
    GENERALIST = "generalist"
    """The single worker of a one-model pool; packed as Strong."""
    REDUCER = "reducer"
    """The synthesis call after the workers; never assigned by L{assign_roles}."""


class Tier(str, Enum):
    """The size tier of a model: small models are cheap and fast, big ones capable."""

    SMALL = "small"
    """Under 10 billion parameters, or a single-digit-B name when no size is configured."""
    BIG = "big"
    """Everything else, unknown sizes included (a name without a size is big)."""


@dataclass(frozen=True)
class Worker:
    """One model of the pool: its name and, when configured, its size."""

    name: str
    """The endpoint's name (what sessions use as the model)."""
    size_b: float | None = None
    """Billions of parameters from loopd.toml, or None to use the name rule."""


@dataclass(frozen=True)
class Assignment:
    """A worker with its role and tier, as L{assign_roles} returns it."""

    name: str
    """The worker's name."""
    role: Role
    """What it is asked to do this turn."""
    tier: Tier
    """Its size tier."""


def is_single_digit_b_name(name: str) -> bool:
    """
    Whether C{name} spells a single-digit size in billions: some digit 1-9 that is not
    preceded by an ASCII digit, ASCII letter or C{.}, is followed by C{b} or C{B}, and that
    C{b} is not followed by an ASCII digit (§1.4).

    C{Qwen3-8B} and C{gemma-2-2b-it} are small; C{Qwen3-32B}, C{Qwen2.5-1.5B} (a decimal
    size), C{Qwen3.6-35B-A3B} (C{A3B} follows a letter) and C{foo-2b1-bar} are not. The
    scan is over the UTF-8 bytes, so a non-ASCII character never counts as a letter.
    """
    data = name.encode("utf-8", "surrogatepass")
    for i in range(len(data) - 1):
        if data[i] not in _NON_ZERO_DIGITS or data[i + 1] not in _B:
            continue
        if i > 0 and data[i - 1] in _NOT_BEFORE:
            continue
        if i + 2 < len(data) and data[i + 2] in _DIGITS:
            continue
        return True
    return False


def is_small_tier(name: str, size_b: float | None = None) -> bool:
    """
    Whether a model is in the small tier: by its configured size when there is one
    (C{size_b < 10}; exactly 10 is big), else by L{is_single_digit_b_name}. A size that
    is not a number (NaN) counts as not configured.
    """
    if size_b is not None and not math.isnan(size_b):
        return size_b < SMALL_TIER_MAX_B
    return is_single_digit_b_name(name)


def tier_of(name: str, size_b: float | None = None) -> Tier:
    """The L{Tier} of a model, by the rule of L{is_small_tier}."""
    return Tier.SMALL if is_small_tier(name, size_b) else Tier.BIG


def assign_roles(workers: Sequence[Worker]) -> tuple[Assignment, ...]:
    """
    Give each worker of the pool its role (§1.4), in pool order.

    No worker: nothing. One: a L{Role.GENERALIST}. Two or more: the workers are
    stable-sorted small tier first, big tier last, keeping the given order inside a tier;
    the first is L{Role.FAST}, the last L{Role.STRONG}, every other one a
    L{Role.SPECIALIST}. With several big models Strong is therefore the last of them in
    pool order (quirk 9 of §7: the reducer ladder starts with the first). The result is in
    that sorted order.
    """
    tiers = [tier_of(worker.name, worker.size_b) for worker in workers]
    if len(workers) == 1:
        return (Assignment(workers[0].name, Role.GENERALIST, tiers[0]),)
    order = sorted(range(len(workers)), key=lambda i: tiers[i] is Tier.BIG)
    last = len(order) - 1
    assignments = []
    for position, i in enumerate(order):
        if position == 0:
            role = Role.FAST
        elif position == last:
            role = Role.STRONG
        else:
            role = Role.SPECIALIST
        assignments.append(Assignment(workers[i].name, role, tiers[i]))
    return tuple(assignments)


def canonical_name(name: str) -> str:
    """
    The canonical base name that identifies aliases of one model (§1.2): lowercase; from an
    C{@} up to, not including, the next C{:} (or to the end when none follows) is deleted;
    C{-gguf}, C{unsloth/} and C{meshllm/} are deleted; then only ASCII letters and digits
    are kept. C{unsloth/Qwen3-8B-GGUF:Q4_K_M} and C{Qwen3-8B-Q4_K_M} are both
    C{qwen38bq4km}.
    """
    text = name.lower()
    at = text.find("@")
    if at >= 0:
        colon = text.find(":", at + 1)
        text = text[:at] + (text[colon:] if colon >= 0 else "")
    for part in _CANONICAL_DROP:
        text = text.replace(part, "")
    return "".join(char for char in text if char in _CANONICAL_KEEP)


def group_aliases(
    names: Iterable[str], *, local: Callable[[str], bool] = lambda name: False
) -> tuple[tuple[str, ...], ...]:
    """
    The names grouped by L{canonical_name} (§1.2 steps 1-3): C{mesh} and exact duplicates
    are dropped; inside a group the aliases run locally served first (C{local(name)}), then
    shorter first (in UTF-8 bytes), then in code point order; the groups are sorted by
    their first alias.
    """
    groups: dict[str, list[str]] = {}
    for name in dict.fromkeys(names):
        if name != VIRTUAL_MODEL_NAME:
            groups.setdefault(canonical_name(name), []).append(name)
    ordered = [
        tuple(sorted(aliases, key=lambda name: (not local(name), _byte_length(name), name)))
        for aliases in groups.values()
    ]
    return tuple(sorted(ordered, key=lambda aliases: aliases[0]))


def _byte_length(name: str) -> int:
    """The length of a name in UTF-8 bytes, as the reference measures it."""
    return len(name.encode("utf-8", "surrogatepass"))


def build_pool(
    workers: Iterable[Worker],
    *,
    reachable: Callable[[str], bool] = lambda name: True,
    local: Callable[[str], bool] = lambda name: False,
) -> tuple[Worker, ...]:
    """
    The worker pool (§1.2 steps 1-4): at most one worker per canonical name, the first
    alias of its group (L{group_aliases} order) that is C{reachable}, in group order. A
    group with no reachable alias contributes nothing. When two workers share a name the
    first one's size is kept.

    Pure: reachability is the caller's knowledge, passed in as a predicate. The pool may
    have fewer than 2 workers; what then happens is the caller's decision (v2 and issue 6:
    a single worker serves the request alone).
    """
    by_name: dict[str, Worker] = {}
    for worker in workers:
        by_name.setdefault(worker.name, worker)
    pool = []
    for aliases in group_aliases(by_name, local=local):
        for name in aliases:
            if reachable(name):
                pool.append(by_name[name])
                break
    return tuple(pool)
