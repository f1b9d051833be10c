"""Benchmark: agents sharing ONE slot of a server whose prompt processing costs real time.

Run from the checkout root with ``python bench/agents.py`` (``tox -e bench``); ``--help``
lists the options. It needs the test extra (``xllamacpp``, ``gguf``, ``numpy``).

The model is the project's tiny model with zero-weight compute ballast
(``loopd.demo.tiny_model.Ballast``, ``--ballast``, 4096:6 by default): it answers exactly
like the plain one, but prompt processing costs real CPU time (about 800-1,300 tokens/s on
2 threads), so a session that lost its place in the KV cache pays seconds to get it back,
as with a real model. A real llama.cpp server (xllamacpp) serves it with ONE slot,
``python -m twisted inferproxy`` forwards a Unix socket to it and ``python -m twisted
loopd`` serves the gateway in front of that (self-test off, the queue deep enough, loopd's
own connection pacing as open as the inferproxy's).

``--agents`` (4) agents run at once, each ``--turns`` (4) turns of its own conversation: a
system prompt of ``--prompt-tokens`` (2,500) tokens of its own, then per turn a user
message (a tool's output, ``--growth`` (250) tokens), the answer (thinking off), then
``--tool-time`` (0.5) s of "running a tool" before the next turn, which sends the whole
history again. Every answer must be the tiny model's scripted one.

Each case runs on a fresh stack, both paths on the same server one after the other
(direct first; each path has session texts of its own, so neither inherits the other's
cache): ``loopd``, every agent with its own ``X-Session-Id`` through twist loopd;
``direct``, the same conversations straight to the server's TCP port with the body loopd's
client sends upstream (``id_slot`` -1: the server places them). The cases differ in the
server's host-RAM prompt cache: (a) ``--cache-ram`` of ``--small-cache-mib`` (4) MiB, too
small to hold the sessions; (b) llama.cpp's default (8 GiB), which holds them all; (c)
``--cache-ram 0``, none; (d) as (a), the server started with ``--slot-save-path`` and
loopd's ``[[endpoint]] slot_save = true``. (d) is skipped, saying why, when the real-server
harness has no slot-save path or loopd's config refuses ``slot_save``.

Per case it prints the wall time of each path (all agents from start to their last
answer) and the ratio loopd/direct, and the prompt tokens the server evaluated (the sum of
``timings.prompt_n`` over every answer) on each path and their ratio, with the goals
(issue 13): loopd's wall time at most 0.5x direct's in (a), (c) and (d), at most 1.0x in
(b); loopd's prompt tokens at most direct's in every case. It also prints the cached
tokens (``timings.cache_n``), the server's prefill speed on each path (``prompt_n`` over
``prompt_ms``; "-" where loopd's timings do not carry it) and the load average after
each path: the machine's other load shows there, and a slower prefill makes every switch
dearer. ``--rounds`` (1) repeats both paths on the case's stack, each round with
conversations of its own, and prints the medians (a ratio: the median of each round's), so
that a burst of other load on a shared machine weighs less. ``--quick`` runs a small
version (2 agents x 3 turns, 1,200-token prompts) to see that it works. The exit status
is 0 when every measurement ran (goals met or not), else 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from _client_e2e import ANSWER, PROXY_CMD, start_server
from _gateway_runs import run_concurrently
from _gateway_stack import loopd_config
from _lease_turns import _body, _post
from _report import non_negative, positive, verdict
from _servers import BenchError, Children, run_guarded, start_forwarder, wait_socket

from loopd.config import ConfigError, parse_config
from loopd.demo.tiny_model import Ballast, BallastError, write_tiny_model
from loopd.llama.types import Assistant, ChatMessage, System, User

N_CTX = 8192
"""The server's context: the one slot has all of it."""
SLOT_SAVE = "slot_save = true\n"
"""The [[endpoint]] field of case (d)."""


@dataclass(frozen=True)
class Case:
    """One server setting: its RAM prompt cache (None: the default) and slot saving."""

    key: str
    label: str
    cache_ram_mib: int | None
    slot_save: bool
    wall_goal: float


@dataclass(frozen=True)
class PathResult:
    """One path's run of every agent: wall time in s and the server's summed timings."""

    wall: float
    prompt_n: int
    prompt_ms: float
    cache_n: int
    answers: int


def cases(small_mib: int) -> tuple[Case, ...]:
    """The four cases, with the small RAM cache of (a) and (d) in MiB."""
    return (
        Case("a", f"(a) --cache-ram {small_mib}", small_mib, False, 0.5),
        Case("b", "(b) default RAM cache", None, False, 1.0),
        Case("c", "(c) --cache-ram 0", 0, False, 0.5),
        Case("d", "(d) (a) + slot_save", small_mib, True, 0.5),
    )


def filler(tokens: int, tag: str) -> str:
    """About `tokens` tokens of text of its own for tag (byte-level: one per character).

    No word the tiny model's vocabulary merges starts here, so a character is a token.
    """
    parts: list[str] = []
    size = 0
    index = 0
    while size < tokens:
        word = f" {tag}q{index % 89}"
        parts.append(word)
        size += len(word)
        index += 1
    return "".join(parts)[:tokens]


def _agent(
    path: str, target: int | str, index: int, round_: int, args: argparse.Namespace
) -> list[Any]:
    """Run one agent's turns on one path in one round; return every answer's timings."""
    tag = f"{path[0]}{index}r{round_}"
    history: list[ChatMessage] = [System(f"You are agent {tag}." + filler(args.prompt_tokens, tag))]
    session = f"agent-{index}-{round_}" if path == "loopd" else None
    timings: list[Any] = []
    for turn in range(args.turns):
        if turn:
            time.sleep(args.tool_time)
        history.append(User(f"Tool output {turn}:" + filler(args.growth, f"{tag}t{turn}")))
        answer = _post(target, _body(path, history), session, args.io_timeout)
        text = answer["choices"][0]["message"].get("content") or ""
        if text != ANSWER:
            raise BenchError(f"{path} agent {index} turn {turn}: answer {text!r}")
        timings.append(answer["timings"])
        history.append(Assistant(text))
    return timings


def run_path(path: str, target: int | str, round_: int, args: argparse.Namespace) -> PathResult:
    """Every agent at once on one path; the wall time and the summed timings."""
    found: list[list[Any]] = [[] for _ in range(args.agents)]

    def work(index: int) -> None:
        found[index] = _agent(path, target, index, round_, args)

    wall = run_concurrently(args.agents, work, path)
    timings = [t for agent in found for t in agent]
    prompt = sum(int(t.get("prompt_n", 0)) for t in timings)
    prompt_ms = sum(float(t.get("prompt_ms", 0.0)) for t in timings)
    cached = sum(int(t.get("cache_n", 0)) for t in timings)
    return PathResult(wall / 1e9, prompt, prompt_ms, cached, len(timings))


def slot_save_missing() -> str | None:
    """Why case (d) cannot run here (None: it can): the harness or loopd's config."""
    from loopd.demo.real_server import ServerOptions

    if "slot_save_path" not in {f.name for f in dataclasses.fields(ServerOptions)}:
        return "loopd.demo.real_server.ServerOptions has no slot_save_path"
    try:
        parse_config(loopd_config("/tmp/x.sock", "/tmp/y.sock") + SLOT_SAVE)
    except ConfigError as e:
        return f"loopd's config refuses it: {'; '.join(e.problems)}"
    return None


def start_case(children: Children, case: Case, args: argparse.Namespace) -> tuple[int, str]:
    """The ballast model on a one-slot server, inferproxy and loopd; port and loopd socket."""
    model = os.path.join(children.dir, "ballast.gguf")
    write_tiny_model(model, ballast=args.ballast)
    more: dict[str, Any] = {"n_ctx": N_CTX}
    if case.slot_save:
        more["slot_save_path"] = os.path.join(children.dir, "slots")
        os.mkdir(more["slot_save_path"], 0o700)
    port = start_server(children, model, args.threads, 1, case.cache_ram_mib, **more)
    infer = start_forwarder(children, "inferproxy", PROXY_CMD, port)
    listen = os.path.join(children.dir, "loopd.sock")
    config = os.path.join(children.dir, "loopd.toml")
    with open(config, "w", encoding="utf-8") as f:
        f.write(loopd_config(listen, infer))
        if case.slot_save:
            f.write(SLOT_SAVE + f"slot_dir = {json.dumps(more['slot_save_path'])}\n")
        f.write("\n[queue]\nserve = false\n")
        if args.grace_ms is not None:
            f.write(f"grace_ms = {args.grace_ms}\n")
    argv = [sys.executable, "-m", "twisted", "--log-format=text", "loopd", "--config", config]
    proc = children.spawn("loopd", argv, log=True)
    wait_socket(children, proc, "loopd", listen)
    return port, listen


@dataclass(frozen=True)
class Round:
    """Both paths of one round, and the 1-minute load average after each."""

    paths: dict[str, PathResult]
    load: dict[str, float]

    def ratio(self, figure: str) -> float:
        """loopd's figure (an attribute of PathResult) over direct's."""
        return _ratio(getattr(self.paths["loopd"], figure), getattr(self.paths["direct"], figure))


def measure_case(case: Case, args: argparse.Namespace) -> list[Round]:
    """The rounds of both paths on a fresh stack for one case, direct first in each;
    each round's conversations are new. The stack is stopped after."""
    children = Children()
    rounds: list[Round] = []
    try:
        port, listen = start_case(children, case, args)
        for round_ in range(args.rounds):
            paths: dict[str, PathResult] = {}
            load: dict[str, float] = {}
            for path, target in (("direct", port), ("loopd", listen)):
                print(f"  {case.label}, round {round_ + 1}: {path} ...", file=sys.stderr)
                paths[path] = run_path(path, target, round_, args)
                load[path] = os.getloadavg()[0]
            rounds.append(Round(paths, load))
    finally:
        children.stop_all()
    return rounds


def _ratio(value: float, anchor: float) -> float:
    """value / anchor, or infinity when the anchor is 0 and value is not."""
    if anchor:
        return value / anchor
    return 0.0 if not value else float("inf")


def _speed(result: PathResult) -> str:
    """The server's prefill speed on a path, tokens/s ("-": its answers had no prompt_ms)."""
    return f"{result.prompt_n / (result.prompt_ms / 1e3):.0f}" if result.prompt_ms else "-"


def print_case(case: Case, rounds: list[Round]) -> None:
    """Print one case: medians over its rounds, the ratios (median of each round's), goals."""
    loopd = [r.paths["loopd"] for r in rounds]
    direct = [r.paths["direct"] for r in rounds]
    wall = statistics.median(r.ratio("wall") for r in rounds)
    prompt = statistics.median(r.ratio("prompt_n") for r in rounds)
    print(
        f"{case.label:<24}{statistics.median(p.wall for p in loopd):>10.1f}s"
        f"{statistics.median(p.wall for p in direct):>8.1f}s{wall:>7.2f}"
        f"{statistics.median(p.prompt_n for p in loopd):>14.0f}"
        f"{statistics.median(p.prompt_n for p in direct):>9.0f}{prompt:>7.2f}"
    )
    print(f"{'':<24}wall ratio {verdict(wall, '<=', case.wall_goal)}")
    print(f"{'':<24}prompt ratio {verdict(prompt, '<=', 1.0)}")
    for number, one in enumerate(rounds, 1):
        mine, anchor = one.paths["loopd"], one.paths["direct"]
        if len(rounds) > 1:
            walls = f"{one.paths['loopd'].wall:.1f}s/{one.paths['direct'].wall:.1f}s"
            ratios = f"ratios {one.ratio('wall'):.2f} {one.ratio('prompt_n'):.2f}"
            print(f"{'':<24}round {number}: wall {walls}, {ratios}")
        print(
            f"{'':<24}  cached tokens {mine.cache_n}/{anchor.cache_n}, prefill tokens/s"
            f" {_speed(mine)}/{_speed(anchor)}"
        )
        print(f"{'':<24}  load average after {one.load['loopd']:.1f}/{one.load['direct']:.1f}")


def print_report(
    results: list[tuple[Case, list[Round]]],
    skipped: list[tuple[Case, str]],
    args: argparse.Namespace,
) -> None:
    """Print each case's wall times and prompt tokens, loopd against direct, with the goals."""
    header = (
        f"Agents sharing a slot: {args.agents} agents x {args.turns} turns at once on ONE"
        f" slot of a real llama.cpp server (xllamacpp {version('xllamacpp')}, --threads"
        f" {args.threads}, n_ctx {N_CTX}) serving the tiny model with zero-weight ballast"
        f" {args.ballast.ff}:{args.ballast.layers}; system prompts of {args.prompt_tokens}"
        f" tokens, {args.growth} more per turn, {args.tool_time:g} s of tool time between"
        " turns, thinking off. loopd: an X-Session-Id per agent through twist loopd"
        f" (grace_ms {'default' if args.grace_ms is None else args.grace_ms}); direct:"
        " straight to the server (the anchor, same server, run first). Prompt tokens: the"
        f" server's timings.prompt_n summed. {args.rounds} round(s) per case: medians, ratios"
        " the median of each round's; figure pairs are loopd/direct."
        f" {os.cpu_count()} CPUs, shared by all."
    )
    print("\n" + textwrap.fill(header, 88) + "\n")
    head = ("case", "wall loopd", "direct", "ratio", "prompt loopd", "direct", "ratio")
    print(
        f"{head[0]:<24}{head[1]:>11}{head[2]:>9}{head[3]:>7}{head[4]:>14}{head[5]:>9}{head[6]:>7}"
    )
    for case, rounds in results:
        print_case(case, rounds)
    for case, why in skipped:
        print(f"{case.label:<24}skipped: {why}")


def run(args: argparse.Namespace) -> None:
    """Run the cases asked for and print the report."""
    results: list[tuple[Case, list[Round]]] = []
    skipped: list[tuple[Case, str]] = []
    need = args.prompt_tokens + args.turns * (args.growth + 64) + 64
    if need > N_CTX:
        raise BenchError(f"about {need} tokens of conversation do not fit the {N_CTX} context")
    for case in cases(args.small_cache_mib):
        if case.key not in args.cases:
            continue
        why = slot_save_missing() if case.slot_save else None
        if why is not None:
            print(f"  {case.label}: skipped: {why}", file=sys.stderr)
            skipped.append((case, why))
            continue
        results.append((case, measure_case(case, args)))
    print_report(results, skipped, args)


def _ballast(text: str) -> Ballast:
    """Parse --ballast; a bad value is argparse's usage error."""
    try:
        return Ballast.parse(text)
    except BallastError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    """Parse a non-negative number of seconds."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be a number of seconds >= 0")
    return value


def _cases(text: str) -> str:
    """Parse --cases: letters out of a, b, c and d."""
    if not text or set(text) - set("abcd"):
        raise argparse.ArgumentTypeError("letters out of a, b, c, d (e.g. ac)")
    return text


FULL = {"agents": 4, "turns": 4, "prompt_tokens": 2500, "growth": 250}
"""The sizes of a full run (unless given explicitly)."""
QUICK = {"agents": 2, "turns": 3, "prompt_tokens": 1200, "growth": 100}
"""What --quick sets (unless given explicitly)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line; --quick fills in the small sizes not given."""
    parser = argparse.ArgumentParser(
        description="Benchmark agents sharing one slot through loopd against direct.",
    )
    add = parser.add_argument
    add("--agents", type=positive, help="agents at once (4; --quick 2)")
    add("--turns", type=positive, help="turns per agent (4; --quick 3)")
    add("--prompt-tokens", type=positive, help="system prompt tokens (2500; --quick 1200)")
    add("--growth", type=positive, help="tokens each turn adds (250; --quick 100)")
    add("--tool-time", type=_seconds, default=0.5, help="s between an agent's turns (0.5)")
    add("--cases", type=_cases, default="abcd", help="which cases to run (abcd)")
    add("--small-cache-mib", type=positive, default=4, help="(a), (d): --cache-ram MiB (4)")
    add("--ballast", type=_ballast, default="4096:6", help="the model's FF:LAYERS (4096:6)")
    add("--grace-ms", type=non_negative, help="loopd's [queue] grace_ms (default: loopd's)")
    add("--threads", type=positive, default=2, help="llama server threads (2)")
    add("--rounds", type=positive, default=1, help="rounds per case, medians (1)")
    add("--quick", action="store_true", help="a small run, to see that it works")
    add("--io-timeout", type=float, default=600.0, help="longest wait for an answer, s (600)")
    args = parser.parse_args(argv)
    defaults = (
        QUICK if args.quick else {"agents": 4, "turns": 4, "prompt_tokens": 2500, "growth": 250}
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    args = parse_args(argv)
    errors = (BenchError, OSError, http.client.HTTPException, json.JSONDecodeError)
    return run_guarded(lambda: run(args), errors)


if __name__ == "__main__":
    sys.exit(main())
