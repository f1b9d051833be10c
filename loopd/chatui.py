# -*- test-case-name: loopd.test.test_chatui -*-
"""
The pure parts of C{loopd chat}: the conversation it keeps, and how one streamed answer
becomes terminal text.

L{Conversation} holds the messages of a multi-turn chat and builds each request body.
L{TurnView} turns what the gateway streams for one turn (C{chat.completion.chunk} data
events, C{: loopd {...}} comments, an error event, C{[DONE]}) into text to write: the
answer as it arrives, the thinking in a block of its own (dimmed on a terminal), and one
status line, rewritten in place with C{\\r}, for the queue position, a busy slot and the
prompt-processing progress bar, and a line for each step of a C{mesh} turn (its C{mesh_*}
events: a worker done or failed, the decision, the reducer). A quiet view (piped input)
writes the answer alone: no status line, no progress, no thinking, no ANSI codes. No I/O:
the caller writes what the methods return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loopd import strict_json
from loopd.sse import SSEComment, SSEEvent, SSEItem

__all__ = [
    "DIM",
    "QUIT",
    "RESET",
    "Conversation",
    "TurnView",
    "http_error_text",
    "mesh_text",
    "one_line",
    "progress_bar",
]

#: ANSI: start dim (faint) text, and back to normal.
DIM = "\x1b[2m"
RESET = "\x1b[0m"
#: The command that ends the chat.
QUIT = "/quit"
#: Cells of the progress bar.
BAR_WIDTH = 24
#: The prefix of loopd's own SSE comments (after the colon and its space).
LOOPD_COMMENT = "loopd "
#: The prefix of the events of a C{mesh} turn.
MESH_EVENT = "mesh_"


def one_line(text: str) -> str:
    """C{text} with every run of whitespace (newlines included) made one space."""
    return " ".join(text.split())


def mesh_text(name: str, event: dict[str, Any]) -> str:
    """
    The one line that shows a step of a C{mesh} turn: the event C{name} (C{mesh_worker},
    C{mesh_decision}, C{mesh_reducer}, C{mesh_reducer_failed}, C{mesh_loop_guard}) with
    its fields; an event of another name shows its name and fields as they are.
    """

    def field(key: str) -> str:
        """A field as one line of text, empty when absent."""
        value = event.get(key)
        return "" if value is None else one_line(str(value))

    if name == "mesh_worker":
        who = f"{field('worker')} ({field('role')})"
        seconds = _count(event.get("elapsed_ms")) / 1000
        if event.get("ok") is True:
            return f"[mesh] {who} answered in {seconds:.1f} s ({field('kind')})"
        return f"[mesh] {who} failed after {seconds:.1f} s: {field('error') or 'no answer'}"
    if name == "mesh_decision":
        return f"[mesh] decision: {field('decision')} ({field('reason')})"
    if name == "mesh_reducer":
        return f"[mesh] reducer {field('model')} started (attempt {field('attempt')})"
    if name == "mesh_reducer_failed":
        return f"[mesh] reducer {field('model')} failed: {field('error')}"
    if name == "mesh_loop_guard":
        return f"[mesh] loop guard: {field('tool')} called {field('count')} times"
    rest = ", ".join(f"{k} {field(k)}" for k in event if k != "event")
    return f"[mesh] {name[len(MESH_EVENT) :]}" + (f": {rest}" if rest else "")


def progress_bar(processed: int, total: int, cache: int, width: int = BAR_WIDTH) -> str:
    """
    The prompt-processing status: a bar of C{processed} of C{total} tokens, the
    percentage, the counts, and how many came from the cache.
    """
    fraction = min(max(processed / total, 0.0), 1.0) if total > 0 else 1.0
    filled = int(fraction * width)
    bar = "#" * filled + "-" * (width - filled)
    return f"prompt [{bar}] {int(fraction * 100):3d}% {processed}/{total} tokens ({cache} cached)"


def http_error_text(status: int, body: bytes) -> str:
    """
    The one-line text of an error answered before the stream: the status, and the
    message and code of an OpenAI error body when there is one, else the body itself.
    """
    try:
        error = strict_json.decode(body).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        code = error.get("code")
        suffix = f" ({code})" if isinstance(code, str) and code else ""
        return one_line(f"HTTP {status}: {error['message']}{suffix}")
    text = body.decode("utf-8", "replace").strip()
    return one_line(f"HTTP {status}: {text}" if text else f"HTTP {status}")


@dataclass
class Conversation:
    """
    The messages of one chat, in OpenAI form, and the request body of the next turn.

    A turn is L{ask}ed, then either L{answered} (the assistant's message joins the
    history) or L{retract}ed (it failed: the question leaves the history again, so the
    next request repeats nothing that went wrong).
    """

    model: str | None = None
    thinking: bool = True
    messages: list[dict[str, Any]] = field(default_factory=list)

    def ask(self, text: str) -> dict[str, Any]:
        """Add the user's C{text} and return the streaming request body of this turn."""
        self.messages.append({"role": "user", "content": text})
        return self.request_body()

    def request_body(self) -> dict[str, Any]:
        """The body of a streaming chat completion request for the history so far."""
        body: dict[str, Any] = {"messages": list(self.messages), "stream": True}
        if self.model:
            body["model"] = self.model
        if not self.thinking:
            body["chat_template_kwargs"] = {"enable_thinking": False}
        return body

    def answered(self, content: str, reasoning: str = "") -> None:
        """Add the assistant's answer (its thinking kept too, as the server sent it)."""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        self.messages.append(message)

    def retract(self) -> None:
        """Take back the unanswered question of a failed turn."""
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()


@dataclass
class TurnView:
    """
    One streamed answer, as text for a terminal. Each method returns the text to write
    now (possibly empty) and records what the turn said.

    @ivar tty: the output is a terminal: thinking is dimmed with ANSI codes; otherwise it
        is marked with a C{thinking: } label.
    @ivar quiet: write the answer alone (its text, tool calls, and an error if it fails):
        no status line, progress, C{mesh} steps, notes or thinking, and never an ANSI code;
        for piped input, whose output is read by a program.
    @ivar content: the answer so far.
    @ivar reasoning: the thinking so far.
    @ivar error: the one-line reason the turn failed, or None.
    @ivar finish_reason: the finish reason once a chunk carried one.
    @ivar done: C{[DONE]} arrived.
    """

    tty: bool = False
    quiet: bool = False
    content: str = ""
    reasoning: str = ""
    error: str | None = None
    finish_reason: str | None = None
    done: bool = False
    # "idle" at the start of a line, or "status", "thinking", "answer", "tool".
    _mode: str = field(default="idle", init=False, repr=False)
    _status_len: int = field(default=0, init=False, repr=False)

    @property
    def succeeded(self) -> bool:
        """The answer ended with a finish reason and C{[DONE]}, without an error."""
        return self.error is None and self.done and self.finish_reason is not None

    def item(self, item: SSEItem) -> str:
        """The text for one decoded SSE item (a data event or a comment)."""
        if isinstance(item, SSEComment):
            return self.comment(item.text)
        assert isinstance(item, SSEEvent)
        if item.done:
            self.done = True
            return ""
        try:
            payload = strict_json.decode(item.data)
        except ValueError:
            return self.fail(f"the stream sent data that is not JSON: {item.data[:80]!r}")
        if not isinstance(payload, dict):
            return self.fail("the stream sent data that is not a JSON object")
        return self.chunk(payload)

    def comment(self, text: str) -> str:
        """The text for one SSE comment: loopd's events; other comments show nothing."""
        if not text.startswith(LOOPD_COMMENT):
            return ""
        try:
            event = strict_json.decode(text[len(LOOPD_COMMENT) :])
        except ValueError:
            return ""
        if not isinstance(event, dict):
            return ""
        return self.event(event)

    def event(self, event: dict[str, Any]) -> str:
        """The text for one of loopd's own events (the JSON of a C{: loopd} comment)."""
        name = event.get("event")
        if name == "queued":
            ahead = _count(event.get("ahead"))
            return self._status(f"queued: position {ahead + 1} ({ahead} ahead)")
        if name == "waiting":
            why = "the server is loading" if event.get("loading") else "the slot is busy"
            return self._status(f"waiting: {why}")
        if name == "progress":
            total = _count(event.get("total"))
            bar = progress_bar(_count(event.get("processed")), total, _count(event.get("cache")))
            return self._status(bar)
        if name == "thinking_capped":
            return self._note(f"[thinking capped after {_count(event.get('tokens'))} tokens]")
        if isinstance(name, str) and name.startswith(MESH_EVENT):
            return self._note(mesh_text(name, event))
        if name == "retrying":
            # A retry starts the answer again, so what came so far no longer counts.
            self.content = self.reasoning = ""
            seconds = _count(event.get("after_ms")) / 1000
            error = one_line(str(event.get("error", "")))
            attempt = _count(event.get("attempt"))
            return self._note(f"[attempt {attempt} failed ({error}); retrying in {seconds:g} s]")
        return ""

    def chunk(self, payload: dict[str, Any]) -> str:
        """The text for one data event: a chunk's deltas, or an error event."""
        error = payload.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else None
            return self.fail(str(message if message is not None else error))
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return ""
        choice = choices[0]
        delta = choice.get("delta")
        out = self._delta(delta) if isinstance(delta, dict) else ""
        reason = choice.get("finish_reason")
        if isinstance(reason, str):
            self.finish_reason = reason
            if reason == "length":
                out += self._note("[the answer reached max_tokens]")
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        """
        The text for one delta, and the answer so far updated: reasoning pieces (dimmed on a
        terminal) and content pieces are kept in C{reasoning} and C{content}; a tool call's
        name opens a line of its own, followed by its argument pieces, which are only shown.
        """
        out = ""
        reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            self.reasoning += reasoning
            if not self.quiet:
                out += self._enter("thinking") + reasoning
        content = delta.get("content")
        if isinstance(content, str) and content:
            self.content += content
            out += self._enter("answer") + content
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            name = function.get("name")
            if isinstance(name, str) and name:
                out += self._end_line() + f"[tool call {name}] "
                self._mode = "tool"
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments:
                out += self._enter("tool") + arguments
        return out

    def fail(self, reason: str) -> str:
        """Record that the turn failed; the text is one C{error:} line."""
        if self.error is not None:
            return ""
        self.error = one_line(reason) or "unknown error"
        return self._end_line() + f"error: {self.error}\n"

    def close(self) -> str:
        """
        The text that ends the turn's output at the start of a fresh line. A stream that
        ended without its finish and C{[DONE]} (and without an error) fails here.
        """
        if self.error is None and not self.succeeded:
            return self.fail("the stream ended before the answer was complete")
        return self._end_line()

    # -- layout ----------------------------------------------------------------------

    def _enter(self, mode: str) -> str:
        """Switch to a block of C{mode} text; the text that opens it."""
        if self._mode == mode:
            return ""
        out = self._end_line()
        self._mode = mode
        if mode == "thinking":
            out += DIM if self.tty and not self.quiet else "thinking: "
        return out

    def _end_line(self) -> str:
        """End whatever is open (dim text, a status line, a partial line)."""
        mode, self._mode = self._mode, "idle"
        self._status_len = 0
        if mode == "idle":
            return ""
        if mode == "thinking" and self.tty and not self.quiet:
            return RESET + "\n"
        return "\n"

    def _status(self, text: str) -> str:
        """
        Rewrite the status line with C{text}, blanking what a longer one left; nothing when
        quiet.
        """
        if self.quiet:
            return ""
        out = "" if self._mode == "status" else self._end_line()
        pad = max(self._status_len - len(text), 0)
        self._mode = "status"
        self._status_len = len(text)
        return out + "\r" + text + " " * pad

    def _note(self, text: str) -> str:
        """A line of its own; nothing when quiet."""
        if self.quiet:
            return ""
        return self._end_line() + text + "\n"


def _count(value: object) -> int:
    """A JSON integer of an event, 0 when absent or not an integer."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return 0
