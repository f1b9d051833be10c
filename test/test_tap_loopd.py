"""
C{twist loopd}: the plugin is found, C{--config} and its default path, a bad configuration
as its errors alone (no usage block after them), the service it builds, and where the gateway
listens by default.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile

from twisted.application.service import IServiceMaker
from twisted.internet.testing import MemoryReactorClock
from twisted.internet.utils import getProcessOutputAndValue
from twisted.plugin import getPlugins
from twisted.trial.unittest import SynchronousTestCase, TestCase

from loopd.config import parse_config
from loopd.service import LoopdService, default_socket_path, listen_path
from loopd.tap.loopd import EX_USAGE, Options, default_config_path, makeService
from loopd.test.support.twist import ROOT

TOML = '[[endpoint]]\nname = "tiny"\nsocket = "/tmp/ld/infer.sock"\n'


class PluginTests(SynchronousTestCase):
    """
    The C{loopd} command is a Twisted plugin.
    """

    def test_discovered(self) -> None:
        """getPlugins(IServiceMaker) lists C{loopd}, pointing at L{loopd.tap.loopd}."""
        makers = {maker.tapname: maker for maker in getPlugins(IServiceMaker)}
        self.assertIn("loopd", makers)
        self.assertEqual(getattr(makers["loopd"], "module", None), "loopd.tap.loopd")


class OptionsTests(SynchronousTestCase):
    """
    L{Options} reads and checks the configuration while parsing.
    """

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def write(self, text: str, *parts: str) -> str:
        """Write C{text} at C{parts} under the temp dir (making directories); its path."""
        path = os.path.join(self.directory, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_config_loaded(self) -> None:
        """--config PATH parses that file into the Config the service gets."""
        options = Options()
        options.parseOptions(["--config", self.write(TOML, "loopd.toml")])
        self.assertEqual(options["loaded"], parse_config(TOML))
        service = makeService(options, MemoryReactorClock())
        self.assertIsInstance(service, LoopdService)
        assert isinstance(service, LoopdService)
        self.assertEqual(service.config, options["loaded"])
        self.assertEqual(list(service.clients), ["tiny"])
        self.assertFalse(service.running)

    def test_default_path(self) -> None:
        """Without --config, $XDG_CONFIG_HOME/loopd/loopd.toml is read."""
        self.write(TOML, "config", "loopd", "loopd.toml")
        self.patch(os, "environ", {**os.environ, "XDG_CONFIG_HOME": f"{self.directory}/config"})
        options = Options()
        options.parseOptions([])
        self.assertEqual(options["loaded"].endpoints[0].name, "tiny")

    def refused(self, *argv: str) -> str:
        """
        Parse C{argv}, which must fail with the exit status L{EX_USAGE}; what the options
        wrote to their stderr.
        """
        options = Options()
        options.stderr = io.StringIO()
        error = self.assertRaises(SystemExit, options.parseOptions, list(argv))
        self.assertEqual(error.code, EX_USAGE)
        return options.stderr.getvalue()

    def test_invalid_config(self) -> None:
        """
        A config with a wrong key is refused with its errors on stderr, naming the key's dotted
        path, and nothing else: no usage block.
        """
        path = self.write(TOML + "[limits]\npoll = 5\n", "loopd.toml")
        errors = self.refused("--config", path)
        self.assertIn("invalid configuration", errors)
        self.assertIn("limits.poll", errors)
        self.assertNotIn("Usage:", errors)
        self.assertNotIn("--config", errors)

    def test_missing_config(self) -> None:
        """A config file that is not there is refused naming the file."""
        path = os.path.join(self.directory, "absent.toml")
        errors = self.refused("--config", path)
        self.assertIn("absent.toml", errors)
        self.assertIn("cannot read the file", errors)


class TwistBadConfigTests(TestCase):
    """
    C{twist loopd} as a process, with a bad config: it exits with L{EX_USAGE} and prints the
    config's errors, and no usage block after them.
    """

    def test_errors_only(self) -> None:
        """C{twist loopd --config BAD} writes the errors and not C{twist}'s usage text."""
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "loopd.toml")
        with open(path, "w") as f:
            f.write(TOML + "[limits]\npoll = 5\n")
        from twisted.internet import reactor

        running = getProcessOutputAndValue(
            sys.executable,
            ["-m", "twisted", "loopd", "--config", path],
            env=dict(os.environ),
            path=str(ROOT),
            reactor=reactor,
        )

        def ended(result: tuple[bytes, bytes, int]) -> None:
            out, err, status = result
            self.assertEqual(status, EX_USAGE, (out, err))
            text = (out + err).decode()
            self.assertIn("invalid configuration", text)
            self.assertIn("limits.poll", text)
            self.assertNotIn("Usage:", text)
            self.assertNotIn("--reactor", text)

        return running.addCallback(ended)


class TwistTelemetryMissingTests(TestCase):
    """
    C{twist loopd} as a process, with C{[telemetry] enabled = true} where OpenTelemetry is
    not installed: it refuses to start, saying in one line how to install it.
    """

    def test_refuses_to_start(self) -> None:
        """It exits 1 before the self-test, with the one line on stderr."""
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "loopd.toml")
        with open(path, "w") as f:
            f.write(
                TOML.replace("/tmp/ld/", directory + "/")
                + "selftest = true\n"
                + f'[server]\nlisten = "unix:{directory}/loopd.sock"\n'
                + f'[telemetry]\nenabled = true\nsocket = "{directory}/otlp.sock"\n'
            )
        from twisted.internet import reactor

        running = getProcessOutputAndValue(
            sys.executable,
            [
                *("-m", "loopd.test.support.without_opentelemetry"),
                *("-m", "twisted", "--log-format=text", "loopd", "--config", path),
            ],
            env=dict(os.environ),
            path=str(ROOT),
            reactor=reactor,
        )

        def ended(result: tuple[bytes, bytes, int]) -> None:
            out, err, status = result
            self.assertEqual(status, 1, (out, err))
            self.assertEqual(
                err.decode().splitlines(),
                [
                    "loopd: cannot start: [telemetry] enabled = true, but OpenTelemetry is not "
                    "installed (no module named 'opentelemetry'): pip install "
                    "'loopd[telemetry]'"
                ],
            )
            self.assertNotIn(b"selftest", out)
            self.assertEqual(sorted(os.listdir(directory)), ["loopd.toml"])

        return running.addCallback(ended)


class DefaultPathTests(SynchronousTestCase):
    """
    Where the config is read from and the gateway listens when nothing says otherwise.
    """

    def test_config_xdg(self) -> None:
        """$XDG_CONFIG_HOME/loopd/loopd.toml when XDG_CONFIG_HOME is set."""
        path = default_config_path({"XDG_CONFIG_HOME": "/x/conf"})
        self.assertEqual(path, "/x/conf/loopd/loopd.toml")

    def test_config_home(self) -> None:
        """~/.config/loopd/loopd.toml otherwise, also when XDG_CONFIG_HOME is empty."""
        expected = os.path.join(os.path.expanduser("~"), ".config", "loopd", "loopd.toml")
        self.assertEqual(default_config_path({}), expected)
        self.assertEqual(default_config_path({"XDG_CONFIG_HOME": ""}), expected)

    def test_socket_runtime_dir(self) -> None:
        """loopd.sock in $XDG_RUNTIME_DIR/loopd/ when XDG_RUNTIME_DIR is set."""
        path = default_socket_path({"XDG_RUNTIME_DIR": "/run/user/7"})
        self.assertEqual(path, "/run/user/7/loopd/loopd.sock")

    def test_socket_temp_dir(self) -> None:
        """Otherwise loopd.sock in a per-user directory under the system temp dir."""
        expected = os.path.join(tempfile.gettempdir(), f"loopd-{os.getuid()}", "loopd.sock")
        self.assertEqual(default_socket_path({}), expected)

    def test_listen_path(self) -> None:
        """A unix: listener's path (escaped colons kept, options dropped), else the default."""
        self.patch(os, "environ", {**os.environ, "XDG_RUNTIME_DIR": "/run/user/7"})
        cases = {
            "unix:/tmp/ld/loopd.sock": "/tmp/ld/loopd.sock",
            "unix:/tmp/ld/a\\:b.sock:mode=600": "/tmp/ld/a:b.sock",
        }
        for listen, expected in cases.items():
            config = parse_config(TOML + f"[server]\nlisten = {json.dumps(listen)}\n")
            self.assertEqual(listen_path(config), expected, listen)
        self.assertEqual(listen_path(parse_config(TOML)), "/run/user/7/loopd/loopd.sock")
