"""
Tests for L{loopd.selftest}, in memory on a clock: the client talks to a scripted fake
llama-server on a L{MemoryNet}; every limit is between 50 and 200 ms and nothing sleeps.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

import loopd
from loopd.digest import sha256_hex
from loopd.errors import ProxyRefused
from loopd.llama import Client
from loopd.selftest import (
    CheckResult,
    SelftestFailed,
    SelftestReport,
    judge_props,
    require_selftests,
    run_selftest,
)
from loopd.settings import Config, Endpoint, Expect, Limits, Retry
from loopd.testing.fake_llama import (
    CHAT,
    LOADING,
    PROPS,
    SLOTS,
    FakeLlama,
    Piece,
    RecordedRequest,
    Reply,
    error_reply,
    json_reply,
    sse_reply,
)
from loopd.testing.llama_replies import props_reply, slots_reply
from loopd.testing.memory_net import MemoryNet
from loopd.testing.reactor import MemoryLoopdReactor

PATH = "/tmp/ld-memory/selftest.sock"
OTHER = "/tmp/ld-memory/other.sock"
NOWHERE = "/tmp/ld-memory/nobody.sock"
TRANSCRIPTS = Path(loopd.__file__).resolve().parent.parent / "fixtures" / "transcripts"

TEMPLATE = "{%- for m in messages -%}{{ m.content }}{%- endfor -%}"
TEMPLATE_SHA = sha256_hex(TEMPLATE.encode("utf-8"))
WRONG_SHA = "0123456789abcdef" * 4
EXPECT = Expect(chat_template_sha256=TEMPLATE_SHA, n_ctx=4096, total_slots=2)
LIMITS = Limits(poll_ms=100, busy_wait_ms=200, load_wait_ms=200, idle_grace_ms=150, liveness_ms=100)
#: One retry after 50 ms, no jitter.
RETRY = Retry(attempts=2, backoff_ms=(50,), jitter=0.0, total_ms=1000)

#: Turn 1's context is 150 + 20 = 170 tokens; turn 2 reuses 168 of them.
TURN_1 = {"cache_n": 0, "prompt_n": 150, "predicted_n": 20}
TURN_2 = {"cache_n": 168, "prompt_n": 12, "predicted_n": 20}


def endpoint(name: str = "tiny", socket: str = PATH, **fields: Any) -> Endpoint:
    """A llama-server endpoint that expects what the fake's /props says by default."""
    return Endpoint(name=name, socket=socket, **{"expect": EXPECT, **fields})


def make_config(*endpoints: Endpoint) -> Config:
    """A config with the short limits above and C{endpoints} (one default one if none)."""
    return Config(endpoints=endpoints or (endpoint(),), limits=LIMITS, retry=RETRY)


def chunk(delta: dict[str, Any], finish: str | None = None, timings: Any = None) -> Any:
    """One streamed chat-completion chunk as llama-server sends it."""
    out: dict[str, Any] = {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
    }
    if timings is not None:
        out["timings"] = timings
    return out


def answer(text: str, timings: Any = TURN_1, finish: str = "stop") -> Reply:
    """A streamed answer: C{text}, then the finish with C{timings}."""
    return sse_reply([chunk({"content": text}), chunk({}, finish, timings)])


def tool_call(name: str, arguments: str, finish: str = "tool_calls") -> Reply:
    """A streamed tool call of C{name} with C{arguments}, then the finish."""
    call = {"index": 0, "id": "call-1", "type": "function"}
    call["function"] = {"name": name, "arguments": arguments}
    return sse_reply([chunk({"tool_calls": [call]}), chunk({}, finish, TURN_1)])


def recorded_tool_call() -> Reply:
    """The real tool-call transcript (fixtures/transcripts/tool-call.sse), ending in [DONE]."""
    body = (TRANSCRIPTS / "tool-call.sse").read_bytes()
    return sse_reply([Piece(0.0, body)], done=False)


class SelftestCase(SynchronousTestCase):
    """A fake llama-server whose /props matches L{EXPECT} and whose chats all pass."""

    def setUp(self) -> None:
        self.reactor = MemoryLoopdReactor()
        self.fake = FakeLlama(self.reactor)
        self.net = MemoryNet(self.reactor)
        self.net.listen(PATH, self.fake)
        self.fake.set_default("GET", PROPS, props_reply(total_slots=2, chat_template=TEMPLATE))
        self.fake.set_default("GET", SLOTS, slots_reply([False, False]))
        self.tool_reply = tool_call("get_weather", '{"city":"Paris"}')
        self.turn_replies = {1: answer("Red."), 2: answer("Blue.", TURN_2)}
        self.fake.set_default("POST", CHAT, self.route)

    def route(self, request: RecordedRequest, fake: FakeLlama) -> Reply:
        """The tool check gets C{tool_reply}; the cache check's turns their own reply."""
        if "tools" in request.json:
            return self.tool_reply
        return self.turn_replies[1 if len(request.json["messages"]) == 2 else 2]

    def client(self, *endpoints: Endpoint) -> Client:
        """A client for the first of C{endpoints} (the default endpoint if none)."""
        config = make_config(*endpoints)
        return Client(self.reactor, config, config.endpoints[0])

    def run_checks(self, *endpoints: Endpoint, clock: bool = False) -> SelftestReport:
        """Run the self-test to its end and return its report."""
        d = run_selftest(self.client(*endpoints), clock=self.reactor if clock else None)
        self.net.advance(10)
        return self.successResultOf(d)

    def check(self, report: SelftestReport, name: str) -> CheckResult:
        """The check called C{name} of C{report}."""
        (found,) = [c for c in report.checks if c.name == name]
        return found

    def assert_only_failure(self, report: SelftestReport, name: str) -> str:
        """Only check C{name} failed; return its line."""
        self.assertEqual([c.name for c in report.failures], [name])
        self.assertFalse(report.passed)
        line = self.check(report, name).line()
        self.assertTrue(line.startswith(f"FAIL {name}: "), line)
        return line


class RunSelftestTests(SelftestCase):
    """The three checks of L{run_selftest}."""

    def test_all_pass(self) -> None:
        """A server as configured passes props, tools and cache, in that order."""
        report = self.run_checks()
        self.assertTrue(report.passed)
        self.assertEqual(report.endpoint, "tiny")
        self.assertEqual([c.name for c in report.checks], ["props", "tools", "cache"])
        props, tools, cache = report.lines()
        self.assertEqual(
            props,
            f"PASS props: chat_template sha256 expected {TEMPLATE_SHA} got {TEMPLATE_SHA}, "
            "n_ctx expected 4096 got 4096, total_slots expected 2 got 2",
        )
        self.assertEqual(
            tools,
            "PASS tools: expected one get_weather call with JSON-object arguments, "
            'finish_reason tool_calls got get_weather {"city":"Paris"}, finish_reason tool_calls',
        )
        self.assertEqual(
            cache,
            "PASS cache: expected turn 2 to reuse turn 1's 150 tokens, at most 64 short "
            "got 168 reused (0 short)",
        )
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        self.assertEqual(self.net.open_connections(), [])

    def test_recorded_tool_call(self) -> None:
        """The real recorded tool-call stream passes the tool check."""
        self.tool_reply = recorded_tool_call()
        report = self.run_checks()
        self.assertTrue(report.passed, report.lines())
        self.assertIn('get_weather {"city":"test"}', self.check(report, "tools").actual)

    def test_wrong_template_hash(self) -> None:
        """A different chat template fails check 1, and its line shows both hashes."""
        line = self.assert_only_failure(
            self.run_checks(
                endpoint(expect=dataclasses.replace(EXPECT, chat_template_sha256=WRONG_SHA))
            ),
            "props",
        )
        self.assertIn(f"chat_template sha256 expected {WRONG_SHA} got {TEMPLATE_SHA}", line)

    def test_wrong_n_ctx(self) -> None:
        """A different per-slot n_ctx fails check 1 with both numbers."""
        report = self.run_checks(endpoint(expect=dataclasses.replace(EXPECT, n_ctx=8192)))
        self.assertIn("n_ctx expected 8192 got 4096", self.assert_only_failure(report, "props"))

    def test_wrong_total_slots(self) -> None:
        """A different number of slots fails check 1 with both numbers."""
        report = self.run_checks(endpoint(expect=dataclasses.replace(EXPECT, total_slots=4)))
        line = self.assert_only_failure(report, "props")
        self.assertIn("total_slots expected 4 got 2", line)

    def test_unset_expectations(self) -> None:
        """Expectations that are not set pass, and the line says they were not checked."""
        report = self.run_checks(endpoint(expect=Expect()))
        self.assertTrue(report.passed)
        self.assertEqual(
            report.lines()[0],
            f"PASS props: chat_template sha256 expected not set got {TEMPLATE_SHA} "
            "(not checked), n_ctx expected not set got 4096 (not checked), "
            "total_slots expected not set got 2 (not checked)",
        )

    def test_props_missing_values(self) -> None:
        """A /props without the template or slot count fails the set expectations."""
        props = {"default_generation_settings": {"n_ctx": 4096}}
        self.fake.set_default("GET", PROPS, json_reply(200, props))
        line = self.assert_only_failure(self.run_checks(), "props")
        self.assertIn(f"chat_template sha256 expected {TEMPLATE_SHA} got missing", line)
        self.assertIn("total_slots expected 2 got missing", line)

    def assert_tools_fail(self, reply: Reply, got: str) -> None:
        """With C{reply} as the tool check's answer, only check 2 fails, showing C{got}."""
        self.tool_reply = reply
        line = self.assert_only_failure(self.run_checks(), "tools")
        self.assertIn("expected one get_weather call with JSON-object arguments", line)
        self.assertTrue(line.endswith(f"got {got}"), line)

    def test_no_tool_call(self) -> None:
        """A plain answer instead of a tool call fails check 2."""
        self.assert_tools_fail(answer("Sunny."), "no tool call, finish_reason stop")

    def test_wrong_tool(self) -> None:
        """A call of another tool fails check 2."""
        got = 'get_time {"city":"Paris"}, finish_reason tool_calls'
        self.assert_tools_fail(tool_call("get_time", '{"city":"Paris"}'), got)

    def test_arguments_not_json(self) -> None:
        """Arguments that do not parse as JSON fail check 2."""
        got = 'get_weather {"city": (arguments not a JSON object), finish_reason tool_calls'
        self.assert_tools_fail(tool_call("get_weather", '{"city":'), got)

    def test_arguments_not_object(self) -> None:
        """Arguments that are JSON but not an object fail check 2."""
        got = 'get_weather ["Paris"] (arguments not a JSON object), finish_reason tool_calls'
        self.assert_tools_fail(tool_call("get_weather", '["Paris"]'), got)

    def test_finish_reason_stop(self) -> None:
        """The right call with finish_reason stop fails check 2."""
        got = 'get_weather {"city":"Paris"}, finish_reason stop'
        self.assert_tools_fail(tool_call("get_weather", '{"city":"Paris"}', "stop"), got)

    def test_cache_loss(self) -> None:
        """A turn 2 that reuses little of turn 1 fails check 3 with both numbers."""
        self.turn_replies[2] = answer("Blue.", {**TURN_2, "cache_n": 10, "prompt_n": 170})
        line = self.assert_only_failure(self.run_checks(), "cache")
        self.assertEqual(
            line,
            "FAIL cache: expected turn 2 to reuse turn 1's 150 tokens, at most 64 short "
            "got 10 reused (140 short)",
        )

    def test_turn_failure(self) -> None:
        """A turn the server refuses fails check 3 with the error text."""
        self.turn_replies[2] = error_reply(400, "invalid_request_error", "no way")
        check = self.check(self.run_checks(), "cache")
        self.assertFalse(check.passed)
        self.assertTrue(check.actual.startswith("turn 2 failed: Http: HTTP 400"), check.actual)
        self.assertIn("no way", check.actual)

    def test_requests_on_the_wire(self) -> None:
        """Check 2 forces the tool on slot 0 without thinking; check 3's turn 2 extends turn 1."""
        self.run_checks()
        tools, turn_1, turn_2 = [r.json for r in self.fake.requests_to("POST", CHAT)]
        self.assertEqual(tools["tool_choice"], "required")
        self.assertEqual([t["function"]["name"] for t in tools["tools"]], ["get_weather"])
        self.assertEqual(tools["chat_template_kwargs"], {"enable_thinking": False})
        self.assertEqual(tools["max_tokens"], 256)
        self.assertEqual([r["id_slot"] for r in (tools, turn_1, turn_2)], [0, 0, 0])
        self.assertNotIn("tools", turn_2)
        self.assertEqual(turn_2["messages"][:2], turn_1["messages"])
        self.assertEqual(turn_2["messages"][2], {"role": "assistant", "content": "Red."})
        self.assertEqual(turn_2["chat_template_kwargs"], {"enable_thinking": False})

    def test_unreachable(self) -> None:
        """
        A server nobody can reach fails props with the error in words; the other two checks
        are not run (they would only wait again), and nothing is left scheduled.
        """
        report = self.run_checks(endpoint(socket=NOWHERE), clock=True)
        self.assertEqual([c.passed for c in report.checks], [False, False, False])
        self.assertEqual(
            report.lines(),
            [
                "FAIL props: endpoint tiny is unreachable: no socket (nothing is serving it); "
                "gave up after 10 s",
                "FAIL tools: not run: /props did not reach endpoint tiny",
                "FAIL cache: not run: /props did not reach endpoint tiny",
            ],
        )
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_props_waits_for_load(self) -> None:
        """Given a clock, a /props answering 503 while the model loads is asked again."""
        self.fake.script("GET", PROPS, LOADING)
        report = self.run_checks(clock=True)
        self.assertTrue(report.passed, report.lines())
        self.assertEqual(len(self.fake.requests_to("GET", PROPS)), 2)

    def test_props_without_clock_once(self) -> None:
        """Without a clock, a /props answering 503 fails check 1 at once."""
        self.fake.script("GET", PROPS, LOADING)
        line = self.assert_only_failure(self.run_checks(), "props")
        self.assertEqual(line, "FAIL props: endpoint tiny answered HTTP 503: Loading model")


def refusal(limit: str = ProxyRefused.CONNECTIONS) -> Reply:
    """An inferproxy's refusal at C{limit}, with Retry-After 1."""
    return Reply(status=503, headers=[(ProxyRefused.HEADER, limit), ("Retry-After", "1")])


class BoundedWaitTests(SelftestCase):
    """
    The self-test's own bounded wait: a progress line per failed attempt, in order, and a
    failure at the endpoint's C{selftest_wait_ms}, whatever the client's retry schedule.
    """

    def start(self, *endpoints: Endpoint, retry: Retry = RETRY) -> Any:
        """Start the self-test with a clock, collecting its progress lines; return its Deferred."""
        config = dataclasses.replace(make_config(*endpoints), retry=retry)
        self.lines: list[str] = []
        client = Client(self.reactor, config, config.endpoints[0])
        return run_selftest(client, clock=self.reactor, on_progress=self.lines.append)

    def test_progress_lines_in_order(self) -> None:
        """
        No socket: a line at each attempt, at 0, 0.5, 1.5, 3.5 ... 9.5 s, saying what is
        waited for and how long of the bound has passed.
        """
        d = self.start(endpoint(socket=NOWHERE))
        self.net.advance(9.9)
        self.assertNoResult(d)
        what = "endpoint tiny: no socket (nothing is serving it), retrying"
        times = ["0", "0.5", "1.5", "3.5", "5.5", "7.5", "9.5"]
        self.assertEqual(self.lines, [f"{what} {t} of 10 s" for t in times])

    def test_fails_at_the_bound(self) -> None:
        """
        With the client's default retries (2 + 8 + 30 s), the self-test still ends at 10 s,
        not before and not after, with its readable line.
        """
        d = self.start(endpoint(socket=NOWHERE), retry=Retry())
        self.net.run_to(9.99)
        self.assertNoResult(d)
        self.net.run_to(10)
        report = self.successResultOf(d)
        self.assertEqual(
            report.lines()[0],
            "FAIL props: endpoint tiny is unreachable: no socket (nothing is serving it); "
            "gave up after 10 s",
        )
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_configured_bound(self) -> None:
        """selftest_wait_ms sets the bound: 3 s gives lines at 0, 0.5, 1.5 and fails at 3."""
        d = self.start(endpoint(socket=NOWHERE, selftest_wait_ms=3000))
        self.net.run_to(2.99)
        self.assertNoResult(d)
        self.net.run_to(3)
        self.assertIn("gave up after 3 s", self.successResultOf(d).lines()[0])
        self.assertEqual(
            [line.split(" retrying ")[1] for line in self.lines],
            ["0 of 3 s", "0.5 of 3 s", "1.5 of 3 s"],
        )

    def test_comes_up_while_waiting(self) -> None:
        """A server that appears during the wait passes: the wait ends at its first answer."""
        self.net.stop_listening(PATH)
        d = self.start()
        self.net.run_to(1)
        self.net.listen(PATH, self.fake)
        self.net.run_to(20)
        self.assertTrue(self.successResultOf(d).passed)
        self.assertEqual(len(self.lines), 2)

    def failure_line(self, *endpoints: Endpoint) -> str:
        """Run the self-test to its end; its props line."""
        d = self.start(*endpoints)
        self.net.advance(30)
        return str(self.successResultOf(d).lines()[0])

    def test_refused(self) -> None:
        """A stale socket (connection refused) says so."""
        self.net.kill(PATH)
        self.assertEqual(
            self.failure_line(),
            "FAIL props: endpoint tiny is unreachable: connection refused (nothing is "
            "listening on the socket); gave up after 10 s",
        )
        self.assertIn(
            "connection refused (nothing is listening on the socket), retrying 0 of", self.lines[0]
        )

    def test_refused_by_inferproxy(self) -> None:
        """An inferproxy at its connection cap: the line names the proxy's limit."""
        self.fake.set_default("GET", PROPS, refusal())
        self.assertEqual(
            self.failure_line(),
            "FAIL props: endpoint tiny is refusing connections: its inferproxy's connection "
            "limit is reached; gave up after 10 s",
        )
        self.assertEqual(
            self.lines[0],
            "endpoint tiny: refused by its inferproxy (its connection limit is reached), "
            "retrying 0 of 10 s",
        )

    def test_no_answer(self) -> None:
        """A server that accepts and never answers /props fails at the bound, cancelled."""
        self.fake.set_default("GET", PROPS, Reply(headers_delay=math.inf))
        self.assertEqual(
            self.failure_line(), "FAIL props: endpoint tiny did not answer /props within 10 s"
        )
        self.assertEqual(self.lines, [])
        self.assertEqual(self.net.open_connections(), [])

    def test_http_error(self) -> None:
        """An HTTP error is not waited for: props fails at once in words, the others still run."""
        self.fake.set_default("GET", PROPS, error_reply(500, "server_error", "it broke"))
        d = self.start()
        self.net.advance(0.01)
        report = self.successResultOf(d)
        self.assertEqual(report.lines()[0], "FAIL props: endpoint tiny answered HTTP 500: it broke")
        self.assertEqual([c.passed for c in report.checks], [False, True, True])
        self.assertEqual(self.lines, [])

    def test_loading_waits_for_load_wait(self) -> None:
        """A loading server (503) is waited for up to load_wait_ms when that is longer."""
        limits = dataclasses.replace(LIMITS, load_wait_ms=30_000)
        self.fake.set_default("GET", PROPS, LOADING)
        config = Config(endpoints=(endpoint(),), limits=limits, retry=RETRY)
        lines: list[str] = []
        d = run_selftest(
            Client(self.reactor, config, config.endpoints[0]),
            clock=self.reactor,
            on_progress=lines.append,
        )
        self.net.run_to(29.9)
        self.assertNoResult(d)
        self.net.run_to(30)
        report = self.successResultOf(d)
        self.assertIn(
            "endpoint tiny answered HTTP 503: Loading model; gave up after 30 s", report.lines()[0]
        )
        self.assertEqual(
            lines[0], "endpoint tiny: not ready (HTTP 503: Loading model), retrying 0 of 30 s"
        )

    def test_require_passes_progress(self) -> None:
        """require_selftests hands the lines to its progress sink."""
        lines: list[str] = []
        config = make_config(endpoint(socket=NOWHERE))
        d = require_selftests(self.reactor, config, {}, lines.append)
        self.net.advance(30)
        self.failureResultOf(d, SelftestFailed)
        self.assertEqual(len(lines), 7)


class JudgePropsTests(SynchronousTestCase):
    """L{judge_props} over any values and expectations."""

    @given(
        template=st.text(max_size=20),
        values=st.tuples(st.integers(1, 9), st.integers(1, 9)),
        wanted=st.tuples(
            st.none() | st.booleans(), st.none() | st.integers(1, 9), st.none() | st.integers(1, 9)
        ),
    )
    def test_passes_iff_set_expectations_hold(
        self, template: str, values: tuple[int, int], wanted: tuple[Any, Any, Any]
    ) -> None:
        """Check 1 passes exactly when every set expectation equals /props; each is shown."""
        digest = sha256_hex(template.encode("utf-8"))
        want_hash = None if wanted[0] is None else (digest if wanted[0] else WRONG_SHA)
        expect = Expect(chat_template_sha256=want_hash, n_ctx=wanted[1], total_slots=wanted[2])
        props = {
            "chat_template": template,
            "default_generation_settings": {"n_ctx": values[0]},
            "total_slots": values[1],
        }
        result = judge_props(props, expect)
        actual = (digest, *values)
        required = [
            (w, a) for w, a in zip((want_hash, *wanted[1:]), actual, strict=True) if w is not None
        ]
        self.assertEqual(result.passed, all(w == a for w, a in required))
        for shown in actual:
            self.assertIn(f"got {shown}", result.line())
        self.assertEqual(result.line().count("not set"), 3 - len(required))


class RequireSelftestsTests(SelftestCase):
    """L{require_selftests}: the gate before loopd serves."""

    def require(self, config: Config, clients: dict[str, Client] | None = None) -> Any:
        """Run the gate to its end; return its Deferred."""
        d = require_selftests(self.reactor, config, clients or {})
        self.net.advance(10)
        return d

    def test_skips_endpoints_without_selftest(self) -> None:
        """Endpoints with selftest false, and openai ones, are not tested at all."""
        config = make_config(
            endpoint(),
            endpoint("off", NOWHERE, selftest=False),
            endpoint("oai", NOWHERE, kind="openai", selftest=False),
        )
        client = Client(self.reactor, config, config.endpoints[0])
        reports = self.successResultOf(self.require(config, {"tiny": client}))
        self.assertEqual([r.endpoint for r in reports], ["tiny"])
        self.assertTrue(reports[0].passed)
        self.assertEqual({c.path for c in self.net.connections}, {PATH})

    def test_builds_missing_clients(self) -> None:
        """An endpoint without a client in C{clients} gets one built for it."""
        reports = self.successResultOf(self.require(make_config()))
        self.assertEqual([r.lines()[2][:10] for r in reports], ["PASS cache"])

    def test_failure_names_check(self) -> None:
        """The first failing endpoint's failing check, with its numbers, is in SelftestFailed."""
        self.net.listen(OTHER, self.fake)
        wrong = dataclasses.replace(EXPECT, chat_template_sha256=WRONG_SHA)
        config = make_config(endpoint(), endpoint("second", OTHER, expect=wrong))
        failure = self.failureResultOf(self.require(config), SelftestFailed)
        error = failure.value
        self.assertEqual(
            str(error),
            "self-test of endpoint second failed: FAIL props: chat_template sha256 expected "
            f"{WRONG_SHA} got {TEMPLATE_SHA}, n_ctx expected 4096 got 4096, "
            "total_slots expected 2 got 2",
        )
        self.assertEqual(error.report.endpoint, "second")
        self.assertEqual([r.passed for r in error.reports], [True, False])
