"""
A Sphinx extension that reads loopd's docstrings, written in epytext as Twisted's are, as
reStructuredText: autodoc hands each docstring to L{convert_lines} before parsing it.

Epytext's inline markup becomes reST's: C{code} a literal, L{name} or L{text <name>} a
Python cross-reference, I{text} emphasis, B{text} strong. Its fields (C{@param x:},
C{@type x:}, C{@return:}, C{@rtype:}, C{@raise E:}, C{@ivar x:}, ...) become reST field
lists, which Sphinx's Python domain renders as it renders its own. A list that starts right
under a paragraph line, as epytext allows, gets the blank line reST needs before it.
"""

from __future__ import annotations

import re
from typing import Any

#: Epytext field names, and the reST field each becomes.
FIELDS = {
    "param": "param",
    "type": "type",
    "keyword": "keyword",
    "kwarg": "keyword",
    "return": "returns",
    "returns": "returns",
    "rtype": "rtype",
    "raise": "raises",
    "raises": "raises",
    "ivar": "ivar",
    "cvar": "cvar",
    "var": "var",
    "note": "note",
    "see": "see",
    "since": "since",
}

_FIELD = re.compile(r"^(\s*)@(\w+)((?:\s+[^:\s][^:]*)?):(.*)$")
_BULLET = re.compile(r"^(\s*)(?:[-*+]|\d+\.)\s")
#: What may stand right before a reST inline markup start and right after its end.
_BEFORE = set(" \t'\"([{<-/:")
_AFTER = set(" \t'\")]}>-/:.,;!?\\")


def _closing(text: str, start: int) -> int:
    """The index of the brace that closes the one at C{start}, or -1."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return index
    return -1


def _markup(tag: str, inner: str) -> str:
    """The reST for epytext's C{tag{inner}}, C{inner} already converted where it nests."""
    if tag == "C":
        inner = inner.strip()
        return f"``{inner}``" if inner else ""
    if tag == "L":
        return f":py:obj:`{inner.strip()}`"
    if tag == "I":
        return f"*{inner.strip()}*"
    if tag == "B":
        return f"**{inner.strip()}**"
    if tag == "U":
        return f"`{inner.strip()} <{inner.strip()}>`__"
    return inner


def convert_inline(text: str) -> str:
    """
    C{text} with epytext's inline markup (C{C}, C{L}, C{I}, C{B}, C{U}) as reST's, an
    escaped space put where reST needs one between the markup and a word it touches.
    """
    out: list[str] = []
    index = 0
    while index < len(text):
        char = text[index]
        if (
            char in "CLIBU"
            and text[index + 1 : index + 2] == "{"
            and (index == 0 or not (text[index - 1].isalnum() or text[index - 1] == "_"))
        ):
            end = _closing(text, index + 1)
            if end > 0:
                inner = text[index + 2 : end]
                if char != "C":
                    inner = convert_inline(inner)
                rest = _markup(char, inner)
                if rest:
                    before = out[-1][-1] if out and out[-1] else "\n"
                    if before not in _BEFORE and before != "\n":
                        out.append("\\ ")
                    out.append(rest)
                    after = text[end + 1 : end + 2]
                    if after and after not in _AFTER and after != "\n":
                        out.append("\\ ")
                index = end + 1
                continue
        out.append(char)
        index += 1
    return "".join(out)


def convert_lines(lines: list[str]) -> list[str]:
    """
    The lines of one epytext docstring as reST: inline markup converted, fields as field
    lists, and a blank line before a field list or a list that follows a paragraph line.
    """
    text = convert_inline("\n".join(lines))
    out: list[str] = []
    in_fields = False
    literal_indent: int | None = None
    for line in text.split("\n"):
        indent = len(line) - len(line.lstrip())
        if literal_indent is not None:
            if line.strip() and indent <= literal_indent:
                literal_indent = None
            else:
                out.append(line)
                continue
        field = _FIELD.match(line)
        if field and field.group(2) in FIELDS:
            if out and out[-1].strip() and not in_fields:
                out.append("")
            name, argument = FIELDS[field.group(2)], field.group(3).strip()
            out.append(
                f"{field.group(1)}:{name}{' ' + argument if argument else ''}:{field.group(4)}"
            )
            in_fields = True
            continue
        if in_fields and line.strip() and indent == 0:
            in_fields = False
        if _BULLET.match(line) and out and out[-1].strip() and not in_fields:
            previous = out[-1]
            previous_indent = len(previous) - len(previous.lstrip())
            if not _BULLET.match(previous) and previous_indent <= indent:
                out.append("")
        out.append(line)
        if line.rstrip().endswith("::"):
            literal_indent = indent
    return out


def _process(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """autodoc's C{autodoc-process-docstring} hook: convert C{lines} in place."""
    lines[:] = convert_lines(lines)


def setup(app: Any) -> dict[str, Any]:
    """Register the hook; the extension keeps no state, so builds may run in parallel."""
    app.connect("autodoc-process-docstring", _process)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
