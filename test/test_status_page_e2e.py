"""
The status page in a real browser (issue 28 item 2): a real llama.cpp server with the
project's tiny model, C{twist inferproxy}, and C{twist loopd} with a TCP listener
(C{[server] tcp = "127.0.0.1:0"}); C{loopd ui} (the real command) prints a login link;
headless Chromium (Debian's C{chromium}, driven by Selenium through C{chromedriver}) opens
it, is signed in and lands on the page; two turns of one session go through the TCP port
with the token, the second reusing the first's cache; the test waits, polling the page's
DOM, until the page shows that session with its reused tokens, and checks them against
C{/v1/status}.

Chromium and chromedriver are installed with C{apt-get} when missing and the test runs as
root (L{loopd.test.support.browser}); otherwise their absence fails the test with the
reason, it is never skipped. A screenshot of the page is kept in C{$LOOPD_ARTIFACTS} (else
in the test's temp dir, under C{_trial_temp}), with the browser's console and chromedriver's
log when the test fails; with C{LOOPD_DOCS_SCREENSHOT=1} it also replaces
C{docs/status-page.png}.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.internet.utils import getProcessOutputAndValue
from twisted.logger import Logger
from twisted.trial.unittest import SkipTest, TestCase

from loopd.test.support.browser import ensure_chromium, open_chromium
from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import ROOT

try:
    from loopd.test.support.gateway_stack import (
        SLOTS,
        httpx,
        serve_behind_proxy,
        start_loopd_tcp,
    )
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the status page's browser test needs the test extra: {e}") from None

_BIN = os.path.join(os.path.dirname(sys.executable), "loopd")
LOOPD = [_BIN] if os.path.exists(_BIN) else [sys.executable, "-m", "loopd.cli"]
#: Where the screenshot goes, when set.
ARTIFACTS_ENV = "LOOPD_ARTIFACTS"
#: Set to 1 to replace the manual's screenshot with this run's.
DOCS_ENV = "LOOPD_DOCS_SCREENSHOT"
DOCS_SCREENSHOT = ROOT / "docs" / "status-page.png"
SESSION = "status-page-e2e"
AGENT = "status-page-test/1.0"
#: The most seconds the page may take to show what happened (it polls every 2 s): a bound
#: on a wait that ends as soon as the DOM shows it, not a timing the test measures.
WAIT = 90.0
#: The browser window: wide enough for the tables, tall enough for the whole page.
WINDOW = (1400, 1700)
FIRST = (
    "We are reviewing a small Python module that parses configuration files. Please list "
    "what a careful reviewer should check first, in a few words."
)
_log = Logger(namespace="test.test_status_page_e2e")

# The page's numbers, read from the DOM as the page drew them (data-value keeps the raw one).
_SESSION_FIELD = """
const row = document.querySelector('tr[data-session="' + arguments[0] + '"]');
if (!row) return null;
const cell = row.querySelector('td[data-field="' + arguments[1] + '"]');
return cell ? Number(cell.dataset.value) : null;
"""
_SLOT_SESSIONS = """
return Array.from(document.querySelectorAll('[data-endpoint] td[data-field="session"]'))
  .map(function (cell) { return cell.textContent; });
"""


class StatusPageBrowserTests(TestCase):
    """
    The status page, signed in with C{loopd ui}'s link, in headless Chromium.
    """

    #: A first run installs Chromium (a minute or two) before the stack starts.
    timeout = 1200

    def artifacts(self) -> str:
        """The directory the screenshot goes to: C{$LOOPD_ARTIFACTS}, else the test's own."""
        chosen = os.environ.get(ARTIFACTS_ENV) or os.path.abspath(self.mktemp())
        os.makedirs(chosen, exist_ok=True)
        return chosen

    @inlineCallbacks
    def test_session_appears(self) -> Any:
        """
        Signed in with the link of C{loopd ui}, the browser is on the page (the code gone
        from its address, an C{HttpOnly}, C{SameSite=Strict} cookie that scripts cannot
        read); after two turns of one session through the TCP port, the page shows the
        session with reused tokens, as C{/v1/status} says, and its slot on the endpoint;
        the console has no error (no CSP violation); the link does not sign in twice; and
        a browser without the cookie is told to run C{loopd ui}.
        """
        try:
            import selenium  # noqa: F401
        except ImportError as e:
            self.fail(f"selenium is not installed (pip install -e '.[test]'): {e}")
        reactor = real_reactor()

        def progress(line: str) -> None:
            reactor.callFromThread(_log.info, "browser kit: {line}", line=line)

        chromium, chromedriver = yield deferToThread(ensure_chromium, progress)
        directory, _, infer = yield serve_behind_proxy(self, "tiny.gguf", SLOTS)
        loopd = yield start_loopd_tcp(self, directory, infer)
        out, err, code = yield getProcessOutputAndValue(
            LOOPD[0], [*LOOPD[1:], "ui", "--socket", loopd.socket], env=dict(os.environ)
        )
        self.assertEqual(code, 0, err)
        link = out.decode().strip()
        self.assertTrue(link.startswith(f"{loopd.url}/ui/login#"), link)

        artifacts = self.artifacts()
        work = tempfile.mkdtemp(prefix="ldchrome", dir="/tmp")
        self.addCleanup(shutil.rmtree, work, True)
        driver = yield deferToThread(open_chromium, chromium, chromedriver, work, WINDOW)
        self.addCleanup(deferToThread, driver.quit)
        try:
            yield deferToThread(self.sign_in, driver, link, loopd.url)
            cached = yield deferToThread(two_turns, loopd.url, loopd.token())
            self.assertGreater(cached, 0, "the server reused nothing of the first turn")
            shown = yield deferToThread(self.wait_for_session, driver)
            document = yield deferToThread(status, loopd.url, loopd.token())
            (entry,) = [s for s in document["sessions"] if s["id"] == SESSION]
            self.assertEqual(shown, entry["reused_tokens"])
            self.assertEqual(entry["turns"], 2)
            self.assertEqual(entry["agent"], AGENT)
            slots = yield deferToThread(driver.execute_script, _SLOT_SESSIONS)
            self.assertIn(SESSION, slots)
            yield deferToThread(self.screenshot, driver, artifacts)
            console = yield deferToThread(driver.get_log, "browser")
            self.assertEqual([e for e in console if e["level"] == "SEVERE"], [])
            yield deferToThread(self.link_used, driver, link)
            yield deferToThread(self.signed_out, driver, loopd.url)
        except BaseException:
            yield deferToThread(keep_evidence, driver, work, artifacts)
            raise

    def sign_in(self, driver: Any, link: str, url: str) -> None:
        """
        Open the link; wait until the page is live; the address is the page's, without the
        code, and the cookie is C{HttpOnly} and C{SameSite=Strict}, unreadable by scripts.
        """
        from selenium.webdriver.support.wait import WebDriverWait

        driver.get(link)
        WebDriverWait(driver, WAIT, poll_frequency=0.1).until(
            lambda d: d.execute_script("return document.body.dataset.state") == "live",
            f"the login link did not open a live page within {WAIT:g} s",
        )
        self.assertEqual(driver.current_url, f"{url}/")
        (cookie,) = driver.get_cookies()
        self.assertEqual(cookie["name"], "loopd_ui")
        self.assertEqual((cookie["httpOnly"], cookie["sameSite"]), (True, "Strict"))
        self.assertFalse(cookie["secure"])
        self.assertEqual(driver.execute_script("return document.cookie"), "")

    def wait_for_session(self, driver: Any) -> int:
        """
        Wait, polling the DOM, until the page shows the session with two turns and reused
        tokens; return the reused tokens it shows.
        """
        from selenium.webdriver.support.wait import WebDriverWait

        def shown(d: Any) -> Any:
            turns = d.execute_script(_SESSION_FIELD, SESSION, "turns")
            reused = d.execute_script(_SESSION_FIELD, SESSION, "reused_tokens")
            return reused if turns == 2 and reused else False

        reused: int = WebDriverWait(driver, WAIT, poll_frequency=0.2).until(
            shown, f"the page did not show {SESSION} with two turns and reused tokens in {WAIT:g} s"
        )
        return reused

    def screenshot(self, driver: Any, artifacts: str) -> None:
        """
        The whole page as PNG in the artifacts (the window made as tall as the page), and
        in the docs when C{LOOPD_DOCS_SCREENSHOT=1}.
        """
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(WINDOW[0], min(max(height + 40, 600), 4000))
        path = os.path.join(artifacts, "status-page.png")
        self.assertTrue(driver.save_screenshot(path))
        _log.info("status page screenshot: {path}", path=path)
        if os.environ.get(DOCS_ENV) == "1":
            shutil.copyfile(path, DOCS_SCREENSHOT)

    def link_used(self, driver: Any, link: str) -> None:
        """The same link again: the login page says it was used, and to run loopd ui."""
        from selenium.webdriver.support.wait import WebDriverWait

        driver.get(link)
        message = WebDriverWait(driver, WAIT, poll_frequency=0.1).until(
            lambda d: d.execute_script(
                "const m = document.querySelector('#message.problem');"
                "return m ? m.textContent : null;"
            ),
            f"the login page did not refuse the used link within {WAIT:g} s",
        )
        self.assertIn("has been used or has expired", message)
        self.assertIn("loopd ui", message)

    def signed_out(self, driver: Any, url: str) -> None:
        """Without the cookie, the page's address is the 401 page that says to run loopd ui."""
        driver.delete_all_cookies()
        driver.get(f"{url}/")
        self.assertEqual(driver.title, "loopd: sign in with loopd ui")
        self.assertIn("loopd ui", driver.find_element("tag name", "body").text)


def two_turns(url: str, token: str) -> int:
    """
    Two turns of one session through the TCP listener with the token, the second extending
    the first; the prompt tokens the server reused for the second.
    """
    headers = {
        "Authorization": f"Bearer {token}",
        "X-Session-Id": SESSION,
        "X-Loopd-Agent": AGENT,
    }
    messages: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]
    with httpx.Client(timeout=60) as client:
        for turn in (1, 2):
            body = {"model": "tiny", "messages": messages, "max_tokens": 16}
            response = client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            response.raise_for_status()
            answer = response.json()
            messages.append(
                {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
            )
            messages.append(
                {"role": "user", "content": f"Thanks. And after that (turn {turn + 1})?"}
            )
    cached: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def status(url: str, token: str) -> Any:
    """C{GET /v1/status} through the TCP listener with the token."""
    with httpx.Client(timeout=30) as client:
        response = client.get(f"{url}/v1/status", headers={"x-api-key": token})
        response.raise_for_status()
        return response.json()


def keep_evidence(driver: Any, work: str, artifacts: str) -> None:
    """After a failure: the screenshot, the page's DOM, the console and chromedriver's log."""
    try:
        driver.save_screenshot(os.path.join(artifacts, "failure.png"))
        with open(os.path.join(artifacts, "failure.html"), "w") as f:
            f.write(driver.page_source)
        with open(os.path.join(artifacts, "console.json"), "w") as f:
            json.dump(driver.get_log("browser"), f, indent=1)
    except Exception as e:  # noqa: BLE001 - the evidence must not hide the failure
        _log.warn("could not keep the browser's evidence: {error}", error=e)
    log = os.path.join(work, "chromedriver.log")
    if os.path.exists(log):
        shutil.copyfile(log, os.path.join(artifacts, "chromedriver.log"))
    _log.info("the browser's evidence is in {path}", path=artifacts)
