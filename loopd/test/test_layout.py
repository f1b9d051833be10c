"""
The project's layout rules, checked on the checkout: packaging lists every package, Twisted
can find the plugins, and every module stays under 500 lines.
"""

from __future__ import annotations

import configparser
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

import loopd

ROOT = Path(loopd.__file__).parent.parent
MAX_LINES = 500


def python_files() -> list[Path]:
    """
    Every Python file of the project: the package, the plugins, the process-level tests and
    the benchmarks.
    """
    files: list[Path] = []
    for folder in ("loopd", "twisted", "test", "bench"):
        files.extend(sorted((ROOT / folder).rglob("*.py")))
    return files


class LayoutTests(SynchronousTestCase):
    """
    Rules of the layout that a later change could break without noticing.
    """

    def test_every_package_is_packaged(self) -> None:
        """
        setup.cfg lists exactly the packages under loopd/ plus twisted.plugins (which
        setuptools' find: would miss, having no __init__.py).
        """
        parser = configparser.ConfigParser()
        parser.read(ROOT / "setup.cfg")
        listed = set(parser["options"]["packages"].split())
        present = {
            ".".join(init.parent.relative_to(ROOT).parts)
            for init in (ROOT / "loopd").rglob("__init__.py")
        }
        self.assertEqual(listed, present | {"twisted.plugins"})

    def test_no_init_under_twisted(self) -> None:
        """
        No __init__.py under twisted/: with one, Twisted's plugin scan would skip the folder
        and shadow Twisted itself.
        """
        self.assertEqual(list((ROOT / "twisted").rglob("__init__.py")), [])

    def test_modules_under_limit(self) -> None:
        """
        Every module has fewer than 500 lines.
        """
        too_long = {
            str(path.relative_to(ROOT)): count
            for path in python_files()
            if (count := len(path.read_text(encoding="utf-8").splitlines())) >= MAX_LINES
        }
        self.assertEqual(too_long, {})
