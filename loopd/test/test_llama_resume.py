"""
Tests for L{loopd.llama.resume}: what was delivered, whether it may be resumed, the
continuation request and the merged completion. Pure: values in, values out.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.llama.resume import (
    Continued,
    Delivered,
    Partial,
    continuation,
    merge,
    prefill_rendered,
    resume_plan,
    resume_refusal,
)
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

    def test_names_the_part_continued(self) -> None:
        """
        The continuation names the part it continues (left implicit, llama.cpp b11434 sent
        the whole prefill back as the stream's first piece) and turns the generation prompt
        off, as the server requires; the request's own fields stay.
        """
        request = replace(REQUEST, fields={"seed": 7})
        thinking = continuation(request, Partial(reasoning="Let", generated=2), 100)
        answering = continuation(request, Partial(reasoning="Let", content="Hi"), 100)
        self.assertEqual(
            (dict(thinking.fields), dict(answering.fields)),
            (
                {
                    "seed": 7,
                    "continue_final_message": "reasoning_content",
                    "add_generation_prompt": False,
                },
                {"seed": 7, "continue_final_message": "content", "add_generation_prompt": False},
            ),
        )

    def test_close_thought(self) -> None:
        """Closing a cut thought: its reasoning as a finished thought, the content empty."""
        asked = continuation(
            REQUEST, Partial(reasoning="Let", generated=2), 100, close_thought=True
        )
        self.assertEqual(asked.messages[-1], Assistant("", "Let"))
        self.assertEqual(asked.fields["continue_final_message"], "content")
        with_content = Partial(reasoning="Let", content="Hi", generated=3)
        self.assertEqual(
            continuation(REQUEST, with_content, 100, close_thought=True),
            continuation(REQUEST, with_content, 100),
        )


#: Prompts llama.cpp b11434 rendered (POST /apply-template) for the tiny thinking model's
#: continuations, and the plan each gives.
OPEN = "<|im_start|>user\nThink<|im_end|>\n<|im_start|>assistant\n<think>\nLet me"
CLOSED = OPEN + "\n</think>\n\n"
ANSWERING = CLOSED + "Hello from"
FRESH = "<|im_start|>user\nThink<|im_end|>\n<|im_start|>assistant\n"
THINKING = Partial(reasoning="Let me", generated=3)
ANSWERED = Partial(reasoning="Let me", content="Hello from", generated=6)


class PlanTests(SynchronousTestCase):
    """How a partial answer is resumed, from the prompt the template made of it."""

    def test_table(self) -> None:
        """
        An open thought is thought on; a thought the prompt closed, or left out, is closed;
        content is continued only when the prompt ends with it.
        """
        table = [
            (THINKING, OPEN, "continue"),
            (THINKING, CLOSED, "close"),
            (THINKING, FRESH, "close"),
            (Partial(reasoning="\nLet me\n"), OPEN, "continue"),
            (ANSWERED, ANSWERING, "continue"),
            (ANSWERED, CLOSED, "refuse"),
            (ANSWERED, FRESH, "refuse"),
            (
                Partial(content="Hello from"),
                FRESH + "<think>\n\n</think>\n\nHello from",
                "continue",
            ),
        ]
        for partial, prompt, plan in table:
            self.assertEqual(resume_plan(partial, prompt), plan, (partial, prompt))

    @given(st.text(min_size=1), st.text(), st.text(min_size=1))
    def test_open_thought(self, before: str, reasoning: str, after: str) -> None:
        """
        A prompt that ends with the delivered reasoning leaves the thought open; one with
        more after it (an end tag) does not, unless that too ends with the reasoning.
        """
        partial = Partial(reasoning=reasoning + "x")
        self.assertTrue(prefill_rendered(before + reasoning + "x", partial))
        closed = before + reasoning + "x" + after
        self.assertEqual(
            prefill_rendered(closed, partial), closed.endswith((reasoning + "x").strip("\n"))
        )


class ContinuedTests(SynchronousTestCase):
    """What of a continuation's stream is new."""

    def test_first_attempt(self) -> None:
        """Nothing delivered: every event passes."""
        guard = Continued(Partial())
        for event in (Reasoning("Let", None), Content("Hi", 0), Progress(1, 0, 1)):
            self.assertTrue(guard.passes(event))

    def test_echo_dropped(self) -> None:
        """
        b11434's echo of a prefill: the delivered reasoning (a newline more when the thought
        was closed) without a count, the content at count 0; then the new pieces.
        """
        guard = Continued(ANSWERED)
        stream = [
            Reasoning("Let me\n", None),
            Content("Hello from", 0),
            Content(" the", 1),
            Content(" tiny", 2),
        ]
        self.assertEqual([guard.passes(e) for e in stream], [False, False, True, True])
        done = guard.completion(completion("Hello from the tiny", "Let me\n"))
        self.assertEqual((done.reasoning_content, done.content), (None, " the tiny"))

    def test_thought_echo_dropped(self) -> None:
        """The echo of a cut thought, then the thought goes on."""
        guard = Continued(THINKING)
        stream = [Reasoning("Let me", 0), Reasoning(" think", 1), Reasoning(" about", 2)]
        self.assertEqual([guard.passes(e) for e in stream], [False, True, True])
        done = guard.completion(completion(None, "Let me think about"))
        self.assertEqual(done.reasoning_content, " think about")

    def test_generated_repeat_kept(self) -> None:
        """
        The same text generated again (a model that repeats itself, cut at a repeat's end)
        is new: it comes with a count.
        """
        guard = Continued(Partial(reasoning="Let me think about this... "))
        self.assertTrue(guard.passes(Reasoning("Let me think about this... ", 7)))
        self.assertTrue(guard.passes(Reasoning("Let me think about this... ", None)))
        done = guard.completion(completion(None, "Let me think about this... " * 2))
        self.assertEqual(done.reasoning_content, "Let me think about this... " * 2)

    def test_other_text_kept(self) -> None:
        """Text before any count that is not the delivered text passes; one echo per channel."""
        guard = Continued(ANSWERED)
        self.assertTrue(guard.passes(Content("Hello", None)))
        guard = Continued(ANSWERED)
        self.assertEqual(
            [guard.passes(Content("Hello from", 0)), guard.passes(Content("Hello from", 0))],
            [False, True],
        )

    def test_closed_thought(self) -> None:
        """After a closed thought, reasoning is a second thought: dropped; content passes."""
        guard = Continued(THINKING, thought_closed=True)
        stream = [Reasoning("Let", 1), Reasoning(" me", 2), Content("Hi", 3)]
        self.assertEqual([guard.passes(e) for e in stream], [False, False, True])
        done = guard.completion(completion("Hi", "Let me"))
        self.assertEqual((done.reasoning_content, done.content), (None, "Hi"))

    @given(st.lists(st.sampled_from(["Let", " me", " think", "...", " ", "\n"]), max_size=12))
    def test_never_repeats(self, pieces: list[str]) -> None:
        """
        Whatever a server echoes first, the delivered text plus what passes is the delivered
        text plus the generated pieces, and the completion agrees with the events.
        """
        prefix = Partial(reasoning="Let me think")
        guard = Continued(prefix)
        echo = Reasoning(prefix.reasoning, 0)
        stream = [echo, *(Reasoning(p, n) for n, p in enumerate(pieces, start=1))]
        passed = "".join(e.text for e in stream if guard.passes(e))
        self.assertEqual(passed, "".join(pieces))
        done = guard.completion(completion(None, "".join(e.text for e in stream)))
        self.assertEqual(done.reasoning_content or "", passed)


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
