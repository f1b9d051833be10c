"""
Sphinx configuration of loopd's manual: Markdown pages read by MyST. Build it with
C{tox -e docs}, or C{sphinx-build -W --keep-going -b html docs docs/_build/html}.
"""

from __future__ import annotations

project = "loopd"
author = "the loopd authors"
copyright = "the loopd authors"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]

# Links to a heading of another page (gateway.md#endpoint-health) resolve for ## to ####.
myst_heading_anchors = 4

nitpicky = False

html_theme = "alabaster"
html_title = "loopd"
