"""
Scenario tests of C{model: "mesh"} through the whole gateway (issue 6, "Tests"): answers,
agreement, synthesis, failures, streaming, cancelling, the thinking knobs and 429; tools
(consensus, a tool proposal against an answer, tool-result turns and their reducer, the
hedged reducer ladder, hallucinated tools and the loop guard); and media, where only the
endpoints that take an image or audio are workers (L{loopd.gateway.mesh_calls.mesh_pool}, as
the C{auto} router's media filter decides).

Each test runs the real gateway site over 2 or 3 scripted fake llama-servers on in-memory
Unix sockets (L{loopd.testing.mesh.MeshHarness}), with scripted latencies on a
C{MemoryReactorClock}, and checks the HTTP status, the body and the C{x-moa-*} headers
(reference/mesh-moa.md §1.10-1.12, §6; DESIGN §3 decisions 28-33).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.activity import ActivityWatcher, RequestRecord
from loopd.settings import Config, Retry
from loopd.testing.fake_llama import CHAT
from loopd.testing.gateway import Response
from loopd.testing.mesh import (
    ASK,
    THREE,
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

VERBOSE = "Paris is the capital of France."


def moa(turn: str, workers: int, ok: int, reducer: bool, attempts: int) -> dict[str, str]:
    """The expected x-moa-* headers but the elapsed time."""
    return {
        "x-moa-turn": turn,
        "x-moa-workers": str(workers),
        "x-moa-workers-ok": str(ok),
        "x-moa-reducer": "true" if reducer else "false",
        "x-moa-reducer-attempts": str(attempts),
    }


class MeshTestCase(SynchronousTestCase):
    """Assertions the scenarios share."""

    def assert_answer(self, response: Response, content: str, headers: dict[str, str]) -> None:
        """A complete 200 chat.completion from model mesh with C{content} and C{headers}."""
        self.assertEqual((response.status, response.complete), (200, True), response.body)
        body = response.json()
        self.assertEqual((body["object"], body["model"]), ("chat.completion", "mesh"))
        self.assertEqual(content_of(body), content)
        self.assertEqual(body["choices"][0]["finish_reason"], "stop")
        self.assertEqual(response.headers["content-length"], str(len(response.body)))
        got = moa_headers(response)
        self.assertIn("x-moa-elapsed-ms", got)
        del got["x-moa-elapsed-ms"]
        self.assertEqual(got, headers)


class AgreementTests(MeshTestCase):
    """Early exit on agreement, and what blocks it (§1.10, decision 31)."""

    def test_consensus_early_exit(self) -> None:
        """Two equal answers (one big-tier) ship at once, the first of equals; the third is cut."""
        harness = MeshHarness()
        harness.script(
            llama_70b=says("Paris.", 1.0), mistral_7b=says("Paris", 0.5), qwen3_8b=says("x", 30)
        )
        response = harness.ask(ASK, 1.0)
        self.assert_answer(response, "Paris", moa("early-exit", 3, 2, False, 0))
        self.assertEqual(response.headers["x-moa-elapsed-ms"], "1000")
        (slow,) = harness.fakes["qwen3-8b"].connections
        self.assertEqual((slow.closed_at, slow.client_closed), (1.0, True))
        self.assertEqual(harness.open_upstream(), [])

    def test_terse_and_verbose_agree(self) -> None:
        """Terse "Paris" and "Paris is the capital of France" agree; the verbose one ships."""
        harness = MeshHarness()
        harness.script(
            llama_70b=says(VERBOSE, 1.0), mistral_7b=says("Paris", 0.5), qwen3_8b=says("x", 30)
        )
        response = harness.ask(ASK, 1.0)
        self.assert_answer(response, VERBOSE, moa("early-exit", 3, 2, False, 0))

    def test_worker_counts_after_early_exit(self) -> None:
        """After an early exit all dispatched workers count: workers 3, workers-ok 2."""
        harness = MeshHarness()
        harness.script(
            llama_70b=says("42", 0.2),
            mistral_7b=says("The answer is 42", 0.1),
            qwen3_8b=says("42", 9),
        )
        response = harness.ask(ASK, 0.2)
        self.assert_answer(response, "The answer is 42", moa("early-exit", 3, 2, False, 0))

    def test_role_budgets(self) -> None:
        """Each worker's upstream body has its role's max_tokens and worker sampling (d. 28)."""
        harness = MeshHarness()
        harness.script(
            llama_70b=says("Paris.", 1.0), mistral_7b=says("Paris", 0.5), qwen3_8b=says("x", 30)
        )
        harness.ask(ASK, 1.0)
        budgets = {
            name: (body["max_tokens"], body["temperature"], body["top_p"])
            for name in THREE
            for body in harness.chat_bodies(name)
        }
        self.assertEqual(
            budgets,
            {
                "mistral-7b": (256, 0.8, 0.95),
                "qwen3-8b": (512, 0.8, 0.95),
                "llama-70b": (1024, 0.8, 0.95),
            },
        )

    def test_negation_blocks_agreement(self) -> None:
        """The negation rule: "Use grep." and "Do not use grep." disagree; the reducer answers."""
        harness = MeshHarness(mesh_config(TWO))
        harness.script(
            llama_70b=[says("Use grep.", 1.0), says("Use grep -r here.", 0.5)],
            mistral_7b=says("Do not use grep.", 0.5),
        )
        response = harness.ask(ASK, 1.5)
        self.assert_answer(response, "Use grep -r here.", moa("fanout", 2, 2, True, 1))
        reducer = harness.chat_bodies("llama-70b")[1]
        self.assertIn("disagreed", system_text(reducer))
        self.assertIn("Do not use grep.", system_text(reducer))
        self.assertEqual((reducer["max_tokens"], reducer["temperature"]), (2048, 0.3))

    def test_disagreement_synthesis(self) -> None:
        """Three disagreeing answers go to the reducer, whose answer ships (v2 §6)."""
        harness = MeshHarness()
        harness.script(
            llama_70b=[says("The capital is Lyon.", 1.5), says(VERBOSE, 0.5)],
            mistral_7b=says("The capital is Paris.", 0.5),
            qwen3_8b=says("The capital is Berlin.", 1.0),
        )
        response = harness.ask(ASK, 2.0)
        self.assert_answer(response, VERBOSE, moa("fanout", 3, 3, True, 1))
        prompt = system_text(harness.chat_bodies("llama-70b")[1])
        for draft in ("Lyon", "Paris", "Berlin"):
            self.assertIn(f"The capital is {draft}.", prompt)
        self.assertEqual(harness.served(), {"llama-70b": 2, "mistral-7b": 1, "qwen3-8b": 1})


class PatienceTests(MeshTestCase):
    """Strong patience: a small-tier consensus waits for a running big Strong worker."""

    def harness(self, strong: str, after: float) -> MeshHarness:
        """Two small workers agree by 1 s; the big Strong worker says C{strong} at C{after}."""
        harness = MeshHarness(mesh_config(strong_patience_ms=10_000))
        harness.script(
            llama_70b=says(strong, after),
            mistral_7b=says("Paris", 0.5),
            qwen3_8b=says("Paris.", 1.0),
        )
        return harness

    def test_waits_for_strong(self) -> None:
        """The small consensus does not ship at 1 s nor at grace; Strong's answer at 6 s does."""
        harness = self.harness(VERBOSE, 6.0)
        connection = harness.post(ASK)
        harness.advance(5.9)
        self.assertEqual(connection.responses(), [])
        harness.advance(0.1)
        self.assert_answer(connection.response(), VERBOSE, moa("fanout", 3, 3, False, 0))

    def test_patience_runs_out(self) -> None:
        """Strong still running at strong_patience_ms: the small consensus ships, Strong is cut."""
        harness = self.harness(VERBOSE, 60.0)
        connection = harness.post(ASK)
        harness.advance(9.9)
        self.assertEqual(connection.responses(), [])
        harness.advance(0.1)
        response = connection.response()
        self.assert_answer(response, "Paris", moa("early-exit", 3, 2, False, 0))
        self.assertEqual(response.headers["x-moa-elapsed-ms"], "10000")
        (strong,) = harness.fakes["llama-70b"].connections
        self.assertEqual((strong.closed_at, strong.client_closed), (10.0, True))

    def test_strong_dissent_reduces(self) -> None:
        """Strong lands within patience and disagrees: the reducer synthesizes (decision 31)."""
        harness = self.harness("Lyon is the capital.", 6.0)
        harness.script(llama_70b=says(VERBOSE, 0.5))
        response = harness.ask(ASK, 6.5)
        self.assert_answer(response, VERBOSE, moa("fanout", 3, 3, True, 1))


class FailureTests(MeshTestCase):
    """Failed workers: 502 when none answered, no waiting on a dead one."""

    def assert_all_failed(self, response: Response) -> None:
        """A 502 JSON all_workers_failed body with its x-moa headers."""
        self.assertEqual((response.status, response.complete), (502, True), response.body)
        self.assertEqual(response.headers["content-type"], "application/json")
        body = response.json()
        self.assertEqual(body["model"], "mesh")
        self.assertEqual(body["choices"][0]["finish_reason"], "error")
        error = {"message": "All MoA workers failed", "type": "moa_failure"}
        self.assertEqual(body["error"], {**error, "code": "all_workers_failed"})
        got = moa_headers(response)
        del got["x-moa-elapsed-ms"]
        self.assertEqual(got, moa("failed", 3, 0, False, 0))

    def script_failures(self, harness: MeshHarness) -> None:
        """Every worker fails: HTTP 500, 503 and 500, at different times."""
        harness.script(
            llama_70b=fails(500, 0.5), mistral_7b=fails(503, 0.2), qwen3_8b=fails(500, 1.0)
        )

    def test_all_fail(self) -> None:
        """Every worker fails: 502 with the error JSON and the headers, no reducer called."""
        harness = MeshHarness()
        self.script_failures(harness)
        response = harness.ask(ASK, 1.0)
        self.assert_all_failed(response)
        self.assertEqual(harness.served(), {name: 1 for name in THREE})

    def test_all_fail_stream(self) -> None:
        """A streaming request whose workers all fail is a 502 JSON body too, no SSE."""
        harness = MeshHarness()
        self.script_failures(harness)
        response = harness.ask({**ASK, "stream": True}, 1.0)
        self.assert_all_failed(response)
        self.assertNotIn(b"data:", response.body)

    def test_one_dead_of_two(self) -> None:
        """A dead worker of two: the other's answer ships when it lands, not after 60 s."""
        harness = MeshHarness(mesh_config(TWO), dead=("mistral-7b",))
        harness.script(llama_70b=[says(VERBOSE, 1.0), says("Still Paris.", 0.5)])
        response = harness.ask(ASK, 1.0)
        self.assert_answer(response, VERBOSE, moa("fanout", 2, 1, False, 0))
        self.assertEqual(response.headers["x-moa-elapsed-ms"], "1000")

    def test_dead_worker_not_retried(self) -> None:
        """With client retries on, a refused worker still fails at once: no backoff waited."""
        config = dataclasses.replace(mesh_config(TWO), retry=Retry(attempts=4))
        harness = MeshHarness(config, dead=("mistral-7b",))
        harness.script(llama_70b=says(VERBOSE, 1.0))
        response = harness.ask(ASK, 1.0)
        self.assert_answer(response, VERBOSE, moa("fanout", 2, 1, False, 0))
        self.assertEqual(response.headers["x-moa-elapsed-ms"], "1000")
        self.assertFalse(harness.gateway.health.eligible("mistral-7b"))

    def test_all_dead(self) -> None:
        """
        Every endpoint down: the turn that finds out is a 502 (its workers failed); the next
        is 503 endpoint_unavailable with Retry-After at once, nothing sent upstream.
        """
        harness = MeshHarness(mesh_config(TWO), dead=("mistral-7b", "llama-70b"))
        self.assertEqual(harness.ask(ASK, 0.1).status, 502)
        response = harness.ask(ASK, 0.0)
        error = response.json()["error"]
        self.assertEqual((response.status, error["code"]), (503, "endpoint_unavailable"))
        self.assertEqual(response.headers["retry-after"], "1")

    def test_dead_worker_next_turn_single(self) -> None:
        """The turn after: the pool is one model, which serves the request alone."""
        harness = MeshHarness(mesh_config(TWO), dead=("mistral-7b",))
        harness.script(llama_70b=[says(VERBOSE, 1.0), says("Still Paris.", 0.5)])
        harness.ask(ASK, 1.0)
        response = harness.ask(ASK, 0.5)
        self.assertEqual((response.status, response.complete), (200, True), response.body)
        body = response.json()
        self.assertEqual((body["model"], content_of(body)), ("llama-70b", "Still Paris."))
        self.assertEqual(moa_headers(response), {})
        self.assertEqual(harness.served(), {"llama-70b": 2, "mistral-7b": 0})


class StreamTests(MeshTestCase):
    """A streamed mesh turn, and a client that leaves."""

    def test_stream_success(self) -> None:
        """Progress comments, then chunks each with a real choices[0], then [DONE]."""
        harness = MeshHarness()
        harness.script(
            llama_70b=says(VERBOSE, 1.0), mistral_7b=says("Paris", 0.5), qwen3_8b=says("x", 30)
        )
        response = harness.ask({**ASK, "stream": True}, 1.0)
        self.assertEqual((response.status, response.complete), (200, True), response.body)
        self.assertEqual(response.headers["content-type"], "text/event-stream")
        events = response.events()
        comments = response.comments()
        self.assertEqual(
            [(c["event"], c.get("worker")) for c in comments[:2]],
            [("mesh_worker", "mistral-7b"), ("mesh_worker", "llama-70b")],
        )
        self.assertTrue(all(c["ok"] for c in comments[:2]))
        first_data = next(i for i, e in enumerate(events) if e.startswith("data: "))
        self.assertTrue(all(e.startswith(": loopd ") for e in events[:first_data]))
        data = response.data()
        self.assertEqual(data[-1], "[DONE]")
        chunks = data[:-1]
        self.assertTrue(chunks)
        for chunk in chunks:
            self.assertEqual((chunk["object"], chunk["model"]), ("chat.completion.chunk", "mesh"))
            self.assertEqual(chunk["choices"][0]["index"], 0)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        self.assertEqual(text, VERBOSE)
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "stop")

    def test_stream_fails_after_open(self) -> None:
        """Every reducer fails after workers answered: one error event, no [DONE]."""
        harness = MeshHarness()
        harness.script(
            llama_70b=[says("Lyon.", 1.0), fails(500)],
            mistral_7b=[says("Berlin.", 0.5), fails(500)],
            qwen3_8b=[says("Rome.", 0.7), fails(500)],
        )
        response = harness.ask({**ASK, "stream": True}, 1.0)
        self.assertEqual((response.status, response.complete), (200, True), response.body)
        (error,) = response.data()
        self.assertEqual(error["error"]["code"], "all_reducers_failed")
        self.assertEqual(error["error"]["type"], "moa_failure")
        self.assertEqual(harness.served(), {name: 2 for name in THREE})

    def test_client_gone_cancels(self) -> None:
        """A client that disconnects mid-turn closes every upstream connection at once."""
        harness = MeshHarness()
        harness.script(
            llama_70b=says(VERBOSE, 10), mistral_7b=says("Paris", 0.5), qwen3_8b=says("x", 10)
        )
        connection = harness.post({**ASK, "stream": True})
        harness.advance(1.0)
        self.assertEqual(sorted(harness.open_upstream()), ["llama-70b", "qwen3-8b"])
        connection.drop()
        self.assertEqual(harness.open_upstream(), [])
        for name in ("llama-70b", "qwen3-8b"):
            (record,) = harness.fakes[name].connections
            self.assertEqual((record.closed_at, record.client_closed), (1.0, True))
        harness.advance(20)
        self.assertEqual(harness.served(), {name: 1 for name in THREE})
        self.assertEqual(harness.gateway.in_flight, set())

    def test_stop_mid_turn(self) -> None:
        """Stopping the gateway answers a turn under way with 503 and closes its calls."""
        for stream in (False, True):
            harness = MeshHarness()
            harness.script(
                llama_70b=says(VERBOSE, 10), mistral_7b=says("Paris", 0.5), qwen3_8b=says("x", 10)
            )
            connection = harness.post({**ASK, "stream": stream})
            harness.advance(1.0)
            harness.gateway.stop()
            harness.net.pump()
            self.assertEqual(harness.open_upstream(), [])
            self.assertEqual(harness.gateway.in_flight, set())
            response = connection.response()
            if stream:
                # The stream had opened at the first answer: the error is its last event.
                self.assertEqual(response.status, 200)
                error = response.data()[-1]["error"]
            else:
                self.assertEqual(response.status, 503)
                error = response.json()["error"]
            self.assertEqual(error["code"], "shutting_down")


class KnobTests(MeshTestCase):
    """What every upstream call carries: the thinking choice; a 429 retried once."""

    def thinking_of(self, document: object) -> list[tuple[object, object]]:
        """Run a disagreement turn for C{document}; each upstream body's thinking fields."""
        harness = MeshHarness()
        harness.script(
            llama_70b=[says("Lyon.", 1.0), says(VERBOSE, 0.5)],
            mistral_7b=says("Berlin.", 0.5),
            qwen3_8b=says("Rome.", 0.7),
        )
        response = harness.ask(document, 1.5)
        self.assert_answer(response, VERBOSE, moa("fanout", 3, 3, True, 1))
        bodies = [body for name in THREE for body in harness.chat_bodies(name)]
        self.assertEqual(len(bodies), 4)
        return [
            (body["chat_template_kwargs"]["enable_thinking"], body.get("reasoning_effort"))
            for body in bodies
        ]

    def test_thinking_off_by_default(self) -> None:
        """No knob: every worker and the reducer get enable_thinking false, effort none."""
        self.assertEqual(self.thinking_of(ASK), [(False, "none")] * 4)

    def test_thinking_kwarg_reaches_all(self) -> None:
        """chat_template_kwargs.enable_thinking true reaches every worker and the reducer."""
        document = {**ASK, "chat_template_kwargs": {"enable_thinking": True}}
        self.assertEqual(self.thinking_of(document), [(True, None)] * 4)

    def test_reasoning_effort_reaches_all(self) -> None:
        """reasoning_effort "high" turns thinking on for every upstream call."""
        document = {**ASK, "reasoning_effort": "high"}
        self.assertEqual(self.thinking_of(document), [(True, None)] * 4)

    def test_openai_endpoint_gets_template_kwarg(self) -> None:
        """An openai-kind endpoint gets chat_template_kwargs.enable_thinking too."""
        config = mesh_config(TWO, kinds={"mistral-7b": "openai"})
        for enabled in (False, True):
            harness = MeshHarness(config)
            harness.script(llama_70b=says(VERBOSE, 0.5), mistral_7b=says("Paris", 0.2))
            document = {**ASK, "chat_template_kwargs": {"enable_thinking": enabled}}
            response = harness.ask(document, 0.5)
            self.assert_answer(response, VERBOSE, moa("fanout", 2, 2, False, 0))
            (body,) = harness.chat_bodies("mistral-7b")
            self.assertEqual(body["chat_template_kwargs"], {"enable_thinking": enabled})
            self.assertNotIn("id_slot", body)

    def test_429_retried_once(self) -> None:
        """A 429 with Retry-After: 1 is asked again once, 1 s later, and its answer counts."""
        harness = MeshHarness(mesh_config(TWO))
        harness.script(
            llama_70b=says(VERBOSE, 0.5),
            mistral_7b=[fails(429, Retry_After="1"), says("Paris", 0.0)],
        )
        response = harness.ask(ASK, 1.0)
        self.assert_answer(response, VERBOSE, moa("fanout", 2, 2, False, 0))
        self.assertEqual(harness.chat_times("mistral-7b"), [0.0, 1.0])
        self.assertEqual(response.headers["x-moa-elapsed-ms"], "1000")


class RouteTests(MeshTestCase):
    """The routes around mesh: the model list and a refused request."""

    def test_models_list_mesh(self) -> None:
        """/v1/models lists every endpoint, then auto and mesh."""
        harness = MeshHarness()
        response = harness.get("/v1/models").response()
        self.assertEqual(response.status, 200)
        ids = [model["id"] for model in response.json()["data"]]
        self.assertEqual(ids, [*THREE, "auto", "mesh"])

    def test_bad_request_calls_nobody(self) -> None:
        """A mesh request without messages is a 400 and no upstream is called."""
        harness = MeshHarness()
        response = harness.ask({"model": "mesh"}, 1.0)
        self.assertEqual(response.status, 400)
        self.assertEqual(response.json()["error"]["code"], "missing_messages")
        self.assertEqual(harness.served(), {name: 0 for name in THREE})
        self.assertEqual(moa_headers(response), {})


class LeaseTests(MeshTestCase):
    """Mesh calls under leases: each takes its endpoint's lease and gives it back."""

    def test_leases_given_back(self) -> None:
        """Workers and the reducer hold the session's leases, released after the grace."""
        harness = MeshHarness(leases=True)
        harness.script(
            llama_70b=[says("Lyon.", 1.0), says(VERBOSE, 0.5)],
            mistral_7b=says("Berlin.", 0.5),
            qwen3_8b=says("Rome.", 0.7),
        )
        response = harness.ask(ASK, 1.5, session="s1")
        self.assert_answer(response, VERBOSE, moa("fanout", 3, 3, True, 1))
        self.assertEqual(harness.held(), {name: {"s1"} for name in THREE})
        harness.advance(3.0)
        self.assertEqual(harness.held(), {name: set() for name in THREE})

    def test_client_gone_under_leases(self) -> None:
        """A client that leaves mid-turn closes its calls; its leases go back after the grace."""
        harness = MeshHarness(leases=True)
        harness.script(
            llama_70b=says(VERBOSE, 10), mistral_7b=says("Paris", 0.5), qwen3_8b=says("x", 10)
        )
        connection = harness.post(ASK, "s1")
        harness.advance(1.0)
        connection.drop()
        self.assertEqual(harness.open_upstream(), [])
        harness.advance(3.0)
        self.assertEqual(harness.held(), {name: set() for name in THREE})


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


IMAGE: dict[str, Any] = {
    "model": "mesh",
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in the picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        }
    ],
}


def with_vision(*names: str) -> Config:
    """L{mesh_config} of L{THREE} where the endpoints C{names} take images."""
    config = mesh_config(THREE)
    endpoints = tuple(dataclasses.replace(e, vision=e.name in names) for e in config.endpoints)
    return dataclasses.replace(config, endpoints=endpoints)


class MediaPoolTests(SynchronousTestCase):
    """Which endpoints an image request reaches under C{model: "mesh"}."""

    def test_only_vision_workers(self) -> None:
        """Two endpoints take images: they are the committee, the third is never called."""
        harness = MeshHarness(with_vision("llama-70b", "qwen3-8b"))
        harness.script(llama_70b=says("A cat on a mat.", 1.0), qwen3_8b=says("A cat", 0.5))
        response = harness.ask(IMAGE, 1.0)
        self.assertEqual(response.status, 200, response.body)
        self.assertEqual(content_of(response.json()), "A cat on a mat.")
        self.assertEqual(response.headers["x-moa-workers"], "2")
        self.assertEqual(harness.served(), {"llama-70b": 1, "mistral-7b": 0, "qwen3-8b": 1})
        # Strong gets the message with its image (and the text again, as v1 packs a
        # multipart turn); Fast gets the last user text only.
        (strong,) = harness.chat_bodies("llama-70b")
        self.assertIn(IMAGE["messages"][0], strong["messages"])
        (fast,) = harness.chat_bodies("qwen3-8b")
        self.assertEqual(fast["messages"][-1]["content"], "What is in the picture?")

    def test_one_vision_endpoint_alone(self) -> None:
        """One endpoint takes images: it serves the request alone, under its own name."""
        harness = MeshHarness(with_vision("qwen3-8b"))
        harness.script(qwen3_8b=says("A cat", 0.5))
        response = harness.ask(IMAGE, 1.0)
        self.assertEqual(response.status, 200, response.body)
        self.assertEqual(response.json()["model"], "qwen3-8b")
        self.assertEqual(harness.served(), {"llama-70b": 0, "mistral-7b": 0, "qwen3-8b": 1})

    def test_no_vision_endpoint(self) -> None:
        """No endpoint takes images: 400 media_unsupported, and nobody is called."""
        harness = MeshHarness(with_vision())
        response = harness.ask(IMAGE, 1.0)
        self.assertEqual(response.status, 400)
        self.assertEqual(response.json()["error"]["code"], "media_unsupported")
        self.assertEqual(harness.served(), {name: 0 for name in THREE})


class AffinityTests(MeshTestCase):
    """
    A mesh turn over openai endpoints that carry loopd's session id to the engine's own
    affinity (decision 42): a named session's id goes, an anonymous one's does not.
    """

    def harness(self) -> MeshHarness:
        """Two openai workers, each asking for the id in C{x-smg-routing-key}."""
        config = mesh_config(TWO, kinds={name: "openai" for name in TWO})
        endpoints = tuple(
            dataclasses.replace(e, affinity_header="x-smg-routing-key") for e in config.endpoints
        )
        harness = MeshHarness(dataclasses.replace(config, endpoints=endpoints))
        harness.script(llama_70b=says("Paris", 0.1), mistral_7b=says("Paris", 0.1))
        return harness

    def routing_keys(self, harness: MeshHarness) -> list[str | None]:
        """The routing key each worker's one request carried."""
        keys = []
        for name in TWO:
            (received,) = harness.fakes[name].requests_to("POST", CHAT)
            keys.append(received.header("x-smg-routing-key"))
        return keys

    def test_named_session_sends_its_id(self) -> None:
        """X-Session-Id agent-1: both workers get it."""
        harness = self.harness()
        response = harness.ask(ASK, 1.0, session="agent-1")
        self.assertEqual(response.status, 200)
        self.assertEqual(self.routing_keys(harness), ["agent-1", "agent-1"])

    def test_anonymous_mesh_sends_no_id(self) -> None:
        """
        No session named: the connection's anonymous id names no conversation, so no worker
        gets one (the engine's own prefix routing decides).
        """
        harness = self.harness()
        response = harness.ask(ASK, 1.0)
        self.assertEqual(response.status, 200)
        self.assertEqual(self.routing_keys(harness), [None, None])


class RecordTests(MeshTestCase):
    """The turn's request record (L{loopd.gateway.activity}) names each call's role."""

    def test_roles(self) -> None:
        """Two workers, then the reducer: the reducer's call is recorded as the reducer's."""
        harness = MeshHarness(mesh_config(TWO))
        records: list[RequestRecord] = []

        class Ended(ActivityWatcher):
            def request_ended(self, record: RequestRecord) -> None:
                records.append(record)

        harness.gateway.activity.watch(Ended())
        harness.script(
            llama_70b=[says("Use grep.", 1.0), says("Use grep -r here.", 0.5)],
            mistral_7b=says("Do not use grep.", 0.5),
        )
        self.assertEqual(harness.ask(ASK, 1.5).status, 200)
        (record,) = records
        self.assertTrue(record.mesh)
        self.assertEqual(
            [(call.role, call.endpoint) for call in record.calls],
            [("worker", "mistral-7b"), ("worker", "llama-70b"), ("reducer", "llama-70b")],
        )
