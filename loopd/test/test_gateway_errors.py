"""
Tests of the gateway's errors: L{loopd.gateway.errors} (the error body, the mapping of
failures to it) and the 400s of L{loopd.gateway.doors.chat_read.parse_request}, one test per
class of bad input.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.errors import (
    Busy,
    Connect,
    Http,
    InferError,
    LoadTimeout,
    Protocol,
    ProxyRefused,
    Stalled,
    StreamClosedEarly,
    ThinkingOverrun,
    WaitTimeout,
)
from loopd.gateway.doors.chat_read import parse_request
from loopd.gateway.errors import GatewayError, error_for, quotes_server
from loopd.gateway.request import GatewayRequest
from loopd.test.support.json_paths import paths

CONTEXT_MESSAGE = "request (9000 tokens) exceeds the available context size (8192 tokens)"
CONTEXT_BODY = (
    f'{{"error":{{"code":400,"message":"{CONTEXT_MESSAGE}","type":"exceed_context_size_error",'
    '"n_prompt_tokens":9000,"n_ctx":8192}}'
)

USER = {"role": "user", "content": "Hi"}
FUNCTION = {"name": "f", "arguments": '{"a":1}'}
CALL: dict[str, Any] = {"id": "c1", "type": "function", "function": FUNCTION}
TOOL_F = {"type": "function", "function": {"name": "f"}}


def encode(document: object) -> bytes:
    """A JSON request body."""
    return json.dumps(document).encode("utf-8")


def fields(error: GatewayError) -> tuple[int, str, str, str]:
    """The four fields of a gateway error, for one comparison."""
    return (error.status, error.message, error.type, error.code)


def status_type_code(error: GatewayError) -> tuple[int, str, str]:
    """The status, type and code of a gateway error."""
    return (error.status, error.type, error.code)


class GatewayErrorTests(SynchronousTestCase):
    """L{GatewayError} carries a status and renders OpenAI's error body."""

    def test_body(self) -> None:
        """
        body() is the OpenAI error object with message, type, code and param: the field the
        error is about, else null.
        """
        error = GatewayError(404, "no model", "not_found_error", "model_not_found")
        inner = {"message": "no model", "type": "not_found_error", "code": "model_not_found"}
        self.assertEqual(error.body(), {"error": {**inner, "param": None}})
        error = GatewayError(
            400, "tools[0].type: no", "invalid_request_error", "x", param="tools[0].type"
        )
        self.assertEqual(error.body()["error"]["param"], "tools[0].type")

    def test_fields_and_str(self) -> None:
        """The fields are attributes, and str() is the message."""
        error = GatewayError(413, "too large", "invalid_request_error", "body_too_large")
        self.assertEqual(
            fields(error), (413, "too large", "invalid_request_error", "body_too_large")
        )
        self.assertEqual(str(error), "too large")

    def test_repr(self) -> None:
        """The repr shows every field."""
        error = GatewayError(429, "busy", "rate_limit_error", "busy")
        self.assertEqual(repr(error), "GatewayError(429, 'busy', 'rate_limit_error', 'busy')")


class FixedMappingTests(SynchronousTestCase):
    """The llama client's own limits map to fixed statuses, types and codes."""

    def test_gateway_error_passes_through(self) -> None:
        """A GatewayError is returned as it is."""
        error = GatewayError(405, "no", "invalid_request_error", "method_not_allowed")
        self.assertIs(error_for(error), error)

    def test_limits(self) -> None:
        """Busy 429, LoadTimeout 503, WaitTimeout and Stalled 504, each with its code."""
        cases = [
            (Busy(), (429, "rate_limit_error", "busy")),
            (InferError.Busy(), (429, "rate_limit_error", "busy")),
            (LoadTimeout(), (503, "server_error", "load_timeout")),
            (WaitTimeout(), (504, "timeout", "wait_timeout")),
            (Stalled(), (504, "timeout", "stalled")),
        ]
        self.assertEqual([(kind, status_type_code(error_for(kind))) for kind, _ in cases], cases)
        self.assertIn("queue", error_for(Busy()).message)


class HttpMappingTests(SynchronousTestCase):
    """An upstream error status: 4xx passes through, the rest is a 502."""

    def test_context_exceeded(self) -> None:
        """
        A prompt that does not fit is 400 code context_exceeded with the server's own
        message, type and counts.
        """
        error = error_for(Http(400, CONTEXT_BODY))
        self.assertEqual(
            fields(error), (400, CONTEXT_MESSAGE, "exceed_context_size_error", "context_exceeded")
        )
        self.assertEqual(
            error.body(),
            {
                "error": {
                    "message": CONTEXT_MESSAGE,
                    "type": "exceed_context_size_error",
                    "code": "context_exceeded",
                    "param": None,
                    "n_prompt_tokens": 9000,
                    "n_ctx": 8192,
                }
            },
        )

    def test_bad_grammar(self) -> None:
        """The server's 400 for a grammar it cannot parse passes through as a 400."""
        body = (
            '{"error":{"code":400,"message":"Failed to initialize samplers: failed to parse '
            'grammar","type":"invalid_request_error"}}'
        )
        self.assertEqual(
            fields(error_for(Http(400, body))),
            (
                400,
                "Failed to initialize samplers: failed to parse grammar",
                "invalid_request_error",
                "http",
            ),
        )

    def test_4xx_llama_body(self) -> None:
        """A llama-server 4xx keeps its status, message and type; the code is http."""
        body = '{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}'
        self.assertEqual(
            fields(error_for(Http(404, body))), (404, "File Not Found", "not_found_error", "http")
        )

    def test_4xx_without_type(self) -> None:
        """A 4xx body without a type is an invalid_request_error."""
        body = '{"error":{"message":"this feature is disabled"}}'
        self.assertEqual(
            fields(error_for(Http(403, body))),
            (403, "this feature is disabled", "invalid_request_error", "http"),
        )

    def test_4xx_other_bodies(self) -> None:
        """Other servers' error shapes, plain text and an empty body all give a message."""
        cases = [
            ('{"error": "bad field"}', "bad field"),
            ('{"object": "error", "message": "bad top_k"}', "bad top_k"),
            ('{"error": {"message": ""}, "message": "m"}', "m"),
            ("  Invalid API Key\n", "Invalid API Key"),
            ("[1]", "[1]"),
            ("[" * 3000, "[" * 3000),
            ("", "(no message)"),
        ]
        self.assertEqual([(body, error_for(Http(422, body)).message) for body, _ in cases], cases)
        self.assertEqual(
            status_type_code(error_for(Http(401, "x"))), (401, "invalid_request_error", "http")
        )

    def test_5xx_is_502(self) -> None:
        """An upstream 500 is a 502 upstream_error that quotes the status and message."""
        body = '{"error":{"code":500,"message":"Context size has been exceeded.","type":"x"}}'
        error = error_for(Http(500, body))
        self.assertEqual((error.status, error.type, error.code), (502, "upstream_error", "http"))
        self.assertIn("HTTP 500", error.message)
        self.assertIn("Context size has been exceeded.", error.message)

    def test_other_statuses_are_502(self) -> None:
        """A 503 (the load wait already gave up) and a status below 400 are 502s too."""
        body = '{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'
        self.assertEqual(
            [error_for(Http(503, body)).status, error_for(Http(302, "")).status], [502] * 2
        )


class UpstreamMappingTests(SynchronousTestCase):
    """Other upstream failures are 502 upstream_error with the kind as the code."""

    def test_kinds(self) -> None:
        """Connect, StreamClosedEarly, ThinkingOverrun, Protocol, a bare InferError."""
        cases = [
            (Connect("refused"), "connect"),
            (StreamClosedEarly(), "stream_closed_early"),
            (ThinkingOverrun(), "thinking_overrun"),
            (Protocol("bad JSON"), "protocol"),
            (InferError(), "infer_error"),
        ]
        self.assertEqual(
            [(kind, status_type_code(error_for(kind))) for kind, _ in cases],
            [(kind, (502, "upstream_error", code)) for kind, code in cases],
        )

    def test_messages(self) -> None:
        """The message says what failed and keeps the client's detail."""
        self.assertIn(
            "No such file or directory", error_for(Connect("No such file or directory")).message
        )
        self.assertIn("SSE line over 1 MiB", error_for(Protocol("SSE line over 1 MiB")).message)
        self.assertIn("stream ended", error_for(StreamClosedEarly()).message)


class EndpointMappingTests(SynchronousTestCase):
    """Connect failures and inferproxy refusals name the endpoint, never a socket path."""

    def test_connect_names_endpoint_not_path(self) -> None:
        """A Connect with a path and an endpoint: 502 connect naming the endpoint only."""
        error = error_for(Connect("connection refused", path="/run/x/tiny.sock", endpoint="tiny"))
        self.assertEqual(status_type_code(error), (502, "upstream_error", "connect"))
        self.assertEqual(error.message, "endpoint tiny is unreachable: connection refused")
        self.assertNotIn("/run/x", error.message)

    def test_connect_without_endpoint_hides_path(self) -> None:
        """A Connect that knows only its path still keeps it out of the answer."""
        error = error_for(Connect("connection refused", path="/run/x/tiny.sock"))
        self.assertEqual(error.message, "the model server is unreachable: connection refused")

    def test_proxy_refused(self) -> None:
        """An inferproxy refusal is 503 proxy_refused naming the limit, not a connect error."""
        error = error_for(ProxyRefused(ProxyRefused.CONNECTIONS, 1.0, endpoint="tiny"))
        self.assertEqual(status_type_code(error), (503, "server_error", "proxy_refused"))
        self.assertEqual(
            error.message,
            "endpoint tiny is refusing connections: its inferproxy's connection limit is"
            " reached; retry after 1 s",
        )


class InternalMappingTests(SynchronousTestCase):
    """Anything else is a 500 that gives nothing away."""

    def test_other_exception(self) -> None:
        """An unexpected exception is 500 internal_error and its text stays out."""
        error = error_for(KeyError("/home/user/secret.toml"))
        self.assertEqual(
            (error.status, error.type, error.code), (500, "server_error", "internal_error")
        )
        self.assertNotIn("secret", error.message)

    @given(
        st.sampled_from(
            [Busy, Connect, LoadTimeout, Protocol, Stalled, StreamClosedEarly, WaitTimeout]
            + [ThinkingOverrun, InferError, ValueError, RuntimeError]
        ),
        st.text(),
    )
    def test_any_error_renders(self, kind: type[Exception], text: str) -> None:
        """Every failure maps to a known status and a body that JSON can carry."""
        error = error_for(kind(text))
        self.assertIn(error.status, {429, 500, 502, 503, 504})
        self.assertEqual(json.loads(json.dumps(error.body())), error.body())

    @given(st.integers(min_value=100, max_value=599), st.text(max_size=200))
    def test_any_http_error(self, status: int, body: str) -> None:
        """Any upstream status and body map to 4xx as is, or to 502, never to an exception."""
        error = error_for(Http(status, body))
        self.assertEqual(error.status, status if 400 <= status < 500 else 502)
        self.assertIsInstance(error.message, str)


class ParseRejectedTests(SynchronousTestCase):
    """Each class of bad input is a 400 whose message names the field."""

    def assert_rejected(self, body: object, code: str, field: str) -> None:
        """C{body} (bytes, or a document to encode) is refused with C{code}, naming C{field}."""
        raw = body if isinstance(body, bytes) else encode(body)
        error = self.assertRaises(GatewayError, parse_request, raw)
        self.assertEqual(
            (error.status, error.type, error.code), (400, "invalid_request_error", code)
        )
        self.assertTrue(error.message.startswith(field + ": "), f"{body!r}: {error.message}")

    def assert_field_rejected(self, code: str, field: str, **fields: Any) -> None:
        """One user message plus C{fields} is refused with C{code}, naming C{field}."""
        self.assert_rejected({"messages": [USER], **fields}, code, field)

    def assert_message_rejected(
        self, message: object, field: str, code: str = "invalid_message"
    ) -> None:
        """A conversation whose second message is C{message} is refused, naming C{field}."""
        self.assert_rejected({"messages": [USER, message]}, code, field)

    def test_not_json(self) -> None:
        """Bodies that are not UTF-8 JSON (as JavaScript reads it) are invalid_json."""
        bad = [b"", b"{", b"\xff{}", b'{"a": NaN}', b'{"a": 1e400}', b'{"a": "\\udc00"}']
        for raw in [*bad, b"[" * 5000]:
            self.assert_rejected(raw, "invalid_json", "body")

    def test_not_an_object(self) -> None:
        """A JSON value other than an object is not_an_object."""
        documents: list[object] = [[], "x", 1, None, True]
        for document in documents:
            self.assert_rejected(document, "not_an_object", "body")

    def test_missing_messages(self) -> None:
        """No messages, null messages or an empty array are missing_messages."""
        documents: list[object] = [{}, {"messages": None}, {"messages": []}]
        for document in documents:
            self.assert_rejected(document, "missing_messages", "messages")

    def test_messages_not_array(self) -> None:
        """messages that is not an array is invalid_message."""
        for messages in ("Hi", {"role": "user"}, 3):
            self.assert_rejected({"messages": messages}, "invalid_message", "messages")

    def test_message_not_object(self) -> None:
        """A message that is not an object names its index."""
        for message in ("Hi", None, [USER]):
            self.assert_message_rejected(message, "messages[1]")

    def test_bad_role(self) -> None:
        """A missing or unknown role names the role field."""
        for message in ({"content": "x"}, {"role": "bot", "content": "x"}, {"role": 1}):
            self.assert_message_rejected(message, "messages[1].role")

    def test_bad_content(self) -> None:
        """Content that is missing, null or not text names the content field."""
        for role in ("system", "user", "tool"):
            for content in ({}, {"content": None}, {"content": 1}, {"content": {"text": "x"}}):
                message = {"role": role, "tool_call_id": "c", **content}
                self.assert_message_rejected(message, "messages[1].content")
        raw = encode({"messages": [{"role": "user"}]})
        error = self.assertRaises(GatewayError, parse_request, raw)
        self.assertIn("expected a string or an array of text parts", error.message)

    def test_bad_content_part(self) -> None:
        """A part that is not a text part names the part."""
        for part in ("x", {"text": "x"}, {"type": 1}, None):
            self.assert_message_rejected(
                {"role": "user", "content": [part]}, "messages[1].content[0]"
            )
        for text in ({"type": "text"}, {"type": "text", "text": 2}):
            message: dict[str, Any] = {"role": "user", "content": [text]}
            self.assert_message_rejected(message, "messages[1].content[0].text")

    def test_unsupported_content(self) -> None:
        """File and refusal parts are unsupported_content, naming the part's type."""
        for kind in ("file", "refusal"):
            message = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": kind}]}
            self.assert_message_rejected(
                message, "messages[1].content[1].type", "unsupported_content"
            )

    def test_assistant_without_content(self) -> None:
        """An assistant with null content needs tool calls (or reasoning)."""
        messages: list[object] = [
            {"role": "assistant"},
            {"role": "assistant", "content": None, "tool_calls": []},
        ]
        for message in messages:
            self.assert_message_rejected(message, "messages[1].content")

    def test_bad_tool_calls(self) -> None:
        """Malformed assistant tool calls name the field that is wrong."""
        function = CALL["function"]
        cases = [
            ("x", "messages[1].tool_calls"),
            (["x"], "messages[1].tool_calls[0]"),
            ([{**CALL, "type": "code"}], "messages[1].tool_calls[0].type"),
            ([{**CALL, "id": None}], "messages[1].tool_calls[0].id"),
            ([{**CALL, "function": "f"}], "messages[1].tool_calls[0].function"),
            (
                [{**CALL, "function": {**function, "name": 1}}],
                "messages[1].tool_calls[0].function.name",
            ),
            (
                [CALL, {**CALL, "function": {"name": "f", "arguments": {}}}],
                "messages[1].tool_calls[1].function.arguments",
            ),
        ]
        for calls, field in cases:
            self.assert_message_rejected({"role": "assistant", "tool_calls": calls}, field)

    def test_bad_reasoning_content(self) -> None:
        """reasoning_content that is not a string names the field."""
        message = {"role": "assistant", "content": "a", "reasoning_content": ["r"]}
        self.assert_message_rejected(message, "messages[1].reasoning_content")

    def test_tool_without_call_id(self) -> None:
        """A tool message must say which call it answers."""
        for call_id in ({}, {"tool_call_id": 7}):
            message = {"role": "tool", "content": "x", **call_id}
            self.assert_message_rejected(message, "messages[1].tool_call_id")

    def test_invalid_tools(self) -> None:
        """Malformed tools are invalid_tools, naming the field."""
        cases = [
            ({"type": "function"}, "tools"),
            (["f"], "tools[0]"),
            ([{"function": {"name": "f"}}], "tools[0].type"),
            ([{"type": "function"}], "tools[0].function"),
            ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
            ([TOOL_F, TOOL_F], "tools[1].function.name"),
            (
                [{"type": "function", "function": {"name": "f", "description": 1}}],
                "tools[0].function.description",
            ),
            (
                [{"type": "function", "function": {"name": "f", "parameters": []}}],
                "tools[0].function.parameters",
            ),
        ]
        for tools, field in cases:
            self.assert_field_rejected("invalid_tools", field, tools=tools)

    def test_bad_tool_choice(self) -> None:
        """An unknown tool_choice form, or an object naming no offered tool, is refused."""
        for choice in ("any", 1, {"type": "tool", "name": "f"}, {"function": {"name": "f"}}):
            self.assert_field_rejected(
                "invalid_parameter", "tool_choice", tools=[TOOL_F], tool_choice=choice
            )
        functions: list[object] = [{"name": "g"}, {"name": 1}, "f"]
        for function in functions:
            named = {"type": "function", "function": function}
            self.assert_field_rejected(
                "invalid_parameter", "tool_choice.function.name", tools=[TOOL_F], tool_choice=named
            )

    def test_bad_max_tokens(self) -> None:
        """max_tokens and max_completion_tokens must be positive integers."""
        for key in ("max_tokens", "max_completion_tokens"):
            for value in (0, -1, 1.5, "5", [5]):
                self.assert_field_rejected("invalid_parameter", key, **{key: value})

    def test_bad_sampling(self) -> None:
        """temperature outside 0-2 and top_p outside 0-1, or not numbers, are refused."""
        cases = [("temperature", 2.01), ("temperature", -1), ("top_p", 1.5), ("top_p", "0.5")]
        for key, value in cases:
            self.assert_field_rejected("invalid_parameter", key, **{key: value})

    def test_bad_stop(self) -> None:
        """stop must be a string or up to four non-empty strings."""
        cases = [(["a"] * 5, "stop"), (3, "stop"), ("", "stop"), (["a", 1], "stop[1]")]
        for stop, field in [*cases, ([""], "stop[0]")]:
            self.assert_field_rejected("invalid_parameter", field, stop=stop)

    def test_bad_stream_fields(self) -> None:
        """stream and include_usage must be booleans, stream_options an object."""
        self.assert_field_rejected("invalid_parameter", "stream", stream="yes")
        self.assert_field_rejected("invalid_parameter", "stream_options", stream_options=True)
        self.assert_field_rejected(
            "invalid_parameter", "stream_options.include_usage", stream_options={"include_usage": 1}
        )

    def test_bad_thinking_fields(self) -> None:
        """reasoning_effort must be a string, enable_thinking a boolean."""
        self.assert_field_rejected("invalid_parameter", "reasoning_effort", reasoning_effort=False)
        self.assert_field_rejected(
            "invalid_parameter", "chat_template_kwargs", chat_template_kwargs=[]
        )
        field = "chat_template_kwargs.enable_thinking"
        for value in (0, "false"):
            kwargs = {"enable_thinking": value}
            self.assert_field_rejected("invalid_parameter", field, chat_template_kwargs=kwargs)

    def test_bad_model(self) -> None:
        """A model that is not a string is refused."""
        self.assert_field_rejected("invalid_parameter", "model", model=["local"])

    def test_booleans_are_not_numbers(self) -> None:
        """true and false are refused wherever a number is expected."""
        for key in ("max_tokens", "max_completion_tokens", "temperature", "top_p"):
            for value in (True, False):
                self.assert_field_rejected("invalid_parameter", key, **{key: value})
        for key in ("n", "seed", "top_k", "presence_penalty", "min_p"):
            self.assert_field_rejected("invalid_parameter", key, **{key: True})

    def test_n_not_an_integer(self) -> None:
        """An n that is not an integer is invalid_parameter (its range is the server's)."""
        for n in ("1", 1.5, [2]):
            self.assert_field_rejected("invalid_parameter", "n", n=n)

    def test_unknown_parameter(self) -> None:
        """A field neither OpenAI's nor llama.cpp's is unsupported_parameter, named."""
        self.assert_field_rejected("unsupported_parameter", "frobnicate", frobnicate=1)


RICH: dict[str, Any] = {
    "model": "local",
    "messages": [
        {"role": "developer", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
    ],
    "tools": [TOOL_F, {"type": "function", "function": {"name": "g", "parameters": {}}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 5,
    "max_completion_tokens": 6,
    "temperature": 1,
    "top_p": 0.5,
    "stop": ["x"],
    "n": 1,
    "reasoning_effort": "low",
    "chat_template_kwargs": {"enable_thinking": True},
}
WRONG: list[object] = [None, True, False, 0, -1, 1.5, "", "x", [], ["x"], {}, {"x": 1}]


class WrongTypeTests(SynchronousTestCase):
    """A full request with any one value replaced by one of another type."""

    def test_every_value_replaced(self) -> None:
        """Every such request is read or refused with a 400, never another exception."""
        self.assertIsInstance(parse_request(encode(RICH)), GatewayRequest)
        for *parents, key in paths(RICH)[1:]:
            for wrong in WRONG:
                document = copy.deepcopy(RICH)
                node = document
                for parent in parents:
                    node = node[parent]
                node[key] = wrong
                try:
                    parse_request(encode(document))
                except GatewayError as error:
                    self.assertEqual(error.status, 400)


class QuotesServerTests(SynchronousTestCase):
    """L{quotes_server}: which errors' messages carry the model server's text."""

    def test_server_text(self) -> None:
        """An upstream error body and a protocol failure's detail are the server's text."""
        for error in (Http(500, "Failed to parse input: ZEBRA"), Http(400, "bad"), Protocol("x")):
            self.assertTrue(quotes_server(error), error)
        self.assertIn("ZEBRA", error_for(Http(500, "Failed to parse input: ZEBRA")).message)

    def test_loopd_words(self) -> None:
        """loopd's own messages: connect failures, its fixed ones, its own errors."""
        for error in (
            Connect("refused", endpoint="tiny"),
            ProxyRefused("max_connections"),
            Busy(),
            WaitTimeout("no lease"),
            GatewayError(400, "bad", "invalid_request_error", "x"),
            ValueError("internal"),
        ):
            self.assertFalse(quotes_server(error), error)
