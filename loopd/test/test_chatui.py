"""
Tests for L{loopd.chatui}: the chat history and how a streamed answer becomes terminal text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.chatui import (
    BAR_WIDTH,
    DIM,
    RESET,
    Conversation,
    TurnView,
    http_error_text,
    mesh_text,
    one_line,
    progress_bar,
)
from loopd.sse import SSEDecoder

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: Text a model may send, escape codes aside.
TEXT = st.characters(blacklist_categories=["Cs"], blacklist_characters="\x1b")


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    """A gateway chunk with C{delta} and C{finish}."""
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {"object": "chat.completion.chunk", "choices": [choice]}


def loopd(event: str, **fields: Any) -> str:
    """The text of a C{: loopd {...}} comment (after the colon and space)."""
    return "loopd " + json.dumps({"event": event, **fields})


def render(view: TurnView, stream: bytes) -> str:
    """Feed a whole SSE body through a decoder into C{view}; return all the text."""
    decoder = SSEDecoder()
    out = "".join(view.item(item) for item in decoder.feed(stream))
    return out + "".join(view.item(item) for item in decoder.finish()) + view.close()


def sse(*items: dict[str, Any] | str) -> bytes:
    """An SSE body: dicts as data events, strings as comments, then C{[DONE]}."""
    parts = []
    for item in items:
        if isinstance(item, str):
            parts.append(f": {item}\n\n")
        else:
            parts.append(f"data: {json.dumps(item)}\n\n")
    return ("".join(parts) + "data: [DONE]\n\n").encode()


class ConversationTests(SynchronousTestCase):
    """
    L{Conversation} keeps the history and builds each request body.
    """

    def test_first_body(self) -> None:
        """The first turn's body is the user's message, streamed, without a model."""
        body = Conversation().ask("Hi")
        self.assertEqual(body, {"messages": [{"role": "user", "content": "Hi"}], "stream": True})

    def test_model_and_no_think(self) -> None:
        """A model is named, and no-think asks the template not to think."""
        body = Conversation(model="tiny", thinking=False).ask("Hi")
        self.assertEqual(body["model"], "tiny")
        self.assertEqual(body["chat_template_kwargs"], {"enable_thinking": False})

    def test_two_turns(self) -> None:
        """The second turn carries the first question, its answer and thinking, in order."""
        chat = Conversation()
        chat.ask("One")
        chat.answered("First.", "hmm")
        body = chat.ask("Two")
        self.assertEqual(
            body["messages"],
            [
                {"role": "user", "content": "One"},
                {"role": "assistant", "content": "First.", "reasoning_content": "hmm"},
                {"role": "user", "content": "Two"},
            ],
        )

    def test_retract(self) -> None:
        """A failed turn's question leaves the history; the earlier turns stay."""
        chat = Conversation()
        chat.ask("One")
        chat.answered("First.")
        chat.ask("Two")
        chat.retract()
        self.assertEqual([m["role"] for m in chat.messages], ["user", "assistant"])
        chat.retract()
        self.assertEqual(len(chat.messages), 2, "retract takes back only a user message")

    def test_body_is_a_copy(self) -> None:
        """A body already sent does not change when the history grows."""
        chat = Conversation()
        body = chat.ask("One")
        chat.answered("First.")
        self.assertEqual(len(body["messages"]), 1)


class ProgressBarTests(SynchronousTestCase):
    """
    L{progress_bar} draws the prompt's progress.
    """

    def test_half(self) -> None:
        """Half the tokens fill half the bar, with the counts and the cache."""
        half = BAR_WIDTH // 2
        self.assertEqual(
            progress_bar(748, 1496, 236),
            f"prompt [{'#' * half}{'-' * half}]  50% 748/1496 tokens (236 cached)",
        )

    def test_ends(self) -> None:
        """Nothing processed is an empty bar, everything a full one; no total is full."""
        self.assertIn(f"[{'-' * BAR_WIDTH}]   0%", progress_bar(0, 10, 0))
        self.assertIn(f"[{'#' * BAR_WIDTH}] 100%", progress_bar(10, 10, 0))
        self.assertIn("100%", progress_bar(0, 0, 0))

    @given(st.integers(-5, 10_000), st.integers(-5, 10_000), st.integers(0, 10_000))
    def test_always_one_bar(self, processed: int, total: int, cache: int) -> None:
        """Any counts give one line with a bar of exactly the width and 0 to 100 percent."""
        text = progress_bar(processed, total, cache)
        bar = re.search(r"\[([#-]*)\]\s+(\d+)%", text)
        assert bar is not None
        self.assertEqual(len(bar.group(1)), BAR_WIDTH)
        self.assertTrue(0 <= int(bar.group(2)) <= 100)
        self.assertNotIn("\n", text)


class HttpErrorTextTests(SynchronousTestCase):
    """
    L{http_error_text} makes one line of an error answered before the stream.
    """

    def test_openai_error(self) -> None:
        """An OpenAI error body gives its message and code."""
        body = json.dumps({"error": {"message": "no endpoint serves\nmodel 'x'", "code": "nf"}})
        self.assertEqual(
            http_error_text(404, body.encode()), "HTTP 404: no endpoint serves model 'x' (nf)"
        )

    def test_other_bodies(self) -> None:
        """Another body is shown as text on one line; an empty one as the status alone."""
        self.assertEqual(http_error_text(502, b"bad\ngateway"), "HTTP 502: bad gateway")
        self.assertEqual(http_error_text(500, b""), "HTTP 500")

    def test_one_line(self) -> None:
        """Runs of whitespace, newlines included, become one space."""
        self.assertEqual(one_line("  a\n\tb  c "), "a b c")


class TurnViewTests(SynchronousTestCase):
    """
    L{TurnView} renders one streamed answer.
    """

    def test_answer(self) -> None:
        """Content pieces are written as they come and the turn succeeds."""
        view = TurnView()
        out = render(view, sse(chunk({"content": "Hello"}), chunk({"content": "!"}, "stop")))
        self.assertEqual(out, "Hello!\n")
        self.assertTrue(view.succeeded)
        self.assertEqual(view.content, "Hello!")

    def test_thinking_dimmed_on_a_tty(self) -> None:
        """On a terminal the thinking is one dim block, then the answer on its own line."""
        view = TurnView(tty=True)
        stream = sse(
            chunk({"reasoning_content": "Let me"}),
            chunk({"reasoning_content": " think"}),
            chunk({"content": "Hi"}, "stop"),
        )
        self.assertEqual(render(view, stream), f"{DIM}Let me think{RESET}\nHi\n")
        self.assertEqual(view.reasoning, "Let me think")

    def test_thinking_labelled_without_a_tty(self) -> None:
        """Without a terminal there is no escape code: the thinking has a label instead."""
        view = TurnView(tty=False)
        stream = sse(chunk({"reasoning_content": "hmm"}), chunk({"content": "Hi"}, "stop"))
        self.assertEqual(render(view, stream), "thinking: hmm\nHi\n")

    def test_progress_line(self) -> None:
        """Progress rewrites one status line with CR; the answer starts on the next line."""
        view = TurnView()
        stream = sse(
            loopd("progress", total=100, cache=0, processed=50),
            loopd("progress", total=100, cache=0, processed=100),
            chunk({"content": "Hi"}, "stop"),
        )
        out = render(view, stream)
        self.assertEqual(out, f"\r{progress_bar(50, 100, 0)}\r{progress_bar(100, 100, 0)}\nHi\n")

    def test_status_padding(self) -> None:
        """A shorter status line blanks what the longer one before it left."""
        view = TurnView()
        first = view.comment(loopd("waiting", slot_busy=True, loading=True))
        second = view.comment(loopd("queued", ahead=0))
        self.assertEqual(first, "\rwaiting: the server is loading")
        text = "queued: position 1 (0 ahead)"
        self.assertEqual(second, "\r" + text + " " * (len(first) - 1 - len(text)))

    def test_queue_position(self) -> None:
        """A queued event shows the position in the queue."""
        out = TurnView().comment(loopd("queued", ahead=2))
        self.assertEqual(out, "\rqueued: position 3 (2 ahead)")

    def test_busy_slot(self) -> None:
        """A waiting event on a busy slot says so."""
        out = TurnView().comment(loopd("waiting", slot_busy=True, loading=False))
        self.assertEqual(out, "\rwaiting: the slot is busy")

    def test_thinking_capped(self) -> None:
        """A capped thinking closes the dim block and says so on a line of its own."""
        view = TurnView(tty=True)
        view.chunk(chunk({"reasoning_content": "x"}))
        out = view.comment(loopd("thinking_capped", tokens=4096))
        self.assertEqual(out, f"{RESET}\n[thinking capped after 4096 tokens]\n")

    def test_retrying_starts_over(self) -> None:
        """A retry note is one line, and the answer collected so far is dropped."""
        view = TurnView()
        view.chunk(chunk({"content": "partial"}))
        event = loopd("retrying", attempt=1, after_ms=2000, error="Stalled:\nsilence")
        out = view.comment(event)
        self.assertEqual(out, "\n[attempt 1 failed (Stalled: silence); retrying in 2 s]\n")
        self.assertEqual(view.content, "")

    def test_other_comments_ignored(self) -> None:
        """Pings and comments that are not loopd's show nothing."""
        view = TurnView()
        self.assertEqual(view.comment(""), "")
        self.assertEqual(view.comment("loopd not json"), "")
        self.assertEqual(view.comment("loopd " + json.dumps({"event": "unknown"})), "")

    def test_error_event(self) -> None:
        """An error event after the stream started is one error line and fails the turn."""
        view = TurnView()
        error = {"error": {"message": "upstream\ngone", "code": "x"}}
        stream = (
            f"data: {json.dumps(chunk({'content': 'Hel'}))}\n\ndata: {json.dumps(error)}\n\n"
        ).encode()
        self.assertEqual(render(view, stream), "Hel\nerror: upstream gone\n")
        self.assertEqual(view.error, "upstream gone")
        self.assertFalse(view.succeeded)

    def test_cut_stream(self) -> None:
        """A stream that ends without finish and [DONE] fails at close, on one line."""
        view = TurnView()
        out = render(view, f"data: {json.dumps(chunk({'content': 'Hel'}))}\n\n".encode())
        self.assertEqual(out, "Hel\nerror: the stream ended before the answer was complete\n")
        self.assertFalse(view.succeeded)

    def test_not_json(self) -> None:
        """Data that is not a JSON object fails the turn."""
        view = TurnView()
        self.assertIn("not JSON", view.item(SSEDecoder().feed(b"data: {nope\n\n")[0]))
        other = TurnView()
        self.assertIn("not a JSON object", other.item(SSEDecoder().feed(b"data: [1]\n\n")[0]))

    def test_only_first_error(self) -> None:
        """A second failure writes nothing and keeps the first reason."""
        view = TurnView()
        view.fail("first")
        self.assertEqual(view.fail("second"), "")
        self.assertEqual(view.error, "first")

    def test_tool_call(self) -> None:
        """A tool call shows its name and its arguments as they stream."""
        call = {"index": 0, "id": "c1", "function": {"name": "get_weather", "arguments": "{"}}
        more = {"index": 0, "function": {"arguments": "}"}}
        view = TurnView()
        stream = sse(chunk({"tool_calls": [call]}), chunk({"tool_calls": [more]}, "tool_calls"))
        self.assertEqual(render(view, stream), "[tool call get_weather] {}\n")
        self.assertTrue(view.succeeded)

    def test_length_note(self) -> None:
        """An answer cut by max_tokens says so."""
        view = TurnView()
        out = render(view, sse(chunk({"content": "a"}), chunk({}, "length")))
        self.assertEqual(out, "a\n[the answer reached max_tokens]\n")

    def test_chunks_without_choices(self) -> None:
        """A usage chunk (no choices) and an empty delta show nothing."""
        view = TurnView()
        self.assertEqual(view.chunk({"choices": [], "usage": {}}), "")
        self.assertEqual(view.chunk(chunk({"role": "assistant", "content": ""})), "")

    @given(
        st.lists(st.text(TEXT, min_size=1, max_size=8), max_size=5),
        st.lists(st.text(TEXT, min_size=1, max_size=8), max_size=5),
        st.booleans(),
        st.integers(1, 40),
    )
    def test_any_stream(self, thoughts: list[str], answers: list[str], tty: bool, cut: int) -> None:
        """Any split of any stream: exact text collected, escapes only on a tty, a line ended."""
        events: list[dict[str, Any] | str] = [loopd("progress", total=9, cache=0, processed=9)]
        events += [chunk({"reasoning_content": t}) for t in thoughts]
        events += [chunk({"content": a}) for a in answers]
        events.append(chunk({}, "stop"))
        stream = sse(*events)
        view = TurnView(tty=tty)
        decoder = SSEDecoder()
        out = ""
        for start in range(0, len(stream), cut):
            out += "".join(view.item(i) for i in decoder.feed(stream[start : start + cut]))
        out += view.close()
        self.assertTrue(view.succeeded)
        self.assertEqual(view.reasoning, "".join(thoughts))
        self.assertEqual(view.content, "".join(answers))
        self.assertEqual("\x1b" in out, tty and bool(thoughts))
        self.assertTrue(out.endswith("\n"))
        self.assertIn("".join(answers), _ANSI.sub("", out))


class MeshProgressTests(SynchronousTestCase):
    """A C{mesh} turn's steps (its C{mesh_*} events) each show as a line of their own."""

    def test_steps(self) -> None:
        """Workers, the decision, the reducer and the loop guard each say what happened."""
        view = TurnView()
        shown = [
            view.event(
                {
                    "event": "mesh_worker",
                    "worker": "a",
                    "role": "fast",
                    "ok": True,
                    "kind": "text",
                    "elapsed_ms": 1250,
                }
            ),
            view.event(
                {
                    "event": "mesh_worker",
                    "worker": "b",
                    "role": "strong",
                    "ok": False,
                    "kind": "failed",
                    "elapsed_ms": 300,
                    "error": "HTTP 503",
                }
            ),
            view.event({"event": "mesh_decision", "decision": "reduce", "reason": "disagree"}),
            view.event({"event": "mesh_reducer", "model": "a", "attempt": 1}),
            view.event({"event": "mesh_reducer_failed", "model": "a", "error": "timeout"}),
            view.event({"event": "mesh_loop_guard", "tool": "ls", "count": 3}),
            view.event({"event": "mesh_new_thing", "x": 1}),
        ]
        self.assertEqual(
            shown,
            [
                "[mesh] a (fast) answered in 1.2 s (text)\n",
                "[mesh] b (strong) failed after 0.3 s: HTTP 503\n",
                "[mesh] decision: reduce (disagree)\n",
                "[mesh] reducer a started (attempt 1)\n",
                "[mesh] reducer a failed: timeout\n",
                "[mesh] loop guard: ls called 3 times\n",
                "[mesh] new_thing: x 1\n",
            ],
        )
        self.assertEqual(
            mesh_text("mesh_decision", {"decision": "ship"}), "[mesh] decision: ship ()"
        )


class QuietViewTests(SynchronousTestCase):
    """A quiet view (piped input) writes the answer alone."""

    def test_answer_alone(self) -> None:
        """
        No status line, progress bar, mesh step, note or thinking, and no ANSI code or
        carriage return, even for a terminal; the answer and an error still show.
        """
        view = TurnView(tty=True, quiet=True)
        out = "".join(
            [
                view.event({"event": "queued", "ahead": 2}),
                view.event({"event": "progress", "processed": 1, "total": 4, "cache": 0}),
                view.event({"event": "mesh_reducer", "model": "a", "attempt": 1}),
                view.event({"event": "thinking_capped", "tokens": 9}),
                view.chunk({"choices": [{"delta": {"reasoning_content": "hmm"}}]}),
                view.chunk({"choices": [{"delta": {"content": "Hi"}}]}),
                view.chunk({"choices": [{"delta": {}, "finish_reason": "length"}]}),
                view.fail("cut"),
                view.close(),
            ]
        )
        self.assertEqual(out, "Hi\nerror: cut\n")
        self.assertEqual((view.content, view.reasoning), ("Hi", "hmm"))
