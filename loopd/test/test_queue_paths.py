"""
Tests for L{loopd.queue.paths}: the agent dir and the files in it (DESIGN §13).
"""

from __future__ import annotations

import os

from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.paths import agent_dir, config_path, socket_path


class AgentDirTests(SynchronousTestCase):
    """
    C{--agent-dir}, else C{$PI_CODING_AGENT_DIR}, else C{~/.pi/agent}.
    """

    def test_explicit_wins(self) -> None:
        """An explicit directory beats the environment."""
        env = {"PI_CODING_AGENT_DIR": "/env/dir"}
        self.assertEqual(agent_dir("/given", env), "/given")

    def test_environment(self) -> None:
        """Without an explicit one the environment names it, with C{~} expanded."""
        env = {"PI_CODING_AGENT_DIR": "~/agents"}
        self.assertEqual(agent_dir(None, env), os.path.expanduser("~/agents"))

    def test_default(self) -> None:
        """Neither: C{~/.pi/agent}."""
        self.assertEqual(agent_dir(None, {}), os.path.expanduser("~/.pi/agent"))

    def test_files(self) -> None:
        """The socket and the config sit in the agent dir under fixed names."""
        self.assertEqual(socket_path("/a"), "/a/llm-queue.sock")
        self.assertEqual(config_path("/a"), "/a/llm-queue.json")
