# -*- test-case-name: loopd.test.test_llama_resume -*-
"""
Resuming an answer that failed after part of it reached the consumer: what was delivered,
whether it may be resumed, the request that continues it, what of that request's stream is
new, and the completion of the whole.

A retry that starts the answer again is invisible only while nothing of it was delivered;
after the first piece of reasoning or content a second run would repeat it. A llama-server
continues a final assistant message as a prefill: the continuation sends the conversation
again with the delivered part as the final assistant message, C{continue_final_message}
naming the part it continues (C{reasoning_content} while the answer was still thinking,
else C{content}), C{add_generation_prompt} false, and C{max_tokens} less what was generated
for it; the consumer sees the continuation's pieces after the ones it has.

A thought cut mid-way. Measured on llama.cpp b11434 with the thinking test model: the
server renders a reasoning-only prefill as an open thought (the prompt ends
C{<think>\nLet me think about this... Let me}) and the model thinks on, but when the
request left C{continue_final_message} implicit (a final assistant message alone) the
server's stream parser did not know it continued, and the first chunk of the stream held
the whole prefill again: C{reasoning_content} became C{"... Let me think about this... Let
meLet me think about this... Let me think..."} (and a cut answer C{"Hello fromHello from
the tiny model!"}, its reasoning repeated too). Named explicitly, the prefill is not sent
back, on b11434 and on the xllamacpp build the tests run.

What the continuation asks is decided from the prompt the server's template makes of it
(C{POST /apply-template}, L{resume_plan}): when the prompt ends with the delivered text, the
answer goes on from it (the thought is thought on, the content written on); when a cut
thought is not left open, the thought is closed instead (the reasoning rendered as a
finished thought and the model asked for the answer, C{continue_final_message} C{content}
with empty content), and any reasoning that continuation streams is dropped; when cut
content is not what the prompt ends with, there is no resume and the failure is the
answer's. Whatever the server does, L{Continued} keeps a continuation's echo of the prefill
(a piece before any token was generated that is the delivered text of its channel again)
from the consumer and from the completion.

Not resumed either, so the failure is the answer's: an endpoint of kind C{openai} (no
prefill promise), a tool call that had started (its arguments cannot be continued as text),
and an answer that had already used its C{max_tokens}.

Pure: a L{Delivered} watches the events one attempt after another; L{resume_refusal},
L{continuation}, L{resume_plan} and L{merge} are functions of its L{Partial}; a
L{Continued} filters one continuation's events.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from loopd.llama.types import (
    Assistant,
    ChatEvent,
    ChatRequest,
    Completion,
    Content,
    Logprobs,
    Reasoning,
    ThinkingCapped,
    Timings,
    ToolCallDelta,
)

__all__ = [
    "Continued",
    "Delivered",
    "Partial",
    "ResumePlan",
    "continuation",
    "merge",
    "prefill_rendered",
    "resume_plan",
    "resume_refusal",
]

ResumePlan = Literal["continue", "close", "refuse"]
"""
How a partial answer is resumed (L{resume_plan}): C{continue} it from the delivered text,
C{close} its cut thought and ask for the answer, or C{refuse} (the failure is the answer's).
"""


@dataclass(frozen=True)
class Partial:
    """
    The part of an answer that reached the consumer.

    @ivar reasoning: the thinking text delivered.
    @ivar content: the answer text delivered.
    @ivar tool_call: a piece of a tool call was delivered.
    @ivar generated: the tokens generated for what was delivered: the server's count at the
        last piece (C{generated} of L{Reasoning} and L{Content}), added up over the attempts
        that delivered; a piece without a count counts one token.
    @ivar reasoning_tokens: of those, the ones generated while the answer was still thinking
        (up to the last reasoning piece before any content).
    @ivar thinking_capped: the thinking cap fired in an attempt that delivered.
    @ivar logprobs: the C{logprobs} entries of what was delivered, in order.
    @ivar several_choices: a piece of a second choice (a request for C{n}) was delivered.
    """

    reasoning: str = ""
    content: str = ""
    tool_call: bool = False
    generated: int = 0
    reasoning_tokens: int = 0
    thinking_capped: bool = False
    logprobs: tuple[Any, ...] = ()
    several_choices: bool = False

    @property
    def empty(self) -> bool:
        """Nothing was delivered: a retry may start the answer again."""
        return not (self.reasoning or self.content or self.tool_call)

    @property
    def thinking(self) -> bool:
        """The answer was still in its reasoning: no content or tool call yet."""
        return not (self.content or self.tool_call)


class Delivered:
    """
    Watches the events of one answer, attempt after attempt, for what of it was delivered.

    Feed every event passed to the consumer to L{observe}; call L{next_attempt} before each
    attempt after the first. L{partial} is everything delivered so far; L{prefix} is what
    the current attempt continues (empty unless it is a continuation).
    """

    def __init__(self) -> None:
        """Nothing delivered, the first attempt running."""
        self._prefix = Partial()
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._tool_call = False
        self._pieces = 0
        self._reported = 0
        self._reasoning_tokens = 0
        self._capped = False
        self._logprobs: list[Any] = []
        self._several = False

    @property
    def prefix(self) -> Partial:
        """What the current attempt continues."""
        return self._prefix

    def observe(self, event: ChatEvent) -> None:
        """Note one event passed to the consumer; only the pieces of the answer count."""
        if isinstance(event, ThinkingCapped):
            self._capped = True
            return
        if isinstance(event, (Reasoning, Content, ToolCallDelta, Logprobs)):
            if event.choice != 0:
                self._several = True
                return
            self._logprobs.extend(event.entries if isinstance(event, Logprobs) else event.logprobs)
        if isinstance(event, ToolCallDelta):
            self._tool_call = True
            return
        if not isinstance(event, (Reasoning, Content)) or not event.text:
            return
        self._pieces += 1
        if event.generated is not None:
            self._reported = max(self._reported, event.generated)
        if isinstance(event, Reasoning):
            self._reasoning.append(event.text)
            if not self._content and not self._tool_call:
                self._reasoning_tokens = self._count()
        else:
            self._content.append(event.text)

    def _count(self) -> int:
        """The tokens of the current attempt's delivered pieces."""
        return max(self._reported, self._pieces)

    def partial(self) -> Partial:
        """Everything delivered so far, over every attempt."""
        prefix = self._prefix
        reasoning = "".join(self._reasoning)
        content = "".join(self._content)
        thinking_before = prefix.thinking
        return Partial(
            reasoning=prefix.reasoning + reasoning,
            content=prefix.content + content,
            tool_call=prefix.tool_call or self._tool_call,
            generated=prefix.generated + self._count(),
            reasoning_tokens=prefix.reasoning_tokens
            + (self._reasoning_tokens if thinking_before else 0),
            thinking_capped=prefix.thinking_capped or self._capped,
            logprobs=prefix.logprobs + tuple(self._logprobs),
            several_choices=prefix.several_choices or self._several,
        )

    def next_attempt(self) -> None:
        """Another attempt starts: it continues everything delivered so far."""
        self._prefix = self.partial()
        self._reasoning, self._content = [], []
        self._tool_call = self._capped = self._several = False
        self._logprobs = []
        self._pieces = self._reported = self._reasoning_tokens = 0


def resume_refusal(partial: Partial, kind: str, max_tokens: int) -> str | None:
    """
    Why the answer delivered as far as C{partial} cannot be resumed, or None when it can
    (or when nothing was delivered, so that a retry starts it again).

    @param kind: the endpoint's kind; only a C{llama-server} continues a prefill.
    @param max_tokens: the answer's limit on generated tokens.
    """
    if partial.empty and not partial.several_choices:
        return None
    if partial.several_choices:
        return "the answer has several choices (n)"
    if kind != "llama-server":
        return f"an endpoint of kind {kind} cannot continue a partial answer"
    if partial.tool_call:
        return "a tool call had started streaming"
    if partial.generated >= max_tokens:
        return f"the partial answer has used its max_tokens ({max_tokens})"
    return None


def continuation(
    request: ChatRequest, partial: Partial, max_tokens: int, *, close_thought: bool = False
) -> ChatRequest:
    """
    The request that continues C{request}'s answer after C{partial}: the same request with
    the delivered part as its final assistant message and C{max_tokens} less the tokens it
    took. C{request} itself when nothing was delivered.

    The final message is C{reasoning_content} alone (C{content} null) while the answer was
    still thinking, and C{continue_final_message} is C{reasoning_content}: the thought goes
    on. With content, or with C{close_thought} while thinking, it holds the reasoning (if
    any) and the content (empty when closing), and C{continue_final_message} is
    C{content}: the server renders the reasoning as a finished thought and the answer goes
    on after the content. C{add_generation_prompt} is false, as the server requires with
    C{continue_final_message}; both come after the request's own C{fields}.

    @param max_tokens: the answer's limit on generated tokens (see L{resume_refusal}, which
        must have allowed the resume).
    @param close_thought: end a cut thought instead of continuing it (L{resume_plan}).
    """
    if partial.empty:
        return request
    if partial.thinking and not close_thought:
        prefill = Assistant(content=None, reasoning_content=partial.reasoning)
        part = "reasoning_content"
    else:
        prefill = Assistant(content=partial.content, reasoning_content=partial.reasoning or None)
        part = "content"
    fields = {**request.fields, "continue_final_message": part, "add_generation_prompt": False}
    return replace(
        request,
        messages=(*request.messages, prefill),
        max_tokens=max_tokens - partial.generated,
        fields=fields,
    )


def prefill_rendered(prompt: str, partial: Partial) -> bool:
    """
    Whether C{prompt}, what the server's template made of the continuation after
    C{partial}, ends with the delivered text the continuation goes on from: the reasoning
    while the answer was still thinking (the thought left open, nothing after it), else the
    content. Newlines at either end of that text do not count (templates strip them).
    """
    text = partial.reasoning if partial.thinking else partial.content
    return prompt.endswith(text.strip("\n"))


def resume_plan(partial: Partial, prompt: str) -> ResumePlan:
    """
    How to resume the answer delivered as far as C{partial}, given the C{prompt} the
    server's template made of L{continuation}: C{continue} when the prompt ends with the
    delivered text (L{prefill_rendered}); C{close} when it does not and the answer was still
    thinking (a thought the template does not leave open is closed, and the answer asked
    for); C{refuse} when it does not and content had been delivered (what the model would
    write is not the rest of it).
    """
    if prefill_rendered(prompt, partial):
        return "continue"
    return "close" if partial.thinking else "refuse"


class Continued:
    """
    What of one continuation attempt's stream is new: not the server's echo of the prefill,
    and, after a closed thought, no reasoning.

    An echo is a piece of reasoning or content that arrives before any generated token
    (its C{generated} count is missing or 0) and is the delivered text of its channel
    again (newlines at either end aside); each channel echoes at most once. A thought
    closed by the continuation (L{resume_plan}'s C{close}) is over: reasoning the
    continuation streams would be a second thought spliced onto the first, and is dropped.
    L{passes} says which events reach the consumer; L{completion} takes the same out of the
    attempt's completion.
    """

    def __init__(self, prefix: Partial, thought_closed: bool = False) -> None:
        """
        @param prefix: what the attempt continues (empty: a first attempt, all passes).
        @param thought_closed: the continuation closed the cut thought.
        """
        self._delivered = {Reasoning: prefix.reasoning, Content: prefix.content}
        self._closed = thought_closed
        self._generating = False
        self._echoed: dict[type, str] = {}

    def passes(self, event: ChatEvent) -> bool:
        """Whether C{event} is new: anything but an echo, or closed-thought reasoning."""
        if not isinstance(event, (Reasoning, Content)) or event.choice != 0:
            return True
        if self._closed and isinstance(event, Reasoning):
            return False
        kind = type(event)
        delivered = self._delivered[kind]
        early = not self._generating and not event.generated
        if event.generated:
            self._generating = True
        if early and delivered and kind not in self._echoed:
            if event.text.strip("\n") == delivered.strip("\n"):
                self._echoed[kind] = event.text
                return False
        return True

    def completion(self, completion: Completion) -> Completion:
        """C{completion} without what L{passes} kept from the consumer."""
        reasoning = completion.reasoning_content
        if self._closed:
            reasoning = None
        elif reasoning is not None:
            reasoning = reasoning.removeprefix(self._echoed.get(Reasoning, "")) or None
        content = completion.content
        if content is not None:
            content = content.removeprefix(self._echoed.get(Content, "")) or None
        return replace(completion, reasoning_content=reasoning, content=content)


def merge(prefix: Partial, completion: Completion) -> Completion:
    """
    The completion of the whole answer: C{prefix}, what earlier attempts delivered, then
    C{completion}, the continuation's. C{completion} itself when C{prefix} is empty.

    The texts are joined; the tool calls, the finish reason and the id are the
    continuation's. The counts are those of one uninterrupted answer: C{predicted_n} is the
    tokens of both parts, and the prompt counts are the continuation's less the partial
    answer it was given back (that is answer, not prompt; it is taken from the evaluated
    tokens first, as it ends the prompt), so that the total is still the context the turn
    left in the slot. The reasoning tokens add up while the prefix was still thinking; the
    C{logprobs} entries are the prefix's, then the continuation's.
    """
    if prefix.empty:
        return completion
    timings = completion.timings
    back = prefix.generated
    from_prompt = min(back, timings.prompt_n)
    merged = Timings(
        cache_n=max(timings.cache_n - (back - from_prompt), 0),
        prompt_n=timings.prompt_n - from_prompt,
        predicted_n=back + timings.predicted_n,
        predicted_per_second=timings.predicted_per_second,
        prompt_per_second=timings.prompt_per_second,
    )
    reasoning_tokens = prefix.reasoning_tokens
    if prefix.thinking:
        reasoning_tokens += completion.reasoning_tokens
    return replace(
        completion,
        content=(prefix.content + (completion.content or "")) or None,
        reasoning_content=(prefix.reasoning + (completion.reasoning_content or "")) or None,
        timings=merged,
        reasoning_tokens=reasoning_tokens,
        thinking_capped=prefix.thinking_capped or completion.thinking_capped,
        logprobs=_joined(prefix.logprobs, completion.logprobs),
    )


def _joined(prefix: tuple[Any, ...], entries: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """The logprobs entries of the whole answer; None when neither part had any."""
    if not prefix:
        return entries
    return prefix + (entries or ())
