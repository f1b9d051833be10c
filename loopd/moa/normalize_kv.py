# -*- test-case-name: loopd.test.test_moa_normalize -*-
"""
The line envelope (reference/mesh-moa.md §1.9 step 2 C{try_kv_parse}) and its removal from a
heuristic payload (C{strip_kv_envelope}).

A worker may answer in lines such as::

    kind: tool_proposal
    tool: read_file
    arguments: {"path": "README.md"}
    confidence: 0.8
    payload: reading the README

Keys are case-sensitive and must start a (trimmed) line; C{payload:} takes the rest of its
line and every later line verbatim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from loopd.moa.normalize_json import loads_strict
from loopd.moa.outcome import Kind

__all__ = ["KvEnvelope", "parse_kv_envelope", "strip_kv_envelope"]

_KINDS = {kind.value: kind for kind in (Kind.TOOL_PROPOSAL, Kind.CRITIQUE, Kind.UNCERTAINTY)}
_HEADER_KEYS = ("kind:", "confidence:", "tool:", "arguments:")
_PAYLOAD = "payload:"
_NO_TOOL = {"", "null", "none"}
# What Rust's f64 parser reads: ASCII decimals, and inf/infinity/nan in any case.
_FLOAT = re.compile(
    r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class KvEnvelope:
    """
    What a line envelope says.

    @ivar kind: the C{kind:} value (an unknown value is an answer).
    @ivar confidence: the C{confidence:} value; NaN and infinities are kept here and
        clamped by L{loopd.moa.outcome.Outcome}.
    @ivar tool: the C{tool:} name.
    @ivar has_arguments: an C{arguments:} line held JSON.
    @ivar arguments: that JSON value.
    @ivar payload: the C{payload:} block, or the fallback text.
    """

    kind: Kind
    confidence: float | None
    tool: str | None
    has_arguments: bool
    arguments: Any
    payload: str


def _lines(text: str) -> list[str]:
    """
    C{text} split into lines at C{\\n}, a trailing C{\\r} dropped from each.
    """
    return [line.removesuffix("\r") for line in text.split("\n")]


def _unquote(value: str) -> str:
    """
    C{value} trimmed of whitespace and of the quotes around it.
    """
    return value.strip().strip("\"'").strip()


def _float(value: str) -> float | None:
    """
    C{value} read as a float as Rust's parser would, or C{None}.
    """
    value = value.strip()
    return float(value) if _FLOAT.fullmatch(value) else None


def parse_kv_envelope(text: str) -> KvEnvelope | None:
    """
    Return the line envelope in C{text}, or C{None} without a C{kind:} line.

    A named tool makes an answer a tool proposal. Without a payload, the payload is the last
    non-empty line before the first key line; if there is none, the text without its key
    lines. (The reference falls back to the whole text, key lines and all, which then reach
    the user and the agreement tokens; the key lines are the envelope, not the answer.)
    """
    lines = _lines(text)
    kind: Kind | None = None
    confidence: float | None = None
    tool: str | None = None
    has_arguments = False
    arguments: Any = None
    payload: str | None = None
    first_key: int | None = None
    for index, raw in enumerate(lines):
        line = raw.strip()
        if not line.startswith((*_HEADER_KEYS, _PAYLOAD)):
            continue
        if first_key is None:
            first_key = index
        key, _, value = line.partition(":")
        if key == "kind":
            kind = _KINDS.get(_unquote(value), Kind.ANSWER)
        elif key == "confidence":
            confidence = _float(value)
        elif key == "tool":
            name = _unquote(value)
            tool = None if name.lower() in _NO_TOOL else name
        elif key == "arguments":
            try:
                arguments, has_arguments = loads_strict(value), True
            except ValueError:
                pass
        else:
            payload = "\n".join([value.lstrip(), *lines[index + 1 :]]).strip()
            break
    if kind is None:
        return None
    if tool is not None and kind is Kind.ANSWER:
        kind = Kind.TOOL_PROPOSAL
    if not payload:
        before = [line.strip() for line in lines[:first_key] if line.strip()]
        payload = before[-1] if before else strip_kv_envelope(text)
    return KvEnvelope(kind, confidence, tool, has_arguments, arguments, payload)


def strip_kv_envelope(text: str) -> str:
    """
    Return C{text} without envelope lines: the C{payload:} block if one is there and not
    empty, else the lines that are not C{kind:}, C{confidence:}, C{tool:} or C{arguments:},
    trimmed; the trimmed text itself if that leaves nothing.
    """
    lines = _lines(text)
    kept = []
    for index, raw in enumerate(lines):
        line = raw.strip()
        if line.startswith(_PAYLOAD):
            block = "\n".join([line[len(_PAYLOAD) :].lstrip(), *lines[index + 1 :]]).strip()
            if block:
                return block
            break
        if not line.startswith(_HEADER_KEYS):
            kept.append(raw)
    rest = "\n".join(kept).strip()
    return rest or text.strip()
