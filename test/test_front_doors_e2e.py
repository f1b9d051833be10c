"""
The Anthropic Messages and OpenAI Responses front doors end to end, with the real SDKs as
clients: a real llama.cpp server (xllamacpp) with the project's tiny models, `twist
inferproxy` in front of it, and `twist loopd --config` serving on its Unix socket and on a
loopback TCP port. The C{anthropic} SDK's C{messages.create} (whole and streamed, a tool-use
round trip), C{messages.count_tokens} and the thinking cap through C{budget_tokens}; the
C{openai} SDK's C{responses.create} (whole, streamed, a function-call round trip); and both
over loopd's loopback TCP listener with its token, and a wrong key's 401.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase

from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import TwistProcess, spawn_twist, stop_twist

try:
    import anthropic
    import openai

    from loopd.demo.tiny_model import ANSWER, THOUGHT
    from loopd.test.support.gateway_stack import SLOTS, httpx, loopd_toml, serve_behind_proxy
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the front-door end-to-end tests need the test extra: {e}") from None

#: How twist loopd's log names its TCP listener's address.
_URL = re.compile(rb"TCP listener on (http://127\.0\.0\.1:\d+):")
#: The tiny model's tool, in Anthropic's and in the Responses API's shape.
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": "Get the weather for a city.",
    "input_schema": WEATHER_SCHEMA,
}
RESPONSES_WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather for a city.",
    "parameters": WEATHER_SCHEMA,
}


class _Stack(TestCase):
    """A real server, an inferproxy and twist loopd, started per test."""

    timeout = 180

    @inlineCallbacks
    def start(self, model: str = "tiny.gguf") -> Any:
        """
        Start the server with C{model}, an inferproxy and C{twist loopd} (no self-test, so
        the thinking model may think long) on its Unix socket and on a free loopback TCP
        port (L{url}) with its token (L{token}) in a file of the test's directory.
        """
        reactor = real_reactor()
        self.directory, self.server, infer = yield serve_behind_proxy(self, model, SLOTS)
        self.socket = os.path.join(self.directory, "loopd.sock")
        token_file = os.path.join(self.directory, "state", "token")
        config = os.path.join(self.directory, "loopd.toml")
        text = loopd_toml(self.socket, infer, None, long=model != "tiny.gguf")
        tcp = f'tcp = "127.0.0.1:0"\ntoken_file = {json.dumps(token_file)}\n'
        with open(config, "w") as f:
            f.write(text.replace("[[endpoint]]", tcp + "[[endpoint]]", 1))
        self.loopd: TwistProcess = spawn_twist(
            reactor, b"loopd serving", "loopd", "--config", config
        )
        self.addCleanup(stop_twist, self.loopd)
        yield self.loopd.ready
        found = _URL.search(self.loopd.output)
        assert found is not None, self.loopd.output
        self.url = found.group(1).decode()
        with open(token_file) as f:
            self.token = f.read().strip()

    def http_client(self) -> Any:
        """An HTTP client of the SDKs' own transport library, over loopd's Unix socket."""
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), timeout=60)


class AnthropicEndToEndTests(_Stack):
    """The C{anthropic} SDK against loopd's C{/v1/messages}."""

    def client(self) -> Any:
        """An Anthropic client that reaches loopd through its Unix socket."""
        return anthropic.Anthropic(
            base_url="http://loopd", api_key="x", max_retries=0, http_client=self.http_client()
        )

    @inlineCallbacks
    def test_create(self) -> Any:
        """A whole answer: thinking and text blocks, end_turn, usage with cache reads."""
        yield self.start()

        def ask() -> Any:
            with self.client() as client:
                return client.messages.create(
                    model="tiny", max_tokens=200, messages=[{"role": "user", "content": "Hi"}]
                )

        message = yield deferToThread(ask)
        kinds = [block.type for block in message.content]
        self.assertEqual(kinds, ["thinking", "text"])
        self.assertEqual(message.content[0].thinking, THOUGHT)
        self.assertEqual(message.content[1].text, ANSWER)
        self.assertEqual(message.stop_reason, "end_turn")
        self.assertEqual(message.role, "assistant")
        self.assertGreater(message.usage.input_tokens + message.usage.cache_read_input_tokens, 0)
        self.assertGreater(message.usage.output_tokens, 0)

    @inlineCallbacks
    def test_stream(self) -> Any:
        """The SDK's stream helper assembles the same message from the events."""
        yield self.start()

        def ask() -> tuple[list[str], Any, str]:
            with self.client() as client:
                with client.messages.stream(
                    model="tiny",
                    max_tokens=200,
                    system="You are terse.",
                    messages=[{"role": "user", "content": "Hi"}],
                    thinking={"type": "disabled"},
                ) as stream:
                    types = [event.type for event in stream]
                    return types, stream.get_final_message(), stream.get_final_text()

        types, message, text = yield deferToThread(ask)
        self.assertEqual(types[0], "message_start")
        self.assertEqual(types[-1], "message_stop")
        self.assertIn("content_block_delta", types)
        self.assertEqual(text, ANSWER)
        self.assertEqual([block.type for block in message.content], ["text"])
        self.assertEqual(message.stop_reason, "end_turn")

    @inlineCallbacks
    def test_tool_use_round_trip(self) -> Any:
        """A tool_use block, its tool_result sent back, and an answer after it."""
        yield self.start()

        def ask() -> tuple[Any, Any]:
            with self.client() as client:
                messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
                first = client.messages.create(
                    model="tiny",
                    max_tokens=200,
                    messages=messages,
                    tools=[ANTHROPIC_WEATHER],
                    tool_choice={"type": "any"},
                    thinking={"type": "disabled"},
                )
                use = [block for block in first.content if block.type == "tool_use"][0]
                messages += [
                    {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
                        ],
                    },
                ]
                second = client.messages.create(
                    model="tiny",
                    max_tokens=200,
                    messages=messages,
                    tools=[ANTHROPIC_WEATHER],
                    thinking={"type": "disabled"},
                )
                return first, second

        first, second = yield deferToThread(ask)
        self.assertEqual(first.stop_reason, "tool_use")
        use = [block for block in first.content if block.type == "tool_use"][0]
        self.assertEqual(use.name, "get_weather")
        self.assertEqual(use.input, {"city": "test"})
        self.assertEqual(second.stop_reason, "end_turn")
        self.assertEqual([block.text for block in second.content], [ANSWER])

    @inlineCallbacks
    def test_attribution_line_keeps_the_prefix_cached(self) -> Any:
        """
        Two Claude-Code-shaped turns of one session whose attribution lines differ (as
        Claude Code's do on every request): loopd removes the line, so the second turn reads
        the first one's prompt from the server's cache.
        """
        yield self.start()
        long_system = "You are an interactive CLI tool. " * 40

        def turn(client: Any, nonce: str, messages: list[Any]) -> Any:
            return client.messages.create(
                model="tiny",
                max_tokens=50,
                system=[
                    {
                        "type": "text",
                        "text": f"x-anthropic-billing-header: cc_version=2.1.90; cch={nonce};",
                    },
                    {"type": "text", "text": long_system},
                ],
                messages=messages,
                thinking={"type": "disabled"},
                extra_headers={"X-Claude-Code-Session-Id": "cc-e2e"},
            )

        def ask() -> tuple[Any, Any]:
            with self.client() as client:
                messages: list[Any] = [{"role": "user", "content": "Hi"}]
                first = turn(client, "1a2b3", messages)
                messages += [
                    {"role": "assistant", "content": first.content[0].text},
                    {"role": "user", "content": "Again"},
                ]
                return first, turn(client, "9f8e7", messages)

        first, second = yield deferToThread(ask)
        # The whole first prompt (the long system prompt above all) comes from the cache.
        self.assertGreater(second.usage.cache_read_input_tokens, first.usage.input_tokens // 2)
        prompt = (yield self.server.query("/slots")).json()
        self.assertFalse(any("billing" in json.dumps(slot) for slot in prompt))

    @inlineCallbacks
    def test_count_tokens(self) -> Any:
        """count_tokens counts with the server's own template: more text, more tokens."""
        yield self.start()

        def ask() -> tuple[int, int]:
            with self.client() as client:
                short = client.messages.count_tokens(
                    model="tiny", messages=[{"role": "user", "content": "Hi"}]
                )
                longer = client.messages.count_tokens(
                    model="tiny",
                    system="You are a helpful assistant.",
                    messages=[{"role": "user", "content": "Hi there, how are you today?"}],
                )
                return short.input_tokens, longer.input_tokens

        short, longer = yield deferToThread(ask)
        self.assertGreater(short, 0)
        self.assertGreater(longer, short)

    @inlineCallbacks
    def test_thinking_budget_caps_thinking(self) -> Any:
        """
        On the model that would think forever, C{budget_tokens} ends the thinking through
        the server's reasoning-end control, and the answer follows.
        """
        yield self.start("tiny-think.gguf")

        def ask() -> Any:
            with self.client() as client:
                return client.messages.create(
                    model="tiny",
                    max_tokens=2000,
                    messages=[{"role": "user", "content": "Hi"}],
                    thinking={"type": "enabled", "budget_tokens": 64},
                )

        message = yield deferToThread(ask)
        thinking = [block for block in message.content if block.type == "thinking"]
        text = [block for block in message.content if block.type == "text"]
        self.assertEqual(len(thinking), 1)
        self.assertEqual(text[0].text, ANSWER)
        self.assertEqual(message.stop_reason, "end_turn")
        self.assertLess(message.usage.output_tokens, 2000)


class OverTcpEndToEndTests(_Stack):
    """Both SDKs over the loopback TCP listener, with loopd's token and with a wrong one."""

    @inlineCallbacks
    def test_anthropic_with_token(self) -> Any:
        """The anthropic SDK's key (sent as x-api-key) is loopd's token: it answers."""
        yield self.start()

        def ask() -> Any:
            with anthropic.Anthropic(base_url=self.url, api_key=self.token, max_retries=0) as c:
                return c.messages.create(
                    model="tiny", max_tokens=50, messages=[{"role": "user", "content": "Hi"}]
                )

        message = yield deferToThread(ask)
        self.assertEqual(message.content[-1].text, ANSWER)

    @inlineCallbacks
    def test_anthropic_wrong_key(self) -> Any:
        """A wrong key is the SDK's AuthenticationError: 401 in Anthropic's shape."""
        yield self.start()

        def ask() -> Any:
            with anthropic.Anthropic(base_url=self.url, api_key="wrong", max_retries=0) as c:
                try:
                    c.messages.create(
                        model="tiny", max_tokens=50, messages=[{"role": "user", "content": "Hi"}]
                    )
                except anthropic.AuthenticationError as error:
                    return error
            return None

        error = yield deferToThread(ask)
        self.assertIsInstance(error, anthropic.AuthenticationError)
        self.assertEqual(error.status_code, 401)
        self.assertEqual(error.body["type"], "error")
        self.assertEqual(error.body["error"]["type"], "authentication_error")

    @inlineCallbacks
    def test_responses_with_token(self) -> Any:
        """The openai SDK's key (sent as a bearer token) is loopd's token: it answers."""
        yield self.start()

        def ask() -> tuple[Any, Any]:
            url = self.url + "/v1"
            with openai.OpenAI(base_url=url, api_key=self.token, max_retries=0) as client:
                answered = client.responses.create(model="tiny", input="Hi")
            with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as client:
                try:
                    client.responses.create(model="tiny", input="Hi")
                except openai.AuthenticationError as error:
                    return answered, error
            return answered, None

        answered, error = yield deferToThread(ask)
        self.assertEqual(answered.output_text, ANSWER)
        self.assertIsInstance(error, openai.AuthenticationError)
        self.assertEqual(error.status_code, 401)


class ResponsesEndToEndTests(_Stack):
    """The C{openai} SDK's Responses API against loopd's C{/v1/responses}."""

    def client(self) -> Any:
        """An OpenAI client that reaches loopd through its Unix socket."""
        return openai.OpenAI(
            base_url="http://loopd/v1", api_key="x", max_retries=0, http_client=self.http_client()
        )

    @inlineCallbacks
    def test_create(self) -> Any:
        """A whole response: reasoning and a message, completed, usage with cached tokens."""
        yield self.start()

        def ask() -> Any:
            with self.client() as client:
                return client.responses.create(model="tiny", input="Hi", instructions="Be brief.")

        response = yield deferToThread(ask)
        self.assertEqual(response.status, "completed")
        self.assertEqual(response.output_text, ANSWER)
        self.assertEqual([item.type for item in response.output], ["reasoning", "message"])
        self.assertGreater(response.usage.input_tokens, 0)
        self.assertIsNotNone(response.usage.input_tokens_details.cached_tokens)

    @inlineCallbacks
    def test_stream(self) -> Any:
        """The event stream, assembled by the SDK's stream helper, ends completed."""
        yield self.start()

        def ask() -> tuple[list[str], Any]:
            with self.client() as client:
                with client.responses.stream(
                    model="tiny", input="Hi", reasoning={"effort": "none"}
                ) as stream:
                    types = [event.type for event in stream]
                    return types, stream.get_final_response()

        types, response = yield deferToThread(ask)
        self.assertEqual(types[:2], ["response.created", "response.in_progress"])
        self.assertEqual(types[-1], "response.completed")
        self.assertIn("response.output_text.delta", types)
        self.assertEqual(response.output_text, ANSWER)

    @inlineCallbacks
    def test_function_call_round_trip(self) -> Any:
        """A function_call item, its function_call_output sent back, and a message after."""
        yield self.start()

        def ask() -> tuple[Any, Any]:
            with self.client() as client:
                first = client.responses.create(
                    model="tiny",
                    input="Weather in Paris?",
                    tools=[RESPONSES_WEATHER],
                    tool_choice="required",
                    reasoning={"effort": "none"},
                )
                call = [item for item in first.output if item.type == "function_call"][0]
                second = client.responses.create(
                    model="tiny",
                    input=[
                        {"role": "user", "content": "Weather in Paris?"},
                        *[item.model_dump(exclude_none=True) for item in first.output],
                        {
                            "type": "function_call_output",
                            "call_id": call.call_id,
                            "output": "sunny",
                        },
                    ],
                    tools=[RESPONSES_WEATHER],
                    reasoning={"effort": "none"},
                )
                return first, second

        first, second = yield deferToThread(ask)
        call = [item for item in first.output if item.type == "function_call"][0]
        self.assertEqual(call.name, "get_weather")
        self.assertEqual(json.loads(call.arguments), {"city": "test"})
        self.assertEqual(second.status, "completed")
        self.assertEqual(second.output_text, ANSWER)
