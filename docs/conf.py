"""
Sphinx configuration of loopd's manual: Markdown pages read by MyST, and the API reference
from the package's docstrings (epytext, read as reST by the local C{epytext} extension).
Build it with C{tox -e docs}, or C{sphinx-build -W --keep-going -b html docs docs/_build/html}.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the epytext extension beside this file
sys.path.insert(0, str(HERE.parent))  # the checkout's loopd, as the tests import it

project = "loopd"
author = "the loopd authors"
copyright = "the loopd authors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "epytext"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]

# Links to a heading of another page (gateway.md#endpoint-health) resolve for ## to ####.
myst_heading_anchors = 4

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
nitpicky = False

html_theme = "alabaster"
html_title = "loopd"


def skip_aliases(
    app: object, what: str, name: str, obj: object, skip: bool, options: object
) -> bool | None:
    """
    Leave out a class attribute that only names a top-level class (C{InferError.Busy} is
    C{loopd.errors.Busy}): the class is documented where it is defined, once.
    """
    if what in ("class", "exception") and isinstance(obj, type) and "." not in obj.__qualname__:
        return True
    return None


def setup(app: object) -> None:
    """Connect the alias filter."""
    app.connect("autodoc-skip-member", skip_aliases)  # type: ignore[attr-defined]
