"""
The manual's agent recipes: the section "Pointing an agent at loopd" of docs/agents.md
(L{PAGE}), read the way a user reads it, so that the tests of the real agents
(L{test.test_agents_e2e}) configure each agent from the page's own text and the page cannot
drift from what was tested.

Each agent is a C{### Name} heading of that section, one level below the section's own. Its
recipe is the heading's fenced blocks (C{sh}, C{json}, C{toml}), each with the file the prose
names for it (the last C{`~/...`} span before the block), and the turns its prose shows:
inline code with a C{"..."} prompt (C{claude -p "..."}, then C{claude -p --continue "..."}).
L{Recipe.filled} puts a real loopd in place of the page's placeholders: C{127.0.0.1:8080},
C{MODEL}, and C{$LOOPD_TOKEN} in shell lines (which L{exports} and L{commands} expand from the
environment they are given, as the shell would).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["Block", "Recipe", "RecipeError", "commands", "exports", "read_recipes"]

#: The page that holds the recipes, relative to the checkout's root.
PAGE = Path("docs", "agents.md")
#: The section of L{PAGE} that holds the recipes, and the address and model it writes.
SECTION = "## Pointing an agent at loopd"
ADDRESS = "127.0.0.1:8080"
MODEL = "MODEL"
#: The prompt placeholder of a command in the prose.
PROMPT = "..."

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)
_SPAN = re.compile(r"`([^`\n]+)`")
_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


class RecipeError(Exception):
    """The page has no recipe of the shape a test needs: it names what is missing."""


@dataclass(frozen=True)
class Block:
    """
    One fenced block of a recipe.

    @ivar lang: its info string (C{sh}, C{json}, C{toml}).
    @ivar path: the file the prose names for it (a C{~/} path), or None.
    """

    lang: str
    text: str
    path: str | None


@dataclass(frozen=True)
class Recipe:
    """
    One agent's recipe.

    @ivar agent: its heading (C{Claude Code}).
    @ivar prose: the section's text outside its blocks.
    @ivar blocks: its fenced blocks, in order.
    @ivar turns: the commands its prose shows with a C{"..."} prompt, in order.
    """

    agent: str
    prose: str
    blocks: tuple[Block, ...]
    turns: tuple[str, ...]

    def files(self) -> dict[str, str]:
        """
        Its blocks that the prose puts in a file (JSON, TOML), by that file's C{~/} path.

        @raise RecipeError: two blocks name the same file.
        """
        found: dict[str, str] = {}
        for block in self.blocks:
            if block.lang != "sh" and block.path is not None:
                if block.path in found:
                    raise RecipeError(f"{PAGE}: the {self.agent} recipe has two {block.path}")
                found[block.path] = block.text
        return found

    def shell(self) -> str:
        """Its shell blocks, one after the other."""
        return "".join(block.text for block in self.blocks if block.lang == "sh")

    def turn(self, index: int, prompt: str) -> list[str]:
        """
        Its C{index}th command with a C{"..."} prompt, as argv, the prompt in its place.

        @raise RecipeError: it has no such command.
        """
        if index >= len(self.turns):
            raise RecipeError(
                f"{PAGE}: the {self.agent} recipe shows {len(self.turns)} commands with a "
                f'"..." prompt; the test needs #{index + 1}'
            )
        return [prompt if word == PROMPT else word for word in shlex.split(self.turns[index])]

    def filled(self, address: str, model: str) -> Recipe:
        """
        The recipe for a loopd at C{address} (C{host:port}) serving C{model}: every block
        and turn with the page's address and C{MODEL} replaced.
        """

        def fill(text: str) -> str:
            return re.sub(rf"\b{MODEL}\b", model, text.replace(ADDRESS, address))

        return replace(
            self,
            blocks=tuple(replace(b, text=fill(b.text)) for b in self.blocks),
            turns=tuple(fill(c) for c in self.turns),
        )


def read_recipes(page: str | Path) -> dict[str, Recipe]:
    """
    The recipes of the page at C{page} (a path, or its text), by agent heading: the
    headings one level below L{SECTION}'s, up to the next heading of its level or above.

    @raise RecipeError: the page has no such section.
    """
    text = page.read_text(encoding="utf-8") if isinstance(page, Path) else page
    start = text.find(SECTION + "\n")
    if start < 0:
        raise RecipeError(f"{PAGE} has no section {SECTION!r}")
    level = len(SECTION) - len(SECTION.lstrip("#"))
    body = text[start + len(SECTION) :]
    # Headings are looked for outside fenced blocks, where a shell comment is no heading.
    outside = _FENCE.sub(lambda fence: re.sub(r"[^\n]", " ", fence.group(0)), body)
    end = re.search(rf"^#{{1,{level}}} ", outside, re.M)
    if end:
        body, outside = body[: end.start()], outside[: end.start()]
    starts = [m.start() for m in re.finditer(rf"^#{{{level + 1}}} ", outside, re.M)]
    recipes = {}
    for first, last in zip(starts, [*starts[1:], len(body)], strict=True):
        agent, _, rest = body[first + level + 2 : last].partition("\n")
        recipes[agent.strip()] = _recipe(agent.strip(), rest)
    return recipes


def _recipe(agent: str, text: str) -> Recipe:
    """One agent's recipe from the text under its heading."""
    blocks, prose, at = [], [], 0
    for fence in _FENCE.finditer(text):
        before = text[at : fence.start()]
        prose.append(before)
        paths = [s for s in _SPAN.findall("".join(prose)) if s.startswith("~/")]
        blocks.append(Block(fence.group(1), fence.group(2), paths[-1] if paths else None))
        at = fence.end()
    prose.append(text[at:])
    words = "".join(prose)
    spans = [s for s in _SPAN.findall(words) if f'"{PROMPT}"' in s]
    return Recipe(agent, words, tuple(blocks), tuple(spans))


def _expand(word: str, env: Mapping[str, str]) -> str:
    """C{word} with C{$NAME} and C{${NAME}} read from C{env} (unset: empty, as sh does)."""
    return _VARIABLE.sub(lambda m: env.get(m.group(1) or m.group(2), ""), word)


def exports(sh: str, env: Mapping[str, str]) -> dict[str, str]:
    """
    The variables the C{export NAME=VALUE ...} lines of C{sh} set, their values expanded
    from C{env} (and from the lines before them).
    """
    found: dict[str, str] = {}
    for line in sh.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] != ["export"]:
            continue
        for word in words[1:]:
            name, equals, value = word.partition("=")
            if equals:
                found[name] = _expand(value, {**env, **found})
    return found


def commands(sh: str, env: Mapping[str, str]) -> list[list[str]]:
    """The lines of C{sh} that are not exports, as argv, expanded from C{env}."""
    found = []
    for line in sh.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] != "export":
            found.append([_expand(word, env) for word in words])
    return found
