"""
Tests for L{loopd.test.support.browser.ensure_chromium}, the browser test's kit: it finds
Chromium and chromedriver, installs them with apt-get as root when they are missing, and
otherwise fails saying what to install. The machine is a fake (L{Machine}): nothing runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from twisted.trial.unittest import SynchronousTestCase

from loopd.demo.llama_binary import Machine, StepResult
from loopd.test.support.browser import BrowserMissingError, ensure_chromium


class _FakeMachine:
    """Programs on PATH, a user id, and the commands run (which may install programs)."""

    def __init__(self, present: set[str], euid: int, installs: set[str] | None = None) -> None:
        self.present = set(present)
        self.uid = euid
        self.installs = installs or set()
        self.ran: list[tuple[list[str], dict[str, str]]] = []
        self.fail: str | None = None

    def run(
        self, argv: Sequence[str], cwd: str | None, env: Mapping[str, str], timeout: float
    ) -> StepResult:
        self.ran.append((list(argv), dict(env)))
        if self.fail is not None and self.fail in argv:
            return StepResult(100, "Reading package lists...\nE: Unable to locate package chromium")
        if "install" in argv:
            self.present |= self.installs
        return StepResult(0, "")

    def which(self, name: str) -> str | None:
        return f"/usr/bin/{name}" if name in self.present else None

    def machine(self) -> Machine:
        return Machine(run=self.run, which=self.which, euid=lambda: self.uid)


class EnsureChromiumTests(SynchronousTestCase):
    """
    L{ensure_chromium} on a fake machine.
    """

    def test_present(self) -> None:
        """Both on PATH: their paths, nothing run (not even as root)."""
        fake = _FakeMachine({"chromium", "chromedriver", "apt-get"}, euid=0)
        found = ensure_chromium(machine=fake.machine())
        self.assertEqual(found, ("/usr/bin/chromium", "/usr/bin/chromedriver"))
        self.assertEqual(fake.ran, [])

    def test_other_name(self) -> None:
        """Chromium may be called chromium-browser."""
        fake = _FakeMachine({"chromium-browser", "chromedriver"}, euid=1000)
        self.assertEqual(ensure_chromium(machine=fake.machine())[0], "/usr/bin/chromium-browser")

    def test_not_root(self) -> None:
        """Missing, not root: an error naming what is missing and the packages to install."""
        fake = _FakeMachine({"chromium", "apt-get"}, euid=1000)
        error = self.assertRaises(BrowserMissingError, ensure_chromium, machine=fake.machine())
        self.assertIn("needs chromedriver on PATH", str(error))
        self.assertIn("apt-get install chromium chromium-driver", str(error))
        self.assertEqual(fake.ran, [])

    def test_no_apt(self) -> None:
        """Missing, root, no apt-get: the same error."""
        fake = _FakeMachine(set(), euid=0)
        error = self.assertRaises(BrowserMissingError, ensure_chromium, machine=fake.machine())
        self.assertIn("needs chromium and chromedriver", str(error))

    def test_installs_as_root(self) -> None:
        """
        Missing, root with apt-get: apt-get update, then install of both packages without a
        prompt; then their paths, and the progress says so.
        """
        fake = _FakeMachine({"apt-get"}, euid=0, installs={"chromium", "chromedriver"})
        lines: list[str] = []
        found = ensure_chromium(lines.append, environ={"PATH": "/usr/bin"}, machine=fake.machine())
        self.assertEqual(found, ("/usr/bin/chromium", "/usr/bin/chromedriver"))
        self.assertEqual(
            [argv for argv, _ in fake.ran],
            [
                ["apt-get", "update", "-qq"],
                [
                    "apt-get",
                    "install",
                    "-y",
                    "-qq",
                    "--no-install-recommends",
                    "chromium",
                    "chromium-driver",
                ],
            ],
        )
        self.assertEqual(
            [env for _, env in fake.ran],
            [{"PATH": "/usr/bin", "DEBIAN_FRONTEND": "noninteractive"}] * 2,
        )
        self.assertEqual(lines[0], "installing chromium chromium-driver with apt-get")

    def test_install_fails(self) -> None:
        """An install that fails: an error with the command and apt-get's last lines."""
        fake = _FakeMachine({"apt-get"}, euid=0)
        fake.fail = "install"
        error = self.assertRaises(BrowserMissingError, ensure_chromium, machine=fake.machine())
        self.assertIn("exited 100", str(error))
        self.assertIn("Unable to locate package chromium", str(error))

    def test_still_missing(self) -> None:
        """An install that brings no chromedriver: an error saying so."""
        fake = _FakeMachine({"apt-get"}, euid=0, installs={"chromium"})
        error = self.assertRaises(BrowserMissingError, ensure_chromium, machine=fake.machine())
        self.assertIn("is still not on PATH", str(error))
