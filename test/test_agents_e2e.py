"""
The real coding agents as loopd's clients (issue 24 item 5, DESIGN decision 47): Claude
Code, Codex CLI, OpenCode, pi (its three APIs), Cline and Qwen Code from npm, Aider from
PyPI, each at its pinned version (C{test/agents}), installed by the kit
(L{loopd.test.support.agents}) into a cache on first use, configured from the manual's own
recipe (docs/agents.md, "Pointing an agent at loopd", read by
L{loopd.test.support.agent_recipes}), kept off the network, and run without a terminal with
its default tools and prompts against C{twist loopd} over TCP with its token, in front of a
real llama.cpp server with the project's tiny model.

The tiny model is a script: it thinks "Let me think about this...", calls one tool when it
is offered tools and no call was made yet, and once a tool result came back it answers
L{ANSWER}. So an agent that printed the answer in a run that offered tools sent a tool result
back (and loopd counted two completions or more). The thinking model thinks until loopd's
thinking cap makes the server end its reasoning.

For each agent:
 - C{test_turns}: turn 1 exits 0 with the answer after the tool round trip; the session id
   loopd logged is the agent's own (found in its private home), for agents that send one;
   turn 2, a new process continuing the session, exits 0 with the answer and reuses the
   cached conversation (loopd's C{loopd_tokens_total{kind="cached"}}, and for a named
   session loopd's "cache hit/loss for session ..." line of the turn);
 - C{test_thinking_cap}: on the model that thinks forever, with C{[thinking] cap = 64}, turn
   1 still exits 0 with the answer;
 - C{test_two_sessions_one_slot}: two sessions at once on a one-slot server both complete.

An agent that cannot be installed fails its tests with the installer's reason: it is not a
skip.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twisted.internet.defer import gatherResults, inlineCallbacks
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.logger import Logger
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.client import Agent as WebAgent
from twisted.web.client import readBody
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from loopd.test.support.agent_recipes import PAGE, Recipe, read_recipes
from loopd.test.support.agents import AGENTS, AgentHome, AgentRun, Kit, install
from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import ROOT, TwistProcess, spawn_twist, stop_twist

try:
    from loopd.demo.tiny_model import ANSWER
    from loopd.test.support.gateway_stack import loopd_toml, serve_behind_proxy
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the agents' end-to-end tests need the test extra: {e}") from None

MANIFESTS = Path(__file__).parent / "agents"
#: Each slot's context: Claude Code's and Qwen Code's prompts are ~72,000 tokens of the
#: tiny model's vocabulary (about a token a byte), and a conversation grows from there.
SLOT_CTX = 131072
#: The thinking cap of the thinking test, in tokens.
CAP = 64
#: The prompts of the two turns.
FIRST = "Run the command `true` with your shell tool, then say hi"
SECOND = "Now say bye"
#: Seconds one agent run may take (a cold 72,000-token prompt takes ~40 s here, several
#: minutes on a busy machine), and one test.
RUN_TIMEOUT = 1200.0
TEST_TIMEOUT = 3600
_URL = re.compile(rb"TCP listener on (http://(127\.0\.0\.1:\d+)):")
_CACHE_LINE = re.compile(
    r"cache (hit|loss) for session (.+?) on slot \d+: reused (\d+) of (\d+) tokens"
)
_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$", re.M)
_log = Logger(namespace="test.agents")


@implementer(IAgentEndpointFactory)
class _UnixEndpoints:
    """Every request to loopd's Unix socket (no token needed there)."""

    def __init__(self, reactor: Any, path: str) -> None:
        self.reactor, self.path = reactor, path

    def endpointForURI(self, uri: Any) -> UNIXClientEndpoint:
        return UNIXClientEndpoint(self.reactor, self.path)


@dataclass(frozen=True)
class Counts:
    """loopd's counters at one moment: requests (ok, failed) and prompt tokens."""

    ok: int = 0
    failed: int = 0
    evaluated: int = 0
    cached: int = 0

    def __sub__(self, other: Counts) -> Counts:
        return Counts(
            self.ok - other.ok,
            self.failed - other.failed,
            self.evaluated - other.evaluated,
            self.cached - other.cached,
        )

    @property
    def prompt(self) -> int:
        """Every prompt token, evaluated or reused."""
        return self.evaluated + self.cached


def counts(metrics: str) -> Counts:
    """L{Counts} from loopd's C{/metrics} page."""
    ok = failed = evaluated = cached = 0
    for name, labels, value in _SAMPLE.findall(metrics):
        if name not in ("loopd_requests_total", "loopd_tokens_total"):
            continue
        number = int(float(value))
        if name == "loopd_requests_total":
            if 'outcome="ok"' in labels:
                ok += number
            else:
                failed += number
        elif name == "loopd_tokens_total" and 'kind="prompt"' in labels:
            evaluated += number
        elif name == "loopd_tokens_total" and 'kind="cached"' in labels:
            cached += number
    return Counts(ok, failed, evaluated, cached)


class Stack:
    """
    A real llama.cpp server, C{twist inferproxy} and C{twist loopd} listening on its Unix
    socket and on a loopback TCP port with a token.

    @ivar url: loopd's TCP URL; C{address} its C{host:port}.
    """

    def __init__(self, loopd: TwistProcess, socket: str, url: str, address: str, token: str):
        self.loopd, self.socket, self.url, self.address, self.token = (
            loopd,
            socket,
            url,
            address,
            token,
        )

    def mark(self) -> int:
        """Where loopd's log is now: L{log} from here on."""
        return len(self.loopd.output)

    def log(self, since: int = 0) -> str:
        """loopd's log from C{since} on."""
        return self.loopd.output[since:].decode("utf-8", "replace")

    @inlineCallbacks
    def counts(self) -> Any:
        """loopd's L{Counts} now, scraped from C{/metrics} over its Unix socket."""
        reactor = real_reactor()
        agent = WebAgent.usingEndpointFactory(reactor, _UnixEndpoints(reactor, self.socket))
        response = yield agent.request(b"GET", b"http://loopd/metrics")
        body = yield readBody(response)
        return counts(body.decode())


@inlineCallbacks
def start_stack(test: TestCase, *, slots: int, think: bool = False) -> Any:
    """
    The stack for C{test}: the tiny model (C{think}: the one that thinks forever, under a
    thinking cap of L{CAP}) with C{slots} slots of L{SLOT_CTX} tokens each.
    """
    model = "tiny-think.gguf" if think else "tiny.gguf"
    directory, _, infer = yield serve_behind_proxy(test, model, slots, n_ctx=SLOT_CTX * slots)
    socket = os.path.join(directory, "loopd.sock")
    token_file = os.path.join(directory, "state", "token")
    text = loopd_toml(socket, infer, None, long=False)
    tcp = f'tcp = "127.0.0.1:0"\ntoken_file = {json.dumps(token_file)}\n'
    text = text.replace("[[endpoint]]", tcp + "[[endpoint]]", 1)
    if think:
        text += f"[thinking]\ncap = {CAP}\n"
    config = os.path.join(directory, "loopd.toml")
    with open(config, "w") as f:
        f.write(text)
    loopd = spawn_twist(real_reactor(), b"loopd serving", "loopd", "--config", config)
    test.addCleanup(stop_twist, loopd)
    test.addCleanup(_summarize, loopd)
    yield loopd.ready
    found = _URL.search(loopd.output)
    assert found is not None, loopd.output
    with open(token_file) as f:
        token = f.read().strip()
    return Stack(loopd, socket, found.group(1).decode(), found.group(2).decode(), token)


def _summarize(loopd: TwistProcess) -> None:
    """Log loopd's requests, cache outcomes, side conversations and warnings (test.log)."""
    for line in loopd.output.decode("utf-8", "replace").splitlines():
        if re.search(r'"POST |#warn|#error|cache (hit|loss)|side conversation', line):
            _log.info("loopd: {line}", line=line.split("] ", 1)[-1][:300])


@dataclass(frozen=True)
class CacheLine:
    """One "cache hit/loss for session ..." line of loopd's log."""

    verdict: str
    session: str
    reused: int
    expected: int


def cache_lines(log: str) -> list[CacheLine]:
    """The cache lines of C{log}, their sessions without a side conversation's suffix."""
    return [
        CacheLine(m.group(1), m.group(2).split(" side:")[0], int(m.group(3)), int(m.group(4)))
        for m in _CACHE_LINE.finditer(log)
    ]


class AgentTurnsTests:
    """
    The turns of one agent (C{test_turns}), mixed into a C{TestCase} per agent: C{agent}
    names it in L{AGENTS}.

    @cvar sends_session_id: whether it sends a session id of its own (default: the kit's).
    @cvar min_reuse: the least share of the conversation so far that its second turn must
        find cached.
    """

    agent: str
    sends_session_id: bool | None = None
    min_reuse = 0.9
    timeout = TEST_TIMEOUT

    # What C{TestCase} provides.
    addCleanup: Callable[..., None]
    assertEqual: Callable[..., None]
    assertTrue: Callable[..., None]
    fail: Callable[..., Any]

    @property
    def spec(self) -> Any:
        return AGENTS[self.agent]

    @property
    def named(self) -> bool:
        """Whether this agent's requests carry its own session id."""
        if self.sends_session_id is not None:
            return self.sends_session_id
        return bool(self.spec.session_id)

    def files(self, files: dict[str, str]) -> dict[str, str]:
        """The recipe's files as this test writes them (a variant changes them)."""
        return files

    @inlineCallbacks
    def kit(self) -> Any:
        """The installed agents this test needs (installed now if they are not)."""
        kit: Kit = yield install(
            real_reactor(),
            MANIFESTS,
            npm=self.spec.package is not None,
            aider=self.agent == "aider",
        )
        return kit

    def recipe(self, stack: Stack) -> Recipe:
        """This agent's recipe (docs/agents.md), filled for C{stack}."""
        return read_recipes(ROOT / PAGE)[self.spec.heading].filled(stack.address, "tiny")

    @inlineCallbacks
    def home(self, kit: Kit, stack: Stack) -> Any:
        """A new private home for this agent, configured from its recipe, set up."""
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="lag", dir="/tmp"))
        home = AgentHome(
            real_reactor(),
            kit,
            self.spec,
            self.recipe(stack),
            root,
            token=stack.token,
            files=self.files,
        )
        self.addCleanup(home.remove)
        yield home.prepare()
        return home

    def explain(self, stack: Stack, run: AgentRun, since: int, what: str) -> str:
        """A failure's message: what failed, the agent's run and loopd's log of it."""
        log = stack.log(since).rstrip().splitlines()[-40:]
        return f"{what}\n{run.tail()}\n--- loopd's log (tail)\n" + "\n".join(log)

    def check_answer(self, stack: Stack, run: AgentRun, since: int) -> None:
        """C{run} exited 0 with the model's answer, and left nothing running."""
        if run.code != 0 or ANSWER not in run.out:
            self.fail(self.explain(stack, run, since, f"no clean exit with {ANSWER!r}"))
        if run.leftovers:
            self.fail(self.explain(stack, run, since, f"left running: {run.leftovers}"))

    def check_completions(
        self, stack: Stack, run: AgentRun, since: int, done: Counts, turns: int, trip: bool
    ) -> None:
        """
        loopd refused nothing of C{turns} turns in C{done}, and answered each turn's
        completions: two or more with a tool round trip (C{trip}), one or more without; an
        agent that offers no tools, exactly one a turn.
        """
        _log.info(
            "{agent}: {ok} completions ({failed} failed), prompt tokens {evaluated} evaluated "
            "and {cached} reused, in {seconds:.1f} s",
            agent=self.spec.heading,
            ok=done.ok,
            failed=done.failed,
            evaluated=done.evaluated,
            cached=done.cached,
            seconds=run.seconds,
        )
        if done.failed:
            self.fail(self.explain(stack, run, since, f"loopd failed {done.failed} requests"))
        if not self.spec.tools:
            if done.ok != turns:
                self.fail(self.explain(stack, run, since, f"{done.ok} completions, not {turns}"))
        elif done.ok < turns * (2 if trip else 1):
            trips = " (no tool round trip)" if trip else ""
            self.fail(self.explain(stack, run, since, f"{done.ok} completions{trips}"))

    @inlineCallbacks
    def first_turn(self, stack: Stack, home: AgentHome) -> Any:
        """Turn 1, checked: fires with (the run, loopd's counts of it, its log mark)."""
        since = stack.mark()
        before = yield stack.counts()
        run = yield home.turn(0, FIRST, RUN_TIMEOUT)
        after = yield stack.counts()
        self.check_answer(stack, run, since)
        self.check_completions(stack, run, since, after - before, 1, True)
        return run, after - before, since

    @inlineCallbacks
    def second_turn(self, stack: Stack, home: AgentHome, first: Counts) -> Any:
        """
        Turn 2, a new process continuing the session, checked against turn 1's counts
        C{first}: fires with (the run, its log mark).
        """
        since = stack.mark()
        before = yield stack.counts()
        run = yield home.turn(1, SECOND, RUN_TIMEOUT)
        second = (yield stack.counts()) - before
        self.check_answer(stack, run, since)
        self.check_completions(stack, run, since, second, 1, False)
        self.check_reuse(stack, run, since, first, second)
        return run, since

    def check_reuse(self, stack: Stack, run: AgentRun, since: int, last: Counts, now: Counts):
        """
        The turn of C{now} found at least L{min_reuse} of the conversation cached: the
        prompt of the turn of C{last}, per completion, is the conversation up to it.
        """
        conversation = last.prompt / max(last.ok, 1)
        if now.cached < self.min_reuse * conversation:
            self.fail(
                self.explain(
                    stack,
                    run,
                    since,
                    f"reused {now.cached} tokens of a {conversation:.0f}-token conversation",
                )
            )

    def check_session(self, stack: Stack, home: AgentHome, run: AgentRun, since: int) -> str:
        """
        loopd logged this agent's session under an id of the agent's own (not anonymous),
        one that the agent stored in its home; fires with it.
        """
        ids = sorted({line.session for line in cache_lines(stack.log(since))})
        own = [i for i in ids if not i.startswith("anonymous:")]
        stored = home.session_ids(own)
        if not stored:
            self.fail(self.explain(stack, run, since, f"no session id of the agent's own in {ids}"))
        return stored[0]

    @inlineCallbacks
    def test_turns(self) -> Any:
        """
        Turn 1 answers after the tool round trip, under the agent's own session id when it
        sends one; turn 2, a new process continuing the session, answers and reuses the
        cached conversation.
        """
        kit = yield self.kit()
        stack = yield start_stack(self, slots=2)
        home = yield self.home(kit, stack)
        run, first, since = yield self.first_turn(stack, home)
        session = self.check_session(stack, home, run, since) if self.named else None
        run, since = yield self.second_turn(stack, home, first)
        if session is not None:
            lines = [x for x in cache_lines(stack.log(since)) if x.session == session]
            if not lines or lines[0].reused < self.min_reuse * lines[0].expected:
                self.fail(self.explain(stack, run, since, f"turn 2 of {session}: {lines}"))


class AgentTests(AgentTurnsTests):
    """
    Every test of one agent: its turns, the thinking cap, two sessions on one slot.
    """

    @inlineCallbacks
    def test_thinking_cap(self) -> Any:
        """
        On the model that thinks until it is stopped, loopd's thinking cap ends each
        completion's reasoning: turn 1 answers after its tool round trip.
        """
        kit = yield self.kit()
        stack = yield start_stack(self, slots=2, think=True)
        home = yield self.home(kit, stack)
        yield self.first_turn(stack, home)

    @inlineCallbacks
    def test_two_sessions_one_slot(self) -> Any:
        """
        Two sessions of the agent at once on a server with one slot: both answer (after
        their tool round trips), each under its own session id when the agent sends one.
        """
        kit = yield self.kit()
        stack = yield start_stack(self, slots=1)
        homes = yield gatherResults([self.home(kit, stack), self.home(kit, stack)])
        since = stack.mark()
        before = yield stack.counts()
        runs = yield gatherResults([home.turn(0, FIRST, RUN_TIMEOUT) for home in homes])
        after = yield stack.counts()
        for run in runs:
            self.check_answer(stack, run, since)
            self.check_completions(stack, run, since, after - before, 2, True)
        if self.named:
            ids = [self.check_session(stack, home, runs[0], since) for home in homes]
            self.assertEqual(len(set(ids)), 2, ids)


class ClaudeCodeTests(AgentTests, TestCase):
    """Claude Code 2.1.197: the Messages door, C{X-Claude-Code-Session-Id}."""

    agent = "claude-code"


class CodexTests(AgentTests, TestCase):
    """Codex CLI 0.171.0: the Responses door, C{session-id}."""

    agent = "codex"


class OpenCodeTests(AgentTests, TestCase):
    """OpenCode 1.18.33: chat completions, C{x-session-affinity}; a title request too."""

    agent = "opencode"


class _Pi(AgentTurnsTests):
    """pi 0.73.1 on one of its three APIs (C{api}), set in its recipe's models.json."""

    agent = "pi"
    api = "openai-completions"

    def files(self, files: dict[str, str]) -> dict[str, str]:
        """
        The recipe's models.json with C{api}; for C{anthropic-messages} the base URL has no
        C{/v1}, as the recipe says (the Anthropic SDK adds C{/v1/messages}).
        """
        path = "~/.pi/agent/models.json"
        models = json.loads(files[path])
        for provider in models["providers"].values():
            provider["api"] = self.api
            if self.api == "anthropic-messages":
                provider["baseUrl"] = provider["baseUrl"].removesuffix("/v1")
        return {**files, path: json.dumps(models)}


class PiCompletionsTests(_Pi, AgentTests, TestCase):
    """pi on chat completions: C{session_id} (with C{sendSessionAffinityHeaders})."""


class PiResponsesTests(_Pi, TestCase):
    """pi on Responses (C{session_id} by itself): turn 1 and turn 2."""

    api = "openai-responses"


class PiMessagesTests(_Pi, TestCase):
    """pi on Messages, where it sends no session id: turn 1 and turn 2."""

    api = "anthropic-messages"
    sends_session_id = False


class AiderTests(AgentTests, TestCase):
    """
    Aider 0.86.2: chat completions through LiteLLM, no session id, and no tools: it edits
    through text formats of its own, so each turn is one completion and there is no tool
    round trip to see (L{check_completions} asserts exactly one a turn). Its second turn
    (C{--restore-chat-history}) puts the first turn's exchange before its own closing
    instructions, not after them, so the prefix it shares with turn 1 ends there: about
    half of the conversation is reused (measured: 1,692 of 3,130 tokens).
    """

    agent = "aider"
    min_reuse = 0.4


class ClineTests(AgentTests, TestCase):
    """
    Cline 3.0.65: chat completions, no session id. Its CLI continues a task only in its
    terminal UI (C{cline --id}, which needs a TTY), so its second turn goes through the
    Agent Client Protocol, as an editor's would (C{cline --acp}: C{session/load} of the
    one-shot task, then C{session/prompt}). ACP offers the model 6 tools where the one-shot
    offers 25, so the second turn shares the first's prompt only up to where the tool lists
    part (measured: 11,023 of 11,911 tokens); a third turn, through ACP again, must reuse
    the second's. Each run is checked to leave no hub daemon (the recipe's
    C{CLINE_SESSION_BACKEND_MODE=local}).
    """

    agent = "cline"

    @inlineCallbacks
    def second_turn(self, stack: Stack, home: AgentHome, first: Counts) -> Any:
        """Turns 2 and 3 through ACP; fires with turn 3's (run, log mark)."""
        listed = yield home.run(["cline", "history", "--json"], RUN_TIMEOUT)
        task = json.loads(listed.out)[0]["sessionId"]
        since = stack.mark()
        before = yield stack.counts()
        run = yield home.acp_turn(["cline", "--acp"], task, SECOND, RUN_TIMEOUT)
        second = (yield stack.counts()) - before
        self.check_answer(stack, run, since)
        self.check_completions(stack, run, since, second, 1, False)
        since = stack.mark()
        before = yield stack.counts()
        run = yield home.acp_turn(["cline", "--acp"], task, "And once more", RUN_TIMEOUT)
        third = (yield stack.counts()) - before
        self.check_answer(stack, run, since)
        self.check_completions(stack, run, since, third, 1, False)
        self.check_reuse(stack, run, since, second, third)
        return run, since


class QwenCodeTests(AgentTests, TestCase):
    """
    Qwen Code 0.24.4: chat completions, no session id. Its second turn also sends a
    background memory-extraction request (another system prompt, ~40,000 tokens), which
    the turn waits for.
    """

    agent = "qwen"
