"""Benchmark: agents on two models of one llama-server router that keeps ONE loaded.

Run from the checkout root with ``python bench/models.py`` (``tox -e bench``); ``--help``
lists the options. It needs the test extra (``gguf``, ``numpy``) and the genuine
llama-server b11434 (``loopd.demo.llama_binary.ensure_llama_server``: ``$LOOPD_LLAMA_SERVER``,
else the cache, ``$LOOPD_LLAMA_CACHE`` or ``~/.cache/loopd/llama-server``, built there
first when missing, 6-9 minutes on 2 cores).

The router (``llama-server --models-dir DIR --models-max 1``) serves two models, ``m1``
and ``m2``: the project's tiny model with zero-weight compute ballast (``--ballast``,
8192:6 by default: the router's natively built binary prefills the 4096:6 of
bench/agents.py at ~3,800 tokens/s, twice its ballast at ~1,900), so that a prompt the
server lost costs seconds to evaluate again. A request for the model that is not loaded
makes the router stop the loaded one's server (once it is idle) and start the other's: a
swap, which loses the evicted model's KV cache with its process. Each model has one slot
per agent that uses it (``-np``, 2 by default), ``--ctx-size`` 8,192 per slot, and
``--cache-ram 0``: the RAM prompt cache lives in the model's own server process and dies
with it at a swap, so it cannot help across swaps, and with a slot per agent it has nothing
to do within one model either; a swap is the only way a conversation loses its cache.

``--agents`` (4) agents run at once, agent i on ``m1`` when i is even, else ``m2``, each
``--turns`` (4) turns of its own conversation: a system prompt of ``--prompt-tokens``
(2,500) tokens of its own, then per turn a user message (a tool's output, ``--growth``
(250) tokens), the answer (thinking off), then ``--tool-time`` (0.5) s of "running a tool"
before the next turn, which sends the whole history again. Every answer must be the tiny
model's scripted one.

Two paths, each on a router of its own started fresh for it (so that neither inherits the
other's caches or loaded model), with session texts of its own: ``direct`` (the anchor),
the agents post straight to the router's TCP port with the body loopd's client sends
upstream (``id_slot`` -1, the ``model`` named); ``loopd``, every agent with its own
``X-Session-Id`` through ``twist loopd`` over ``twist inferproxy`` in front of the router,
whose ``[[endpoint]]`` is ``kind = "llama-server-router"`` with ``models_max = 1``,
``slot_save = true`` (the router started with ``--slot-save-path``, a 0700 directory, as
``slot_dir``), ``swap_wait_ms`` (``--swap-wait-ms``, 10,000) and ``[queue] grace_ms``
(``--grace-ms``, 3,000: loopd's default); self-test off, the queue deep enough, loopd's
connection pacing as open as the inferproxy's. loopd's swap gate holds a request for the
model that is not loaded while the loaded one's sessions are mid-task, as long as the swap
would cost more (the router's learned load time, plus the victim's re-prefill, none with
slot files), and saves the evicted model's slots to files first, restoring them when the
model is back.

Per path it measures the wall time (all agents from start to their last answer), the
prompt tokens the server evaluated (the sum of ``timings.prompt_n`` over every answer) and
the cached ones (``timings.cache_n``), and the router's model loads: the lines of the
router's own log that say it spawns a model's server (``spawning server instance with
name=``), one per load. For loopd it also counts its swap decisions (its log's "router
gpu: X evicts Y" lines). It prints loopd's ratios to direct with the goals (issue 27):
loopd's wall time at most 0.5x direct's and its prompt tokens at most 0.3x; the loads are
reported. ``--rounds`` (3) repeats both paths, the order alternating (direct first in odd
rounds), each round with conversations and routers of its own, and prints the medians (a
ratio: the median of each round's), with the load average after each path. ``--quick`` runs
a small version (2 agents x 3 turns, 1,200-token prompts, one round) to see that it works.
The exit status is 0 when every measurement ran (goals met or not), else 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from typing import Any

from _client_e2e import ANSWER, PROXY_CMD
from _gateway_runs import SHORT_MAX_TOKENS, run_concurrently
from _lease_turns import _post
from _report import non_negative, positive, verdict
from _servers import BenchError, Children, run_guarded, start_forwarder, wait_socket
from agents import filler

from loopd.demo.llama_binary import VERSION, LlamaBuildError, ensure_llama_server
from loopd.demo.orphan_guard import guarded_argv
from loopd.demo.router_server import LISTENING, RouterOptions
from loopd.demo.tiny_model import Ballast, BallastError, write_tiny_model
from loopd.llama.request import chat_body, encode
from loopd.llama.types import Assistant, ChatMessage, ChatRequest, System, User
from loopd.settings import Config, Endpoint

MODELS = ("m1", "m2")
"""The router's two models (their ids: the file stems of its models dir)."""
ROUTER = "gpu"
"""The name of loopd's llama-server-router endpoint."""
SLOT_CTX = 8192
"""Each slot's context: the router's --ctx-size is this times the slots."""
READY_TIMEOUT = 60.0
"""Seconds the router has to answer /health and /v1/models."""
LOAD_LINE = re.compile(rb"spawning server instance with name=(\S+)")
"""The router's log line of each model load (the server it starts for the model)."""
EVICT_LINE = re.compile(rb"router \S+: (\S+) evicts (\S+)")
"""loopd's log line of each swap it lets happen."""
PATHS = ("direct", "loopd")
"""The paths, the anchor first."""
WALL_GOAL = 0.5
"""loopd's wall time at most this share of direct's."""
PROMPT_GOAL = 0.3
"""loopd's prompt tokens evaluated at most this share of direct's."""


@dataclass(frozen=True)
class PathResult:
    """One path's run of every agent: wall time in s, the server's summed timings, the
    router's loads and (loopd) the swaps loopd decided."""

    wall: float
    prompt_n: int
    cache_n: int
    answers: int
    loads: int
    evictions: int | None
    load_average: float


def model_of(index: int) -> str:
    """The model agent index uses: m1 for even agents, m2 for odd ones."""
    return MODELS[index % len(MODELS)]


def slots_per_model(agents: int) -> int:
    """One slot for each agent of the busier model."""
    return -(-agents // len(MODELS))


def _direct_body(model: str, history: list[ChatMessage]) -> bytes:
    """The body loopd's client sends the router for one turn (non-streaming)."""
    endpoint = Endpoint(name=model, socket="", model=model, router=ROUTER)
    request = ChatRequest(
        slot=-1, messages=tuple(history), thinking=False, max_tokens=SHORT_MAX_TOKENS
    )
    body = json.loads(encode(chat_body(request, Config(endpoints=(endpoint,)), endpoint)))
    body["stream"] = False
    body.pop("stream_options", None)
    return json.dumps(body).encode()


def _loopd_body(model: str, history: list[ChatMessage]) -> bytes:
    """The OpenAI body of one turn, naming the model, thinking off (non-streaming)."""
    wire: list[dict[str, str]] = []
    for message in history:
        role = {System: "system", User: "user", Assistant: "assistant"}[type(message)]
        wire.append({"role": role, "content": getattr(message, "content", "")})
    return json.dumps(
        {
            "model": model,
            "messages": wire,
            "max_tokens": SHORT_MAX_TOKENS,
            "reasoning_effort": "none",
            "stream": False,
        }
    ).encode()


def _agent(
    path: str, target: int | str, index: int, round_: int, args: argparse.Namespace
) -> list[Any]:
    """Run one agent's turns on one path in one round; return every answer's timings."""
    tag = f"{path[0]}{index}r{round_}"
    model = model_of(index)
    history: list[ChatMessage] = [System(f"You are agent {tag}." + filler(args.prompt_tokens, tag))]
    session = f"agent-{index}-{round_}" if path == "loopd" else None
    timings: list[Any] = []
    for turn in range(args.turns):
        if turn:
            time.sleep(args.tool_time)
        history.append(User(f"Tool output {turn}:" + filler(args.growth, f"{tag}t{turn}")))
        if path == "loopd":
            body = _loopd_body(model, history)
        else:
            body = _direct_body(model, history)
        answer = _post(target, body, session, args.io_timeout)
        text = answer["choices"][0]["message"].get("content") or ""
        if text != ANSWER:
            raise BenchError(f"{path} agent {index} ({model}) turn {turn}: answer {text!r}")
        timings.append(answer["timings"])
        history.append(Assistant(text))
    return timings


def _get(port: int, path: str) -> tuple[int, bytes]:
    """GET path from the router; its status and body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def start_router(
    children: Children, binary: str, models: str, args: argparse.Namespace, slots: str | None
) -> int:
    """The router over the models dir (--models-max 1, --cache-ram 0, slot files in slots
    when given); its port, once /health and /v1/models answer 200."""
    parallel = slots_per_model(args.agents)
    options = RouterOptions(
        binary,
        models,
        models_max=1,
        n_ctx=SLOT_CTX * parallel,
        parallel=parallel,
        threads=args.threads,
        cache_ram_mib=0,
        slot_save_path=slots,
    )
    proc = children.spawn("router", guarded_argv(options.command()), log=True)
    logpath = os.path.join(children.dir, "router.log")
    deadline = time.monotonic() + READY_TIMEOUT
    port = 0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = children.log_tail(proc)
            raise BenchError(f"the router exited with {proc.returncode}:\n{tail}")
        if not port:
            with open(logpath, "rb") as f:
                found = LISTENING.search(f.read().decode(errors="replace"))
            port = int(found.group(1)) if found else 0
        if port:
            try:
                if _get(port, "/health")[0] == 200 and _get(port, "/v1/models")[0] == 200:
                    return port
            except OSError:
                pass
        time.sleep(0.1)
    raise BenchError(f"the router was not ready within {READY_TIMEOUT} s")


def loopd_config(listen: str, infer: str, slots: str, args: argparse.Namespace) -> str:
    """loopd.toml: one llama-server-router endpoint (models_max 1, slot files), no
    self-test, a deep queue, the inferproxy's limits, the grace asked for."""
    return "\n".join(
        [
            "[server]",
            f"listen = {json.dumps('unix:' + listen)}",
            "",
            "[limits]",
            "queue_depth = 64",
            "",
            "[queue]",
            "serve = false",
            f"grace_ms = {args.grace_ms}",
            "",
            "[[endpoint]]",
            f"name = {json.dumps(ROUTER)}",
            'kind = "llama-server-router"',
            f"socket = {json.dumps(infer)}",
            "selftest = false",
            "models_max = 1",
            f"swap_wait_ms = {args.swap_wait_ms}",
            "slot_save = true",
            f"slot_dir = {json.dumps(slots)}",
            # The limits PROXY_CMD starts the inferproxy with (loopd paces to them).
            "proxy_max_connections = 64",
            "proxy_burst = 1000000",
            "proxy_refill_per_second = 1000000",
            "",
        ]
    )


def start_path(
    children: Children, path: str, binary: str, models: str, args: argparse.Namespace
) -> int | str:
    """A fresh router for path, and for loopd inferproxy and loopd in front of it; where
    the agents post (the router's port, or loopd's socket)."""
    if path == "direct":
        return start_router(children, binary, models, args, None)
    slots = os.path.join(children.dir, "slots")
    os.mkdir(slots, 0o700)
    port = start_router(children, binary, models, args, slots)
    infer = start_forwarder(children, "inferproxy", PROXY_CMD, port)
    listen = os.path.join(children.dir, "loopd.sock")
    config = os.path.join(children.dir, "loopd.toml")
    with open(config, "w", encoding="utf-8") as f:
        f.write(loopd_config(listen, infer, slots, args))
    argv = [sys.executable, "-m", "twisted", "--log-format=text", "loopd", "--config", config]
    proc = children.spawn("loopd", argv, log=True)
    wait_socket(children, proc, "loopd", listen)
    return listen


def _count(children: Children, name: str, line: re.Pattern[bytes]) -> int:
    """How many lines of child name's log match line."""
    with open(os.path.join(children.dir, f"{name}.log"), "rb") as f:
        return len(line.findall(f.read()))


def run_path(
    path: str, round_: int, binary: str, models: str, args: argparse.Namespace
) -> PathResult:
    """Every agent at once on one path, on a fresh router (and loopd); the wall time, the
    summed timings and the loads. The processes are stopped after."""
    children = Children()
    try:
        target = start_path(children, path, binary, models, args)
        found: list[list[Any]] = [[] for _ in range(args.agents)]

        def work(index: int) -> None:
            found[index] = _agent(path, target, index, round_, args)

        wall = run_concurrently(args.agents, work, path)
        load_average = os.getloadavg()[0]
        loads = _count(children, "router", LOAD_LINE)
        evictions = _count(children, "loopd", EVICT_LINE) if path == "loopd" else None
        if args.keep_logs:
            into = os.path.join(args.keep_logs, f"r{round_ + 1}-{path}")
            skip = shutil.ignore_patterns("*.sock", "slots")
            kept = shutil.copytree(children.dir, into, ignore=skip)
            print(f"  logs kept in {kept}", file=sys.stderr)
    finally:
        children.stop_all()
    timings = [t for agent in found for t in agent]
    return PathResult(
        wall / 1e9,
        sum(int(t.get("prompt_n", 0)) for t in timings),
        sum(int(t.get("cache_n", 0)) for t in timings),
        len(timings),
        loads,
        evictions,
        load_average,
    )


@dataclass(frozen=True)
class Round:
    """Both paths of one round."""

    paths: dict[str, PathResult]

    def ratio(self, figure: str) -> float:
        """loopd's figure (an attribute of PathResult) over direct's."""
        return _ratio(getattr(self.paths["loopd"], figure), getattr(self.paths["direct"], figure))


def _ratio(value: float, anchor: float) -> float:
    """value / anchor, or infinity when the anchor is 0 and value is not."""
    if anchor:
        return value / anchor
    return 0.0 if not value else float("inf")


def _median(rounds: list[Round], path: str, figure: str) -> float:
    """The median of one path's figure over the rounds."""
    return statistics.median(float(getattr(r.paths[path], figure)) for r in rounds)


def print_report(rounds: list[Round], args: argparse.Namespace) -> None:
    """Print the medians, the ratios (the median of each round's) with the goals, and each
    round's figures."""
    parallel = slots_per_model(args.agents)
    header = (
        f"Agents on two models of one router: {args.agents} agents x {args.turns} turns at"
        f" once, half on m1, half on m2, served by the genuine llama-server {VERSION} in"
        f" router mode, --models-max 1 ({parallel} slots per model, --ctx-size"
        f" {SLOT_CTX * parallel}, --cache-ram 0, --threads {args.threads}), each model the"
        f" tiny model with zero-weight ballast {args.ballast.ff}:{args.ballast.layers};"
        f" system prompts of {args.prompt_tokens} tokens, {args.growth} more per turn,"
        f" {args.tool_time:g} s of tool time between turns, thinking off. loopd: an"
        " X-Session-Id per agent through twist loopd (llama-server-router endpoint,"
        f" models_max 1, slot_save, swap_wait_ms {args.swap_wait_ms}, grace_ms"
        f" {args.grace_ms}); direct: straight to the router (the anchor). Each path on a"
        " fresh router. Prompt tokens: the server's timings.prompt_n summed; loads: the"
        " router log's model server starts. "
        f"{args.rounds} round(s), the order alternating: medians, ratios the median of each"
        f" round's; figure pairs are loopd/direct. {os.cpu_count()} CPUs, shared by all."
    )
    print("\n" + textwrap.fill(header, 88) + "\n")
    head = ("", "loopd", "direct", "ratio")
    print(f"{head[0]:<26}{head[1]:>10}{head[2]:>10}{head[3]:>8}")
    wall = statistics.median(r.ratio("wall") for r in rounds)
    prompt = statistics.median(r.ratio("prompt_n") for r in rounds)
    loads = statistics.median(r.ratio("loads") for r in rounds)
    print(
        f"{'wall time (s)':<26}{_median(rounds, 'loopd', 'wall'):>10.1f}"
        f"{_median(rounds, 'direct', 'wall'):>10.1f}{wall:>8.2f}   {verdict(wall, '<=', WALL_GOAL)}"
    )
    print(
        f"{'prompt tokens evaluated':<26}{_median(rounds, 'loopd', 'prompt_n'):>10.0f}"
        f"{_median(rounds, 'direct', 'prompt_n'):>10.0f}{prompt:>8.2f}"
        f"   {verdict(prompt, '<=', PROMPT_GOAL)}"
    )
    print(
        f"{'cached tokens':<26}{_median(rounds, 'loopd', 'cache_n'):>10.0f}"
        f"{_median(rounds, 'direct', 'cache_n'):>10.0f}"
    )
    print(
        f"{'model loads':<26}{_median(rounds, 'loopd', 'loads'):>10.0f}"
        f"{_median(rounds, 'direct', 'loads'):>10.0f}{loads:>8.2f}   (reported)"
    )
    print(f"{'swaps loopd decided':<26}{_median(rounds, 'loopd', 'evictions'):>10.0f}")
    for number, one in enumerate(rounds, 1):
        mine, anchor = one.paths["loopd"], one.paths["direct"]
        first = "direct" if number % 2 else "loopd"
        print(
            f"round {number} ({first} first): wall {mine.wall:.1f}s/{anchor.wall:.1f}s"
            f" ({one.ratio('wall'):.2f}), prompt {mine.prompt_n}/{anchor.prompt_n}"
            f" ({one.ratio('prompt_n'):.2f}), cached {mine.cache_n}/{anchor.cache_n}, loads"
            f" {mine.loads}/{anchor.loads} (loopd's swaps {mine.evictions}), load average"
            f" after {mine.load_average:.1f}/{anchor.load_average:.1f}"
        )


def run(args: argparse.Namespace) -> None:
    """Write the two models, run the rounds and print the report."""
    need = args.prompt_tokens + args.turns * (args.growth + 64) + 64
    if need > SLOT_CTX:
        raise BenchError(f"about {need} tokens of conversation do not fit a {SLOT_CTX} slot")
    binary = ensure_llama_server(lambda line: print(f"  {line}", file=sys.stderr))
    models = tempfile.mkdtemp(prefix="lbm", dir="/tmp")
    rounds: list[Round] = []
    try:
        for name in MODELS:
            write_tiny_model(os.path.join(models, f"{name}.gguf"), ballast=args.ballast)
        for round_ in range(args.rounds):
            paths: dict[str, PathResult] = {}
            order = PATHS if round_ % 2 == 0 else PATHS[::-1]
            for path in order:
                print(f"  round {round_ + 1}: {path} ...", file=sys.stderr)
                paths[path] = run_path(path, round_, binary, models, args)
                print(f"    {dataclasses.asdict(paths[path])}", file=sys.stderr)
            rounds.append(Round(paths))
    finally:
        shutil.rmtree(models, ignore_errors=True)
    print_report(rounds, args)


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


FULL = {"agents": 4, "turns": 4, "prompt_tokens": 2500, "growth": 250, "rounds": 3}
"""The sizes of a full run (unless given explicitly)."""
QUICK = {"agents": 2, "turns": 3, "prompt_tokens": 1200, "growth": 100, "rounds": 1}
"""What --quick sets (unless given explicitly)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line; --quick fills in the small sizes not given."""
    parser = argparse.ArgumentParser(
        description="Benchmark agents on two models of a one-model router through loopd"
        " against direct.",
    )
    add = parser.add_argument
    add("--agents", type=positive, help="agents at once, half per model (4; --quick 2)")
    add("--turns", type=positive, help="turns per agent (4; --quick 3)")
    add("--prompt-tokens", type=positive, help="system prompt tokens (2500; --quick 1200)")
    add("--growth", type=positive, help="tokens each turn adds (250; --quick 100)")
    add("--tool-time", type=_seconds, default=0.5, help="s between an agent's turns (0.5)")
    add("--ballast", type=_ballast, default="8192:6", help="the models' FF:LAYERS (8192:6)")
    add("--grace-ms", type=non_negative, default=3000, help="loopd's [queue] grace_ms (3000)")
    add("--swap-wait-ms", type=positive, default=10000, help="loopd's swap_wait_ms (10000)")
    add("--threads", type=positive, default=2, help="each model server's threads (2)")
    add("--rounds", type=positive, help="rounds of both paths, medians (3; --quick 1)")
    add("--quick", action="store_true", help="a small run, to see that it works")
    add("--io-timeout", type=float, default=600.0, help="longest wait for an answer, s (600)")
    add("--keep-logs", metavar="DIR", help="copy each path's logs and config into DIR")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    args = parse_args(argv)
    errors = (BenchError, OSError, http.client.HTTPException, json.JSONDecodeError)
    return run_guarded(lambda: run(args), (*errors, LlamaBuildError))


if __name__ == "__main__":
    sys.exit(main())
