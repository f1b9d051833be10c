"""Benchmark: the real coding agents through loopd and straight to llama-server (issue 24).

Run from the checkout root with ``python bench/agents_real.py`` (``tox -e bench``);
``--help`` lists the options. It needs the test extra (``xllamacpp``, ``gguf``, ``numpy``)
and installs the pinned agents as the tests do (``loopd.test.support.agents``: npm and, for
Aider, PyPI, into ``$LOOPD_AGENT_CACHE``).

Each agent does a fixed three-turn task ("Run the command `true` with your shell tool, then
say hi", "Now say bye", "One more: say ok"), configured from the manual's own recipe
(docs/agents.md), with its default tools and prompts, against a real llama.cpp server
(xllamacpp) with ONE slot serving the project's tiny model with zero-weight compute ballast
(``--ballast``, 4096:6 by default: the same answers, a real prefill cost of about 1,000
tokens a second on 2 threads), by two paths:

 - ``loopd``: the agent talks to ``twist loopd`` over TCP with its token, loopd to the server
   through ``twist inferproxy`` (the agent-box limits of docs/demo.md);
 - ``direct``: the agent talks to the server's own TCP port (the anchor).

Two cases: ``alone``, one agent; ``sharing``, two agents of the same kind at once, each its
own session and its own three turns, sharing the one slot. Codex CLI runs with its multi-
agent tools off on both paths (``same_prompt``): llama-server skips their namespace tool,
loopd flattens and offers it, and the paths would not send the same prompt. Each path of
each case runs on a fresh server (nothing cached from the other path), the paths one after
the other, in turn first (``--rounds``). ``--cache-ram`` sets the server's host-RAM prompt
cache (llama.cpp's default, 8 GiB, restores a session switched out of the slot; ``0`` has
none); ``--slot-save`` starts the server with ``--slot-save-path`` (both paths) and gives
loopd's endpoint ``slot_save = true``, so loopd saves a switched-out session's slot to a
file and restores it when the session is back (direct, nobody calls the server's slot
routes). Per path it prints the wall time (from the first turn's start to the last turn's end)
and the prompt tokens the server evaluated (its ``llamacpp:prompt_tokens_total`` before and
after), and the ratio loopd/direct, with the goals (issue 24): alone, loopd's wall time at
most 1.05x direct's; sharing, fewer prompt tokens and less wall time than direct. A turn
that fails (an exit code other than 0, no answer) is printed with its output's tail and the
run counts as failed. The exit status is 0 when every run completed (goals met or not), else
1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

from _report import positive

from loopd.demo.real_server import RealServer
from loopd.demo.tiny_model import ANSWER, Ballast, BallastError, write_tiny_model
from loopd.test.support.agent_recipes import PAGE, read_recipes
from loopd.test.support.agents import AGENTS, AgentHome, install
from loopd.test.support.twist import ROOT, spawn_twist, stop_twist

PROMPTS = (
    "Run the command `true` with your shell tool, then say hi",
    "Now say bye",
    "One more: say ok",
)
"""The three turns of the task."""
SLOT_CTX = 131072
"""The one slot's context: Claude Code's prompt is ~72,000 tokens of the tiny vocabulary."""
PROXY_LIMITS = ("--burst", "100", "--refill", "20", "--max-connections", "32")
"""The inferproxy limits docs/demo.md gives for an agent box."""
ENDPOINT_LIMITS = "proxy_burst = 100\nproxy_refill_per_second = 20.0\nproxy_max_connections = 32\n"
"""The endpoint fields that name them."""
GOAL_ALONE = 1.05
"""Alone, loopd's wall time at most this times direct's."""
_URL = re.compile(rb"TCP listener on http://(127\.0\.0\.1:\d+):")
_PROMPT_TOKENS = re.compile(r"^llamacpp:prompt_tokens_total (\S+)$", re.M)


@dataclass
class PathRun:
    """One path's run of one case: wall time, prompt tokens evaluated, failed turns."""

    wall: float = 0.0
    evaluated: int = 0
    failures: list[str] = field(default_factory=list)


def same_prompt(files: dict[str, str]) -> dict[str, str]:
    """
    The recipe's files, changed so that both paths send the model the same prompt: Codex
    CLI's multi-agent tools come as a C{namespace} tool, which llama-server skips and loopd
    flattens and offers (about 7,500 more tokens of this tiny vocabulary on every request),
    so they are turned off on both paths; the comparison is of loopd's overhead, not of its
    extra tools.
    """
    codex = "~/.codex/config.toml"
    if codex in files:
        files = {
            **files,
            codex: files[codex] + "\n[agents]\nenabled = false\n",
        }
    return files


def prompt_tokens(port: int) -> int:
    """The server's prompt tokens evaluated so far (its C{/metrics})."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    found = _PROMPT_TOKENS.search(text)
    if found is None:
        raise RuntimeError("the server's /metrics has no llamacpp:prompt_tokens_total")
    return int(float(found.group(1)))


class Bench:
    """Runs the cases on the real reactor; see the module docstring."""

    def __init__(self, reactor: Any, args: argparse.Namespace) -> None:
        """@param args: the command line's options."""
        self.reactor = reactor
        self.args = args
        self.recipes = read_recipes(ROOT / PAGE)
        self.scratch = Path(tempfile.mkdtemp(prefix="lda", dir="/tmp"))
        self.model = str(self.scratch / "heavy.gguf")
        write_tiny_model(self.model, ballast=args.ballast)

    async def serve(self, where: Path) -> RealServer:
        """
        A fresh one-slot server on the heavy model; with C{--slot-save}, its slot files in
        C{where}.
        """
        more: dict[str, Any] = {}
        if self.args.slot_save:
            slots = where / "slots"
            slots.mkdir(mode=0o700)
            more["slot_save_path"] = str(slots)
        server = RealServer(
            self.reactor,
            self.model,
            n_ctx=SLOT_CTX,
            parallel=1,
            threads=self.args.threads,
            cache_ram_mib=self.args.cache_ram,
            start_timeout=120.0,
            **more,
        )
        await server.start()
        return server

    async def loopd_in_front(self, port: int, where: Path) -> tuple[Any, Any, str, str]:
        """An inferproxy and twist loopd (TCP with a token) for the server on C{port}."""
        infer = str(where / "infer.sock")
        proxy = spawn_twist(
            self.reactor,
            b"inferproxy listening on",
            *("inferproxy", "--listen", infer, "--upstream", f"127.0.0.1:{port}"),
            *PROXY_LIMITS,
        )
        await proxy.ready
        token_file = where / "token"
        config = where / "loopd.toml"
        config.write_text(
            "[server]\n"
            f"listen = {json.dumps('unix:' + str(where / 'loopd.sock'))}\n"
            'tcp = "127.0.0.1:0"\n'
            f"token_file = {json.dumps(str(token_file))}\n"
            "[[endpoint]]\n"
            'name = "tiny"\n'
            f"socket = {json.dumps(infer)}\n"
            "selftest = false\n"
            + ENDPOINT_LIMITS
            + (
                f"slot_save = true\nslot_dir = {json.dumps(str(where / 'slots'))}\n"
                if self.args.slot_save
                else ""
            )
        )
        loopd = spawn_twist(self.reactor, b"loopd serving", "loopd", "--config", str(config))
        await loopd.ready
        found = _URL.search(loopd.output)
        if found is None:
            raise RuntimeError(f"twist loopd named no TCP listener: {loopd.output[-500:]!r}")
        return proxy, loopd, found.group(1).decode(), token_file.read_text().strip()

    async def agent_turns(self, home: AgentHome, run: PathRun) -> None:
        """The three turns of one agent; a failed turn is noted and ends its task."""
        await home.prepare()
        for index, prompt in enumerate(PROMPTS):
            turn = await home.turn(min(index, 1), prompt, self.args.turn_timeout)
            if turn.code != 0 or ANSWER not in turn.out:
                run.failures.append(f"{home.agent.heading} turn {index + 1}:\n{turn.tail()}")
                return

    async def one_path(self, name: str, path: str, agents: int, kit: Any) -> PathRun:
        """Agent C{name}'s task on C{path}, C{agents} of it at once, on a fresh stack."""
        from twisted.internet.defer import Deferred, gatherResults

        where = Path(tempfile.mkdtemp(prefix="p", dir=self.scratch))
        server = await self.serve(where)
        children: list[Any] = []
        homes: list[AgentHome] = []
        run = PathRun()
        try:
            if path == "loopd":
                proxy, loopd, address, token = await self.loopd_in_front(server.port, where)
                children += [loopd, proxy]
            else:
                address, token = f"127.0.0.1:{server.port}", "direct"
            spec = AGENTS[name]
            recipe = self.recipes[spec.heading].filled(address, "tiny")
            for index in range(agents):
                root = where / f"agent{index}"
                homes.append(
                    AgentHome(self.reactor, kit, spec, recipe, root, token=token, files=same_prompt)
                )
            before = prompt_tokens(server.port)
            start = time.perf_counter()
            tasks = [Deferred.fromCoroutine(self.agent_turns(home, run)) for home in homes]
            await gatherResults(tasks)
            run.wall = time.perf_counter() - start
            run.evaluated = prompt_tokens(server.port) - before
        finally:
            for home in homes:
                home.remove()
            for child in children:
                await stop_twist(child)
            await server.stop()
        return run

    async def measure(self) -> dict[str, dict[str, dict[str, list[PathRun]]]]:
        """Every agent, case, round and path; the runs by agent, case and path."""
        names = self.args.agents
        kit = await install(
            self.reactor,
            ROOT / "test" / "agents",
            npm=any(AGENTS[n].package for n in names),
            aider="aider" in names,
        )
        results: dict[str, dict[str, dict[str, list[PathRun]]]] = {}
        for name in names:
            for case, agents in (("alone", 1), ("sharing", 2)):
                if case not in self.args.cases:
                    continue
                runs = results.setdefault(name, {}).setdefault(case, {"loopd": [], "direct": []})
                for round_ in range(self.args.rounds):
                    order = ("loopd", "direct") if round_ % 2 == 0 else ("direct", "loopd")
                    for path in order:
                        print(f"  {name} {case} round {round_ + 1}: {path} ...", file=sys.stderr)
                        runs[path].append(await self.one_path(name, path, agents, kit))
        return results


def _median(values: Sequence[float]) -> float:
    """The median of C{values}."""
    return float(statistics.median(values))


def report(
    results: dict[str, dict[str, dict[str, list[PathRun]]]], args: argparse.Namespace
) -> bool:
    """Print the table; whether every run completed."""
    header = (
        f"The real coding agents, a three-turn task each, through loopd and straight to a real"
        f" llama.cpp server (xllamacpp {version('xllamacpp')}, one slot of {SLOT_CTX} tokens,"
        f" --threads {args.threads}, --cache-ram"
        f" {'default' if args.cache_ram is None else args.cache_ram}"
        f"{', --slot-save-path (loopd: slot_save)' if args.slot_save else ''}) on the tiny"
        " model with"
        f" ballast {args.ballast.ff}:"
        f"{args.ballast.layers}; {args.rounds} round(s), medians; {os.cpu_count()} CPUs shared"
        " by the server, loopd and the agents."
    )
    print("\n" + textwrap.fill(header, 96))
    complete = True
    row = "{:<14} {:<8} {:>10} {:>10} {:>7} {:>12} {:>12} {:>7}  {}"
    print(
        row.format(
            "agent",
            "case",
            "loopd s",
            "direct s",
            "ratio",
            "loopd tok",
            "direct tok",
            "ratio",
            "goal",
        )
    )
    for name, cases in results.items():
        for case, paths in cases.items():
            failures = [f for path in paths.values() for run in path for f in run.failures]
            if failures:
                complete = False
                print(row.format(name, case, "-", "-", "-", "-", "-", "-", "FAILED"))
                for failure in failures:
                    print(textwrap.indent(failure, "    "))
                continue
            wall = {p: _median([r.wall for r in runs]) for p, runs in paths.items()}
            tokens = {p: _median([r.evaluated for r in runs]) for p, runs in paths.items()}
            wall_ratio = wall["loopd"] / wall["direct"]
            token_ratio = tokens["loopd"] / tokens["direct"] if tokens["direct"] else float("nan")
            if case == "alone":
                met = wall_ratio <= GOAL_ALONE
                goal = f"wall <= {GOAL_ALONE}x: {'met' if met else 'MISSED'}"
            else:
                met = wall_ratio < 1 and token_ratio < 1
                goal = f"fewer tokens, less wall: {'met' if met else 'MISSED'}"
            print(
                row.format(
                    name,
                    case,
                    f"{wall['loopd']:.1f}",
                    f"{wall['direct']:.1f}",
                    f"{wall_ratio:.2f}",
                    f"{tokens['loopd']:.0f}",
                    f"{tokens['direct']:.0f}",
                    f"{token_ratio:.2f}",
                    goal,
                )
            )
    return complete


def _ballast(text: str) -> Ballast:
    """The --ballast option; its error becomes argparse's."""
    try:
        return Ballast.parse(text)
    except BallastError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _agents(text: str) -> list[str]:
    """The --agents option: names the kit knows."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in AGENTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"agents among {', '.join(AGENTS)}; not {unknown}")
    return names


def main() -> int:
    """Parse the options, run, print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=_agents, default=list(AGENTS), help="comma-separated")
    parser.add_argument("--cases", default="alone,sharing", help="alone, sharing or both")
    parser.add_argument("--ballast", type=_ballast, default=Ballast(4096, 6), metavar="FF:LAYERS")
    parser.add_argument("--rounds", type=positive, default=1, help="runs of each path")
    parser.add_argument("--threads", type=positive, default=2, help="llama-server threads")
    parser.add_argument(
        "--cache-ram",
        type=int,
        default=None,
        metavar="MIB",
        help="the server's host-RAM prompt cache (0: none; default: llama.cpp's, 8 GiB)",
    )
    parser.add_argument(
        "--slot-save",
        action="store_true",
        help="start the server with --slot-save-path and loopd's endpoint with slot_save",
    )
    parser.add_argument(
        "--turn-timeout", type=float, default=3600.0, help="seconds a turn may take"
    )
    args = parser.parse_args()
    args.cases = {case.strip() for case in args.cases.split(",")}
    from twisted.internet.defer import Deferred
    from twisted.internet.task import react

    complete: list[bool] = []

    async def run(reactor: Any) -> None:
        bench = Bench(reactor, args)
        try:
            complete.append(report(await bench.measure(), args))
        finally:
            shutil.rmtree(bench.scratch, ignore_errors=True)

    try:
        react(lambda reactor: Deferred.fromCoroutine(run(reactor)))
    except SystemExit as e:
        if e.code not in (0, None):
            return 1
    return 0 if complete and complete[0] else 1


if __name__ == "__main__":
    sys.exit(main())
