"""
Tests for L{loopd.gateway.telemetry}: the spans of the gateway's requests, made by
L{TelemetryWatcher} from each request's record, read with OpenTelemetry's own in-memory
exporter behind requests through the whole gateway in memory
(L{loopd.testing.gateway.GatewayHarness}, L{loopd.testing.mesh.MeshHarness}): a plain
answer, a failed call, a retry, a lease wait, a mesh turn, a client that leaves, a refused
request; that no prompt or answer text ever reaches a span; that the attributes' names are
the GenAI conventions'; that OpenTelemetry stays an optional import; and, once, the real
export (L{GatewayTelemetry}) over a real Unix socket to a collector that decodes what came.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase
from twisted.web.server import Site

import loopd
from loopd.gateway.activity import ActivityWatcher, CallRecord, RequestRecord
from loopd.llama.types import Timings
from loopd.settings import Config, Retry, Telemetry
from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import ROOT
from loopd.testing.fake_llama import CHAT, error_reply, sse_reply
from loopd.testing.gateway import HI, NOW, GatewayHarness, make_config
from loopd.testing.llama_replies import answer
from loopd.testing.mesh import ASK, MeshHarness, says

try:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode

    from loopd.gateway.telemetry import (
        GEN_AI_ATTRIBUTES,
        GatewayTelemetry,
        TelemetryWatcher,
        session_label,
    )
    from loopd.test.support.otlp_receiver import OtlpReceiver
except ImportError as e:  # pragma: no cover - the telemetry extra is not installed
    raise SkipTest(f"the telemetry tests need the telemetry extra: {e}") from None

#: A prompt and an answer no span may carry.
SECRET_PROMPT = "purple elephant forty-two"
SECRET_ANSWER = "green giraffe seventeen"
ASK_SECRET = {"messages": [{"role": "user", "content": SECRET_PROMPT}]}


class Records(ActivityWatcher):
    """Keeps every request record that ended."""

    def __init__(self) -> None:
        self.ended: list[RequestRecord] = []

    def request_ended(self, record: RequestRecord) -> None:
        self.ended.append(record)


def ns(record: RequestRecord, at: float | None) -> int:
    """The wall clock's nanoseconds of reactor time C{at} of C{record}."""
    assert at is not None
    return round(record.wall_started * 1e9) + round((at - record.started) * 1e9)


class SpanCase(SynchronousTestCase):
    """A gateway in memory whose activity a telemetry watcher hears, spans kept in memory."""

    def watch(self, harness: GatewayHarness, session_ids: str = "hash") -> None:
        """Make C{harness}'s requests into spans, kept by an in-memory exporter."""
        self.harness = harness
        self.exporter = InMemorySpanExporter()
        exporter = self.exporter

        def emit(span: ReadableSpan) -> None:
            exporter.export([span])

        watcher = TelemetryWatcher(emit, harness.config.endpoints, session_ids)
        self.records = Records()
        harness.gateway.activity.watch(watcher)
        harness.gateway.activity.watch(self.records)

    def spans(self) -> Sequence[ReadableSpan]:
        """Every span finished so far."""
        return self.exporter.get_finished_spans()

    def request_span(self) -> ReadableSpan:
        """The one request span (kind SERVER)."""
        (span,) = [s for s in self.spans() if s.kind is SpanKind.SERVER]
        return span

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        """The spans whose parent is C{parent}, in the order they ended."""
        return [
            s
            for s in self.spans()
            if s.parent is not None and s.parent.span_id == parent.context.span_id
        ]

    def record(self) -> RequestRecord:
        """The one request's record."""
        (record,) = self.records.ended
        return record


class AnswerTests(SpanCase):
    """A request that is answered: its span and its call's, with their times."""

    def setUp(self) -> None:
        self.watch(GatewayHarness())

    def test_request_and_call(self) -> None:
        """
        The request is a SERVER span C{chat} (no model named), the upstream call a CLIENT
        span C{chat tiny} under it, in the same trace; no lease wait without leases.
        """
        self.harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
        self.harness.post(HI, session="s1")
        self.harness.advance(1)
        request = self.request_span()
        self.assertEqual((request.name, request.parent), ("chat", None))
        (call,) = self.children(request)
        self.assertEqual((call.name, call.kind), ("chat tiny", SpanKind.CLIENT))
        self.assertEqual(call.context.trace_id, request.context.trace_id)
        self.assertEqual(self.children(call), [])
        self.assertEqual(len(self.spans()), 2)

    def test_times(self) -> None:
        """
        Each span starts and ends at its record's reactor times placed on the wall clock;
        the request's first token and the call's send are events at their times.
        """
        self.harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
        self.harness.post(HI, session="s1")
        self.harness.advance(1)
        record = self.record()
        (call_record,) = record.calls
        request = self.request_span()
        (call,) = self.children(request)
        self.assertEqual(request.start_time, NOW * 10**9)
        self.assertEqual(
            (request.start_time, request.end_time),
            (ns(record, record.started), ns(record, record.ended)),
        )
        self.assertGreater(request.end_time or 0, request.start_time or 0)
        self.assertEqual(
            (call.start_time, call.end_time),
            (ns(record, call_record.started), ns(record, call_record.ended)),
        )
        self.assertEqual(
            [(e.name, e.timestamp) for e in request.events],
            [("first_token", ns(record, record.first_token))],
        )
        self.assertEqual(
            [(e.name, e.timestamp) for e in call.events], [("sent", ns(record, call_record.sent))]
        )

    def test_request_attributes(self) -> None:
        """The request's span: GenAI's names where they fit, loopd's own for the rest."""
        self.harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
        connection = self.harness.connect()
        connection.request(
            "POST",
            CHAT,
            b'{"model": "tiny", "stream": true, "messages": [{"role": "user", "content": "Hi"}]}',
            ["X-Session-Id: s1", "User-Agent: claude-cli/2.0.1 (external)"],
        )
        self.harness.advance(1)
        record = self.record()
        request = self.request_span()
        self.assertEqual(request.name, "chat tiny")
        self.assertEqual(request.status.status_code, StatusCode.UNSET)
        assert record.first_token is not None
        self.assertEqual(
            dict(request.attributes or {}),
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": "tiny",
                "gen_ai.response.model": "tiny",
                "gen_ai.usage.input_tokens": 13,
                "gen_ai.usage.cache_read.input_tokens": 3,
                "gen_ai.usage.output_tokens": 2,
                "gen_ai.response.time_to_first_chunk": round(
                    record.first_token - record.started, 6
                ),
                "http.response.status_code": 200,
                "loopd.request.id": record.id,
                "loopd.door": "chat",
                "loopd.session": session_label("s1", "hash"),
                "loopd.session.anonymous": False,
                "loopd.agent": "claude-cli/2.0.1",
                "loopd.stream": True,
                "loopd.mesh": False,
                "loopd.calls": 1,
                "loopd.retries": 0,
                "loopd.thinking_capped": False,
                "loopd.outcome": "ok",
            },
        )

    def test_call_attributes(self) -> None:
        """The call's span: the endpoint, its slot, llama.cpp's counts, its finish reason."""
        self.harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
        self.harness.post(HI, session="s1")
        self.harness.advance(1)
        (call,) = self.children(self.request_span())
        (call_record,) = self.record().calls
        self.assertEqual(
            dict(call.attributes or {}),
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": "llama.cpp",
                "gen_ai.request.model": "tiny",
                "gen_ai.response.model": "tiny",
                "gen_ai.response.finish_reasons": ("stop",),
                "gen_ai.usage.input_tokens": 13,
                "gen_ai.usage.cache_read.input_tokens": 3,
                "gen_ai.usage.output_tokens": 2,
                "loopd.endpoint": "tiny",
                "loopd.endpoint.kind": "llama-server",
                "loopd.call.role": "answer",
                "loopd.slot": call_record.slot,
                "loopd.retries": 0,
                "loopd.thinking_capped": False,
                "loopd.outcome": "ok",
                "loopd.llama.cache_n": 3,
                "loopd.llama.prompt_n": 10,
                "loopd.llama.predicted_n": 2,
                "loopd.llama.predicted_per_second": 50.0,
            },
        )

    def test_session_label(self) -> None:
        """
        A session is named by the first 16 hex digits of its id's SHA-256 unless plain ids
        are asked for; an anonymous one says so.
        """
        digest = hashlib.sha256(b"s1").hexdigest()[:16]
        self.assertEqual(
            (session_label("s1", "hash"), session_label("s1", "plain")), (digest, "s1")
        )
        self.harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
        self.harness.post(HI)
        self.harness.advance(1)
        attributes = self.request_span().attributes or {}
        self.assertEqual(attributes["loopd.session.anonymous"], True)
        self.assertEqual(attributes["loopd.session"], session_label(self.record().session, "hash"))

    def test_plain_session_ids(self) -> None:
        """With C{session_ids = "plain"} the span names the session by its id."""
        self.watch(GatewayHarness(), session_ids="plain")
        self.harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
        self.harness.post(HI, session="s1")
        self.harness.advance(1)
        self.assertEqual((self.request_span().attributes or {})["loopd.session"], "s1")

    def test_no_text(self) -> None:
        """Neither the prompt nor the answer (nor any piece of them) is in any span."""
        self.harness.fake.script("POST", CHAT, answer({"content": SECRET_ANSWER}))
        connection = self.harness.post(ASK_SECRET, session="s1")
        self.harness.advance(1)
        self.assertIn(SECRET_ANSWER, connection.response().body.decode())
        for span in self.spans():
            values = [span.name, *map(str, (span.attributes or {}).values())]
            values += [event.name for event in span.events]
            values += [str(v) for e in span.events for v in (e.attributes or {}).values()]
            for value in values:
                for word in (*SECRET_PROMPT.split(), *SECRET_ANSWER.split()):
                    self.assertNotIn(word, value, span.name)


class FailureTests(SpanCase):
    """Calls that fail, retry, or are abandoned; a request refused before any call."""

    def test_failed_call(self) -> None:
        """
        An upstream 500: the call's span is an error of its kind, the request's an error of
        its outcome, with the status answered; neither carries the error's message.
        """
        self.watch(GatewayHarness())
        self.harness.fake.script("POST", CHAT, error_reply(500, "server_error", "it broke"))
        connection = self.harness.post(HI, session="s1")
        self.harness.advance(1)
        status = connection.response().status
        request = self.request_span()
        (call,) = self.children(request)
        self.assertEqual(call.status.status_code, StatusCode.ERROR)
        self.assertEqual(
            {
                k: v
                for k, v in (call.attributes or {}).items()
                if k in ("error.type", "loopd.outcome")
            },
            {"error.type": "Http", "loopd.outcome": "error"},
        )
        self.assertNotIn("gen_ai.usage.input_tokens", call.attributes or {})
        self.assertEqual(request.status.status_code, StatusCode.ERROR)
        attributes = request.attributes or {}
        self.assertEqual(attributes["http.response.status_code"], status)
        self.assertEqual(attributes["error.type"], self.record().outcome)
        self.assertEqual(attributes["loopd.outcome"], self.record().outcome)
        for span in self.spans():
            self.assertIsNone(span.status.description)
            self.assertNotIn("it broke", repr(dict(span.attributes or {})))

    def test_retry(self) -> None:
        """A call that the client tried again counts its retries, on its span and the request's."""
        config = make_config(retry=Retry(attempts=3, backoff_ms=(50,), jitter=0.0))
        self.watch(GatewayHarness(config))
        cut = sse_reply([], end="cut")
        self.harness.fake.script("POST", CHAT, cut, answer({"content": "Hello"}))
        connection = self.harness.post(HI, session="s1")
        self.harness.advance(1)
        self.assertEqual(connection.response().status, 200)
        request = self.request_span()
        (call,) = self.children(request)
        self.assertEqual((call.attributes or {})["loopd.retries"], 1)
        self.assertEqual((call.attributes or {})["loopd.outcome"], "ok")
        self.assertEqual((request.attributes or {})["loopd.retries"], 1)

    def test_client_leaves(self) -> None:
        """
        A client that leaves mid-stream: the request's outcome is C{client_gone} and its
        call C{cancelled}, neither an error; both end when the client left.
        """
        self.watch(GatewayHarness())
        self.harness.fake.script(
            "POST", CHAT, answer(*[{"content": str(i)} for i in range(8)], delay_s=0.05)
        )
        connection = self.harness.post({**HI, "stream": True}, session="s1")
        self.harness.advance(0.1)
        connection.drop()
        self.harness.advance(1)
        record = self.record()
        request = self.request_span()
        (call,) = self.children(request)
        self.assertEqual((request.attributes or {})["loopd.outcome"], "client_gone")
        self.assertNotIn("error.type", request.attributes or {})
        self.assertEqual(request.status.status_code, StatusCode.UNSET)
        self.assertEqual((call.attributes or {})["loopd.outcome"], "cancelled")
        self.assertNotIn("error.type", call.attributes or {})
        self.assertEqual(call.status.status_code, StatusCode.UNSET)
        self.assertEqual(request.end_time, ns(record, 0.1))
        self.assertEqual(call.end_time, ns(record, 0.1))

    def test_refused_request(self) -> None:
        """A request a door refuses (no such model) is one span: its status and error kind."""
        self.watch(GatewayHarness())
        connection = self.harness.post({**HI, "model": "nope"}, session="s1")
        self.harness.advance(0)
        self.assertEqual(connection.response().status, 404)
        (request,) = self.spans()
        self.assertEqual(request.name, "chat nope")
        attributes = request.attributes or {}
        self.assertEqual(
            (attributes["http.response.status_code"], attributes["error.type"]),
            (404, "model_not_found"),
        )
        self.assertEqual(
            (attributes["loopd.calls"], request.status.status_code), (0, StatusCode.ERROR)
        )

    def test_long_model_name(self) -> None:
        """A model name is cut to its first 256 characters in the span's name and attribute."""
        self.watch(GatewayHarness())
        self.harness.post({**HI, "model": "m" * 1000}, session="s1")
        self.harness.advance(0)
        (request,) = self.spans()
        self.assertEqual(request.name, "chat " + "m" * 256)
        self.assertEqual((request.attributes or {})["gen_ai.request.model"], "m" * 256)


class LeaseTests(SpanCase):
    """Under leases, each call's wait for its lease is a span of its own under the call."""

    def test_lease_wait(self) -> None:
        """
        Two sessions on a one-slot endpoint: the second's call waits for the first's lease
        and has its C{lease wait} span, from the call's start to the grant; the first's,
        granted at once, has none (its call span says it waited 0 s).
        """
        self.watch(GatewayHarness(make_config(slots=1), leases=True, grace_ms=0))
        self.harness.fake.script(
            "POST", CHAT, answer({"content": "one"}), answer({"content": "two"})
        )
        first = self.harness.post(HI, session="a")
        second = self.harness.post(HI, session="b")
        self.harness.advance(2)
        self.assertEqual((first.response().status, second.response().status), (200, 200))
        waits = []
        for record in self.records.ended:
            (call_record,) = record.calls
            assert call_record.leased is not None
            (request,) = [
                s
                for s in self.spans()
                if s.kind is SpanKind.SERVER
                and (s.attributes or {})["loopd.request.id"] == record.id
            ]
            (call,) = self.children(request)
            self.assertEqual(
                (call.attributes or {})["loopd.lease.wait_seconds"],
                round(call_record.leased - call_record.started, 6),
            )
            if call_record.leased == call_record.started:
                self.assertEqual(self.children(call), [])
                waits.append(0.0)
                continue
            (wait,) = self.children(call)
            self.assertEqual((wait.name, wait.kind), ("lease wait", SpanKind.INTERNAL))
            self.assertEqual(dict(wait.attributes or {}), {"loopd.endpoint": "tiny"})
            self.assertEqual(
                (wait.start_time, wait.end_time),
                (ns(record, call_record.started), ns(record, call_record.leased)),
            )
            waits.append(call_record.leased - call_record.started)
        self.assertEqual(waits[0], 0)
        self.assertGreater(waits[1], 0.1)


class MeshTests(SpanCase):
    """A mesh turn: the request marks the mesh; each worker's and the reducer's call is a span."""

    def test_workers_and_reducer(self) -> None:
        """
        Three disagreeing workers and the reducer: four call spans under the request, each
        with its role, model and counts; the request sums their counts.
        """
        self.watch(MeshHarness())
        harness = self.harness
        assert isinstance(harness, MeshHarness)
        harness.script(
            llama_70b=[says("The capital is Lyon.", 1.5), says("Paris it is.", 0.5)],
            mistral_7b=says("The capital is Paris.", 0.5),
            qwen3_8b=says("The capital is Berlin.", 1.0),
        )
        self.assertEqual(harness.ask(ASK, 2.0).status, 200)
        request = self.request_span()
        self.assertEqual(request.name, "chat mesh")
        attributes = request.attributes or {}
        self.assertEqual((attributes["loopd.mesh"], attributes["loopd.calls"]), (True, 4))
        self.assertNotIn("gen_ai.response.model", attributes)
        self.assertEqual(
            (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]),
            (4 * 13, 4 * 2),
        )
        calls = sorted(
            (
                (c.attributes or {})["loopd.call.role"],
                c.name,
                (c.attributes or {})["loopd.outcome"],
            )
            for c in self.children(request)
        )
        self.assertEqual(
            calls,
            [
                ("reducer", "chat llama-70b", "ok"),
                ("worker", "chat llama-70b", "ok"),
                ("worker", "chat mistral-7b", "ok"),
                ("worker", "chat qwen3-8b", "ok"),
            ],
        )

    def test_early_exit_cancels(self) -> None:
        """A worker cut by an early exit is C{cancelled}, not an error; the turn is fine."""
        self.watch(MeshHarness())
        harness = self.harness
        assert isinstance(harness, MeshHarness)
        harness.script(
            llama_70b=says("Paris.", 1.0), mistral_7b=says("Paris", 0.5), qwen3_8b=says("x", 30)
        )
        self.assertEqual(harness.ask(ASK, 1.0).status, 200)
        request = self.request_span()
        outcomes = {
            c.name: ((c.attributes or {})["loopd.outcome"], c.status.status_code)
            for c in self.children(request)
        }
        self.assertEqual(
            outcomes,
            {
                "chat llama-70b": ("ok", StatusCode.UNSET),
                "chat mistral-7b": ("ok", StatusCode.UNSET),
                "chat qwen3-8b": ("cancelled", StatusCode.UNSET),
            },
        )
        self.assertEqual(request.status.status_code, StatusCode.UNSET)


class ConventionTests(SynchronousTestCase):
    """The attributes' names are the GenAI semantic conventions' own."""

    def test_gen_ai_names(self) -> None:
        """Each GenAI name the spans use is the installed conventions' constant of that name."""
        try:
            from opentelemetry.semconv._incubating.attributes import gen_ai_attributes
        except ImportError:  # pragma: no cover - an SDK without the conventions package
            raise SkipTest("opentelemetry-semantic-conventions is not installed") from None
        for constant, name in GEN_AI_ATTRIBUTES.items():
            self.assertEqual(getattr(gen_ai_attributes, constant), name)


#: The modules that import OpenTelemetry, relative to the package.
OPTIONAL = {"gateway/telemetry.py", "gateway/span_export.py"}
#: Their dotted names.
OPTIONAL_MODULES = {"loopd.gateway.telemetry", "loopd.gateway.span_export"}


def eager_imports(source: str) -> list[str]:
    """
    The modules C{source} imports when it is imported itself: at module level or in a
    class body, not inside a function nor under C{if TYPE_CHECKING:}.
    """
    found: list[str] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append(node.module)
                found.extend(f"{node.module}.{alias.name}" for alias in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    visit([n for n in inner if isinstance(n, ast.stmt)])
            for handler in getattr(node, "handlers", []):
                visit(handler.body)

    visit(ast.parse(source).body)
    return found


class OptionalTests(SynchronousTestCase):
    """
    OpenTelemetry is an extra: loopd imports and runs without it, so only the telemetry
    modules import it, and nothing in the package imports them but lazily.
    """

    def test_eager_imports_found(self) -> None:
        """The scanner sees module-level and class-body imports, not deferred ones."""
        source = (
            "import a\nfrom b import c\nclass K:\n    import d\n"
            "def f():\n    import e\nif TYPE_CHECKING:\n    import g\n"
            "try:\n    import h\nexcept ImportError:\n    import i\n"
        )
        self.assertEqual(eager_imports(source), ["a", "b", "b.c", "d", "h", "i"])

    def test_only_telemetry_imports_opentelemetry(self) -> None:
        """No module of the package but the telemetry ones imports OpenTelemetry."""
        package = Path(loopd.__file__).parent
        offenders = []
        for path in sorted(package.rglob("*.py")):
            relative = path.relative_to(package).as_posix()
            if relative in OPTIONAL or relative.startswith("test/"):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                offenders += [f"{relative}: {n}" for n in names if n.startswith("opentelemetry")]
        self.assertEqual(offenders, [])

    def test_telemetry_imported_lazily(self) -> None:
        """Outside the tests, the telemetry modules are imported only when telemetry is on."""
        package = Path(loopd.__file__).parent
        offenders = []
        for path in sorted(package.rglob("*.py")):
            relative = path.relative_to(package).as_posix()
            if relative in OPTIONAL or relative.startswith("test/"):
                continue
            for name in eager_imports(path.read_text(encoding="utf-8")):
                if name in OPTIONAL_MODULES or name.removesuffix(".telemetry") == "loopd.gateway":
                    offenders.append(f"{relative}: {name}")
        self.assertEqual(offenders, [])


#: Run without OpenTelemetry: the gateway answers a chat, and the telemetry cannot load.
WITHOUT = """
import sys
import loopd.cli, loopd.service, loopd.tap.loopd
from loopd.service import TelemetryUnavailableError, load_telemetry
from loopd.testing.fake_llama import CHAT
from loopd.testing.gateway import HI, GatewayHarness
from loopd.testing.llama_replies import answer

harness = GatewayHarness()
harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
connection = harness.post(HI)
harness.advance(1)
print("status", connection.response().status)
print("imported", sorted(n for n in sys.modules if n.startswith("opentelemetry")))
try:
    load_telemetry()
except TelemetryUnavailableError as e:
    print("telemetry:", e)
"""


class WithoutOpenTelemetryTests(TestCase):
    """In a process where OpenTelemetry is missing, loopd imports and runs."""

    timeout = 60

    def test_runs_without(self) -> Any:
        """
        The gateway answers a chat without importing OpenTelemetry; asking for the telemetry
        says, in one line, how to install it.
        """
        running = getProcessOutputAndValue(
            sys.executable,
            ["-m", "loopd.test.support.without_opentelemetry", "-c", WITHOUT],
            env=dict(os.environ),
            path=str(ROOT),
            reactor=real_reactor(),
        )

        def ended(result: tuple[bytes, bytes, int]) -> None:
            out, err, status = result
            self.assertEqual(status, 0, (out, err))
            self.assertEqual(
                out.decode().splitlines(),
                [
                    "status 200",
                    "imported []",
                    "telemetry: [telemetry] enabled = true, but OpenTelemetry is not installed "
                    "(no module named 'opentelemetry'): pip install 'loopd[telemetry]'",
                ],
            )

        return running.addCallback(ended)


def hand_made_record() -> RequestRecord:
    """A mesh-free request of session C{s1} with one leased, completed call."""
    record = RequestRecord(7, "messages", 100.0, 1_700_000_000.0, session="s1", model="tiny")
    call = CallRecord("tiny", "answer", 100.0, "s1", leased=100.25, slot=1, sent=100.5)
    call.ended = 101.5
    call.timings = Timings(cache_n=40, prompt_n=8, predicted_n=5, predicted_per_second=20.0)
    call.finish_reason = "stop"
    record.calls.append(call)
    record.first_token = 101.0
    record.ended = 102.0
    record.status = 200
    record.outcome = "ok"
    return record


class RealExportTests(TestCase):
    """
    Once through the real path: L{GatewayTelemetry} exports over a real Unix socket, on the
    real reactor, to a collector that decodes the OTLP protobuf it receives.
    """

    timeout = 30

    @inlineCallbacks
    def test_spans_arrive(self) -> Any:
        """
        A request's spans reach the collector at stop, decoded by OpenTelemetry's own
        protobuf classes: names, kinds, parents, times, attributes, the service's name.
        """
        reactor = real_reactor()
        directory = tempfile.mkdtemp(prefix="lo", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        socket = os.path.join(directory, "otlp.sock")
        receiver = OtlpReceiver()
        port = reactor.listenUNIX(socket, Site(receiver))
        self.addCleanup(port.stopListening)
        settings = Telemetry(enabled=True, socket=socket, service_name="loopd-test")
        config = Config(endpoints=make_config().endpoints, telemetry=settings)
        telemetry = GatewayTelemetry(reactor, settings, config.endpoints)
        telemetry.start()
        telemetry.watcher.request_ended(hand_made_record())
        yield telemetry.stop()
        yield receiver.received(1)
        self.assertEqual(receiver.heads, [(b"/v1/traces", b"application/x-protobuf")])
        spans = {span.name: span for span in receiver.spans()}
        self.assertEqual(set(spans), {"chat tiny", "lease wait"})
        received = receiver.spans()
        (request,) = [s for s in received if s.kind == "SERVER"]
        (call,) = [s for s in received if s.kind == "CLIENT"]
        wait = spans["lease wait"]
        self.assertEqual(
            (request.parent_span_id, call.parent_span_id, wait.parent_span_id),
            ("", request.span_id, call.span_id),
        )
        self.assertEqual({request.trace_id, call.trace_id, wait.trace_id}, {request.trace_id})
        wall = 1_700_000_000 * 10**9
        self.assertEqual((request.start_ns, request.end_ns), (wall, wall + 2 * 10**9))
        self.assertEqual((call.start_ns, call.end_ns), (wall, wall + 15 * 10**8))
        self.assertEqual((wait.start_ns, wait.end_ns), (wall, wall + 25 * 10**7))
        self.assertEqual(request.events, (("first_token", wall + 10**9),))
        self.assertEqual(call.events, (("sent", wall + 5 * 10**8),))
        self.assertEqual(request.attributes["loopd.door"], "messages")
        self.assertEqual(request.attributes["loopd.session"], session_label("s1", "hash"))
        self.assertEqual(request.attributes["gen_ai.usage.input_tokens"], 48)
        self.assertEqual(request.attributes["gen_ai.usage.cache_read.input_tokens"], 40)
        self.assertEqual(call.attributes["gen_ai.response.finish_reasons"], ("stop",))
        self.assertEqual(call.attributes["loopd.llama.predicted_per_second"], 20.0)
        self.assertEqual((call.attributes["loopd.slot"], call.status), (1, "UNSET"))
        self.assertEqual(request.resource["service.name"], "loopd-test")
        self.assertEqual(request.resource["service.version"], loopd.__version__)
        self.assertEqual(request.scope, "loopd")
        self.assertEqual(telemetry.queue.exported, 3)
