"""
Tests for the tiny test model and the real llama.cpp server harness.

The unit tests drive `RealServer` and `run_query` with a fake process reactor on a
`task.Clock`; the server tests build both tiny models and run a real xllamacpp server
in a child process (skipped when `gguf` or `xllamacpp` is not installed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import sys
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError
from twisted.trial.unittest import SynchronousTestCase, TestCase

from loopd.demo import orphan_guard, real_server
from loopd.demo.real_server import (
    QueryFailedError,
    QueryTimeoutError,
    RealServer,
    ServerExitedError,
    ServerStartTimeoutError,
    run_query,
)
from loopd.test.support.fake_processes import FakeProcess, FakeProcessReactor

ANSWER = "Hello from the tiny model!"
THOUGHT = "Let me think about this..."
HI = [{"role": "user", "content": "Hi"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _missing(*modules: str) -> str | None:
    """Return a skip reason naming the first module that cannot be imported."""
    for name in modules:
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed (pip install .[test])"
    return None


def _ready_line(port: int) -> bytes:
    """Return the child's ready line for `port`."""
    info = {"port": port, "pid": 4242, "url": f"http://127.0.0.1:{port}"}
    return (real_server.READY_PREFIX + json.dumps(info) + "\n").encode()


class RealServerUnitTests(SynchronousTestCase):
    """RealServer and run_query against fake processes and a fake clock."""

    def setUp(self) -> None:
        self.reactor = FakeProcessReactor()
        self.server = RealServer(self.reactor, "/m/tiny.gguf", start_timeout=60.0)

    def _started(self, port: int = 40123) -> FakeProcess:
        """Start the server and feed its ready line; return the fake child."""
        d = self.server.start()
        child = self.reactor.spawned[-1]
        child.protocol.outReceived(_ready_line(port))
        self.assertEqual(self.successResultOf(d), port)
        return child

    def test_command_carries_options(self) -> None:
        """
        The child argv runs behind the orphan guard (it dies with this process) and names the
        model, port, context, slots and alias.
        """
        self.server.start()
        guarded = self.reactor.spawned[0].args
        self.assertEqual(guarded[1:3], [orphan_guard.SCRIPT, str(os.getpid())])
        args = guarded[3:]
        self.assertEqual(args[1], real_server.SCRIPT)
        self.assertTrue(args[1].endswith(os.path.join("demo", "real_server.py")))
        for flag, value in [
            ("--model", "/m/tiny.gguf"),
            ("--port", "0"),
            ("--ctx", "8192"),
            ("--parallel", "2"),
            ("--alias", "tiny"),
        ]:
            self.assertEqual(args[args.index(flag) + 1], value)
        self.assertIn("--exit-on-eof", args)
        self.assertNotIn("--cache-ram", args)

    def test_command_cache_ram(self) -> None:
        """A RAM prompt cache size, 0 included, is passed on; None leaves llama.cpp's."""
        for size in (0, 512):
            argv = real_server.ServerOptions("/m", cache_ram_mib=size).command()
            self.assertEqual(argv[argv.index("--cache-ram") + 1], str(size))

    def test_command_slot_save_path(self) -> None:
        """A slot save directory is passed on, from RealServer too; none by default."""
        self.assertNotIn("--slot-save-path", real_server.ServerOptions("/m").command())
        server = RealServer(FakeProcessReactor(), "/m", slot_save_path="/s", cache_ram_mib=0)
        argv = server.options.command()
        self.assertEqual(argv[argv.index("--slot-save-path") + 1], "/s")
        self.assertEqual(argv[argv.index("--cache-ram") + 1], "0")

    @given(st.lists(st.integers(min_value=0, max_value=120), max_size=8))
    def test_ready_line_in_any_chunks(self, cuts: list[int]) -> None:
        """The ready line is found however stdout is split into chunks."""
        reactor = FakeProcessReactor()
        server = RealServer(reactor, "/m/tiny.gguf")
        d = server.start()
        data = b"noise before\n" + _ready_line(40999)
        edges = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
        for a, b in zip(edges, edges[1:], strict=False):
            reactor.spawned[0].protocol.outReceived(data[a:b])
        self.assertEqual(self.successResultOf(d), 40999)
        self.assertEqual(server.base_url, "http://127.0.0.1:40999")

    def test_start_timeout_kills_and_fails_typed(self) -> None:
        """No ready line within start_timeout: SIGKILL, then ServerStartTimeoutError."""
        d = self.server.start()
        child = self.reactor.spawned[0]
        self.reactor.advance(59.9)
        self.assertNoResult(d)
        self.reactor.advance(0.1)
        self.assertEqual(child.signals, ["KILL"])
        self.assertNoResult(d)
        child.end(None, 9)
        self.failureResultOf(d, ServerStartTimeoutError)
        self.assertFalse(self.server.running)

    def test_exit_before_ready_fails_with_stderr(self) -> None:
        """A child that dies while starting fails start with its stderr tail."""
        d = self.server.start()
        child = self.reactor.spawned[0]
        child.protocol.errReceived(b"failed to load model\n")
        child.end(1)
        failure = self.failureResultOf(d, ServerExitedError)
        self.assertIn("failed to load model", str(failure.value))
        self.assertIn("exit code 1", str(failure.value))
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_start_twice_fails(self) -> None:
        """Starting a running server fails instead of spawning a second child."""
        self._started()
        self.failureResultOf(self.server.start(), real_server.RealServerError)
        self.assertEqual(len(self.reactor.spawned), 1)

    def test_stop_escalates_to_kill(self) -> None:
        """stop sends SIGTERM, then SIGKILL after stop_timeout, and fires at the end."""
        child = self._started()
        d = self.server.stop()
        self.assertEqual(child.signals, ["TERM"])
        self.reactor.advance(self.server.stop_timeout)
        self.assertEqual(child.signals, ["TERM", "KILL"])
        self.assertNoResult(d)
        child.end(None, 9)
        self.assertIsNone(self.successResultOf(d))
        self.assertEqual(self.server.last_end, "signal 9")

    def test_clean_stop_cancels_timer(self) -> None:
        """A child that exits on SIGTERM leaves no timer behind."""
        child = self._started()
        d = self.server.stop()
        child.end(0)
        self.successResultOf(d)
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        self.assertEqual(self.server.last_end, "exit code 0")

    def test_restart_after_kill_reuses_port(self) -> None:
        """After kill, start asks the new child for the port the old one had."""
        child = self._started(40555)
        d = self.server.kill()
        self.assertEqual(child.signals, ["KILL"])
        child.end(None, 9)
        self.successResultOf(d)
        self.server.start()
        args = self.reactor.spawned[1].args
        self.assertEqual(args[args.index("--port") + 1], "40555")

    def test_restart_stops_then_starts(self) -> None:
        """restart waits for the old child to end, then starts on the same port."""
        child = self._started(40777)
        d = self.server.restart()
        self.assertEqual((child.signals, len(self.reactor.spawned)), (["TERM"], 1))
        child.end(0)
        new = self.reactor.spawned[1]
        self.assertEqual(new.args[new.args.index("--port") + 1], "40777")
        new.protocol.outReceived(_ready_line(40777))
        self.assertEqual(self.successResultOf(d), 40777)

    def test_cancel_start_kills_child(self) -> None:
        """Cancelling start kills the child and fails with CancelledError."""
        d = self.server.start()
        d.cancel()
        self.assertEqual(self.reactor.spawned[0].signals, ["KILL"])
        self.failureResultOf(d, CancelledError)
        self.reactor.spawned[0].end(None, 9)
        self.assertFalse(self.server.running)

    def test_query_parses_envelope(self) -> None:
        """run_query sends the JSON body on stdin and returns status and body."""
        d = run_query(self.reactor, "http://127.0.0.1:1/x", {"a": 1}, timeout=5.0)
        child = self.reactor.spawned[0]
        self.assertEqual(json.loads(child.stdin), {"a": 1})
        self.assertTrue(child.stdin_closed)
        child.protocol.outReceived(b'{"status": 404, "body": "{\\"e\\": 1}"}\n')
        child.end(1)
        result = self.successResultOf(d)
        self.assertEqual((result.status, result.json()), (404, {"e": 1}))
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_query_connection_error_is_typed(self) -> None:
        """A query child that got no answer fails with QueryFailedError."""
        d = run_query(self.reactor, "http://127.0.0.1:1/x")
        child = self.reactor.spawned[0]
        child.protocol.outReceived(b'{"error": "ConnectionRefusedError"}\n')
        child.end(2)
        failure = self.failureResultOf(d, QueryFailedError)
        self.assertIn("ConnectionRefusedError", str(failure.value))

    def test_query_timeout_kills_child(self) -> None:
        """A query child outliving its timeout is killed; QueryTimeoutError."""
        d = run_query(self.reactor, "http://127.0.0.1:1/x", timeout=5.0)
        child = self.reactor.spawned[0]
        self.reactor.advance(5.0)
        self.assertEqual(child.signals, ["KILL"])
        child.end(None, 9)
        self.failureResultOf(d, QueryTimeoutError)


class TinyModelTests(SynchronousTestCase):
    """The GGUF writer: same bytes every time, and a scripted greedy path."""

    skip = _missing("gguf", "numpy")

    def test_builds_are_byte_identical(self) -> None:
        """Two builds of each model give the same sha256; the variants differ."""
        from loopd.demo.tiny_model import write_tiny_model

        base = self.mktemp()
        os.makedirs(base)
        digests = {}
        names = []
        for think in (False, True):
            paths = [os.path.join(base, f"{think}-{i}.gguf") for i in (1, 2)]
            names += [os.path.basename(p) for p in paths]
            shas = [write_tiny_model(p, think_forever=think) for p in paths]
            self.assertEqual(shas[0], shas[1])
            with open(paths[0], "rb") as f:
                self.assertEqual(hashlib.sha256(f.read()).hexdigest(), shas[0])
            digests[think] = shas[0]
        self.assertNotEqual(digests[False], digests[True])
        self.assertEqual(sorted(os.listdir(base)), sorted(names))  # no partial files

    def _greedy(self, think_forever: bool, steps: int) -> str:
        """Follow the argmax of the output head from "\\n" (no tools in context)."""
        import numpy as np

        from loopd.demo import tiny_model

        vocab = tiny_model.build_vocab()
        w = tiny_model.build_weights(vocab, think_forever=think_forever)
        symbols = {s: bytes([b]) for b, s in enumerate(tiny_model.byte_symbols())}
        eos = vocab.ids["<|im_end|>"]
        token, text = vocab.id_of("\n"), b""
        for _ in range(steps):
            x = w["token_embd.weight"][token]
            logits = w["output.weight"] @ (x / np.sqrt(np.mean(x * x) + 1e-6))
            token = int(np.argmax(logits))
            if token == eos:
                break
            piece = vocab.tokens[token]
            if piece in tiny_model.TAG_TOKENS:
                text += piece.encode()
            else:
                text += b"".join(symbols[s] for s in piece)
        return text.decode()

    def test_script_thinks_then_answers(self) -> None:
        """The tiny model's greedy path is the thought, then the answer, then eos."""
        self.assertEqual(self._greedy(False, 50), f"<think>{THOUGHT}</think>\n\n{ANSWER}")

    def test_think_forever_never_closes(self) -> None:
        """The think-forever model repeats its thought and never writes </think>."""
        text = self._greedy(True, 70)
        self.assertTrue(text.startswith(f"<think>{THOUGHT} {THOUGHT} "))
        self.assertNotIn("</think>", text)

    def test_ballast_adds_only_zeros(self) -> None:
        """
        With ballast every tensor of the plain model is there with the same values (a
        feed-forward only wider, with zeros); the extra layers are zero apart from their
        norms, which are ones as in the plain layers.
        """
        import numpy as np

        from loopd.demo import tiny_model

        vocab = tiny_model.build_vocab()
        plain = tiny_model.build_weights(vocab)
        heavy = tiny_model.build_weights(vocab, ballast=tiny_model.Ballast(256, 4))
        widened = {"ffn_gate": (256, 64), "ffn_up": (256, 64), "ffn_down": (64, 256)}
        for name, tensor in plain.items():
            kind = name.split(".")[-2]
            if kind in widened:
                self.assertEqual(heavy[name].shape, widened[kind], name)
                self.assertFalse(heavy[name].any(), name)
            else:
                np.testing.assert_array_equal(heavy[name], tensor, err_msg=name)
        layer_one = [name for name in plain if name.startswith("blk.1.")]
        extra = {name.replace("blk.1.", f"blk.{i}.") for name in layer_one for i in (2, 3)}
        self.assertEqual(set(heavy) - set(plain), extra)
        for name in extra:
            expected = 1.0 if name.endswith("_norm.weight") else 0.0
            self.assertTrue((heavy[name] == expected).all(), name)

    def test_ballast_bytes(self) -> None:
        """A ballast model has bytes of its own, the same on every build."""
        from loopd.demo.tiny_model import Ballast, write_tiny_model

        base = self.mktemp()
        os.makedirs(base)
        paths = [os.path.join(base, f"{i}.gguf") for i in range(3)]
        plain = write_tiny_model(paths[0])
        heavy = [write_tiny_model(p, ballast=Ballast(256, 3)) for p in paths[1:]]
        self.assertEqual(heavy[0], heavy[1])
        self.assertNotEqual(plain, heavy[0])
        self.assertGreater(os.path.getsize(paths[1]), os.path.getsize(paths[0]))

    def test_ballast_below_the_plain_model_is_refused(self) -> None:
        """A ballast narrower or shallower than the plain model says which and why."""
        from loopd.demo.tiny_model import N_FF, N_LAYER, Ballast, BallastError

        with self.assertRaisesRegex(BallastError, "feed-forward width 64 is below 128"):
            Ballast(64, 6)
        with self.assertRaisesRegex(BallastError, "layer count 1 is below 2"):
            Ballast(4096, 1)
        self.assertEqual(Ballast(N_FF, N_LAYER), Ballast.parse(f"{N_FF}:{N_LAYER}"))

    def test_ballast_option(self) -> None:
        """--ballast FF:LAYERS parses; anything else is a usage error naming the text."""
        from loopd.demo.tiny_model import Ballast, BallastError, main

        self.assertEqual(Ballast.parse("8192:6"), Ballast(8192, 6))
        for bad in ("8192", "8192:", ":6", "a:6", "8192:6:1", "-1:6", "8192:٣x", " 1:6"):
            with self.assertRaisesRegex(BallastError, "is not FF:LAYERS"):
                Ballast.parse(bad)
        path = self.mktemp()
        stderr = io.StringIO()
        self.patch(sys, "stderr", stderr)
        with self.assertRaises(SystemExit) as caught:
            main([path, "--ballast", "64:6"])
        self.assertEqual(caught.exception.code, 2)
        self.assertIn("--ballast: ballast feed-forward width 64 is below 128", stderr.getvalue())
        self.assertFalse(os.path.exists(path))


class RealServerTests(TestCase):
    """A real llama.cpp server (xllamacpp) serving the tiny models in a child."""

    timeout = 120
    skip = _missing("gguf", "numpy", "xllamacpp")

    def setUp(self) -> None:
        from twisted.internet import reactor

        from loopd.demo.tiny_model import write_tiny_model

        self.reactor = reactor
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.tiny = os.path.join(self.dir, "tiny.gguf")
        self.think = os.path.join(self.dir, "tiny-think.gguf")
        write_tiny_model(self.tiny)
        write_tiny_model(self.think, think_forever=True)

    def _server(self, model: str) -> RealServer:
        """Return a server for `model` that is stopped when the test ends."""
        server = RealServer(self.reactor, model)
        self.addCleanup(server.stop)
        return server

    async def _chat(self, server: RealServer, **request: object) -> Any:
        """POST a chat completion and return its first choice."""
        result = await server.query("/v1/chat/completions", request)
        self.assertEqual(result.status, 200, result.body)
        return result.json()["choices"][0]

    async def test_props_and_chat(self) -> None:
        """/props, /slots and /metrics answer; a chat thinks, then answers."""
        server = self._server(self.tiny)
        port = await server.start()
        self.assertEqual(port, server.port)
        props = (await server.query("/props")).json()
        self.assertEqual(props["total_slots"], 2)
        self.assertEqual(props["model_alias"], "tiny")
        self.assertEqual(props["default_generation_settings"]["n_ctx"], 4096)
        self.assertEqual(len((await server.query("/slots")).json()), 2)
        metrics = await server.query("/metrics")
        self.assertIn(b"llamacpp:requests_processing", metrics.body)
        choice = await self._chat(server, messages=HI)
        self.assertEqual(choice["message"]["content"], ANSWER)
        self.assertEqual(choice["message"]["reasoning_content"], THOUGHT)
        choice = await self._chat(
            server, messages=HI, chat_template_kwargs={"enable_thinking": False}
        )
        self.assertEqual(choice["message"]["content"], ANSWER)
        self.assertNotIn("reasoning_content", choice["message"])

    async def test_tool_call_then_answer(self) -> None:
        """Offered tools, it calls one; given the tool's result, it answers."""
        server = self._server(self.tiny)
        await server.start()
        asked = [{"role": "user", "content": "Weather?"}]
        choice = await self._chat(server, messages=asked, tools=[WEATHER_TOOL])
        self.assertEqual(choice["finish_reason"], "tool_calls")
        call = choice["message"]["tool_calls"][0]
        self.assertEqual(call["function"]["name"], "get_weather")
        self.assertEqual(json.loads(call["function"]["arguments"]), {"city": "test"})
        answered = asked + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
        ]
        choice = await self._chat(server, messages=answered, tools=[WEATHER_TOOL])
        self.assertEqual(choice["message"]["content"], ANSWER)

    async def test_ballast_answers_like_the_plain_model(self) -> None:
        """
        Served by a real server, the ballast model gives the plain model's answers:
        thinking, not thinking, a tool call and the answer after it, for the same
        prompt tokens.
        """
        from loopd.demo.tiny_model import Ballast, write_tiny_model

        heavy = os.path.join(self.dir, "heavy.gguf")
        write_tiny_model(heavy, ballast=Ballast(512, 4))
        servers = [self._server(self.tiny), self._server(heavy)]
        for server in servers:
            await server.start()
        asked = [{"role": "user", "content": "Weather?"}]
        function = {"name": "get_weather", "arguments": '{"city": "test"}'}
        call = {"id": "c1", "type": "function", "function": function}
        answered = asked + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
        requests: list[dict[str, Any]] = [
            {"messages": HI},
            {"messages": HI, "chat_template_kwargs": {"enable_thinking": False}},
            {"messages": asked, "tools": [WEATHER_TOOL]},
            {"messages": answered, "tools": [WEATHER_TOOL]},
        ]
        for request in requests:
            seen = []
            for server in servers:
                result = await server.query("/v1/chat/completions", request)
                self.assertEqual(result.status, 200, result.body)
                body = result.json()
                (choice,) = body["choices"]
                for tool_call in choice["message"].get("tool_calls", []):
                    tool_call.pop("id")
                seen.append((choice, body["timings"]["prompt_n"]))
            self.assertEqual(seen[0], seen[1], request)
        self.assertEqual(seen[0][0]["message"]["content"], ANSWER)

    async def test_think_forever_until_forced(self) -> None:
        """tiny-think thinks to max_tokens, and answers once a budget ends thinking."""
        server = self._server(self.think)
        await server.start()
        choice = await self._chat(server, messages=HI, max_tokens=40)
        self.assertEqual(choice["finish_reason"], "length")
        self.assertEqual(choice["message"]["content"], "")
        self.assertTrue(choice["message"]["reasoning_content"].startswith(THOUGHT))
        choice = await self._chat(server, messages=HI, reasoning_budget_tokens=20)
        self.assertEqual(choice["message"]["content"], ANSWER)

    async def test_kill_and_restart_on_same_port(self) -> None:
        """After SIGKILL the port refuses; a new start serves on the same port."""
        server = self._server(self.tiny)
        port = await server.start()
        first_pid = server.pid
        await server.kill()
        self.assertFalse(server.running)
        self.assertEqual(server.last_end, "signal 9")
        with self.assertRaises(QueryFailedError):
            await server.query("/health")
        self.assertEqual(await server.start(), port)
        self.assertNotEqual(server.pid, first_pid)
        health = await server.query("/health")
        self.assertEqual((health.status, health.json()), (200, {"status": "ok"}))
        choice = await self._chat(server, messages=HI)
        self.assertEqual(choice["message"]["content"], ANSWER)

    async def test_stop_exits_cleanly(self) -> None:
        """stop ends the child through SIGTERM with exit code 0."""
        server = self._server(self.tiny)
        await server.start()
        await server.stop()
        self.assertFalse(server.running)
        self.assertEqual(server.last_end, "exit code 0")

    async def test_bad_model_fails_typed(self) -> None:
        """A model file that does not load fails start with ServerExitedError."""
        bad = os.path.join(self.dir, "bad.gguf")
        with open(bad, "wb") as f:
            f.write(b"not a gguf file")
        server = self._server(bad)
        with self.assertRaises(ServerExitedError) as caught:
            await server.start()
        self.assertIn("exit code 1", str(caught.exception))
