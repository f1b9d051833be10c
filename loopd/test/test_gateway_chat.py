"""
Tests for L{loopd.gateway.exchange} and L{loopd.gateway.doors.chat}: C{POST /v1/chat/completions}
through the gateway's site with real HTTP parsing, against the scripted fake llama-server in
memory on a C{MemoryReactorClock} (L{loopd.testing.gateway.GatewayHarness}). Nothing sleeps:
the clock jumps from one scheduled call to the next.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from loopd.settings import Retry
from loopd.testing.fake_llama import CHAT, LOADING, SLOTS, error_reply, sse_reply
from loopd.testing.gateway import (
    HI,
    NOW,
    PATH,
    ClientConnection,
    GatewayHarness,
    Response,
    make_config,
    outcome,
)
from loopd.testing.llama_replies import TIMINGS, answer, chunk, slots_reply, template_reply

STREAM = {**HI, "stream": True}
#: An upstream reply that never comes, not even its headers: a slot that never frees.
UNANSWERED = sse_reply([], headers_delay=math.inf)
#: OpenAI's usage for L{TIMINGS}: the prompt counts the cached tokens too.
USAGE = {
    "prompt_tokens": 13,
    "completion_tokens": 2,
    "total_tokens": 15,
    "prompt_tokens_details": {"cached_tokens": 3},
    "prompt_cache_hit_tokens": 3,
    "prompt_cache_miss_tokens": 10,
}
#: The upstream deltas of a streamed tool call, and the call they make.
CALL_DELTAS = (
    {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {}}]},
    {"tool_calls": [{"index": 0, "function": {"name": "get_weather", "arguments": ""}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
)
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def deltas(response: Response) -> list[dict[str, Any]]:
    """The C{choices[0].delta} of every chunk of a stream that has a choice."""
    chunks = [d for d in response.data() if d != "[DONE]" and d.get("choices")]
    return [d["choices"][0]["delta"] for d in chunks]


class ChatTestCase(SynchronousTestCase):
    """A harness per test, and the checks the tests share."""

    config = make_config()

    def setUp(self) -> None:
        self.harness = GatewayHarness(self.config)
        self.fake = self.harness.fake

    def script(self, *replies: Any) -> None:
        """Queue upstream replies to the chat route."""
        self.fake.script("POST", CHAT, *replies)

    def slots_sent(self) -> list[int]:
        """The C{id_slot} of each chat request the fake received, in order."""
        return [r.json["id_slot"] for r in self.fake.requests_to("POST", CHAT)]

    def error_status(
        self, connection: ClientConnection, status: int, code: str, *more: str
    ) -> dict[str, Any]:
        """
        Assert a whole JSON error answer with C{status} and C{code} (and the error fields
        C{more}); return the error.
        """
        response = connection.response()
        self.assertEqual((response.status, response.complete), (status, True))
        self.assertEqual(response.headers["content-type"], "application/json")
        error: dict[str, Any] = response.json()["error"]
        keys = sorted(["code", "message", "param", "type", *more])
        self.assertEqual((sorted(error), error["code"]), (keys, code))
        return error

    def error_event(self, connection: ClientConnection, code: str) -> dict[str, Any]:
        """Assert a whole 200 stream that ends with one error event, no C{[DONE]}."""
        response = connection.response()
        self.assertEqual((response.status, response.complete), (200, True))
        data = response.data()
        self.assertNotIn("[DONE]", data)
        self.assertEqual([d for d in data if "error" in d], [data[-1]])
        error: dict[str, Any] = data[-1]["error"]
        self.assertEqual(
            (sorted(error), error["code"]), (["code", "message", "param", "type"], code)
        )
        return error


class AnswerTests(ChatTestCase):
    """
    Answers in both forms: a C{chat.completion} object, or a stream of chunks.
    """

    def test_non_stream(self) -> None:
        """A non-stream answer is one chat.completion with usage and the upstream timings."""
        self.script(answer({"reasoning_content": "Hmm"}, {"content": "Hel"}, {"content": "lo"}))
        connection = self.harness.post({**HI, "model": "tiny"})
        self.harness.advance(0.15)
        self.assertEqual(connection.responses(), [])
        self.harness.advance(0.15)
        response = connection.response()
        self.assertEqual((response.status, response.complete), (200, True))
        self.assertEqual(response.headers["content-type"], "application/json")
        body = response.json()
        self.assertRegex(body.pop("id"), "^chatcmpl-[0-9a-f]{24}$")
        message = {"role": "assistant", "content": "Hello", "reasoning_content": "Hmm"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        expected = {"object": "chat.completion", "created": NOW, "model": "tiny"}
        expected.update(choices=[choice], usage=USAGE, timings=TIMINGS)
        self.assertEqual(body, expected)

    def test_non_stream_tool_call(self) -> None:
        """A tool call comes back whole in the message, with finish_reason tool_calls."""
        self.script(answer(*CALL_DELTAS, finish="tool_calls"))
        connection = self.harness.post({**HI, "tools": [WEATHER_TOOL]})
        self.harness.advance(0.5)
        (choice,) = connection.response().json()["choices"]
        self.assertEqual(choice["finish_reason"], "tool_calls")
        self.assertEqual(choice["message"]["tool_calls"], [CALL])

    def test_upstream_request(self) -> None:
        """The request goes upstream streamed, on a slot, with the client's messages and tools."""
        self.script(answer({"content": "ok"}))
        self.harness.post({**HI, "tools": [WEATHER_TOOL], "max_tokens": 10**6})
        (sent,) = self.fake.requests_to("POST", CHAT)
        self.assertEqual(sent.json["messages"], HI["messages"])
        self.assertEqual(sent.json["tools"][0]["function"]["name"], "get_weather")
        self.assertEqual((sent.json["id_slot"], sent.json["stream"]), (0, True))
        self.assertEqual(sent.json["max_tokens"], self.config.max_tokens)

    def test_stream(self) -> None:
        """A stream: role, reasoning, content, finish, usage (asked for), [DONE]; one id."""
        self.script(answer({"reasoning_content": "Hmm"}, {"content": "Hel"}, {"content": "lo"}))
        connection = self.harness.post({**STREAM, "stream_options": {"include_usage": True}})
        self.harness.advance(0.5)
        response = connection.response()
        self.assertEqual((response.status, response.complete), (200, True))
        self.assertEqual(response.headers["content-type"], "text/event-stream")
        self.assertEqual(response.headers["cache-control"], "no-cache")
        *chunks, done = response.data()
        self.assertEqual(done, "[DONE]")
        self.assertEqual(
            [c["choices"] for c in chunks],
            [
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": None},
                        "finish_reason": None,
                    }
                ],
                [{"index": 0, "delta": {"reasoning_content": "Hmm"}, "finish_reason": None}],
                [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}],
                [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}],
                [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                [],
            ],
        )
        self.assertEqual(chunks[-1]["usage"], USAGE)
        envelopes = {(c["id"], c["object"], c["created"], c["model"]) for c in chunks}
        self.assertEqual(len(envelopes), 1)
        self.assertEqual(envelopes.pop()[1:], ("chat.completion.chunk", NOW, "tiny"))

    def test_stream_tool_call(self) -> None:
        """Tool call deltas go out as they come: id and type first, then name, then arguments."""
        self.script(answer(*CALL_DELTAS, finish="tool_calls"))
        connection = self.harness.post({**STREAM, "tools": [WEATHER_TOOL]})
        self.harness.advance(0.5)
        response = connection.response()
        calls = [d["tool_calls"] for d in deltas(response) if "tool_calls" in d]
        function = {"name": "get_weather", "arguments": ""}
        self.assertEqual(
            calls,
            [
                [{"index": 0, "id": "call_1", "type": "function", "function": {"arguments": ""}}],
                [{"index": 0, "function": function}],
                [{"index": 0, "function": {"arguments": '{"city":'}}],
                [{"index": 0, "function": {"arguments": '"Paris"}'}}],
            ],
        )
        *chunks, done = response.data()
        self.assertEqual(
            (chunks[-1]["choices"][0]["finish_reason"], done), ("tool_calls", "[DONE]")
        )
        self.assertNotIn("usage", chunks[-1])

    def test_stream_written_as_it_arrives(self) -> None:
        """Each delta reaches the client when the server sends it, not at the end."""
        self.script(answer({"content": "a"}, {"content": "b"}, {"content": "c"}))
        connection = self.harness.post(STREAM)
        self.assertEqual(connection.responses(), [])
        self.harness.advance(0.05)
        self.assertEqual(deltas(connection.response())[1:], [{"content": "a"}])
        self.harness.advance(0.05)
        response = connection.response()
        self.assertEqual(deltas(response)[1:], [{"content": "a"}, {"content": "b"}])
        self.assertFalse(response.complete)


class LoopdEventTests(ChatTestCase):
    """
    loopd's own events reach a streaming client as C{: loopd {...}} comment lines.
    """

    config = make_config(slots=1)

    def test_queued(self) -> None:
        """A request queued for the only slot streams a queued comment, then goes upstream."""
        self.script(answer({"content": "first"}), answer({"content": "second"}))
        first = self.harness.post(STREAM)
        second = self.harness.post(STREAM)
        waiting = second.response()
        self.assertEqual((waiting.status, waiting.complete), (200, False))
        self.assertEqual(waiting.comments(), [{"event": "queued", "ahead": 1}])
        self.assertEqual(deltas(waiting), [{"role": "assistant", "content": None}])
        self.assertEqual(len(self.fake.requests), 1)
        self.harness.advance(1)
        self.assertTrue(first.response().complete)
        self.assertEqual(deltas(second.response())[1], {"content": "second"})
        went, came = self.fake.requests_to("POST", CHAT)
        # The second goes upstream the moment the first's reply has ended.
        self.assertEqual(round(came.received_at, 9), 0.15)
        self.assertEqual(came.received_at, went.connection.reply_ended_at)

    def test_queued_non_stream(self) -> None:
        """A non-stream request that waits its turn gets only its answer, no comment."""
        self.script(answer({"content": "first"}), answer({"content": "second"}))
        self.harness.post(STREAM)
        second = self.harness.post(HI)
        self.assertEqual(second.responses(), [])
        self.harness.advance(1)
        self.assertEqual(second.response().json()["choices"][0]["message"]["content"], "second")

    def test_progress(self) -> None:
        """Prompt progress goes out as progress comments, before the first delta."""
        events = [
            chunk(progress=(30, 10, 20)),
            chunk(progress=(30, 10, 30)),
            chunk({"content": "a"}),
        ]
        self.script(sse_reply([*events, chunk({}, "stop", timings=TIMINGS)], delay_s=0.05))
        connection = self.harness.post(STREAM)
        self.harness.advance(0.05)
        response = connection.response()
        self.assertEqual(
            response.comments(), [{"event": "progress", "total": 30, "cache": 10, "processed": 20}]
        )
        self.harness.advance(0.5)
        events_seen = connection.response().events()
        progress = [i for i, e in enumerate(events_seen) if '"progress"' in e]
        content = [i for i, e in enumerate(events_seen) if '"content":"a"' in e]
        self.assertEqual(len(progress), 2)
        self.assertLess(progress[-1], content[0])

    def test_timings_per_token(self) -> None:
        """
        With C{timings_per_token} each piece's chunk carries the server's C{timings} of its
        own chunk, as llama-server's stream does; without it, none does.
        """
        per_token = {"predicted_n": 1, "predicted_ms": 4.0, "prompt_n": 3}
        events = [
            {**chunk({"reasoning_content": "hm"}), "timings": per_token},
            {**chunk({"content": "a"}), "timings": {**per_token, "predicted_n": 2}},
            chunk({"content": "b"}),
        ]
        reply = sse_reply([*events, chunk({}, "stop", timings=TIMINGS)], delay_s=0.05)
        for asked in (True, False):
            self.script(reply)
            connection = self.harness.post({**STREAM, "timings_per_token": asked})
            self.harness.advance(1)
            data = [d for d in connection.response().data() if isinstance(d, dict)]
            pieces = [
                d
                for d in data
                if d["choices"]
                and d["choices"][0]["delta"].get(
                    "content", d["choices"][0]["delta"].get("reasoning_content")
                )
            ]
            seen = [piece.get("timings") for piece in pieces]
            expected = [per_token, {**per_token, "predicted_n": 2}, None] if asked else [None] * 3
            self.assertEqual(seen, expected)
            sent = self.fake.requests_to("POST", CHAT)[-1].json
            assert sent is not None
            self.assertIs(sent["timings_per_token"], True)

    def test_waiting(self) -> None:
        """While the server holds the request for a busy slot, waiting comments go out."""
        self.script(dataclasses.replace(answer({"content": "a"}), headers_delay=0.12))
        self.fake.set_default("GET", SLOTS, slots_reply(True))
        connection = self.harness.post(STREAM)
        self.harness.advance(0.11)
        waiting = {"event": "waiting", "slot_busy": True, "loading": False}
        self.assertEqual(connection.response().comments(), [waiting, waiting])
        self.harness.advance(0.5)
        self.assertEqual(connection.response().data()[-1], "[DONE]")


class ErrorTests(ChatTestCase):
    """
    Errors before the stream are an HTTP status and a JSON body; after it, one event.
    """

    config = make_config(slots=1)

    def test_busy(self) -> None:
        """With the slot taken and its queue full, one more request is 429 busy at once."""
        self.script(answer({"content": "a"}), answer({"content": "b"}))
        self.harness.post(STREAM)
        self.harness.post(STREAM)
        error = self.error_status(self.harness.post(STREAM), 429, "busy")
        self.assertEqual(error["type"], "rate_limit_error")
        self.assertEqual(len(self.fake.requests), 1)
        self.assertEqual(self.harness.scrape()[outcome("tiny", "busy")], 1.0)

    def test_context_exceeded(self) -> None:
        """
        A prompt that does not fit is 400 context_exceeded with the server's own message,
        type and counts.
        """
        text = "the request exceeds the available context size, try increasing it"
        self.script(error_reply(400, "exceed_context_size_error", text, n_prompt_tokens=9000))
        connection = self.harness.post(STREAM)
        error = self.error_status(connection, 400, "context_exceeded", "n_prompt_tokens")
        self.assertEqual(
            (error["type"], error["message"], error["n_prompt_tokens"]),
            ("exceed_context_size_error", text, 9000),
        )

    def test_load_timeout(self) -> None:
        """A server loading past load_wait_ms is 503 load_timeout; the request is closed."""
        self.script(UNANSWERED)
        self.fake.set_default("GET", SLOTS, LOADING)
        connection = self.harness.post(HI)
        self.harness.advance(0.5)
        self.assertEqual(self.error_status(connection, 503, "load_timeout")["type"], "server_error")
        self.assertFalse(self.fake.requests_to("POST", CHAT)[0].connection.open)

    def test_wait_timeout(self) -> None:
        """A slot busy past busy_wait_ms is 504 wait_timeout."""
        self.script(UNANSWERED)
        self.fake.set_default("GET", SLOTS, slots_reply(True))
        connection = self.harness.post(HI)
        self.harness.advance(0.5)
        self.assertEqual(self.error_status(connection, 504, "wait_timeout")["type"], "timeout")

    def test_upstream_500(self) -> None:
        """An upstream 500 is 502 upstream_error, with the server's message."""
        self.script(error_reply(500, "server_error", "kv cache broke"))
        error = self.error_status(self.harness.post(STREAM), 502, "http")
        self.assertEqual(error["type"], "upstream_error")
        self.assertIn("kv cache broke", error["message"])

    def test_error_event_mid_stream(self) -> None:
        """An error event after deltas went out is passed on as one event, without [DONE]."""
        failure = {"error": {"code": 500, "message": "decode failed", "type": "server_error"}}
        self.script(sse_reply([chunk({"content": "Hel"}), failure], delay_s=0.05, done=False))
        connection = self.harness.post(STREAM)
        self.harness.advance(0.5)
        error = self.error_event(connection, "http")
        self.assertIn("decode failed", error["message"])
        self.assertEqual(deltas(connection.response())[1:], [{"content": "Hel"}])
        self.assertEqual(self.harness.scrape()[outcome("tiny", "http")], 1.0)

    def test_unreachable_names_endpoint_not_socket(self) -> None:
        """
        A chat to an endpoint whose socket is gone is 503 endpoint_unavailable naming the
        endpoint and why; the socket's path is in the log, never in the answer.
        """
        self.harness.net.stop_listening(PATH)
        with capturedLogs() as events:
            connection = self.harness.post(HI)
            self.harness.advance(5)
        error = self.error_status(connection, 503, "endpoint_unavailable")
        self.assertEqual(
            error["message"],
            "endpoint tiny is down: no socket (nothing is serving it); retry after 1 s",
        )
        self.assertNotIn(PATH, connection.response().body.decode())
        self.assertIn(PATH, " ".join(formatEvent(e) for e in events))

    def test_unreachable_mid_stream_names_endpoint_not_socket(self) -> None:
        """
        A stream already started (it waited its turn for the slot) whose server has gone
        when its turn comes ends with an endpoint_unavailable error event naming the
        endpoint; the path stays in the log.
        """
        self.script(answer({"content": "a"}, delay_s=0.1))
        with capturedLogs() as events:
            self.harness.post(STREAM)
            connection = self.harness.post(STREAM)
            self.harness.advance(0.01)
            self.harness.net.stop_listening(PATH)
            self.harness.advance(5)
        error = self.error_event(connection, "endpoint_unavailable")
        self.assertEqual(
            error["message"],
            "endpoint tiny is down: no socket (nothing is serving it); retry after 1 s",
        )
        self.assertNotIn(PATH, connection.response().body.decode())
        self.assertIn(PATH, " ".join(formatEvent(e) for e in events))

    def test_wait_timeout_after_waiting_comments(self) -> None:
        """A stream already started by waiting comments ends with a wait_timeout event."""
        self.script(UNANSWERED)
        self.fake.set_default("GET", SLOTS, slots_reply(True))
        connection = self.harness.post(STREAM)
        self.harness.advance(0.5)
        self.error_event(connection, "wait_timeout")
        self.assertEqual({c["event"] for c in connection.response().comments()}, {"waiting"})


def counted(delta: dict[str, Any], generated: int) -> dict[str, Any]:
    """An upstream chunk of one token's piece, with llama-server's per-token timings."""
    return chunk(delta, timings={"cache_n": 0, "prompt_n": 10, "predicted_n": generated})


class InterruptedStreamTests(ChatTestCase):
    """
    An upstream stream cut after deltas went out is never started again: a llama-server
    continues it, anything else ends it with the error event.
    """

    config = make_config(retry=Retry(attempts=3, backoff_ms=(50,), jitter=0.0))

    def test_resumed_once_each(self) -> None:
        """Cut after "Hel": one role chunk, each piece once, the finish and [DONE]."""
        role = chunk({"role": "assistant", "content": None})
        cut = sse_reply(
            [role, counted({"reasoning_content": "Hmm"}, 2), counted({"content": "Hel"}, 4)],
            delay_s=0.01,
            end="cut",
        )

        def model(request: Any, fake: Any) -> Any:
            """The whole answer again, or its rest after a partial answer given back."""
            if request.json["messages"][-1]["role"] == "assistant":
                return answer({"content": "lo"})
            return answer({"reasoning_content": "Hmm"}, {"content": "Hel"}, {"content": "lo"})

        self.script(cut)
        self.fake.set_default("POST", CHAT, model)
        self.fake.set_default("POST", "/apply-template", template_reply())
        connection = self.harness.post(STREAM)
        self.harness.advance(1)
        response = connection.response()
        self.assertEqual((response.status, response.complete), (200, True))
        self.assertEqual(
            deltas(response),
            [
                {"role": "assistant", "content": None},
                {"reasoning_content": "Hmm"},
                {"content": "Hel"},
                {"content": "lo"},
                {},
            ],
        )
        self.assertEqual(response.data()[-1], "[DONE]")
        self.assertEqual([c["event"] for c in response.comments()], ["retrying"])
        _, again = self.fake.requests_to("POST", CHAT)
        self.assertEqual(
            again.json["messages"][-1],
            {"role": "assistant", "content": "Hel", "reasoning_content": "Hmm"},
        )
        self.assertEqual(again.json["continue_final_message"], "content")

    def test_tool_call_ends_with_error(self) -> None:
        """Cut inside a tool call: the error event ends the stream; nothing is sent again."""
        cut = sse_reply([chunk(CALL_DELTAS[0]), chunk(CALL_DELTAS[1])], delay_s=0.01, end="cut")
        self.script(cut, answer({"content": "never"}))
        connection = self.harness.post({**STREAM, "tools": [WEATHER_TOOL]})
        self.harness.advance(1)
        self.error_event(connection, "stream_closed_early")
        sent = [d for d in deltas(connection.response()) if "tool_calls" in d]
        self.assertEqual(len(sent), 2)
        self.assertEqual(len(self.fake.requests_to("POST", CHAT)), 1)


class EndingTests(ChatTestCase):
    """
    A client that leaves, and a gateway that stops, end the upstream request.
    """

    config = make_config(slots=1)

    def test_client_gone_mid_stream(self) -> None:
        """The client leaving mid-stream closes the upstream connection at that moment."""
        self.script(answer(*[{"content": str(i)} for i in range(8)]))
        connection = self.harness.post(STREAM)
        self.harness.advance(0.1)
        self.assertEqual(len(deltas(connection.response())), 3)
        written = connection.transport.value()
        connection.drop()
        upstream = self.fake.requests_to("POST", CHAT)[0].connection
        self.assertEqual((upstream.closed_at, upstream.client_closed), (0.1, True))
        self.harness.advance(1)
        self.assertEqual(connection.transport.value(), written)
        self.assertEqual(self.harness.scrape()[outcome("tiny", "client_gone")], 1.0)
        self.assertEqual(self.harness.gateway.in_flight, set())

    def test_client_gone_while_queued(self) -> None:
        """A queued client that leaves never reaches the server."""
        self.script(answer({"content": "a"}), answer({"content": "b"}))
        self.harness.post(STREAM)
        self.harness.post(STREAM).drop()
        self.harness.advance(1)
        self.assertEqual(len(self.fake.requests_to("POST", CHAT)), 1)

    def test_stop_mid_stream(self) -> None:
        """Stopping the gateway ends a stream with a shutting_down event and closes upstream."""
        self.script(answer(*[{"content": str(i)} for i in range(8)]))
        connection = self.harness.post(STREAM)
        self.harness.advance(0.1)
        self.harness.gateway.stop()
        self.harness.net.pump()
        self.assertEqual(self.error_event(connection, "shutting_down")["type"], "server_error")
        upstream = self.fake.requests_to("POST", CHAT)[0].connection
        self.assertEqual((upstream.closed_at, upstream.client_closed), (0.1, True))
        self.assertEqual(self.harness.gateway.in_flight, set())

    def test_stop_before_answer(self) -> None:
        """Stopping the gateway answers a non-stream request under way with 503."""
        self.script(answer({"content": "a"}))
        connection = self.harness.post(HI)
        self.harness.gateway.stop()
        self.error_status(connection, 503, "shutting_down")


class SessionTests(ChatTestCase):
    """
    Sessions keep their slot, and their cache outcomes are logged.
    """

    def turn(self, session: str | None, **timings: int) -> ClientConnection:
        """Queue an answer with these timings and post one request of C{session}."""
        self.script(answer({"content": "ok"}, timings={**TIMINGS, **timings}))
        return self.harness.post(HI, session)

    def test_session_keeps_its_slot(self) -> None:
        """Two sessions on two slots: each session's second request goes to its first slot."""
        self.turn("a")
        self.turn("b")
        self.harness.advance(1)
        self.turn("b")
        self.turn("a")
        self.harness.advance(1)
        self.assertEqual(self.slots_sent(), [0, 1, 1, 0])

    def test_anonymous_session_per_connection(self) -> None:
        """Without X-Session-Id, each connection is a session of its own."""
        self.turn(None)
        second = self.turn(None)
        self.harness.advance(1)
        self.script(answer({"content": "again"}))
        second.post(HI)
        self.harness.advance(1)
        self.assertEqual(self.slots_sent(), [0, 1, 1])
        self.assertEqual(len(second.responses()), 2)

    def test_cache_loss_logged(self) -> None:
        """A turn that reuses too little of the last is logged with both numbers, and counted."""
        self.turn("a", cache_n=0, prompt_n=100, predicted_n=20)
        self.harness.advance(1)
        with capturedLogs() as events:
            self.turn("a", cache_n=10, prompt_n=200, predicted_n=5)
            self.harness.advance(1)
        (loss,) = [e for e in events if "cache loss" in e["log_format"]]
        self.assertEqual((loss["cached"], loss["expected"], loss["slot"]), (10, 100, 0))
        self.assertIn("session a on slot 0: reused 10 of 100 tokens", formatEvent(loss))
        losses = ("loopd_cache_losses_total", frozenset({("endpoint", "tiny")}))
        self.assertEqual(self.harness.scrape()[losses], 1.0)

    def test_cache_hit_logged(self) -> None:
        """A turn that reuses the whole last prompt is logged as a hit."""
        self.turn("a", cache_n=0, prompt_n=100, predicted_n=20)
        self.harness.advance(1)
        with capturedLogs() as events:
            self.turn("a", cache_n=100, prompt_n=30, predicted_n=5)
            self.harness.advance(1)
        texts = [formatEvent(e) for e in events if "cache" in e.get("log_format", "")]
        self.assertEqual(texts, ["cache hit for session a on slot 0: reused 100 of 100 tokens"])
