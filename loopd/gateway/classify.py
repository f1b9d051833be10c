# -*- test-case-name: loopd.test.test_gateway_router_classify -*-
"""
The C{auto} router's request classifier (reference/mesh-moa.md §5): a category, a
complexity, whether the request needs tools, and which media it carries, by heuristics on
its text. The signal words are loopd's own (the reference gives only how many each category
has); a C{developer} message counts as system prompt. Malformed parts are skipped, never
raised on. Also L{wants_auto}: whether a request is the router's at all.

Pure: no reactor, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = ["Category", "Classification", "Complexity", "classify", "wants_auto"]

Category = Literal["code", "reasoning", "creative", "image", "tool_call", "info", "chat"]
"""What a request is about; the first matching rule of L{classify} wins."""
Complexity = Literal["quick", "moderate", "deep"]
"""How much work a request looks like."""

# Signal substrings, matched in the lowercased text of every message; a score is the number
# of distinct signals found. The lists are loopd's own (the reference only gives their sizes).
_CODE_SIGNALS = (
    "```", "def ", "function(", "=>", "#include", "import ", "printf", "console.log",
    "stack trace", "traceback", "stderr", "stdout", "compile error", "compiler",
    "syntax error", "segfault", "null pointer", "nullpointer", "refactor", "unit test",
    "debug", "python", "javascript", "typescript", "golang", "rustc", "cargo ", "c++",
    "kotlin", "sql", "regex", "json", "yaml", "bash", "shell script", "npm ", "pip install",
    "dockerfile", "git commit", "source code", "code review",
)  # fmt: skip
_REASONING_SIGNALS = (
    "prove that", "proof", "step by step", "reasoning", "why does", "why is", "explain why",
    "derive", "calculate", "solve for", "solve this", "logic", "puzzle", "equation",
    "theorem", "deduce", "compare and contrast",
)  # fmt: skip
_CREATIVE_SIGNALS = (
    "a story", "short story", "poem", "poetry", "fiction", "lyrics", "song", "screenplay",
    "haiku", "limerick", "creative",
)  # fmt: skip
_INFO_SIGNALS = (
    "what is", "what are", "who is", "who was", "when did", "when was", "where is",
    "definition of", "history of", "meaning of", "how many", "how much", "capital of",
    "population of", "facts about", "tell me about", "explain what",
)  # fmt: skip
_IMAGE_SIGNALS = (
    "image", "picture", "photo of", "photograph", "screenshot", "diagram", "drawing",
    "illustration", "sketch",
)  # fmt: skip
_DEEP_SIGNALS = (
    "in depth", "in-depth", "detailed", "comprehensive", "thorough", "step-by-step",
    "architecture", "design a", "trade-off", "from scratch", "end to end", "end-to-end",
    "deep dive", "research",
)  # fmt: skip
# The system prompt alone makes a request code when it names one of these.
_CODE_SYSTEM_SIGNALS = ("developer", "coding", "programmer")

_VISION_BLOCKS = frozenset({"image_url", "input_image", "image"})
_AUDIO_BLOCKS = frozenset({"audio_url", "input_audio", "audio"})
_FILE_BLOCKS = frozenset({"file", "input_file"})
_TOOL_BLOCKS = frozenset({"tool_use", "tool_result"})
_SYSTEM_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True)
class Classification:
    """What L{classify} found in a request."""

    category: Category
    """The first matching category rule."""
    complexity: Complexity
    """Deep, quick or moderate."""
    needs_tools: bool
    """A non-empty C{tools} array, or a C{tool_use}/C{tool_result} content block."""
    needs_vision: bool = False
    """An image content block (or a block with an image field)."""
    needs_audio: bool = False
    """An audio content block (or a block with an audio field)."""
    has_media: bool = False
    """Any media block at all, files included."""


def wants_auto(body: Mapping[str, object]) -> bool:
    """
    Whether the C{auto} router serves a request: its C{model} is C{"auto"}, or missing,
    C{null} or empty (no model named).
    """
    model = body.get("model")
    return model is None or model == "" or model == "auto"


def _named(value: object, names: frozenset[str]) -> bool:
    """Whether C{value} is one of the strings C{names} (a list or dict never is)."""
    return isinstance(value, str) and value in names


def classify(body: Mapping[str, object]) -> Classification:
    """
    Classify an OpenAI (or Anthropic-style) chat request by heuristics on its text (§5).

    Category, first match wins: code (the system prompt names developer, coding or
    programmer; or code score ≥ 2; or code ≥ 1 with no reasoning and no creative signal),
    reasoning (score ≥ 2), creative (≥ 1), image (vision needed or image score ≥ 1),
    tool_call (tools needed, no code, reasoning or creative signal), info (score ≥ 2 and
    no code signal), else chat. Complexity: deep (a deep signal, a last user message over
    500 bytes, or over 10 messages), quick (last user message under 60 bytes, at most 2
    messages, no reasoning or deep signal), else moderate. Malformed parts are skipped.
    """
    raw = body.get("messages")
    messages = [m for m in raw if isinstance(m, Mapping)] if isinstance(raw, list) else []
    text = "\n".join(t for m in messages for t in _texts(m.get("content"))).lower()
    system = "\n".join(
        t
        for m in messages
        if _named(m.get("role"), _SYSTEM_ROLES)
        for t in _texts(m.get("content"))
    ).lower()
    blocks = [b for m in messages for b in _blocks(m.get("content"))]
    tools = body.get("tools")
    needs_tools = (isinstance(tools, list) and len(tools) > 0) or any(
        _named(b.get("type"), _TOOL_BLOCKS) for b in blocks
    )
    vision = any(
        _named(b.get("type"), _VISION_BLOCKS) or "image_url" in b or "image" in b for b in blocks
    )
    audio = any(
        _named(b.get("type"), _AUDIO_BLOCKS) or "audio_url" in b or "audio" in b for b in blocks
    )
    has_media = vision or audio or any(_named(b.get("type"), _FILE_BLOCKS) for b in blocks)

    code, reasoning, creative = (_score(text, s) for s in _SIGNAL_SETS[:3])
    info, image, deep = (_score(text, s) for s in _SIGNAL_SETS[3:])
    category: Category
    if any(s in system for s in _CODE_SYSTEM_SIGNALS) or code >= 2:
        category = "code"
    elif code >= 1 and reasoning == 0 and creative == 0:
        category = "code"
    elif reasoning >= 2:
        category = "reasoning"
    elif creative >= 1:
        category = "creative"
    elif vision or image >= 1:
        category = "image"
    elif needs_tools and code == reasoning == creative == 0:
        category = "tool_call"
    elif info >= 2 and code == 0:
        category = "info"
    else:
        category = "chat"

    users = [m for m in messages if m.get("role") == "user"]
    last_user = len("".join(_texts(users[-1].get("content"))).encode()) if users else 0
    complexity: Complexity
    if deep >= 1 or last_user > 500 or len(messages) > 10:
        complexity = "deep"
    elif last_user < 60 and len(messages) <= 2 and reasoning == 0 and deep == 0:
        complexity = "quick"
    else:
        complexity = "moderate"
    return Classification(category, complexity, needs_tools, vision, audio, has_media)


_SIGNAL_SETS = tuple(
    map(
        frozenset,
        (_CODE_SIGNALS, _REASONING_SIGNALS, _CREATIVE_SIGNALS)
        + (_INFO_SIGNALS, _IMAGE_SIGNALS, _DEEP_SIGNALS),
    )
)


def _score(text: str, signals: frozenset[str]) -> int:
    """How many distinct signals occur in C{text}."""
    return sum(1 for signal in signals if signal in text)


def _blocks(content: object) -> Iterator[Mapping[str, object]]:
    """The content blocks of a message's content (none for string content)."""
    if isinstance(content, list):
        yield from (block for block in content if isinstance(block, Mapping))


def _texts(content: object) -> Iterator[str]:
    """The text parts of a message's content: the string itself, or each block's C{text}."""
    if isinstance(content, str):
        yield content
        return
    for block in _blocks(content):
        text = block.get("text")
        if isinstance(text, str):
            yield text
