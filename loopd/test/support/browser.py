"""
Headless Chromium for the process-level test of the status page
(L{test.test_status_page_e2e}), driven through Selenium and Debian's C{chromedriver}.

L{ensure_chromium} finds C{chromium} and C{chromedriver} on C{PATH}; when either is missing
and the tests run as root on a machine with C{apt-get} (a fresh Debian CI machine), it
installs Debian's C{chromium} and C{chromium-driver} first, as the llama-server kit installs
its build tools (L{loopd.demo.llama_binary}); else it raises L{BrowserMissingError} naming what to
install. It blocks (an install takes a minute or more): call it from a thread.

L{open_chromium} starts a headless Chromium (C{--headless=new}, C{--no-sandbox}: CI runs as
root, where Chromium's sandbox refuses to start) with a profile of its own in a given
directory, the browser console kept for the test to read, and chromedriver's log beside it.
Selenium is given both paths, so its own manager never looks for a browser on the network.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from loopd.demo.llama_binary import Machine, StepResult

__all__ = [
    "APT_TIMEOUT",
    "PACKAGES",
    "BrowserMissingError",
    "ensure_chromium",
    "open_chromium",
]

#: The Debian packages of the browser and of its driver.
PACKAGES = ("chromium", "chromium-driver")
#: The names the browser goes by on C{PATH} (Debian's, then other distributions').
BROWSERS = ("chromium", "chromium-browser")
DRIVER = "chromedriver"
#: Seconds C{apt-get update} or C{apt-get install} may take.
APT_TIMEOUT = 900.0
#: How many of a failed step's last lines the error shows.
TAIL_LINES = 30


class BrowserMissingError(Exception):
    """
    Chromium or chromedriver is not there and could not be installed; the message says why.
    """


def _browser(machine: Machine) -> str | None:
    """The path of Chromium on C{PATH}, if any."""
    for name in BROWSERS:
        found = machine.which(name)
        if found is not None:
            return found
    return None


def _tail(result: StepResult) -> str:
    """The last lines of a step's output."""
    return "\n".join(result.output.rstrip().splitlines()[-TAIL_LINES:])


def ensure_chromium(
    progress: Callable[[str], None] = lambda line: None,
    *,
    environ: Mapping[str, str] | None = None,
    machine: Machine | None = None,
) -> tuple[str, str]:
    """
    The paths of Chromium and chromedriver, installed first with C{apt-get} when missing and
    this process may (see the module docstring).

    @param progress: told what happens, a line at a time.
    @param environ: the environment of the install's steps (default: this process's).
    @param machine: how commands are run and programs found (default: for real).
    @raise BrowserMissingError: they are missing and could not be installed; it says why.
    """
    box = machine or Machine()
    env = dict(os.environ if environ is None else environ)
    browser, driver = _browser(box), box.which(DRIVER)
    if browser is not None and driver is not None:
        return browser, driver
    missing = [name for name, path in (("chromium", browser), (DRIVER, driver)) if path is None]
    if box.euid() != 0 or box.which("apt-get") is None:
        raise BrowserMissingError(
            f"the status page's browser test needs {' and '.join(missing)} on PATH and cannot "
            f"install them here (not root, or no apt-get): install them (Debian: apt-get "
            f"install {' '.join(PACKAGES)})"
        )
    progress(f"installing {' '.join(PACKAGES)} with apt-get")
    apt_env = dict(env, DEBIAN_FRONTEND="noninteractive")
    steps: Sequence[Sequence[str]] = (
        ("apt-get", "update", "-qq"),
        ("apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES),
    )
    for argv in steps:
        result = box.run(argv, None, apt_env, APT_TIMEOUT)
        if not result.ok:
            how = "timed out" if result.code is None else f"exited {result.code}"
            raise BrowserMissingError(
                f"the status page's browser test needs {' and '.join(missing)}; "
                f"`{' '.join(argv)}` {how}:\n{_tail(result)}"
            )
    browser, driver = _browser(box), box.which(DRIVER)
    if browser is None or driver is None:
        raise BrowserMissingError(
            f"apt-get installed {' '.join(PACKAGES)} but chromium or {DRIVER} is still not on PATH"
        )
    progress(f"installed {browser} and {driver}")
    return browser, driver


def open_chromium(browser: str, driver: str, directory: str, size: tuple[int, int]) -> Any:
    """
    A headless Chromium under Selenium: its profile in C{directory}/profile, chromedriver's
    log in C{directory}/chromedriver.log, its window C{size} (width, height) pixels, its
    console kept (C{driver.get_log("browser")}).

    @raise selenium.common.exceptions.WebDriverException: it did not start.
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-sync",
        "--disable-features=Translate,OptimizationHints,MediaRouter",
        "--force-device-scale-factor=1",
        f"--window-size={size[0]},{size[1]}",
        f"--user-data-dir={os.path.join(directory, 'profile')}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(
        executable_path=driver, log_output=os.path.join(directory, "chromedriver.log")
    )
    return webdriver.Chrome(service=service, options=options)
