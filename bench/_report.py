"""
Small pieces the benchmark scripts share: option parsers, percentiles and goal verdicts.
"""

from __future__ import annotations

import argparse
import math

W = 40
"""Width of the label column."""


def positive(text: str) -> int:
    """Parse a positive integer option."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def non_negative(text: str) -> int:
    """Parse a non-negative integer option."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return value


def percentile(samples: list[int], q: float) -> float:
    """Return the nearest-rank q-quantile (0 < q <= 1) of ns samples, in ms."""
    ordered = sorted(samples)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1] / 1e6


def verdict(value: float, op: str, goal: float) -> str:
    """Say whether value meets its goal (op is ">=" or "<=")."""
    met = value >= goal if op == ">=" else value <= goal
    return f"goal {op} {goal:g}  {'PASS' if met else 'MISS'}"
