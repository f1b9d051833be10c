"""
OpenTelemetry end to end, every part a real process, as docs/telemetry.md sets it up: a
real llama.cpp server behind a C{twist inferproxy}, C{twist loopd} with C{[telemetry]} on,
and the collector on TCP (as most are) with a second C{twist inferproxy} in front of it,
whose Unix socket loopd exports to. The collector is the test's own: it decodes each OTLP
protobuf export it receives with OpenTelemetry's classes.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.server import Site

from loopd import http
from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import TwistProcess, spawn_twist, stop_twist

try:
    from loopd.test.support.gateway_stack import HI, SLOTS, loopd_toml, serve_behind_proxy
    from loopd.test.support.otlp_receiver import OtlpReceiver
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the telemetry end-to-end test needs the test extra: {e}") from None


class TelemetryEndToEndTests(TestCase):
    """loopd's traces reach a collector on TCP through an inferproxy."""

    timeout = 180

    @inlineCallbacks
    def test_trace_at_stop(self) -> Any:
        """
        A chat through loopd, then SIGTERM: its trace reaches the collector as loopd stops
        (the export's interval is far longer than the test), through the inferproxy in
        front of the collector: the request's span, the call's under it with llama.cpp's
        counts, and the service's name.
        """
        reactor = real_reactor()
        directory, server, infer = yield serve_behind_proxy(self, "tiny.gguf", SLOTS)
        receiver = OtlpReceiver()
        port = reactor.listenTCP(0, Site(receiver), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        otlp = os.path.join(directory, "otlp.sock")
        upstream = f"127.0.0.1:{port.getHost().port}"
        collector = spawn_twist(
            reactor,
            b"inferproxy listening on",
            "inferproxy",
            "--listen",
            otlp,
            "--upstream",
            upstream,
        )
        self.addCleanup(stop_twist, collector)
        yield collector.ready
        socket = os.path.join(directory, "loopd.sock")
        config = os.path.join(directory, "loopd.toml")
        with open(config, "w") as f:
            f.write(loopd_toml(socket, infer, None, long=False))
            f.write(
                "[telemetry]\nenabled = true\n"
                f"socket = {json.dumps(otlp)}\n"
                'service_name = "loopd-e2e"\nexport_interval_ms = 600000\n'
            )
        loopd: TwistProcess = spawn_twist(reactor, b"loopd serving", "loopd", "--config", config)
        self.addCleanup(stop_twist, loopd)
        yield loopd.ready
        self.assertIn(b"telemetry: a trace of every request goes to", loopd.output)
        body = json.dumps({"model": "tiny", "messages": HI}).encode()
        response = yield http.request(
            reactor, socket, "POST", "/v1/chat/completions", body, {"X-Session-Id": "e2e"}
        )
        answer = json.loads((yield response.read_body()))
        self.assertEqual(response.status, 200, answer)
        self.assertEqual(receiver.requests, [])
        assert loopd.transport is not None
        loopd.transport.signalProcess("TERM")
        yield loopd.ended
        self.assertEqual(loopd.signal, signal.SIGTERM)
        yield receiver.received(1)
        spans = receiver.spans()
        (request,) = [s for s in spans if s.kind == "SERVER"]
        (call,) = [s for s in spans if s.kind == "CLIENT"]
        self.assertEqual((request.name, call.name), ("chat tiny", "chat tiny"))
        self.assertEqual(call.parent_span_id, request.span_id)
        self.assertEqual(request.attributes["http.response.status_code"], 200)
        self.assertEqual(request.attributes["loopd.outcome"], "ok")
        usage = answer["usage"]
        self.assertEqual(
            request.attributes["gen_ai.usage.output_tokens"], usage["completion_tokens"]
        )
        self.assertEqual(request.attributes["gen_ai.usage.input_tokens"], usage["prompt_tokens"])
        self.assertEqual(call.attributes["gen_ai.provider.name"], "llama.cpp")
        self.assertGreater(call.attributes["loopd.llama.prompt_n"], 0)
        self.assertEqual(request.resource["service.name"], "loopd-e2e")
        self.assertEqual(receiver.heads, [(b"/v1/traces", b"application/x-protobuf")])
