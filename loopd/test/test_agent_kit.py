"""
Tests of the agents kit of the real-agent tests: the recipes of docs/agents.md as
L{loopd.test.support.agent_recipes} reads them, the private homes and the install failures
of L{loopd.test.support.agents}. The agents themselves run in L{test.test_agents_e2e}.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.trial.unittest import SynchronousTestCase, TestCase

from loopd.test.support import agents
from loopd.test.support.agent_recipes import PAGE, RecipeError, commands, exports, read_recipes
from loopd.test.support.agents import AGENTS, AgentHome, InstallError, Kit, install
from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

RECIPES = ROOT / PAGE
MANIFESTS = ROOT / "test" / "agents"


class RecipeTests(SynchronousTestCase):
    """
    The section "Pointing an agent at loopd" of docs/agents.md, read as the agents' tests
    read it.
    """

    def setUp(self) -> None:
        self.recipes = {
            name: recipe.filled("127.0.0.1:5555", "tiny")
            for name, recipe in read_recipes(RECIPES).items()
        }

    def test_every_agent(self) -> None:
        """Every agent the kit runs has a recipe under its heading."""
        for agent in AGENTS.values():
            self.assertIn(agent.heading, self.recipes)

    def test_turns(self) -> None:
        """
        Each agent's prose shows its first turn with a C{"..."} prompt and, but for Cline
        (whose second turn is ACP's), its second; the prompt takes the placeholder's place.
        """
        for name, agent in AGENTS.items():
            recipe = self.recipes[agent.heading]
            first = recipe.turn(0, "say hi")
            self.assertEqual((first[0], first.count("say hi")), (agent.program, 1), name)
            if name != "cline":
                self.assertEqual(recipe.turn(1, "bye")[0], agent.program, name)
        self.assertEqual(
            self.recipes["Codex CLI"].turn(1, "bye"), ["codex", "exec", "resume", "--last", "bye"]
        )

    def test_filled(self) -> None:
        """The page's address and C{MODEL} are replaced everywhere, words only."""
        claude = exports(self.recipes["Claude Code"].shell(), {"LOOPD_TOKEN": "t0k"})
        self.assertEqual(claude["ANTHROPIC_BASE_URL"], "http://127.0.0.1:5555")
        self.assertEqual(claude["ANTHROPIC_AUTH_TOKEN"], "t0k")
        self.assertEqual(claude["ANTHROPIC_DEFAULT_HAIKU_MODEL"], "tiny")
        codex = tomllib.loads(self.recipes["Codex CLI"].files()["~/.codex/config.toml"])
        self.assertEqual(codex["model"], "tiny")
        self.assertEqual(codex["model_providers"]["loopd"]["base_url"], "http://127.0.0.1:5555/v1")

    def test_shell(self) -> None:
        """
        Cline's shell blocks: its set-up command, with the token expanded as sh would, and
        its exports.
        """
        shell = self.recipes["Cline"].shell()
        env = exports(shell, {"LOOPD_TOKEN": "t0k"})
        self.assertEqual(env["CLINE_SESSION_BACKEND_MODE"], "local")
        self.assertEqual(env["CLINE_API_KEY"], "t0k")
        [auth] = commands(shell, {"LOOPD_TOKEN": "t0k"})
        self.assertEqual(auth[:2], ["cline", "auth"])
        self.assertEqual(auth[auth.index("--apikey") + 1], "t0k")

    def test_missing(self) -> None:
        """A page without the section, or a turn the recipe lacks, is a clear error."""
        self.assertRaises(RecipeError, read_recipes, "# loopd\n")
        error = self.assertRaises(RecipeError, self.recipes["Cline"].turn, 5, "x")
        self.assertIn("Cline", str(error))


class HomeTests(SynchronousTestCase):
    """
    An agent's private home: its files and environment.
    """

    def home(self, name: str, **options: Any) -> AgentHome:
        """A home for agent C{name} configured from its recipe (nothing runs)."""
        root = Path(tempfile.mkdtemp(prefix="lak", dir="/tmp"))
        self.addCleanup(shutil.rmtree, root, True)
        kit = Kit(root / "npm", root / "aider", MANIFESTS)
        agent = AGENTS[name]
        recipe = read_recipes(RECIPES)[agent.heading].filled("127.0.0.1:5555", "tiny")
        return AgentHome(real_reactor(), kit, agent, recipe, root, token="t0k", **options)

    def test_environment(self) -> None:
        """
        A run's environment holds none of the user's: no API key of theirs reaches an
        agent, its every way out is a dead proxy, and its own programs come first.
        """
        os.environ["OPENAI_API_KEY"] = "the user's"
        self.addCleanup(os.environ.pop, "OPENAI_API_KEY")
        home = self.home("qwen")
        self.assertEqual(home.env["OPENAI_API_KEY"], "t0k")
        self.assertNotIn("ANTHROPIC_API_KEY", self.home("claude-code").env)
        self.assertEqual(home.env["HTTPS_PROXY"], "http://127.0.0.1:9")
        self.assertEqual(home.env["HOME"], str(home.home))
        self.assertTrue(home.env["PATH"].startswith(str(home.kit.npm)))

    def test_settings(self) -> None:
        """
        The recipe's file gets the agent's own switches: Codex's top-level keys before its
        first table (else TOML would put them in it), Qwen Code's merged into its JSON.
        """
        codex = tomllib.loads((self.home("codex").home / ".codex/config.toml").read_text())
        self.assertIs(codex["check_for_update_on_startup"], False)
        self.assertIs(codex["analytics"]["enabled"], False)
        self.assertEqual(codex["model_provider"], "loopd")
        qwen = (self.home("qwen").home / ".qwen/settings.json").read_text()
        self.assertIn('"usageStatisticsEnabled": false', qwen)
        self.assertIn('"selectedType": "openai"', qwen)

    def test_seed(self) -> None:
        """Cline's telemetry switch is in its home before anything of it runs."""
        home = self.home("cline")
        settings = home.home / ".cline/data/settings/global-settings.json"
        self.assertIn('"telemetryOptOut": true', settings.read_text())


class InstallTests(TestCase):
    """
    An install that cannot be had fails with the reason, never a skip.
    """

    timeout = 60

    def setUp(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="lak", dir="/tmp"))
        self.addCleanup(shutil.rmtree, self.root, True)
        self.manifests = self.root / "manifests"
        shutil.copytree(MANIFESTS, self.manifests)
        self.bin = self.root / "bin"
        self.bin.mkdir()
        self.setenv("LOOPD_AGENT_CACHE", str(self.root / "cache"))

    def setenv(self, name: str, value: str) -> None:
        """Set C{name} in this process's environment for this test."""
        old = os.environ.get(name)
        os.environ[name] = value
        self.addCleanup(
            lambda: os.environ.__setitem__(name, old) if old else os.environ.pop(name, None)
        )

    @inlineCallbacks
    def test_npm_fails(self) -> Any:
        """npm's failure is an L{InstallError} with npm's last lines; nothing counts as done."""
        npm = self.bin / "npm"
        npm.write_text(
            "#!/bin/sh\necho 'npm error code E404'\necho 'npm error 404 Not Found' >&2\nexit 1\n"
        )
        npm.chmod(npm.stat().st_mode | stat.S_IXUSR)
        self.setenv("PATH", f"{self.bin}{os.pathsep}{os.environ['PATH']}")
        error = yield self.assertFailure(install(real_reactor(), self.manifests), InstallError)
        self.assertIn("npm error 404 Not Found", str(error))
        self.assertIn("exited 1", str(error))
        self.assertEqual(list((self.root / "cache").glob("npm-*/installed.json")), [])

    @inlineCallbacks
    def test_no_npm(self) -> Any:
        """Without npm on PATH the error says what the agents' tests need."""
        self.setenv("PATH", str(self.bin))
        error = yield self.assertFailure(install(real_reactor(), self.manifests), InstallError)
        self.assertIn("need Node.js and npm", str(error))

    def test_cache(self) -> None:
        """The cache is C{$LOOPD_AGENT_CACHE}, else C{~/.cache/loopd/agents}."""
        self.assertEqual(agents.cache_root(), self.root / "cache")
        os.environ.pop("LOOPD_AGENT_CACHE")
        self.assertEqual(agents.cache_root(), Path.home() / ".cache/loopd/agents")
