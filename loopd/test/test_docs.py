"""
Tests of the manual in docs/ and the README that points to it: the README's copies of the
pages' recipes say what the pages say (the pages' own are the ones the process-level tests
run), its links reach pages that exist, and the Sphinx extension that reads the package's
epytext docstrings as reST (docs/epytext.py) converts what the docstrings use.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

from twisted.trial.unittest import SynchronousTestCase

from loopd.test.support.agent_recipes import PAGE, read_recipes
from loopd.test.support.twist import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)


def blocks(text: str, lang: str) -> list[str]:
    """The text of every fenced block of C{text} whose info string is C{lang}, in order."""
    return [m.group(2) for m in _FENCE.finditer(text) if m.group(1) == lang]


def set_up_block(path: Path) -> str:
    """The first C{sh} block after the line C{# Set up} or C{## Set up} of C{path}."""
    text = path.read_text(encoding="utf-8")
    found = re.search(r"^#{1,2} Set up\n", text, re.M)
    assert found is not None, f"{path} has no Set up section"
    return blocks(text[found.end() :], "sh")[0]


def load_epytext() -> ModuleType:
    """docs/epytext.py, the Sphinx extension, imported from its file (it needs no Sphinx)."""
    spec = importlib.util.spec_from_file_location("docs_epytext", DOCS / "epytext.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ReadmeTests(SynchronousTestCase):
    """
    The README's short versions of the manual's recipes are the manual's, word for word.
    """

    def test_set_up(self) -> None:
        """
        The two set-up commands (the ones .ci/run reads from the README) are those of
        docs/setup.md, and there are two.
        """
        readme = set_up_block(README)
        self.assertEqual(readme, set_up_block(DOCS / "setup.md"))
        self.assertEqual(len(readme.splitlines()), 2)

    def test_claude_code(self) -> None:
        """The README's Claude Code lines are its recipe's shell block, which the tests run."""
        recipe = read_recipes(ROOT / PAGE)["Claude Code"]
        [readme] = [b for b in blocks(README.read_text(), "sh") if "ANTHROPIC_BASE_URL" in b]
        self.assertEqual(readme, recipe.shell())

    def test_sdk(self) -> None:
        """The README's openai SDK program is docs/demo.md's."""
        [readme] = blocks(README.read_text(), "python")
        [page] = blocks((DOCS / "demo.md").read_text(), "python")
        self.assertEqual(readme, page)

    def test_links(self) -> None:
        """Every link of the README into docs/ names a page that exists."""
        links = re.findall(r"\]\((docs/[^)#]+)", README.read_text())
        self.assertTrue(links)
        for link in links:
            self.assertTrue((ROOT / link).is_file(), link)

    def test_every_page_is_in_the_index(self) -> None:
        """Every page of docs/ is in docs/index.md's tables of contents."""
        index = (DOCS / "index.md").read_text()
        listed = set(re.findall(r"^([\w-]+)$", index, re.M))
        pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
        self.assertEqual(pages - listed, set())


class EpytextTests(SynchronousTestCase):
    """
    docs/epytext.py turns the epytext of loopd's docstrings into reST.
    """

    def setUp(self) -> None:
        self.epytext = load_epytext()

    def test_inline(self) -> None:
        """
        C{C}, C{L} (with and without a text), C{I} and C{B} become reST's literal,
        cross-reference, emphasis and strong; braces nest.
        """
        convert = self.epytext.convert_inline
        self.assertEqual(convert("a C{x} b"), "a ``x`` b")
        self.assertEqual(convert("C{{'a': {}}}"), "``{'a': {}}``")
        self.assertEqual(convert("see L{Client.chat}."), "see :py:obj:`Client.chat`.")
        self.assertEqual(
            convert("L{the client <loopd.llama.Client>}"),
            ":py:obj:`the client <loopd.llama.Client>`",
        )
        self.assertEqual(convert("I{not} B{C{x}}"), "*not* **``x``**")

    def test_touching_words(self) -> None:
        """Markup that touches a word gets the escaped space reST needs; punctuation does not."""
        convert = self.epytext.convert_inline
        self.assertEqual(convert("C{Deferred}s"), "``Deferred``\\ s")
        self.assertEqual(convert("re-C{x}, (C{y})"), "re-``x``, (``y``)")
        self.assertEqual(convert("aC{x}"), "aC{x}")

    def test_fields(self) -> None:
        """Epytext fields become a reST field list, after a blank line."""
        lines = [
            "Do it.",
            "@param reactor: the reactor",
            "    to use.",
            "@return: C{None}.",
            "@raise ValueError: when not.",
            "@ivar x: an attribute.",
        ]
        self.assertEqual(
            self.epytext.convert_lines(lines),
            [
                "Do it.",
                "",
                ":param reactor: the reactor",
                "    to use.",
                ":returns: ``None``.",
                ":raises ValueError: when not.",
                ":ivar x: an attribute.",
            ],
        )

    def test_list_after_a_paragraph(self) -> None:
        """A list right under a paragraph line gets a blank line; one inside a list does not."""
        lines = ["What it holds:", " - one", " - two", "", "text::", "", "    - code"]
        self.assertEqual(
            self.epytext.convert_lines(lines),
            ["What it holds:", "", " - one", " - two", "", "text::", "", "    - code"],
        )
