"""
Tests for L{loopd.llama.resume}: what was delivered, whether it may be resumed, the
continuation request and the merged completion. Pure: values in, values out.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.llama.resume import Delivered, Partial, continuation, merge, resume_refusal
from loopd.llama.types import (
    Assistant,
    ChatRequest,
    Completion,
    Content,
    FinishReason,
    Logprobs,
    Progress,
    Reasoning,
    ThinkingCapped,
    Timings,
    ToolCallDelta,
    User,
)

REQUEST = ChatRequest(slot=0, messages=(User("Hi"),))


def completion(
    content: str | None, reasoning: str | None = None, timings: Timings | None = None
) -> Completion:
    """A finished answer with C{content} and C{reasoning}."""
    return Completion(
        id="chatcmpl-b",
        content=content,
        reasoning_content=reasoning,
        tool_calls=(),
        finish_reason=FinishReason.STOP,
        timings=timings or Timings(cache_n=30, prompt_n=5, predicted_n=2),
        reasoning_tokens=0,
    )


class DeliveredTests(SynchronousTestCase):
    """A Delivered counts the pieces of the answer, attempt after attempt."""

    def test_nothing(self) -> None:
        """Progress, an empty piece and a capped note deliver nothing."""
        delivered = Delivered()
        for event in (Progress(10, 0, 10), Content(""), Reasoning("", 3)):
            delivered.observe(event)
        self.assertTrue(delivered.partial().empty)
        self.assertEqual(delivered.partial(), Partial())

    def test_pieces_and_counts(self) -> None:
        """The texts are joined; the count is the server's at the last piece."""
        delivered = Delivered()
        for event in (Reasoning("Let", 2), Reasoning(" me", 3), Content("Hel", 6)):
            delivered.observe(event)
        self.assertEqual(
            delivered.partial(),
            Partial(reasoning="Let me", content="Hel", generated=6, reasoning_tokens=3),
        )

    def test_uncounted_pieces(self) -> None:
        """Pieces without the server's count count one token each."""
        delivered = Delivered()
        delivered.observe(Content("a"))
        delivered.observe(Content("b"))
        self.assertEqual(delivered.partial().generated, 2)

    def test_tool_call_and_cap(self) -> None:
        """A tool-call piece and the thinking cap are noted."""
        delivered = Delivered()
        delivered.observe(ThinkingCapped(40))
        delivered.observe(ToolCallDelta(0, "c1", "f", ""))
        partial = delivered.partial()
        self.assertEqual((partial.tool_call, partial.thinking_capped), (True, True))
        self.assertFalse(partial.empty)

    def test_attempts_add_up(self) -> None:
        """A continuation's counts restart at zero; the partial adds them to the prefix."""
        delivered = Delivered()
        delivered.observe(Reasoning("Let", 2))
        delivered.next_attempt()
        self.assertEqual(
            delivered.prefix, Partial(reasoning="Let", generated=2, reasoning_tokens=2)
        )
        delivered.observe(Reasoning(" me", 1))
        delivered.observe(Content("Hi", 4))
        self.assertEqual(
            delivered.partial(),
            Partial(reasoning="Let me", content="Hi", generated=6, reasoning_tokens=3),
        )


class RefusalTests(SynchronousTestCase):
    """Which partial answers cannot be resumed."""

    def test_nothing_delivered(self) -> None:
        """Nothing delivered: no refusal, on any endpoint."""
        self.assertIsNone(resume_refusal(Partial(), "openai", 10))

    def test_llama_server(self) -> None:
        """Text on a llama-server within its max_tokens is resumed."""
        self.assertIsNone(resume_refusal(Partial(content="a", generated=3), "llama-server", 10))

    def test_refused(self) -> None:
        """An openai endpoint, a started tool call and a used-up max_tokens are refused."""
        text = Partial(content="a", generated=3)
        self.assertIn("openai", resume_refusal(text, "openai", 10) or "")
        tool = Partial(content="a", tool_call=True, generated=3)
        self.assertIn("tool call", resume_refusal(tool, "llama-server", 10) or "")
        self.assertIn("max_tokens", resume_refusal(text, "llama-server", 3) or "")


class ChoicesAndLogprobsTests(SynchronousTestCase):
    """A request for n choices is not resumed; logprobs entries carry over a resume."""

    def test_several_choices(self) -> None:
        """A delivered piece of a second choice refuses the resume."""
        delivered = Delivered()
        delivered.observe(Content("a", choice=1))
        partial = delivered.partial()
        self.assertTrue(partial.several_choices)
        self.assertEqual(
            resume_refusal(partial, "llama-server", 100), "the answer has several choices (n)"
        )

    def test_logprobs(self) -> None:
        """The delivered entries come before the continuation's in the merged completion."""
        delivered = Delivered()
        delivered.observe(Logprobs(("t",)))
        delivered.observe(Content("Hel", logprobs=("h",)))
        partial = delivered.partial()
        self.assertEqual(partial.logprobs, ("t", "h"))
        done = merge(partial, replace(completion("lo"), logprobs=("l",)))
        self.assertEqual(done.logprobs, ("t", "h", "l"))
        self.assertIsNone(merge(Partial(content="x"), completion("y")).logprobs)


class ContinuationTests(SynchronousTestCase):
    """The request that continues a partial answer."""

    def test_nothing_delivered(self) -> None:
        """Nothing delivered: the request itself."""
        self.assertIs(continuation(REQUEST, Partial(), 100), REQUEST)

    def test_prefill(self) -> None:
        """The partial answer is the final assistant message; max_tokens less its tokens."""
        partial = Partial(reasoning="Let me", content="Hel", generated=6)
        asked = continuation(REQUEST, partial, 100)
        self.assertEqual(asked.messages, (User("Hi"), Assistant("Hel", "Let me")))
        self.assertEqual(asked.max_tokens, 94)
        self.assertEqual((asked.slot, asked.thinking), (REQUEST.slot, REQUEST.thinking))

    def test_still_thinking(self) -> None:
        """A partial answer with no content yet is prefilled with its reasoning alone."""
        asked = continuation(REQUEST, Partial(reasoning="Let", generated=2), 100)
        self.assertEqual(asked.messages[-1], Assistant(None, "Let"))


class MergeTests(SynchronousTestCase):
    """The completion of the whole answer."""

    def test_nothing_delivered(self) -> None:
        """No prefix: the completion itself."""
        done = completion("Hello")
        self.assertIs(merge(Partial(), done), done)

    def test_counts(self) -> None:
        """
        Generated tokens add up; the partial answer leaves the prompt counts, from the
        evaluated ones first.
        """
        prefix = Partial(content="Hel", generated=7)
        done = merge(prefix, completion("lo", timings=Timings(30, 5, 2, 9.5)))
        self.assertEqual(done.content, "Hello")
        self.assertEqual(
            done.timings, Timings(cache_n=28, prompt_n=0, predicted_n=9, predicted_per_second=9.5)
        )

    def test_reasoning(self) -> None:
        """A thinking prefix adds its reasoning and its reasoning tokens; the cap carries."""
        prefix = Partial(reasoning="Let", generated=2, reasoning_tokens=2, thinking_capped=True)
        whole = Completion(
            id="b",
            content="Hi",
            reasoning_content=" me",
            tool_calls=(),
            finish_reason=FinishReason.STOP,
            timings=Timings(0, 20, 5),
            reasoning_tokens=1,
        )
        done = merge(prefix, whole)
        self.assertEqual((done.reasoning_content, done.content), ("Let me", "Hi"))
        self.assertEqual((done.reasoning_tokens, done.thinking_capped), (3, True))

    @given(st.text(min_size=2, max_size=40), st.data())
    def test_split_anywhere(self, text: str, data: st.DataObject) -> None:
        """An answer cut at any point and continued is the answer, once."""
        cut = data.draw(st.integers(1, len(text) - 1))
        delivered = Delivered()
        delivered.observe(Content(text[:cut], cut))
        prefix = delivered.partial()
        asked = continuation(REQUEST, prefix, 1000)
        self.assertEqual(asked.messages[-1], Assistant(text[:cut]))
        done = merge(prefix, completion(text[cut:], timings=Timings(40, 10, len(text) - cut)))
        self.assertEqual(done.content, text)
        self.assertEqual(done.timings.predicted_n, len(text))
