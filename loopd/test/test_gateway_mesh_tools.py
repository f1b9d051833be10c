"""
Scenario tests of C{model: "mesh"} with tools, through the whole gateway (issue 6, "Tests"):
tool consensus, a tool proposal against an answer, tool-result turns and their reducer, the
hedged reducer ladder, hallucinated tools and the loop guard.

The gateway runs over 2 or 3 scripted fake llama-servers on in-memory Unix sockets
(L{MeshHarness}); each test checks the HTTP status, the body and the C{x-moa-*} headers
(reference/mesh-moa.md §1.10-1.12, §6; DESIGN §3 decisions 31-33).
"""

from __future__ import annotations

import json
from typing import Any

from loopd.test.support.mesh_harness import (
    ASK,
    TWO,
    MeshHarness,
    calls_tool,
    content_of,
    fails,
    mesh_config,
    moa_headers,
    says,
    system_text,
)
from loopd.test.test_gateway_mesh import MeshTestCase, moa
from loopd.test.test_gateway_site import Response


def tool(name: str, description: str = "A tool.") -> dict[str, Any]:
    """A declared function tool C{name} taking a C{path}."""
    parameters = {"type": "object", "properties": {"path": {"type": "string"}}}
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


TOOLS = [tool("read_file", "Read a file."), tool("list_files", "List a directory.")]
NAMES = ["read_file", "list_files"]
README = {"path": "README.md"}
READ_ASK = {**ASK, "messages": [{"role": "user", "content": "Read README.md"}], "tools": TOOLS}


def tool_round(call_id: str, name: str, arguments: object, result: str) -> list[dict[str, Any]]:
    """An assistant message calling C{name} with C{arguments}, and the tool's C{result}."""
    call: dict[str, Any] = {"id": call_id, "type": "function"}
    call["function"] = {"name": name, "arguments": json.dumps(arguments)}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


#: A tool-result turn: the agent read the file and nudges the model on.
TOOL_RESULT_ASK = {
    **READ_ASK,
    "messages": [
        {"role": "user", "content": "Read README.md"},
        *tool_round("call_1", "read_file", README, "hello world"),
        {"role": "user", "content": "Go on."},
    ],
}


class ToolTestCase(MeshTestCase):
    """Assertions of the tool scenarios."""

    def assert_tool_call(
        self, response: Response, name: str, arguments: object, headers: dict[str, str]
    ) -> None:
        """A complete 200 tool-call body calling C{name} with C{arguments}, and C{headers}."""
        self.assertEqual((response.status, response.complete), (200, True), response.body)
        body = response.json()
        self.assertEqual(body["model"], "mesh")
        choice = body["choices"][0]
        self.assertEqual(choice["finish_reason"], "tool_calls")
        self.assertIsNone(choice["message"]["content"])
        (call,) = choice["message"]["tool_calls"]
        self.assertEqual((call["type"], call["function"]["name"]), ("function", name))
        self.assertEqual(json.loads(call["function"]["arguments"]), arguments)
        got = moa_headers(response)
        del got["x-moa-elapsed-ms"]
        self.assertEqual(got, headers)


class FreshToolTests(ToolTestCase):
    """A fresh turn with tools: the workers' proposals."""

    def test_tool_consensus_prefers_arguments(self) -> None:
        """Two proposals of one tool: the one with arguments ships, over a surer bare one."""
        harness = MeshHarness()
        bare = json.dumps({"kind": "tool_proposal", "tool": "read_file", "confidence": 0.95})
        harness.script(
            mistral_7b=says(bare, 0.5),
            qwen3_8b=calls_tool("read_file", README, 1.0),
            llama_70b=says("slow", 30),
        )
        response = harness.ask(READ_ASK, 1.0)
        self.assert_tool_call(response, "read_file", README, moa("early-exit", 3, 2, False, 0))
        (strong,) = harness.fakes["llama-70b"].connections
        self.assertEqual((strong.closed_at, strong.client_closed), (1.0, True))

    def test_tools_per_role(self) -> None:
        """Fast gets the tool names in its prompt only; Specialist and Strong get the tools."""
        harness = MeshHarness()
        harness.script(
            mistral_7b=calls_tool("read_file", README, 0.5),
            qwen3_8b=calls_tool("read_file", README, 1.0),
            llama_70b=says("slow", 30),
        )
        harness.ask(READ_ASK, 1.0)
        (fast,) = harness.chat_bodies("mistral-7b")
        self.assertNotIn("tools", fast)
        self.assertIn("Available tools: read_file, list_files", system_text(fast))
        for name in ("qwen3-8b", "llama-70b"):
            (body,) = harness.chat_bodies(name)
            self.assertEqual([t["function"]["name"] for t in body["tools"]], NAMES)

    def test_tool_call_streamed(self) -> None:
        """A streamed tool consensus: chunks with tool_calls, finish tool_calls, [DONE]."""
        harness = MeshHarness()
        harness.script(
            mistral_7b=calls_tool("read_file", README, 0.5),
            qwen3_8b=calls_tool("read_file", README, 1.0),
            llama_70b=says("slow", 30),
        )
        response = harness.ask({**READ_ASK, "stream": True}, 1.0)
        self.assertEqual((response.status, response.complete), (200, True), response.body)
        *chunks, done = response.data()
        self.assertEqual(done, "[DONE]")
        (call,) = chunks[0]["choices"][0]["delta"]["tool_calls"]
        self.assertEqual(call["function"]["name"], "read_file")
        self.assertEqual(json.loads(call["function"]["arguments"]), README)
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "tool_calls")
        self.assertTrue(all(chunk["choices"][0]["index"] == 0 for chunk in chunks))

    def test_tool_against_answer_reduces(self) -> None:
        """One worker proposes a tool, another answers: the reducer decides (here, the tool)."""
        harness = MeshHarness()
        harness.script(
            mistral_7b=says("The README says hello.", 0.5),
            qwen3_8b=calls_tool("read_file", README, 1.0),
            llama_70b=[says("slow", 30), calls_tool("read_file", README, 0.5)],
        )
        response = harness.ask(READ_ASK, 1.5)
        self.assert_tool_call(response, "read_file", README, moa("fanout", 3, 2, True, 1))
        reducer = harness.chat_bodies("llama-70b")[1]
        self.assertIn("propose tools, others answer directly", system_text(reducer))
        self.assertEqual([t["function"]["name"] for t in reducer["tools"]], NAMES)

    def test_hallucinated_tool_filtered(self) -> None:
        """A worker calling an undeclared tool is no tool call: the other's answer ships."""
        harness = MeshHarness(mesh_config(TWO))
        harness.script(
            llama_70b=calls_tool("delete_everything", {"path": "/"}, 0.5),
            mistral_7b=says("There is nothing to read.", 1.0),
        )
        response = harness.ask(READ_ASK, 1.0)
        self.assert_answer(response, "There is nothing to read.", moa("fanout", 2, 2, False, 0))
        self.assertNotIn("tool_calls", response.json()["choices"][0]["message"])


class ToolResultTests(ToolTestCase):
    """A tool-result turn: the reducer alone, its ladder and the loop guard."""

    def test_tool_result_reducer_only(self) -> None:
        """A tool result and a user nudge: only the reducer is called, no worker."""
        harness = MeshHarness()
        harness.script(llama_70b=says("The README says hello world.", 0.5))
        response = harness.ask(TOOL_RESULT_ASK, 0.5)
        headers = moa("tool-result", 1, 1, True, 1)
        self.assert_answer(response, "The README says hello world.", headers)
        self.assertEqual(harness.served(), {"llama-70b": 1, "mistral-7b": 0, "qwen3-8b": 0})
        (body,) = harness.chat_bodies("llama-70b")
        self.assertEqual(body["max_tokens"], 2048)
        self.assertIn(
            {"role": "tool", "tool_call_id": "call_1", "content": "hello world"},
            [{k: m.get(k) for k in ("role", "tool_call_id", "content")} for m in body["messages"]],
        )
        self.assertEqual(len(body["tools"]), 2)

    def test_hedged_third_wins(self) -> None:
        """First reducer slow past 5 s, second 500 at once: the third starts and wins."""
        harness = MeshHarness()
        harness.script(
            llama_70b=says("Slow answer.", 8.0),
            mistral_7b=fails(500),
            qwen3_8b=says("Third answer.", 1.0),
        )
        connection = harness.post(TOOL_RESULT_ASK)
        harness.advance(5.9)
        self.assertEqual(connection.responses(), [])
        harness.advance(0.1)
        response = connection.response()
        self.assert_answer(response, "Third answer.", moa("tool-result", 1, 1, True, 3))
        self.assertEqual(response.headers["x-moa-elapsed-ms"], "6000")
        self.assertEqual(harness.chat_times("mistral-7b"), [5.0])
        self.assertEqual(harness.chat_times("qwen3-8b"), [5.0])
        (first,) = harness.fakes["llama-70b"].connections
        self.assertEqual((first.closed_at, first.client_closed), (6.0, True))

    def test_hedged_first_wins(self) -> None:
        """The slow first reducer answers before the third: the first wins, 3 attempts."""
        harness = MeshHarness()
        harness.script(
            llama_70b=says("Slow answer.", 8.0),
            mistral_7b=fails(500),
            qwen3_8b=says("Third answer.", 10.0),
        )
        response = harness.ask(TOOL_RESULT_ASK, 8.0)
        self.assert_answer(response, "Slow answer.", moa("tool-result", 1, 1, True, 3))
        (third,) = harness.fakes["qwen3-8b"].connections
        self.assertEqual((third.closed_at, third.client_closed), (8.0, True))

    def test_reducer_429_retried(self) -> None:
        """A reducer's 429 with Retry-After: 2 is asked again 2 s later; one attempt."""
        harness = MeshHarness()
        harness.script(llama_70b=[fails(429, Retry_After="2"), says("Hello world.", 0.5)])
        response = harness.ask(TOOL_RESULT_ASK, 2.5)
        self.assert_answer(response, "Hello world.", moa("tool-result", 1, 1, True, 1))
        self.assertEqual(harness.chat_times("llama-70b"), [0.0, 2.0])
        self.assertEqual(harness.served(), {"llama-70b": 2, "mistral-7b": 0, "qwen3-8b": 0})

    def test_all_reducers_fail(self) -> None:
        """Every reducer candidate fails: 502 all_reducers_failed, workers 1, ok 0."""
        harness = MeshHarness()
        harness.script(llama_70b=fails(500), mistral_7b=fails(500), qwen3_8b=fails(503))
        response = harness.ask(TOOL_RESULT_ASK, 1.0)
        self.assertEqual((response.status, response.complete), (502, True), response.body)
        self.assertEqual(response.json()["error"]["code"], "all_reducers_failed")
        got = moa_headers(response)
        del got["x-moa-elapsed-ms"]
        self.assertEqual(got, moa("tool-result", 1, 0, True, 3))

    def loop_ask(self) -> dict[str, Any]:
        """A history ending with three identical read_file calls and their results."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Build it"}]
        for number in range(3):
            messages += tool_round(f"call_{number}", "read_file", README, "hello world")
        return {**READ_ASK, "messages": messages}

    def test_loop_guard(self) -> None:
        """3 identical tool calls: the reducer gets no tools and the guard text."""
        harness = MeshHarness()
        harness.script(llama_70b=says("The README says hello world.", 0.5))
        response = harness.ask(self.loop_ask(), 0.5)
        headers = moa("tool-result", 1, 1, True, 1)
        self.assert_answer(response, "The README says hello world.", headers)
        (body,) = harness.chat_bodies("llama-70b")
        self.assertNotIn("tools", body)
        guard = (
            "Tool loop guard: the last 3 completed tool calls all used `read_file`. "
            "Answer now from the gathered tool results. Do not call another tool."
        )
        self.assertIn(guard, system_text(body))

    def test_loop_guard_holds(self) -> None:
        """Under the guard a reducer that calls the tool again is no tool call (502)."""
        harness = MeshHarness()
        harness.script(
            llama_70b=calls_tool("read_file", README, 0.5),
            mistral_7b=calls_tool("read_file", README, 0.1),
            qwen3_8b=calls_tool("read_file", README, 0.1),
        )
        response = harness.ask(self.loop_ask(), 1.0)
        self.assertEqual((response.status, response.complete), (502, True), response.body)
        self.assertEqual(response.json()["error"]["code"], "no_usable_answer")
        self.assertEqual(content_of(response.json()), response.json()["error"]["message"])
