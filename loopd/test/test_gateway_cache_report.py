"""
Tests for L{loopd.gateway.cache_report}: what an agent hears of its cache, through each
front door of a gateway on a memory clock: the C{X-Loopd-Cache} header of a whole answer,
the C{cache} comment that ends a stream, a mesh turn's, and the report's arithmetic.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.activity import Activity, CallRecord, RequestRecord
from loopd.gateway.cache_report import CACHE_HEADER, cache_header, cache_report
from loopd.llama.types import Timings
from loopd.testing.fake_llama import CHAT
from loopd.testing.gateway import GatewayHarness, Response, make_config
from loopd.testing.llama_replies import answer
from loopd.testing.mesh import MeshHarness, says

#: A cold first request: the endpoint's prompt speed is measured at 300 tokens/s.
COLD = {"cache_n": 0, "prompt_n": 1000, "predicted_n": 4, "prompt_per_second": 300.0}
#: The request asked about: 900 tokens reused, priced at the speed COLD measured.
MEASURED = {
    "cache_n": 900,
    "prompt_n": 100,
    "predicted_n": 4,
    "prompt_per_second": 300.0,
    "predicted_per_second": 40.0,
}
REPORT = {"reused": 900, "evaluated": 100, "saved_ms": 3000}
HEADER = "reused=900; evaluated=100; saved_ms=3000"
#: Each door's path and smallest body.
DOORS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    "messages": (
        "/v1/messages",
        {"max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]},
    ),
    "responses": ("/v1/responses", {"input": "Hi"}),
}


def ask(harness: GatewayHarness, door: str, stream: bool) -> Response:
    """
    Two requests through C{door}: a cold one (L{COLD}) that measures the endpoint's prompt
    speed, then the one asked about (L{MEASURED}); its response.
    """
    harness.fake.script(
        "POST",
        CHAT,
        answer({"content": "ok"}, timings=COLD),
        answer({"content": "ok"}, timings=MEASURED),
    )
    path, body = DOORS[door]
    document = {**body, "stream": stream}
    for _ in range(2):
        connection = harness.connect()
        connection.request(
            "POST", path, json.dumps(document).encode(), ["Content-Type: application/json"]
        )
        harness.advance(1)
    return connection.response()


class DoorTests(SynchronousTestCase):
    """Every door reports, in both forms."""

    def test_whole_answer_header(self) -> None:
        """A whole answer of each door carries the header."""
        for door in DOORS:
            response = ask(GatewayHarness(make_config()), door, stream=False)
            self.assertEqual(response.status, 200, door)
            self.assertEqual(response.headers.get(CACHE_HEADER.decode()), HEADER, door)

    def test_stream_comment(self) -> None:
        """A stream of each door reports after its text, before its closing events."""
        for door in DOORS:
            response = ask(GatewayHarness(make_config()), door, stream=True)
            self.assertEqual((response.status, response.complete), (200, True), door)
            self.assertEqual(response.cache_report(), {"event": "cache", **REPORT}, door)
            events = response.events()
            [report] = [i for i, e in enumerate(events) if '"event":"cache"' in e]
            text = min(i for i, e in enumerate(events) if '"ok"' in e)
            self.assertTrue(text < report < len(events) - 1, (door, events))
            self.assertNotIn(CACHE_HEADER.decode(), response.headers, door)

    def test_usage_agrees(self) -> None:
        """The door's own usage fields say the same reuse as the report."""
        body: dict[str, Any] = ask(GatewayHarness(make_config()), "messages", False).json()
        self.assertEqual(body["usage"]["cache_read_input_tokens"], REPORT["reused"])
        body = ask(GatewayHarness(make_config()), "chat", False).json()
        self.assertEqual(body["usage"]["prompt_tokens_details"]["cached_tokens"], 900)

    def test_error_has_none(self) -> None:
        """An error answer reports nothing."""
        harness = GatewayHarness(make_config())
        connection = harness.post({"messages": [], "model": "nowhere"})
        response = connection.response()
        self.assertNotEqual(response.status, 200)
        self.assertNotIn(CACHE_HEADER.decode(), response.headers)

    def test_mesh(self) -> None:
        """A mesh turn's answer reports its workers' calls together."""
        harness = MeshHarness()
        harness.script(
            llama_70b=says("Paris.", 1.0), mistral_7b=says("Paris", 0.5), qwen3_8b=says("x", 30)
        )
        response = harness.ask({"model": "mesh", "messages": DOORS["chat"][1]["messages"]}, 2)
        header = response.headers[CACHE_HEADER.decode()]
        self.assertRegex(header, r"^reused=\d+; evaluated=\d+; saved_ms=\d+$")


class ReportTests(SynchronousTestCase):
    """The report's arithmetic."""

    def record(self, *timings: Timings | None) -> RequestRecord:
        """A record with a call per C{timings} (C{None}: a failed call)."""
        record = RequestRecord(1, "chat", 0.0, 0.0)
        for index, counts in enumerate(timings):
            record.calls.append(CallRecord(f"e{index}", "worker", 0.0, timings=counts))
        return record

    def test_sums_calls(self) -> None:
        """Each completed call's counts and saving (the board's); a failed call adds nothing."""
        record = self.record(Timings(1000, 100, 1), Timings(300, 1, 1), None, Timings(7, 1, 1))
        for call, saved in zip(record.calls, (2.0, 3.0, 9.0, 0.0), strict=True):
            call.saved_seconds = saved
        self.assertEqual(cache_report(record), {"reused": 1307, "evaluated": 102, "saved_ms": 5000})

    def test_header(self) -> None:
        """The header's form."""
        self.assertEqual(
            cache_header({"reused": 1, "evaluated": 2, "saved_ms": 3}),
            (b"x-loopd-cache", b"reused=1; evaluated=2; saved_ms=3"),
        )

    def test_unused_activity(self) -> None:
        """A record with no calls reports zeros."""
        record = Activity(lambda: 0.0, lambda: 0.0).begin("chat", b"")
        self.assertEqual(cache_report(record), {"reused": 0, "evaluated": 0, "saved_ms": 0})
