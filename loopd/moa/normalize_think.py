# -*- test-case-name: loopd.test.test_moa_normalize -*-
"""
Thinking blocks in a reply's text: removing them and reading them (reference/mesh-moa.md
§1.8 C{strip_thinking}/C{extract_thinking} and §1.9 step 0 C{strip_thinking_blocks}).

The reference has two strippers: C{worker.rs} knows C{<think>} only and drops orphan
closers; the guardrails one also knows Mistral's C{[THINK]} and keeps orphan closers. Here
one function does both: each complete block of either style goes, an unclosed opener drops
the rest of the text, orphan closers of either style go. The guardrails' "if nothing is left,
keep the original" fallback is not kept: v2 (§6) treats a text that is all thinking as a
reasoning-only reply, a failure, rather than classifying the reasoning.
"""

from __future__ import annotations

import re

__all__ = ["extract_thinking", "strip_thinking"]

_TAG = re.compile(r"<think>|</think>|\[THINK\]|\[/THINK\]")
_CLOSER = {"<think>": "</think>", "[THINK]": "[/THINK]"}


def _split(text: str) -> tuple[str, str]:
    """
    Split C{text} in one pass into what lies outside thinking blocks and what lies inside
    them (each part joined without separators).
    """
    outside: list[str] = []
    inside: list[str] = []
    position = 0
    while True:
        found = _TAG.search(text, position)
        if found is None:
            outside.append(text[position:])
            break
        outside.append(text[position : found.start()])
        tag = found.group()
        closer = _CLOSER.get(tag)
        if closer is None:
            position = found.end()
            continue
        end = text.find(closer, found.end())
        if end == -1:
            inside.append(text[found.end() :])
            break
        inside.append(text[found.end() : end])
        position = end + len(closer)
    return "".join(outside), "".join(inside)


def strip_thinking(text: str) -> str:
    """
    Return C{text} without its thinking, trimmed: complete C{<think>…</think>} and
    C{[THINK]…[/THINK]} blocks are dropped, an unclosed opener drops the rest of the text,
    and orphan closers are dropped.
    """
    return _split(text)[0].strip()


def extract_thinking(text: str) -> str:
    """
    Return the text inside C{text}'s thinking blocks (an unclosed block runs to the end),
    trimmed; empty when there is none.
    """
    return _split(text)[1].strip()
