"""
Tests for L{loopd.moa.context}: the context of each role (reference C{mesh-moa.md} §1.5),
with v2's chained tool results (PR #713) and loop guard on the tool-result turn (§6), over
the checked request's messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.llama.types import (
    Assistant,
    ChatMessage,
    System,
    Tool,
    ToolCall,
    ToolSchema,
    User,
)
from loopd.moa.context import (
    PREAMBLE,
    Draft,
    Packed,
    augmented_system_prompt,
    cut_utf8,
    pack_fast,
    pack_for_reducer,
    pack_for_role,
    pack_for_tool_result_turn,
    pack_specialist,
    pack_strong,
    recent_messages,
    shorten,
    tool_summary,
    utf8_length,
)
from loopd.moa.roles import Role
from loopd.moa.turn import ToolLoop, Turn, read_turn

TOOLS = (
    ToolSchema(
        "read_file",
        "Read a file from disk\nSecond line ignored.",
        {"type": "object", "properties": {"path": {"type": "string"}}},
    ),
    ToolSchema("web_search", ""),
)

AUGMENTED = PREAMBLE + "\n\nYou are helpful."


def system(text: str = "You are helpful.") -> System:
    """A system message."""
    return System(text)


def user(text: str) -> User:
    """A user message."""
    return User(text)


def assistant(text: str) -> Assistant:
    """A plain assistant message."""
    return Assistant(text)


def calling(call_id: str, name: str = "read_file", arguments: str = "{}") -> Assistant:
    """An assistant message calling one tool."""
    return Assistant(None, None, (ToolCall(call_id, name, arguments),))


def result(call_id: str, content: str = "out") -> Tool:
    """A tool result message."""
    return Tool(call_id, content)


def turn_of(messages: Sequence[ChatMessage], tools: Sequence[ToolSchema] = ()) -> Turn:
    """The turn of a request with these messages and tools."""
    return read_turn(messages, tools)


#: A user turn that carries an image beside its text.
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}


class CutTests(SynchronousTestCase):
    """The UTF-8-safe byte cuts."""

    def test_ascii(self) -> None:
        """ASCII text is cut at exactly the byte count."""
        self.assertEqual(cut_utf8("abcdef", 4), "abcd")
        self.assertEqual(cut_utf8("ab", 4), "ab")
        self.assertEqual(cut_utf8("ab", 0), "")

    def test_never_half_a_character(self) -> None:
        """A multi-byte character that does not fit whole is left out."""
        self.assertEqual(cut_utf8("aé", 2), "a")
        self.assertEqual(cut_utf8("a€b", 3), "a")
        self.assertEqual(cut_utf8("a€b", 4), "a€")
        self.assertEqual(cut_utf8("😀x", 3), "")

    def test_shorten(self) -> None:
        """Over the limit: the first limit-3 bytes plus "..."; at the limit: unchanged."""
        self.assertEqual(shorten("x" * 80, 80), "x" * 80)
        self.assertEqual(shorten("x" * 81, 80), "x" * 77 + "...")
        self.assertEqual(shorten("é" * 41, 80), "é" * 38 + "...")

    @given(st.text(max_size=60), st.integers(0, 100))
    def test_cut_properties(self, text: str, limit: int) -> None:
        """A cut is the longest prefix within the limit."""
        cut = cut_utf8(text, limit)
        self.assertTrue(text.startswith(cut))
        self.assertLessEqual(utf8_length(cut), limit)
        if len(cut) < len(text):
            self.assertGreater(utf8_length(text[: len(cut) + 1]), limit)

    @given(st.text(max_size=600), st.sampled_from([80, 500]))
    def test_shorten_fits(self, text: str, limit: int) -> None:
        """A shortened text never exceeds its limit in bytes."""
        self.assertLessEqual(utf8_length(shorten(text, limit)), limit)


class PreambleTests(SynchronousTestCase):
    """The preamble and the augmented system prompt."""

    def test_exact_preamble(self) -> None:
        """Every packed system prompt starts with the reference's exact preamble."""
        self.assertEqual(
            PREAMBLE,
            "[Multiple models are analyzing this request in parallel. Respond with your "
            "best answer or tool call. Be direct.]",
        )

    def test_augmented(self) -> None:
        """Preamble + blank line + the agent's system prompt, or the preamble alone."""
        self.assertEqual(augmented_system_prompt(turn_of([system(), user("q")])), AUGMENTED)
        self.assertEqual(augmented_system_prompt(turn_of([user("q")])), PREAMBLE)

    def test_recent_messages(self) -> None:
        """recent_messages(n) is the last n messages of the whole history."""
        history = [user("1"), user("2"), user("3")]
        self.assertEqual(recent_messages(history, 2), tuple(history[1:]))
        self.assertEqual(recent_messages(history, 10), tuple(history))


class FastTests(SynchronousTestCase):
    """The Fast worker's context."""

    def test_with_tools(self) -> None:
        """System prompt + tool names, then the last user text; no tools; 256 tokens."""
        packed = pack_fast(turn_of([system(), user("a"), assistant("b"), user("q")], TOOLS))
        self.assertEqual(
            packed,
            Packed(
                (
                    system(AUGMENTED + "\n\nAvailable tools: read_file, web_search"),
                    user("q"),
                ),
                None,
                256,
            ),
        )

    def test_without_tools(self) -> None:
        """Without tools the system prompt is the augmented prompt alone."""
        packed = pack_fast(turn_of([user("q")]))
        self.assertEqual(packed.messages, (system(PREAMBLE), user("q")))

    def test_media_user_as_text(self) -> None:
        """The user message carries the last user text alone, without its media."""
        turn = turn_of([User("ab", ({"type": "text", "text": "ab"}, IMAGE))])
        self.assertEqual(pack_fast(turn).messages[1], user("ab"))


class SpecialistTests(SynchronousTestCase):
    """The Specialist worker's context."""

    def test_summaries(self) -> None:
        """A line per tool: name and first line of the description."""
        packed = pack_specialist(turn_of([user("q")], TOOLS))
        self.assertEqual(
            packed.messages[0],
            System(
                PREAMBLE + "\n\nAvailable tools:\n  - read_file: Read a file from disk"
                "\n  - web_search: "
            ),
        )
        self.assertEqual(packed.tools, TOOLS)
        self.assertEqual(packed.max_tokens, 512)

    def test_description_cut(self) -> None:
        """A first line over 80 bytes is cut to 77 bytes (UTF-8 safe) plus "..."."""
        self.assertEqual(tool_summary(ToolSchema("t", "d" * 81)), "t: " + "d" * 77 + "...")
        self.assertEqual(tool_summary(ToolSchema("t", "d" * 80 + "\nmore")), "t: " + "d" * 80)
        self.assertEqual(tool_summary(ToolSchema("t", "é" * 41)), "t: " + "é" * 38 + "...")
        self.assertEqual(tool_summary(ToolSchema("t", "line\r\nnext")), "t: line")

    def test_window_filter(self) -> None:
        """Of the last 4 messages: users, and assistants without tool calls."""
        history = [
            user("old"),
            assistant("old reply"),
            user("q"),
            calling("c"),
            result("c"),
            calling("d"),
            assistant("plain"),
        ]
        packed = pack_specialist(turn_of(history, TOOLS))
        self.assertEqual(packed.messages[1:], (assistant("plain"), user("q")))

    def test_no_append_when_last(self) -> None:
        """The last user text is not appended when the last packed message is that string."""
        packed = pack_specialist(turn_of([system(), user("a"), assistant("b"), user("q")]))
        self.assertEqual(packed.messages[1:], (user("a"), assistant("b"), user("q")))
        self.assertIsNone(packed.tools)

    def test_media_appended_again(self) -> None:
        """A user turn with media never matches, so the text is appended after it."""
        media = User("q", ({"type": "text", "text": "q"}, IMAGE))
        packed = pack_specialist(turn_of([media]))
        self.assertEqual(packed.messages[1:], (media, user("q")))


class StrongTests(SynchronousTestCase):
    """The Strong (and Generalist) worker's context."""

    def test_window(self) -> None:
        """The last 10 messages, system ones dropped, tool messages kept."""
        history: list[ChatMessage] = [user(f"u{i}") for i in range(5)]
        history += [system("late"), calling("c"), result("c"), system("later"), user("q")]
        history.append(assistant("a"))
        packed = pack_strong(turn_of([system(), *history], TOOLS))
        self.assertEqual(packed.messages[0], system(AUGMENTED))
        self.assertEqual(
            packed.messages[1:],
            (
                user("u1"),
                user("u2"),
                user("u3"),
                user("u4"),
                calling("c"),
                result("c"),
                user("q"),
                assistant("a"),
                user("q"),
            ),
        )
        self.assertEqual((packed.tools, packed.max_tokens), (TOOLS, 1024))

    def test_orphan_tool_quirk(self) -> None:
        """v1 quirk kept: the 10-message window may begin with an orphan tool message."""
        history = [user("q"), calling("c"), *[result("c", str(i)) for i in range(10)]]
        packed = pack_strong(turn_of(history))
        self.assertIsInstance(packed.messages[1], Tool)

    def test_roles(self) -> None:
        """Generalist and Reducer pack as Strong; Fast and Specialist as themselves."""
        turn = turn_of([system(), user("q")], TOOLS)
        self.assertEqual(pack_for_role(turn, Role.FAST), pack_fast(turn))
        self.assertEqual(pack_for_role(turn, Role.SPECIALIST), pack_specialist(turn))
        for role in (Role.STRONG, Role.GENERALIST, Role.REDUCER):
            self.assertEqual(pack_for_role(turn, role), pack_strong(turn))


class ReducerTests(SynchronousTestCase):
    """The reducer after a conflict."""

    def test_exact_prompt(self) -> None:
        """The system prompt lists the reason, the instruction and each worker's output."""
        drafts = [
            Draft("a-7b", "Paris"),
            Draft("b-32b", "calling read_file", "read_file", {"path": "é.md", "n": 1}),
            Draft("c-8b", "x" * 501, "web_search"),
        ]
        turn = turn_of([system(), user("q")], TOOLS)
        packed = pack_for_reducer(turn, drafts, "answers disagree")
        expected = "\n".join(
            [
                AUGMENTED,
                "",
                "Multiple models analyzed this request and disagreed. Reason: answers disagree",
                "Review their outputs below and produce ONE final response \u2014 either a "
                "direct answer or a tool call. Be concise.",
                "",
                "## Worker outputs",
                "\n[Worker 1 \u2014 a-7b]:",
                "Paris",
                "\n[Worker 2 \u2014 b-32b]:",
                "calling read_file",
                "  \u2192 Proposed tool: read_file",
                '  \u2192 Arguments: {"path":"é.md","n":1}',
                "\n[Worker 3 \u2014 c-8b]:",
                "x" * 497 + "...",
                "  \u2192 Proposed tool: web_search",
            ]
        )
        self.assertEqual(packed, Packed((system(expected), user("q")), TOOLS, 2048))

    def test_payload_at_limit(self) -> None:
        """A payload of exactly 500 bytes is kept whole."""
        packed = pack_for_reducer(turn_of([user("q")]), [Draft("m", "y" * 500)], "r")
        self.assertTrue(_content(packed.messages[0]).endswith("\n" + "y" * 500))
        self.assertIsNone(packed.tools)


class ToolResultTests(SynchronousTestCase):
    """The reducer of a tool-result turn (v2 chained tool results, loop guard)."""

    def test_single_round(self) -> None:
        """A single round: system, the user message, the call and its result; tools; 2048."""
        history = [system(), user("q"), calling("c"), result("c")]
        packed = pack_for_tool_result_turn(turn_of(history, TOOLS))
        self.assertEqual(
            packed,
            Packed((system(AUGMENTED), user("q"), calling("c"), result("c")), TOOLS, 2048),
        )

    def test_chained_rounds_kept(self) -> None:
        """Chained rounds within the window all go (v1 kept only the last round)."""
        history = [user("q"), calling("c1"), result("c1"), calling("c2"), result("c2")]
        packed = pack_for_tool_result_turn(turn_of(history))
        self.assertEqual(packed.messages[1:], tuple(history))

    def test_window_never_starts_with_tool(self) -> None:
        """A window cutting a round moves back to its call; the user anchor goes first."""
        history: list[ChatMessage] = [system(), user("task"), calling("c0")]
        history += [result("c0", str(i)) for i in range(4)]
        for i in range(1, 4):
            history += [calling(f"c{i}"), result(f"c{i}")]
        # 13 messages: the last 10 would begin with result("c0", "1").
        packed = pack_for_tool_result_turn(turn_of(history))
        self.assertEqual(packed.messages[1:], tuple(history[1:]))
        self.assertIsInstance(packed.messages[1], User)

    def test_user_anchor(self) -> None:
        """Long chains: the user message before the last tool result is put first."""
        history: list[ChatMessage] = [user("older"), assistant("ok"), user("task")]
        for i in range(6):
            history += [calling(f"c{i}"), result(f"c{i}")]
        packed = pack_for_tool_result_turn(turn_of(history))
        self.assertEqual(packed.messages[1:], (user("task"), *history[-10:]))

    def test_nudge_in_window(self) -> None:
        """A user nudge inside the window stands: no anchor is added."""
        history: list[ChatMessage] = [user("task"), assistant("ok")]
        for i in range(4):
            history += [calling(f"c{i}"), result(f"c{i}")]
        history.append(user("Go on."))
        packed = pack_for_tool_result_turn(turn_of(history))
        self.assertEqual(packed.messages[1:], tuple(history[-10:]))

    def test_latest_round_whole(self) -> None:
        """Many nudges after the round: the window still reaches back to the last call."""
        history: list[ChatMessage] = [user("task"), calling("c"), result("c")]
        history += [user(f"n{i}") for i in range(12)]
        packed = pack_for_tool_result_turn(turn_of(history))
        self.assertEqual(packed.messages[1:], tuple(history[1:]))

    def test_system_dropped(self) -> None:
        """System messages are left out of the window."""
        history = [system(), user("q"), calling("c"), system("mid"), result("c")]
        packed = pack_for_tool_result_turn(turn_of(history))
        self.assertEqual(packed.messages[1:], (user("q"), calling("c"), result("c")))

    def test_no_tool_call(self) -> None:
        """With no tool-calling assistant message the window is the last 10 messages."""
        history: list[ChatMessage] = [user(str(i)) for i in range(12)]
        history.append(result("x"))
        packed = pack_for_tool_result_turn(turn_of(history))
        self.assertEqual(packed.messages[1:], tuple(history[-10:]))

    def test_loop_guard(self) -> None:
        """With a loop: the guard instruction ends the system prompt and no tools go."""
        history = [system(), user("q"), calling("c"), result("c")]
        packed = pack_for_tool_result_turn(turn_of(history, TOOLS), ToolLoop("read_file", 3))
        self.assertEqual(
            packed.messages[0],
            system(
                AUGMENTED + "\n\nTool loop guard: the last 3 completed tool calls all used "
                "`read_file`. Answer now from the gathered tool results. Do not call another "
                "tool. If the evidence is incomplete, say what can be determined and what is "
                "missing."
            ),
        )
        self.assertIsNone(packed.tools)
        self.assertEqual(packed.max_tokens, 2048)

    @given(
        st.lists(
            st.sampled_from(["user", "assistant", "call", "tool", "system"]),
            max_size=30,
        )
    )
    def test_window_properties(self, shape: list[str]) -> None:
        """Any history: a suffix (plus an anchor), the latest round whole, no leading bare tool."""
        makers: dict[str, Callable[[int], ChatMessage]] = {
            "user": lambda i: user(f"u{i}"),
            "assistant": lambda i: assistant(f"a{i}"),
            "call": lambda i: calling(f"c{i}"),
            "tool": lambda i: result(f"c{i}"),
            "system": lambda i: system(f"s{i}"),
        }
        history = [makers[kind](i) for i, kind in enumerate(shape)]
        packed = pack_for_tool_result_turn(turn_of(history)).messages[1:]
        kept = [m for m in history if not isinstance(m, System)]
        body = list(packed)
        if body and kept[len(kept) - len(body) :] != body:
            body = body[1:]
            self.assertIsInstance(packed[0], User)
        self.assertEqual(kept[len(kept) - len(body) :], body)
        calls = [i for i, kind in enumerate(shape) if kind == "call"]
        if calls:
            tail = [m for m in history[calls[-1] :] if not isinstance(m, System)]
            self.assertEqual(list(packed[len(packed) - len(tail) :]), tail)
            first = packed[0] if packed else None
            earlier_call = first is not None and any(
                kind == "call" for kind in shape[: history.index(first)]
            )
            if earlier_call:
                self.assertNotIsInstance(first, Tool)


def _content(message: ChatMessage) -> str:
    """A system message's text."""
    assert isinstance(message, System)
    return message.content


_text = st.text(max_size=6)
messages = st.lists(
    st.one_of(
        st.builds(System, _text),
        st.builds(User, _text),
        st.builds(Tool, _text, _text),
        st.builds(Assistant, st.none() | _text),
        st.builds(calling, _text, _text, _text),
    ),
    max_size=14,
)
tools = st.lists(st.builds(ToolSchema, _text, _text), max_size=3)


class AnyRequestTests(SynchronousTestCase):
    """Every packer on any request."""

    @given(messages, tools, st.lists(st.text(max_size=6), max_size=3), st.text(max_size=20))
    def test_every_packer(
        self,
        history: list[ChatMessage],
        offered: list[ToolSchema],
        payloads: list[Any],
        reason: str,
    ) -> None:
        """Every packer answers any request with its budget, its system prompt first."""
        turn = read_turn(history, offered)
        drafts = [Draft("m", str(p), "t", p) for p in payloads]
        packs = [
            pack_fast(turn),
            pack_specialist(turn),
            pack_strong(turn),
            pack_for_reducer(turn, drafts, reason),
            pack_for_tool_result_turn(turn),
            pack_for_tool_result_turn(turn, ToolLoop("t", 3)),
        ]
        self.assertEqual([p.max_tokens for p in packs], [256, 512, 1024, 2048, 2048, 2048])
        for packed in packs:
            self.assertTrue(_content(packed.messages[0]).startswith(PREAMBLE))
