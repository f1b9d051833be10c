# -*- test-case-name: loopd.test.test_moa_normalize -*-
"""
The prose heuristics of the normalizer (reference/mesh-moa.md §1.9 step 3, checks 2-4):
a tool proposal described in words, a critique, an uncertain reply. All matching is on the
lowercased text, by substring.
"""

from __future__ import annotations

from typing import Any

from loopd.moa.normalize_json import (
    extract_json_object,
    normalize_tool_arguments,
    tool_arguments_of,
    tool_name_of,
)

__all__ = [
    "ACTION_PHRASES",
    "CRITIQUE_MARKERS",
    "KNOWN_TOOLS",
    "TOOL_MARKERS",
    "UNCERTAINTY_MARKERS",
    "is_critique",
    "is_uncertain",
    "looks_like_tool_proposal",
    "tool_proposal_parts",
]

#: Phrases that mark a structured tool proposal (unless the text says "i would not").
TOOL_MARKERS = ("tool_call", "function_call", "i would call", "i propose calling", "tool_proposal")

#: The phrase that cancels L{TOOL_MARKERS}.
NEGATED_MARKER = "i would not"

#: Tools a worker may name in prose.
KNOWN_TOOLS = (
    "read_file",
    "edit_file",
    "run_command",
    "search_code",
    "web_search",
    "get_weather",
    "create_file",
    "delete_file",
    "list_files",
)

#: Phrases that, with a known tool named, make prose a tool proposal.
ACTION_PHRASES = (
    "i'll use",
    "i will use",
    "let me use",
    "i need to use",
    "use the",
    "using the",
    "should use",
    "call the",
    "calling",
    "propose",
    "**tool**",
    "tool:",
    "identify the tool",
)

#: Markers of a critique; two of them make one.
CRITIQUE_MARKERS = (
    "however,",
    "but actually",
    "correction:",
    "that's incorrect",
    "this is wrong",
    "i disagree",
    "the correct answer",
    "actually,",
)

#: Markers of an uncertain reply (ASCII apostrophes only); one is enough.
UNCERTAINTY_MARKERS = (
    "i'm not sure",
    "i don't know",
    "uncertain",
    "hard to say",
    "it depends",
    "i cannot determine",
    "insufficient information",
)


def _first_known_tool(lower: str) -> str | None:
    """
    The known tool named earliest in C{lower}, or C{None}.
    """
    found = [(lower.find(tool), tool) for tool in KNOWN_TOOLS if tool in lower]
    return min(found)[1] if found else None


def looks_like_tool_proposal(lower: str) -> bool:
    """
    Whether lowercased text proposes a tool: a structured marker (and no "i would not"), or
    a known tool named together with an action phrase.
    """
    if NEGATED_MARKER not in lower and any(marker in lower for marker in TOOL_MARKERS):
        return True
    return _first_known_tool(lower) is not None and any(
        phrase in lower for phrase in ACTION_PHRASES
    )


def tool_proposal_parts(text: str) -> tuple[str | None, dict[str, Any] | None]:
    """
    Return the tool name and arguments of a prose proposal (C{extract_tool_proposal}, after
    the rescue has found nothing): a JSON object with a tool name in it; else a known tool
    named in the text, with the first JSON object, if any, as its arguments. The name may
    be C{None}.
    """
    found = extract_json_object(text)
    if found is not None:
        name = tool_name_of(found)
        if name is not None:
            return name, normalize_tool_arguments(*tool_arguments_of(found))
    known = _first_known_tool(text.lower())
    if known is None:
        return None, None
    return known, found


def is_critique(lower: str) -> bool:
    """
    Whether lowercased text is a critique: at least two distinct markers.
    """
    return sum(marker in lower for marker in CRITIQUE_MARKERS) >= 2


def is_uncertain(lower: str) -> bool:
    """
    Whether lowercased text is uncertain: any marker.
    """
    return any(marker in lower for marker in UNCERTAINTY_MARKERS)
