"""
The project's layout rules, checked on the checkout: packaging lists every package, Twisted
can find the plugins, and every module but the test modules stays under 500 lines.
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


def is_test_module(path: Path) -> bool:
    """
    Whether C{path} is a module of tests (C{test_*.py} in C{loopd/test} or C{test/}), not
    test support or the public test kit.
    """
    folder = path.parent.relative_to(ROOT).parts
    return path.name.startswith("test_") and folder in (("loopd", "test"), ("test",))


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
        Every module has fewer than 500 lines, but the test modules: tests are grouped by
        the concept they test, with no size limit (DESIGN §2).
        """
        too_long = {
            str(path.relative_to(ROOT)): count
            for path in python_files()
            if not is_test_module(path)
            and (count := len(path.read_text(encoding="utf-8").splitlines())) >= MAX_LINES
        }
        self.assertEqual(too_long, {})

    def test_only_test_modules_exempt(self) -> None:
        """
        The size exemption covers the test modules only: not test support, not the public
        test kit, not a module merely named test_ elsewhere.
        """
        exempt = {
            "loopd/test/test_layout.py": True,
            "test/test_gateway_e2e.py": True,
            "loopd/test/support/peers.py": False,
            "loopd/testing/gateway.py": False,
            "loopd/queue/test_queue.py": False,
        }
        self.assertEqual({path: is_test_module(ROOT / path) for path in exempt}, exempt)
