# -*- test-case-name: loopd.test.test_fake_llama -*-
"""
What llama-server answers on its routes, as L{Reply} scripts for
L{loopd.testing.fake_llama.FakeLlama}: a chat stream's chunks (L{chunk}) and a whole streamed
answer (L{answer}), C{/slots} (L{slots_reply}), C{/props} (L{props_reply}), the
reasoning-end control (L{control_reply}) and C{/apply-template} (L{template_reply}), in the
shapes of reference/llama-server-api.md.

Part of loopd's public test kit (L{loopd.testing})::

    fake.script("POST", CHAT, answer({"content": "Hello"}))
    fake.set_default("GET", SLOTS, slots_reply([True, False]))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from loopd.testing.fake_llama import FakeLlama, RecordedRequest, Reply, json_reply, sse_reply

__all__ = [
    "TIMINGS",
    "answer",
    "chunk",
    "control_reply",
    "props_reply",
    "slots_reply",
    "template_reply",
]


def slots_reply(
    busy: bool | Sequence[bool] = False,
    *,
    n_ctx: int = 4096,
    counters: tuple[int, int, int] = (60, 3, 1),
) -> Reply:
    """
    A C{GET /slots} answer, one slot per entry of C{busy} (a bool is one slot). An idle slot
    has the shape of one that never ran a task; a busy one has a task, params and a
    one-element C{next_token} list, as the real server gives.

    @param counters: a busy slot's C{n_prompt_tokens}, C{n_prompt_tokens_processed} and
        C{next_token[0].n_decoded}, the numbers that move as the server works.
    """
    n_prompt_tokens, processed, decoded = counters
    slots: list[dict[str, Any]] = []
    for number, is_busy in enumerate([busy] if isinstance(busy, bool) else busy):
        slot: dict[str, Any] = {"id": number, "n_ctx": n_ctx, "speculative": False}
        slot["is_processing"] = is_busy
        if is_busy:
            slot.update(id_task=100 + number, n_prompt_tokens=n_prompt_tokens)
            slot.update(n_prompt_tokens_processed=processed, n_prompt_tokens_cache=22)
            slot["params"] = {"n_predict": -1, "stream": True}
            slot["next_token"] = [
                {
                    "has_next_token": True,
                    "has_new_line": False,
                    "n_remain": -1,
                    "n_decoded": decoded,
                }
            ]
        slots.append(slot)
    return json_reply(200, slots)


def props_reply(
    *, total_slots: int = 1, n_ctx: int = 4096, chat_template: str = "{{ x }}", **extra: Any
) -> Reply:
    """A C{GET /props} answer with the fields loopd reads, and C{extra} at the top level."""
    props = {
        "default_generation_settings": {"params": {"n_predict": -1}, "n_ctx": n_ctx},
        "total_slots": total_slots,
        "model_alias": "tiny",
        "chat_template": chat_template,
        "build_info": "b0-fake",
        **extra,
    }
    return json_reply(200, props)


def control_reply(success: bool = True, message: str | None = None) -> Reply:
    """A control answer: C{{"success": true}}, or C{false} with a message (default: no such id)."""
    if success:
        return json_reply(200, {"success": True})
    message = message or "no active completion for this id"
    return json_reply(200, {"success": False, "message": message})


#: Upstream timings of a finished answer: 13 prompt tokens (3 from the cache), 2 generated,
#: 50 tokens per second (what the C{auto} router measures).
TIMINGS: Mapping[str, Any] = {
    "cache_n": 3,
    "prompt_n": 10,
    "predicted_n": 2,
    "predicted_per_second": 50.0,
}


def chunk(
    delta: Mapping[str, Any] | None = None,
    finish: str | None = None,
    *,
    timings: Mapping[str, Any] | None = None,
    progress: tuple[int, int, int] | None = None,
) -> dict[str, Any]:
    """
    One upstream C{chat.completion.chunk} as llama-server sends it (model C{tiny}).

    @param delta: the choice's C{delta}, e.g. C{{"content": "Hi"}}.
    @param finish: the C{finish_reason}, on the last chunk only.
    @param timings: llama-server's C{timings}, on the last chunk only.
    @param progress: C{(total, cache, processed)} of a C{prompt_progress}.
    """
    choice = {"finish_reason": finish, "index": 0, "delta": dict(delta or {})}
    sent: dict[str, Any] = {"choices": [choice], "created": 1, "id": "chatcmpl-upstream"}
    sent.update(model="tiny", object="chat.completion.chunk")
    if timings is not None:
        sent["timings"] = dict(timings)
    if progress is not None:
        total, cache, processed = progress
        sent["prompt_progress"] = {"total": total, "cache": cache, "processed": processed}
    return sent


def answer(
    *deltas: Mapping[str, Any],
    finish: str = "stop",
    timings: Mapping[str, Any] = TIMINGS,
    delay_s: float = 0.05,
) -> Reply:
    """
    A whole streamed chat answer: one L{chunk} per delta, then the finish chunk with
    C{timings}, each C{delay_s} after the one before, then C{[DONE]}. For example
    C{fake.script("POST", CHAT, answer({"content": "Hello"}))}.
    """
    events = [chunk(delta) for delta in deltas]
    return sse_reply([*events, chunk({}, finish, timings=timings)], delay_s=delay_s)


def template_reply(*, open_thought: bool = True) -> Callable[[RecordedRequest, FakeLlama], Reply]:
    """
    A C{POST /apply-template} answer, for L{FakeLlama.set_default}: the request's messages
    rendered in the Qwen3 format of the tiny model's template (C{<think>} blocks), its
    final assistant message continued as llama-server continues it when the body names
    C{continue_final_message}: C{reasoning_content} leaves the thought open (the prompt
    ends with the reasoning), C{content} closes it and ends with the content.

    @param open_thought: False: a template that never leaves a thought open (it closes
        the reasoning of a C{reasoning_content} continuation as well).
    """

    def render(request: RecordedRequest, fake: FakeLlama) -> Reply:
        body = request.json
        messages = list(body["messages"])
        part = body.get("continue_final_message")
        last = messages.pop() if part and messages[-1]["role"] == "assistant" else None
        prompt = "".join(
            f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages
        )
        prompt += "<|im_start|>assistant\n"
        if last is not None:
            prompt += "<think>\n" + (last.get("reasoning_content") or "").strip("\n")
            if part == "content" or not open_thought:
                prompt += "\n</think>\n\n" + (last.get("content") or "")
        return json_reply(200, {"prompt": prompt})

    return render
