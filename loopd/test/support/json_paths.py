"""
The paths into a JSON document, for tests that alter one value at a time (the gateway's
request parsing: L{loopd.test.test_gateway_errors}, L{loopd.test.test_doors_chat_read}).
"""

from __future__ import annotations

from typing import Any


def paths(value: object, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of every value inside C{value}, as keys and indexes from the top."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return [prefix]
    return [prefix] + [path for key, child in items for path in paths(child, (*prefix, key))]
