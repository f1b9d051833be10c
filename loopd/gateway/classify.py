# -*- test-case-name: loopd.test.test_gateway_classify -*-
"""
The C{auto} router's request classifier (reference/mesh-moa.md §5): a category, a
complexity, whether the request needs tools, and which media it carries, by heuristics on
its text. The signal words are loopd's own (the reference gives only how many each category
has); a C{developer} message counts as system prompt (the front door made it one).

It reads the checked request (L{GatewayRequest}), so nothing malformed reaches it; a
request's media are the image and audio parts of its user turns.

Pure: no reactor, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from loopd.gateway.request import GatewayRequest
from loopd.llama.types import Assistant, ChatMessage, System, Tool, User

__all__ = ["Category", "Classification", "Complexity", "classify"]

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


@dataclass(frozen=True)
class Classification:
    """What L{classify} found in a request."""

    category: Category
    """The first matching category rule."""
    complexity: Complexity
    """Deep, quick or moderate."""
    needs_tools: bool
    """The request offers tools."""
    needs_vision: bool = False
    """A user turn carries an image."""
    needs_audio: bool = False
    """A user turn carries audio."""
    has_media: bool = False
    """It carries any media at all."""


def classify(request: GatewayRequest) -> Classification:
    """
    Classify a chat request by heuristics on its text (§5).

    Category, first match wins: code (the system prompt names developer, coding or
    programmer; or code score ≥ 2; or code ≥ 1 with no reasoning and no creative signal),
    reasoning (score ≥ 2), creative (≥ 1), image (vision needed or image score ≥ 1),
    tool_call (tools needed, no code, reasoning or creative signal), info (score ≥ 2 and
    no code signal), else chat. Complexity: deep (a deep signal, a last user message over
    500 bytes, or over 10 messages), quick (last user message under 60 bytes, at most 2
    messages, no reasoning or deep signal), else moderate.
    """
    messages = request.messages
    text = "\n".join(t for m in messages for t in _texts(m)).lower()
    system = "\n".join(t for m in messages if isinstance(m, System) for t in _texts(m)).lower()
    needs_tools = bool(request.tools)
    modalities = request.modalities
    vision, audio = "vision" in modalities, "audio" in modalities

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

    users = [m for m in messages if isinstance(m, User)]
    last_user = len(users[-1].content.encode()) if users else 0
    complexity: Complexity
    if deep >= 1 or last_user > 500 or len(messages) > 10:
        complexity = "deep"
    elif last_user < 60 and len(messages) <= 2 and reasoning == 0 and deep == 0:
        complexity = "quick"
    else:
        complexity = "moderate"
    return Classification(category, complexity, needs_tools, vision, audio, vision or audio)


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


def _texts(message: ChatMessage) -> Iterator[str]:
    """
    The texts of a message: its content, or for a user turn with media each text part as
    sent; an assistant turn without content has none.
    """
    if isinstance(message, User) and message.parts:
        for part in message.parts:
            text = part.get("text")
            if part.get("type") == "text" and isinstance(text, str):
                yield text
    elif isinstance(message, (System, User, Tool)):
        yield message.content
    elif isinstance(message, Assistant) and message.content is not None:
        yield message.content
