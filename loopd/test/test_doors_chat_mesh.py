"""
Tests for L{loopd.gateway.doors.chat_mesh}: the chat door's answer to a mesh turn, its bodies
and SSE chunks (reference §1.12).
"""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.chat_mesh import (
    MeshChatAnswer,
    arguments_wire_string,
    chat_response,
    error_response,
    is_failure,
    stream_chunks,
    tool_call_response,
    usage_for,
)
from loopd.gateway.doors.door import data_line, done_line
from loopd.gateway.errors import GatewayError, MeshTurnError
from loopd.llama.types import Completion, Content, FinishReason, Timings, ToolCall

ID = "chatcmpl-moa-17f0"
CREATED = 1_760_000_000


def strict_loads(text: str) -> Any:
    """Parse C{text} as strict JSON (no NaN or Infinity)."""

    def reject(name: str) -> Any:
        raise ValueError(name)

    return json.loads(text, parse_constant=reject)


def answer(content: str = "Paris.") -> dict[str, Any]:
    """An answer body with the test id and time."""
    return chat_response(content, completion_id=ID, created=CREATED)


def tool_call(name: str = "read_file", arguments: object = None) -> dict[str, Any]:
    """A tool-call body with the test ids and time."""
    if arguments is None:
        arguments = {"path": "a.txt"}
    return tool_call_response(
        name, arguments, completion_id=ID, call_id="call_abc", created=CREATED
    )


def failure(code: str = "all_workers_failed") -> dict[str, Any]:
    """A failure body with the test id and time."""
    return error_response("all 3 workers failed", code, completion_id=ID, created=CREATED)


class UsageTests(SynchronousTestCase):
    """'completion_tokens = ceil(chars/4), chars counts Unicode scalars, minimum of 1 for
    non-empty text and 0 for ""; prompt_tokens = 0, total_tokens = completion_tokens'."""

    TABLE = [
        ("", 0),
        ("a", 1),
        ("abc", 1),
        ("abcd", 1),
        ("abcde", 2),
        ("abcdefgh", 2),
        ("abcdefghi", 3),
        ("é", 1),
        ("éééé", 1),
        ("ééééé", 2),
        ("\U0001f600", 1),
        ("\U0001f600" * 5, 2),
        ("日本語の文", 2),
    ]

    def test_table(self) -> None:
        """Each row of the usage table gives its completion token count."""
        for text, tokens in self.TABLE:
            with self.subTest(text=text):
                self.assertEqual(
                    usage_for(text),
                    {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens},
                )

    def test_scalars_not_bytes(self) -> None:
        """Four two-byte scalars count as four, not eight (scalars, not UTF-8 bytes)."""
        self.assertEqual(usage_for("éééé")["completion_tokens"], 1)

    @given(st.text())
    def test_rule(self, text: str) -> None:
        """For any text, completion is ceil(len/4), prompt is 0 and total equals completion."""
        usage = usage_for(text)
        self.assertEqual(usage["completion_tokens"], math.ceil(len(text) / 4))
        self.assertEqual(usage["prompt_tokens"], 0)
        self.assertEqual(usage["total_tokens"], usage["completion_tokens"])
        self.assertEqual(usage["completion_tokens"] >= 1, text != "")


class ArgumentsWireStringTests(SynchronousTestCase):
    """ARG_STRING (§1.12): its four rules."""

    def test_object_string_verbatim(self) -> None:
        """'a string that parses to a JSON object → passed through verbatim' (spacing kept)."""
        for text in ['{"path": "a"}', "{}", ' { "a" : [1, {"b": null}] } ', '{"é":"ü"}']:
            with self.subTest(text=text):
                self.assertEqual(arguments_wire_string(text), text)

    def test_other_string(self) -> None:
        """'any other string → "{}"': not JSON, or JSON that is not an object."""
        for text in ["", "path=a", "[1, 2]", '"x"', "42", "null", "true", "{", '{"a": NaN}']:
            with self.subTest(text=text):
                self.assertEqual(arguments_wire_string(text), "{}")

    def test_object_serialized(self) -> None:
        """'an object → serialized', compactly and with non-ASCII text kept."""
        self.assertEqual(
            arguments_wire_string({"path": "a.txt", "n": 2, "tags": ["é", None, True]}),
            '{"path":"a.txt","n":2,"tags":["é",null,true]}',
        )
        self.assertEqual(arguments_wire_string({}), "{}")

    def test_null_and_primitives(self) -> None:
        """'Null or a primitive → "{}"'; an array is no object and gets the same."""
        for value in [None, True, False, 0, 3.5, [1, 2], []]:
            with self.subTest(value=value):
                self.assertEqual(arguments_wire_string(value), "{}")

    def test_unserializable_object(self) -> None:
        """An object strict JSON cannot carry (NaN, a non-JSON value) becomes C{"{}"}."""
        self.assertEqual(arguments_wire_string({"x": float("nan")}), "{}")
        self.assertEqual(arguments_wire_string({"x": object()}), "{}")

    @given(
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(st.text(max_size=5), inner, max_size=3)
            ),
            max_leaves=10,
        )
        | st.text()
    )
    def test_always_an_object(self, value: object) -> None:
        """Whatever it is given, the result parses as a strict JSON object."""
        self.assertIsInstance(strict_loads(arguments_wire_string(value)), dict)

    @given(st.dictionaries(st.text(max_size=8), st.integers() | st.text() | st.none()))
    def test_serialized_object_round_trips(self, value: dict[str, object]) -> None:
        """A serialized object reads back equal, and as a string it passes through unchanged."""
        wire = arguments_wire_string(value)
        self.assertEqual(strict_loads(wire), value)
        self.assertEqual(arguments_wire_string(wire), wire)


class BodyTests(SynchronousTestCase):
    """The §1.12 body table, row by row, plus C{created} (a deliberate departure)."""

    def test_chat_response(self) -> None:
        """An answer body has every field of the table's answer column."""
        self.assertEqual(
            answer("Paris is the capital."),
            {
                "id": ID,
                "object": "chat.completion",
                "created": CREATED,
                "model": "mesh",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "Paris is the capital."},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": 6, "total_tokens": 6},
            },
        )

    def test_tool_call_response(self) -> None:
        """A tool-call body has C{content: null}, one call, C{tool_calls}, usage from ARG_STRING."""
        wire = '{"path":"a.txt"}'
        self.assertEqual(
            tool_call(),
            {
                "id": ID,
                "object": "chat.completion",
                "created": CREATED,
                "model": "mesh",
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {
                                    "id": "call_abc",
                                    "type": "function",
                                    "function": {"name": "read_file", "arguments": wire},
                                }
                            ],
                        },
                        "finish_reason": "tool_calls",
                    }
                ],
                "usage": usage_for(wire),
            },
        )

    def test_tool_call_arguments_are_arg_string(self) -> None:
        """The call's arguments go through ARG_STRING: a string object verbatim, else C{"{}"}."""
        for arguments, wire in [('{"a": 1}', '{"a": 1}'), ("oops", "{}"), (7, "{}")]:
            with self.subTest(arguments=arguments):
                body = tool_call(arguments=arguments)
                function = body["choices"][0]["message"]["tool_calls"][0]["function"]
                self.assertEqual(function["arguments"], wire)
                self.assertEqual(body["usage"], usage_for(wire))

    def test_error_response(self) -> None:
        """A failure body: message as content, C{error} finish, the C{moa_failure} error."""
        message = "all 3 workers failed"
        self.assertEqual(
            failure("all_workers_failed"),
            {
                "id": ID,
                "object": "chat.completion",
                "created": CREATED,
                "model": "mesh",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": message},
                        "finish_reason": "error",
                    }
                ],
                "usage": usage_for(message),
                "error": {"message": message, "type": "moa_failure", "code": "all_workers_failed"},
            },
        )

    def test_error_codes(self) -> None:
        """Each of the three error codes is carried as given."""
        for code in ["all_workers_failed", "all_reducers_failed", "no_usable_answer"]:
            with self.subTest(code=code):
                self.assertEqual(failure(code)["error"]["code"], code)

    def test_bodies_are_json(self) -> None:
        """Every body serializes as strict JSON and reads back equal."""
        for body in [answer("é \U0001f600"), tool_call(), failure()]:
            with self.subTest(body=body):
                self.assertEqual(strict_loads(json.dumps(body, allow_nan=False)), body)


class IsFailureTests(SynchronousTestCase):
    """'A body is a failure if it has a top-level error key or choices[0].finish_reason ==
    "error"' (§1.12)."""

    def test_shapes(self) -> None:
        """Each shape is classified by the two tests of the rule and nothing else."""
        table: list[tuple[object, bool]] = [
            (failure(), True),
            (answer(), False),
            (tool_call(), False),
            ({"error": None}, True),
            ({"error": {"message": "x"}, "choices": []}, True),
            ({"choices": [{"finish_reason": "error"}]}, True),
            ({"choices": [{"finish_reason": "stop"}, {"finish_reason": "error"}]}, False),
            ({"choices": [{"finish_reason": "length"}]}, False),
            ({"choices": []}, False),
            ({"choices": "error"}, False),
            ({"choices": ["error"]}, False),
            ({}, False),
            (None, False),
            ("error", False),
            ([{"error": 1}], False),
        ]
        for body, expected in table:
            with self.subTest(body=body):
                self.assertEqual(is_failure(body), expected)


class StreamChunksTests(SynchronousTestCase):
    """Chat SSE (§1.12): one delta with the whole answer, then the finishing chunk."""

    def assert_envelope(self, chunks: list[dict[str, Any]]) -> None:
        """Every chunk has the body's id, created, model and a real choices[0]."""
        self.assertEqual(len(chunks), 2)
        for chunk in chunks:
            self.assertEqual(chunk["object"], "chat.completion.chunk")
            self.assertEqual((chunk["id"], chunk["created"], chunk["model"]), (ID, CREATED, "mesh"))
            self.assertEqual(len(chunk["choices"]), 1)
            self.assertEqual(chunk["choices"][0]["index"], 0)
            self.assertIn("delta", chunk["choices"][0])

    def test_text(self) -> None:
        """A text answer: role and content in chunk 1, then empty delta, stop and usage."""
        body = answer("Paris is the capital.")
        chunks = stream_chunks(body)
        self.assert_envelope(chunks)
        first, last = chunks
        self.assertEqual(
            first["choices"],
            [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": "Paris is the capital."},
                    "finish_reason": None,
                }
            ],
        )
        self.assertNotIn("usage", first)
        self.assertEqual(last["choices"], [{"index": 0, "delta": {}, "finish_reason": "stop"}])
        self.assertEqual(last["usage"], body["usage"])

    def test_two_tool_calls(self) -> None:
        """Every tool call is in chunk 1 with its index; chunk 2 finishes with tool_calls."""
        body = tool_call()
        calls = body["choices"][0]["message"]["tool_calls"]
        calls.append(
            {"id": "call_def", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
        )
        chunks = stream_chunks(body)
        self.assert_envelope(chunks)
        first, last = chunks
        self.assertEqual(
            first["choices"][0]["delta"],
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_abc",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path":"a.txt"}'},
                    },
                    {
                        "index": 1,
                        "id": "call_def",
                        "type": "function",
                        "function": {"name": "ls", "arguments": "{}"},
                    },
                ],
            },
        )
        self.assertIsNone(first["choices"][0]["finish_reason"])
        self.assertEqual(
            last["choices"], [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]
        )
        self.assertEqual(last["usage"], body["usage"])

    def test_missing_call_id(self) -> None:
        """A call without an id streams as C{call_<index>}."""
        body = tool_call()
        del body["choices"][0]["message"]["tool_calls"][0]["id"]
        delta = stream_chunks(body)[0]["choices"][0]["delta"]
        self.assertEqual(delta["tool_calls"][0]["id"], "call_0")

    def test_usage_missing(self) -> None:
        """A body without usage streams the usage of its text."""
        body = answer("abcde")
        del body["usage"]
        self.assertEqual(stream_chunks(body)[1]["usage"], usage_for("abcde"))

    def test_content_verbatim(self) -> None:
        """The streamed content is the body's content exactly, also empty or non-ASCII."""
        for content in ["", "é \U0001f600\n\nline"]:
            with self.subTest(content=content):
                delta = stream_chunks(answer(content))[0]["choices"][0]["delta"]
                self.assertEqual(delta["content"], content)

    def test_failure_refused(self) -> None:
        """'Any request, failure body → 502, non-streaming': a failure body is a ValueError."""
        self.assertRaises(ValueError, stream_chunks, failure())
        self.assertRaises(ValueError, stream_chunks, {**answer(), "error": {"code": "x"}})
        body = answer()
        body["choices"][0]["finish_reason"] = "error"
        self.assertRaises(ValueError, stream_chunks, body)

    def test_not_a_body(self) -> None:
        """A mapping without id, created or a message is refused, not streamed half-built."""
        for broken in [
            {k: v for k, v in answer().items() if k != "id"},
            {k: v for k, v in answer().items() if k != "created"},
            {**answer(), "created": True},
            {**answer(), "choices": []},
            {**answer(), "choices": [{"index": 0}]},
        ]:
            with self.subTest(body=broken):
                self.assertRaises(ValueError, stream_chunks, broken)

    def test_chunks_are_json(self) -> None:
        """Every chunk serializes as strict JSON."""
        for chunk in stream_chunks(answer("é")) + stream_chunks(tool_call()):
            self.assertEqual(strict_loads(json.dumps(chunk, allow_nan=False)), chunk)


class MeshChatAnswerTests(SynchronousTestCase):
    """
    L{MeshChatAnswer}, the chat door's answer to a mesh turn: the bodies and chunks above,
    from the turn's completion.
    """

    def setUp(self) -> None:
        """An answer with the test id and time."""
        self.answer = MeshChatAnswer(ID, CREATED)

    def test_text(self) -> None:
        """A text answer is the answer body, or its two chunks and C{[DONE]}."""
        completion = Completion(ID, "Paris.", None, (), FinishReason.STOP, Timings())
        self.assertEqual(self.answer.body(completion), answer("Paris."))
        streamed = [data_line(chunk) for chunk in stream_chunks(answer("Paris."))]
        self.assertEqual(self.answer.closing(completion), b"".join(streamed) + done_line())

    def test_tool_call(self) -> None:
        """A tool call is the tool-call body, its call id and wire arguments kept."""
        wire = arguments_wire_string({"path": "a.txt"})
        call = ToolCall("call_abc", "read_file", wire)
        completion = Completion(ID, None, None, (call,), FinishReason.TOOL_CALLS, Timings())
        self.assertEqual(self.answer.body(completion), tool_call())

    def test_nothing_while_running(self) -> None:
        """The answer goes out whole at the end: nothing at the opening or per event."""
        self.assertEqual(self.answer.opening(), b"")
        self.assertEqual(self.answer.during(Content("Paris.")), b"")

    def test_turn_failure(self) -> None:
        """A turn's failure is 502 with the failure body, or its error object as an event."""
        error = MeshTurnError("all 3 workers failed", "all_workers_failed")
        self.assertEqual(self.answer.error(error), (502, failure()))
        self.assertEqual(self.answer.stream_error(error), data_line({"error": failure()["error"]}))

    def test_other_error(self) -> None:
        """Any other error (the daemon stopping) is OpenAI's error body with its status."""
        error = GatewayError(503, "loopd is shutting down", "server_error", "shutting_down")
        self.assertEqual(self.answer.error(error), (503, error.body()))
        self.assertEqual(self.answer.stream_error(error), data_line(error.body()))

    def test_keepalive(self) -> None:
        """A keep-alive is a chunk of this answer with an empty delta."""
        chunk = json.loads(self.answer.keepalive()[len(b"data: ") :])
        self.assertEqual(
            (chunk["id"], chunk["model"], chunk["choices"]),
            (ID, "mesh", [{"index": 0, "delta": {}, "finish_reason": None}]),
        )
