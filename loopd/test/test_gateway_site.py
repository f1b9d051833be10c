"""
Tests for L{loopd.gateway.site}: routing, refusals, C{/v1/models}, C{/health} and
C{/metrics}, with real HTTP parsing on both sides and nothing on disk.

The gateway runs in L{loopd.testing.gateway.GatewayHarness}: its site reads raw request bytes
and writes raw response bytes, which the harness parses; its upstream clients talk to a
scripted L{FakeLlama} per endpoint in memory on a C{MemoryReactorClock}, every limit between
50 and 200 ms.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math

from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from loopd.errors import ProxyRefused
from loopd.gateway.channel import GatewaySite
from loopd.testing.fake_llama import CHAT, LOADING, Reply, json_reply
from loopd.testing.gateway import (
    BODY_BYTES,
    HI,
    NOW,
    OTHER_PATH,
    ClientConnection,
    GatewayHarness,
    Response,
    make_config,
    outcome,
)
from loopd.testing.llama_replies import answer


class RefusalTests(SynchronousTestCase):
    """
    Bad input gets a 4xx in the OpenAI error shape and nothing goes upstream.
    """

    def setUp(self) -> None:
        self.harness = GatewayHarness()

    def refused(self, connection: ClientConnection, status: int, code: str) -> Response:
        """Assert one whole JSON error response with C{status} and C{code}; return it."""
        response = connection.response()
        self.assertEqual((response.status, response.complete), (status, True))
        self.assertEqual(response.headers["content-type"], "application/json")
        error = response.json()["error"]
        self.assertEqual(sorted(error), ["code", "message", "param", "type"])
        self.assertEqual(error["code"], code)
        self.assertEqual(self.harness.fake.requests, [])
        return response

    def test_not_json(self) -> None:
        """A body that is not JSON is 400 invalid_json."""
        connection = self.harness.connect()
        connection.request("POST", CHAT, b"{not json", ["Content-Type: application/json"])
        self.refused(connection, 400, "invalid_json")

    def test_not_an_object(self) -> None:
        """A JSON array body is 400 not_an_object."""
        self.refused(self.harness.post([HI]), 400, "not_an_object")

    def test_missing_messages(self) -> None:
        """
        A body without messages is 400 missing_messages; the message names the field, and so
        does C{param}, as OpenAI's errors do.
        """
        response = self.refused(self.harness.post({"model": "tiny"}), 400, "missing_messages")
        self.assertIn("messages", response.json()["error"]["message"])
        self.assertEqual(response.json()["error"]["param"], "messages")

    def test_unknown_model(self) -> None:
        """A model no endpoint serves is 404 model_not_found, naming the model (its param)."""
        response = self.refused(self.harness.post({**HI, "model": "gpt-9"}), 404, "model_not_found")
        self.assertIn("gpt-9", response.json()["error"]["message"])
        self.assertEqual(response.json()["error"]["param"], "model")

    def test_declared_body_over_cap(self) -> None:
        """A Content-Length over [server] body_bytes is 413 too_large."""
        big = json.dumps({**HI, "pad": "x" * BODY_BYTES}).encode()
        connection = self.harness.connect()
        connection.request("POST", CHAT, big, ["Content-Type: application/json"])
        self.refused(connection, 413, "too_large")

    def test_body_over_cap_in_the_door_shape(self) -> None:
        """
        Under C{/v1/messages} the channel's refusals are Anthropic's: a body over the cap is
        413 C{request_too_large} in its error shape.
        """
        big = json.dumps({"messages": [], "pad": "x" * BODY_BYTES}).encode()
        connection = self.harness.connect()
        connection.request(
            "POST", "/v1/messages?beta=true", big, ["Content-Type: application/json"]
        )
        response = connection.response()
        self.assertEqual(response.status, 413)
        body = response.json()
        self.assertEqual(body["type"], "error")
        self.assertEqual(body["error"]["type"], "request_too_large")
        self.assertEqual(self.harness.fake.requests, [])

    def test_every_door_shapes_its_own_refusals(self) -> None:
        """
        The gateway has one table of its front doors by path; the channel answers a refusal
        under each door's path (with a query, or a path under it) in that door's own error
        shape from it, and any other path in OpenAI's.
        """
        gateway = self.harness.gateway
        site = self.harness.site
        assert isinstance(site, GatewaySite)
        errors = [door.error for _, door in gateway.doors.by_path]
        self.assertEqual(
            [path for path, _ in gateway.doors.by_path],
            [b"/v1/chat/completions", b"/v1/messages", b"/v1/responses"],
        )
        for path, door in gateway.doors.by_path:
            for target in (path, path + b"?beta=true", path + b"/count_tokens"):
                self.assertEqual(site.shape_for(target), door.error)
        for other in (b"/v1/models", b"/health", b"/", None):
            self.assertNotIn(site.shape_for(other), errors)

    def test_chunked_body_over_cap(self) -> None:
        """A chunked body that grows past the cap is 413 too_large too."""
        connection = self.harness.connect()
        head = f"POST {CHAT} HTTP/1.1\r\nHost: loopd\r\nTransfer-Encoding: chunked\r\n\r\n"
        piece = b"x" * 1000
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(3))
        connection.send(head.encode() + chunks + b"0\r\n\r\n")
        self.refused(connection, 413, "too_large")

    def test_body_at_cap_accepted(self) -> None:
        """A body of exactly body_bytes is read and answered."""
        self.harness.fake.script("POST", CHAT, answer({"content": "ok"}, delay_s=0))
        # Padded with a system prompt: an unknown field would be a 400 of its own.
        system = {"role": "system", "content": ""}
        document = {**HI, "messages": [system, *HI["messages"]]}
        system["content"] = "x" * (BODY_BYTES - len(json.dumps(document)))
        connection = self.harness.post(document)
        self.assertEqual(connection.response().status, 200)
        self.assertEqual(len(self.harness.fake.requests), 1)

    def test_get_on_chat_route(self) -> None:
        """GET on the chat route is 405 with Allow naming POST alone."""
        response = self.refused(self.harness.get(CHAT), 405, "method_not_allowed")
        self.assertEqual(response.headers["allow"], "POST")

    def test_head_on_chat_route(self) -> None:
        """HEAD on the POST-only chat route is a 405 too, not a server error."""
        connection = self.harness.connect()
        connection.request("HEAD", CHAT)
        response = connection.response()
        self.assertEqual((response.status, response.headers["allow"]), (405, "POST"))

    def test_post_on_models(self) -> None:
        """POST on /v1/models is 405 with Allow naming GET and HEAD."""
        connection = self.harness.connect()
        connection.request("POST", "/v1/models", b"{}")
        response = self.refused(connection, 405, "method_not_allowed")
        self.assertEqual(response.headers["allow"], "GET, HEAD")

    def test_index(self) -> None:
        """
        C{GET /} says what answers and where; C{HEAD /} (agents' connectivity probe) has
        the same status and length with no body, and logs nothing.
        """
        get = self.harness.get("/").response()
        self.assertEqual(get.status, 200)
        self.assertEqual(get.json()["service"], "loopd")
        self.assertEqual(get.json()["doors"]["messages"], "/v1/messages")
        with capturedLogs() as events:
            connection = self.harness.connect()
            connection.request("HEAD", "/")
            head = connection.response()
        self.assertEqual((head.status, head.body), (200, b""))
        self.assertEqual(head.headers["content-length"], str(len(get.body)))
        self.assertEqual([formatEvent(event) for event in events], [])

    def test_head_of_a_refusal(self) -> None:
        """A C{HEAD} that is refused (an unknown path) has its status and no body."""
        connection = self.harness.connect()
        connection.request("HEAD", "/v2/chat")
        response = connection.response()
        self.assertEqual((response.status, response.body), (404, b""))

    def test_unknown_path(self) -> None:
        """An unknown path is 404 not_found naming the path, whatever the method."""
        for method in ("GET", "POST"):
            connection = self.harness.connect()
            connection.request(method, "/v2/chat", b"{}" if method == "POST" else None)
            response = self.refused(connection, 404, "not_found")
            self.assertIn("/v2/chat", response.json()["error"]["message"])

    def test_refusals_counted(self) -> None:
        """Each refused chat request counts under endpoint "-" with its code."""
        self.harness.post([HI])
        self.harness.post([HI])
        self.harness.post({**HI, "model": "gpt-9"})
        samples = self.harness.scrape()
        self.assertEqual(samples[outcome("-", "not_an_object")], 2.0)
        self.assertEqual(samples[outcome("-", "model_not_found")], 1.0)


class ModelsTests(SynchronousTestCase):
    """
    C{GET /v1/models} lists the endpoints and the virtual models C{auto} and C{mesh}.
    """

    def test_lists_endpoints(self) -> None:
        """Each endpoint is a model object, in config order, then auto and mesh; a slash too."""
        harness = GatewayHarness(make_config(endpoints=("tiny", "big")))
        models = [
            {"id": name, "object": "model", "created": NOW, "owned_by": "loopd"}
            for name in ("tiny", "big", "auto", "mesh")
        ]
        for target in ("/v1/models", "/v1/models/"):
            response = harness.get(target).response()
            self.assertEqual(response.status, 200)
            self.assertEqual(response.headers["content-type"], "application/json")
            self.assertEqual(response.json(), {"object": "list", "data": models})

    def test_retrieve_one(self) -> None:
        """C{/v1/models/{id}} is the listed object of that id, endpoint or virtual."""
        harness = GatewayHarness(make_config(endpoints=("tiny", "big")))
        for model_id in ("tiny", "big", "auto", "mesh"):
            for target in (f"/v1/models/{model_id}", f"/v1/models/{model_id}/"):
                response = harness.get(target).response()
                self.assertEqual(response.status, 200, target)
                self.assertEqual(
                    response.json(),
                    {"id": model_id, "object": "model", "created": NOW, "owned_by": "loopd"},
                )

    def test_retrieve_unknown(self) -> None:
        """An id no endpoint serves is 404 model_not_found in the error shape; others go on."""
        harness = GatewayHarness(make_config(endpoints=("tiny",)))
        for model_id, shown in (("gpt-9", "'gpt-9'"), ("a%2Fb", "'a/b'"), ("t%C3%AFny", "'tïny'")):
            response = harness.get(f"/v1/models/{model_id}").response()
            self.assertEqual(response.status, 404)
            self.assertEqual(
                response.json(),
                {
                    "error": {
                        "message": f"no endpoint serves model {shown}",
                        "type": "invalid_request_error",
                        "code": "model_not_found",
                        "param": None,
                    }
                },
            )
        self.assertEqual(harness.get("/v1/models/tiny").response().status, 200)

    def test_retrieve_wrong_method(self) -> None:
        """POST to a model's path is a 405 naming GET, like the other routes."""
        harness = GatewayHarness(make_config(endpoints=("tiny",)))
        connection = harness.connect()
        connection.request("POST", "/v1/models/tiny", b"{}")
        response = connection.response()
        self.assertEqual(
            (response.status, response.json()["error"]["code"]), (405, "method_not_allowed")
        )


class HealthTests(SynchronousTestCase):
    """
    C{GET /health} asks every endpoint's C{/health}.
    """

    def setUp(self) -> None:
        self.harness = GatewayHarness(make_config(endpoints=("tiny", "big")))
        self.big = self.harness.fakes["big"]
        for fake in (self.harness.fake, self.big):
            fake.set_default("GET", "/health", json_reply(200, {"status": "ok"}))

    def health(self) -> Response:
        """Ask, let the probes run out their time, and return the answer."""
        connection = self.harness.get("/health")
        self.harness.advance(0.2)
        return connection.response()

    def test_all_reachable(self) -> None:
        """Both endpoints answer 200: 200 ok."""
        response = self.health()
        self.assertEqual(response.status, 200)
        probing = {"state": "probing", "detail": "not probed yet"}
        expected = {
            "status": "ok",
            "endpoints": {"tiny": "ok", "big": "ok"},
            "states": {"tiny": probing, "big": probing},
        }
        self.assertEqual(response.json(), expected)
        self.assertEqual([r.path for r in self.big.requests], ["/health"])

    def test_states(self) -> None:
        """
        C{states} has each endpoint's health state and why: after the probes, tiny up and
        big, whose socket is gone, down.
        """
        self.harness.net.stop_listening(OTHER_PATH)
        self.harness.gateway.start()
        self.harness.advance(0.2)
        states = self.health().json()["states"]
        self.assertEqual(
            states,
            {
                "tiny": {"state": "up", "detail": "/health: ok"},
                "big": {
                    "state": "down",
                    "detail": "/health: unreachable: no socket (nothing is serving it)",
                },
            },
        )

    def test_socket_missing(self) -> None:
        """An endpoint nobody listens for: 503 naming it as unreachable."""
        self.harness.net.stop_listening(OTHER_PATH)
        response = self.health()
        self.assertEqual(response.status, 503)
        body = response.json()
        self.assertEqual(body["status"], "degraded")
        self.assertEqual(body["endpoints"]["tiny"], "ok")
        self.assertTrue(body["endpoints"]["big"].startswith("unreachable: "), body)

    def test_socket_missing_names_no_path(self) -> None:
        """The unreachable endpoint's detail says why without naming its socket."""
        self.harness.net.stop_listening(OTHER_PATH)
        response = self.health()
        self.assertEqual(
            response.json()["endpoints"]["big"], "unreachable: no socket (nothing is serving it)"
        )
        self.assertNotIn(OTHER_PATH.encode(), response.body)

    def test_refused_at_cap(self) -> None:
        """
        An endpoint whose inferproxy refuses at its connection cap: 503, and the detail
        says so (the server itself may be up), not unreachable.
        """
        refused = Reply(status=503, headers=[(ProxyRefused.HEADER, ProxyRefused.CONNECTIONS)])
        self.big.set_default("GET", "/health", refused)
        response = self.health()
        self.assertEqual(response.status, 503)
        self.assertEqual(
            response.json()["endpoints"]["big"],
            "refused by its inferproxy: its connection limit is reached",
        )

    def test_loading(self) -> None:
        """An endpoint answering 503 (loading): 503 naming it with the status."""
        self.big.set_default("GET", "/health", LOADING)
        response = self.health()
        self.assertEqual(response.status, 503)
        self.assertEqual(response.json()["endpoints"], {"tiny": "ok", "big": "HTTP 503"})

    def test_silent(self) -> None:
        """An endpoint that never answers: 503 after poll_ms, naming it as unreachable."""
        silent = dataclasses.replace(json_reply(200, {}), headers_delay=math.inf)
        self.big.set_default("GET", "/health", silent)
        connection = self.harness.get("/health")
        self.harness.advance(0.049)
        self.assertEqual(connection.responses(), [])
        self.harness.advance(0.001)
        response = connection.response()
        self.assertEqual(response.status, 503)
        self.assertTrue(response.json()["endpoints"]["big"].startswith("unreachable: "))
        self.assertFalse(self.big.connections[0].open)

    def test_client_gone_before_answer(self) -> None:
        """A client that leaves before the probes end is no error; the probes still end."""
        silent = dataclasses.replace(json_reply(200, {}), headers_delay=math.inf)
        self.big.set_default("GET", "/health", silent)
        connection = self.harness.get("/health")
        connection.drop()
        self.harness.advance(0.2)
        # A Deferred that failed unhandled is logged when collected: make that happen now.
        gc.collect()
        self.assertEqual(connection.responses(), [])
        self.assertFalse(self.big.connections[0].open)


class MetricsTests(SynchronousTestCase):
    """
    C{GET /metrics} serves the Prometheus text of the gateway's figures.
    """

    def test_requests_by_outcome(self) -> None:
        """After one answered and one refused request, both outcomes are counted."""
        harness = GatewayHarness()
        harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
        harness.post(HI)
        harness.post({})
        harness.advance(0.2)
        connection = harness.get("/metrics")
        response = connection.response()
        self.assertEqual(response.status, 200)
        self.assertTrue(response.headers["content-type"].startswith("text/plain"))
        self.assertIn(b'loopd_requests_total{endpoint="tiny",outcome="ok"} 1.0', response.body)
        samples = harness.scrape()
        self.assertEqual(samples[outcome("-", "missing_messages")], 1.0)
        tokens = {"endpoint": "tiny", "kind": "completion"}
        self.assertEqual(samples[("loopd_tokens_total", frozenset(tokens.items()))], 2.0)

    def test_pacing(self) -> None:
        """
        /metrics counts each endpoint's paced connections, those that waited and how long,
        the Busy ones and the refusals its inferproxy still gave, by limit.
        """
        harness = GatewayHarness()
        harness.fake.set_default("POST", CHAT, answer({"content": "a"}, delay_s=0))
        for _ in range(11):
            harness.post(HI)
            harness.advance(0.01)
        harness.advance(1)
        harness.fake.set_default(
            "POST", CHAT, Reply(status=503, headers=[(ProxyRefused.HEADER, "connections")])
        )
        harness.post(HI)
        harness.advance(0.1)
        samples = harness.scrape()
        tiny = frozenset({("endpoint", "tiny")})
        self.assertEqual(samples[("loopd_upstream_connections_total", tiny)], 12.0)
        self.assertEqual(samples[("loopd_upstream_connection_waits_total", tiny)], 1.0)
        waited = samples[("loopd_upstream_connection_wait_seconds_total", tiny)]
        self.assertAlmostEqual(waited, 0.4, places=6)
        self.assertEqual(samples[("loopd_upstream_connection_busy_total", tiny)], 0.0)
        refused = frozenset({("endpoint", "tiny"), ("limit", "connections")})
        self.assertEqual(samples[("loopd_upstream_refusals_total", refused)], 1.0)
        self.assertEqual(samples[("loopd_upstream_connections_open", tiny)], 0.0)

    def test_queue_depth(self) -> None:
        """loopd_queue_depth counts the requests waiting at the slot gate, now."""
        harness = GatewayHarness(make_config(slots=1))
        harness.fake.script("POST", CHAT, answer({"content": "a"}), answer({"content": "b"}))
        depth = ("loopd_queue_depth", frozenset({("endpoint", "tiny")}))
        harness.post({**HI, "stream": True})
        harness.post({**HI, "stream": True})
        self.assertEqual(harness.scrape()[depth], 1.0)
        harness.advance(0.5)
        self.assertEqual(harness.scrape()[depth], 0.0)
