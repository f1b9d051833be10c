"""
Tests for L{loopd.moa.knobs}: sampling per role, the host's thinking policy (reference
C{mesh-moa.md} §1.6) and the upstream request of a worker or reducer (DESIGN decision 28),
checked down to the body the llama client sends.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from loopd.llama.request import chat_body
from loopd.llama.types import ChatRequest, System, ToolSchema, User
from loopd.moa.context import Packed, pack_fast, pack_strong
from loopd.moa.knobs import (
    REDUCER_SAMPLING,
    WORKER_SAMPLING,
    SamplingParams,
    effective_enable_thinking,
    sampling_for,
    upstream_request,
)
from loopd.moa.roles import Role
from loopd.moa.turn import read_turn
from loopd.settings import Config, Endpoint

LLAMA = Endpoint(name="qwen", socket="/tmp/ld/q.sock", model="qwen")
OPENAI = Endpoint(name="far", socket="/tmp/ld/f.sock", kind="openai")
CONFIG = Config(endpoints=(LLAMA, OPENAI))


class SamplingTests(SynchronousTestCase):
    """Sampling per role."""

    def test_values(self) -> None:
        """Workers 0.8 / 0.95, the reducer 0.3 / 0.9."""
        self.assertEqual(WORKER_SAMPLING, SamplingParams(0.8, 0.95))
        self.assertEqual(REDUCER_SAMPLING, SamplingParams(0.3, 0.9))

    def test_by_role(self) -> None:
        """Every worker role samples as a worker; the reducer as the reducer."""
        for role in (Role.FAST, Role.SPECIALIST, Role.STRONG, Role.GENERALIST):
            self.assertEqual(sampling_for(role), WORKER_SAMPLING)
        self.assertEqual(sampling_for(Role.REDUCER), REDUCER_SAMPLING)


class PolicyTests(SynchronousTestCase):
    """C{effective_enable_thinking}: off unless the caller turns it on."""

    def test_silent_caller(self) -> None:
        """A caller that says nothing gets thinking off."""
        self.assertFalse(effective_enable_thinking(None))

    def test_explicit(self) -> None:
        """An explicit choice wins either way (v1's escape hatch)."""
        self.assertTrue(effective_enable_thinking(True))
        self.assertFalse(effective_enable_thinking(False))


class UpstreamRequestTests(SynchronousTestCase):
    """C{upstream_request}: DESIGN decision 28's request, and the wire form it becomes."""

    def test_worker_request(self) -> None:
        """The packing, the role budget, worker sampling, the thinking choice, any slot."""
        packed = pack_fast(read_turn([User("q")]))
        request = upstream_request(packed, sampling=WORKER_SAMPLING, enable_thinking=False)
        self.assertEqual(
            request,
            ChatRequest(
                slot=-1,
                messages=packed.messages,
                thinking=False,
                max_tokens=256,
                temperature=0.8,
                top_p=0.95,
                template_thinking=True,
            ),
        )

    def test_thinking_off_on_the_wire(self) -> None:
        """Off: enable_thinking false plus reasoning_effort none, for both kinds of endpoint."""
        packed = pack_fast(read_turn([User("q")]))
        request = upstream_request(packed, sampling=WORKER_SAMPLING, enable_thinking=False)
        for endpoint in (LLAMA, OPENAI):
            body = chat_body(request, CONFIG, endpoint)
            self.assertEqual(body["chat_template_kwargs"], {"enable_thinking": False})
            self.assertEqual(body["reasoning_effort"], "none")
            self.assertEqual((body["max_tokens"], body["temperature"]), (256, 0.8))

    def test_tools_and_thinking_on(self) -> None:
        """Tools when packed; thinking on sends enable_thinking true and no reasoning_effort."""
        tools = (ToolSchema("f", ""),)
        packed = pack_strong(read_turn([User("q")], tools))
        request = upstream_request(packed, sampling=REDUCER_SAMPLING, enable_thinking=True)
        self.assertEqual(request.tools, tools)
        body = chat_body(request, CONFIG, OPENAI)
        self.assertNotIn("reasoning_effort", body)
        self.assertEqual(body["chat_template_kwargs"], {"enable_thinking": True})
        self.assertEqual((body["max_tokens"], body["temperature"], body["top_p"]), (1024, 0.3, 0.9))
        self.assertEqual([tool["function"]["name"] for tool in body["tools"]], ["f"])

    def test_no_tools_field(self) -> None:
        """A packing without tools sends no tools field."""
        packed = Packed((System("s"), User("q")), None, 2048)
        request = upstream_request(packed, sampling=REDUCER_SAMPLING, enable_thinking=False)
        self.assertEqual(request.tools, ())
        self.assertNotIn("tools", chat_body(request, CONFIG, LLAMA))
        self.assertEqual(request.max_tokens, 2048)
