"""
Tests for L{loopd.gateway.late_system}: folding system messages after the first into user
turns, asking each endpoint's template once whether it renders them, and the gateway sending
each endpoint what its template takes (the Messages door's Claude Code shape).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, cast

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from loopd.errors import Http
from loopd.gateway.late_system import (
    PROBE_MARKER,
    PROBE_MESSAGES,
    LateSystem,
    fold_late_system,
    has_late_system,
    renders_late_system,
)
from loopd.llama import Client
from loopd.llama.types import Assistant, ChatMessage, System, Tool, ToolCall, User
from loopd.settings import Endpoint
from loopd.testing.fake_llama import CHAT, json_reply
from loopd.testing.gateway import GatewayHarness
from loopd.testing.llama_replies import answer

CALL = ToolCall("c1", "f", "{}")


class FoldTests(SynchronousTestCase):
    """L{fold_late_system}: where each late system message goes."""

    def test_nothing_late(self) -> None:
        """A conversation with no late system message is what it was."""
        messages = (System("s"), User("u"), Assistant("a"), User("v"))
        self.assertFalse(has_late_system(messages))
        self.assertEqual(fold_late_system(messages), messages)
        self.assertFalse(has_late_system(()))

    def test_leading_ones_join(self) -> None:
        """System messages at the start become one (Codex CLI sends two developer ones)."""
        messages = (System("one"), System(""), System("two"), User("u"))
        self.assertTrue(has_late_system(messages))
        self.assertEqual(fold_late_system(messages), (System("one\n\ntwo"), User("u")))

    def test_after_a_user_turn_at_the_end(self) -> None:
        """
        Claude Code's shape: a system message after the first user turn, nothing after
        it yet: the end of that user turn, this turn and every later one.
        """
        turn_1 = (System("s"), User("Hi"), System("Agents: a"))
        folded = (System("s"), User("Hi\n\nAgents: a"))
        self.assertEqual(fold_late_system(turn_1), folded)
        turn_2 = (*turn_1, Assistant(None, None, (CALL,)), Tool("c1", "ok"))
        self.assertEqual(fold_late_system(turn_2), (*folded, *turn_2[3:]))

    def test_before_a_user_turn(self) -> None:
        """A run of system messages right before a user turn starts that turn."""
        messages = (User("u"), Assistant("a"), System("r1"), System("r2"), User("v"))
        self.assertEqual(
            fold_late_system(messages), (User("u"), Assistant("a"), User("r1\n\nr2\n\nv"))
        )

    def test_between_other_turns(self) -> None:
        """Between an assistant turn and a tool result it is a user turn of its own."""
        messages = (User("u"), Assistant(None, None, (CALL,)), System("r"), Tool("c1", "x"))
        self.assertEqual(
            fold_late_system(messages),
            (User("u"), Assistant(None, None, (CALL,)), User("r"), Tool("c1", "x")),
        )

    def test_media_turn(self) -> None:
        """A user turn with media parts gets the text as a part too, where it goes."""
        image = {"type": "image_url", "image_url": {"url": "data:x"}}
        messages = (User("u"), Assistant("a"), System("r"), User("look", ({**image},)))
        folded = fold_late_system(messages)
        self.assertEqual(folded[2], User("r\n\nlook", ({"type": "text", "text": "r"}, {**image})))

    @given(
        st.lists(
            st.tuples(
                st.sampled_from(["system", "user", "assistant", "tool"]),
                st.text("abc ", min_size=1, max_size=4),
            ),
            max_size=12,
        ),
        st.integers(0, 12),
    )
    def test_properties(self, spec: list[tuple[str, str]], cut: int) -> None:
        """
        No system message but the first; every text kept, in order; and as a conversation
        grows, everything before the last folded message of its earlier turn stays the same
        (so the server's cached prefix does).
        """
        messages = tuple(_message(role, text) for role, text in spec)
        folded = fold_late_system(messages)
        self.assertFalse(has_late_system(folded))
        self.assertEqual(_texts(folded), _texts(messages))
        shorter = fold_late_system(messages[:cut])
        self.assertEqual(folded[: max(0, len(shorter) - 1)], shorter[:-1])


def _message(role: str, text: str) -> ChatMessage:
    """A message of C{role} saying C{text}."""
    if role == "system":
        return System(text)
    if role == "user":
        return User(text)
    if role == "assistant":
        return Assistant(text)
    return Tool("c", text)


def _texts(messages: tuple[ChatMessage, ...]) -> list[str]:
    """Every text of C{messages}, in order, each fold's joins undone."""
    texts: list[str] = []
    for message in messages:
        content = getattr(message, "content", None)
        if content:
            texts.extend(piece for piece in content.split("\n\n") if piece)
    return texts


class ProbeRenderingTests(SynchronousTestCase):
    """L{renders_late_system}: the probe's marker in the rendered prompt."""

    def test_marker(self) -> None:
        """Rendered with the marker: yes; dropped: no."""
        self.assertTrue(renders_late_system(f"<|im_start|>system\n{PROBE_MARKER}<|im_end|>"))
        self.assertFalse(renders_late_system("<|im_start|>user\nAgain.<|im_end|>"))
        self.assertEqual(PROBE_MESSAGES[3], {"role": "system", "content": PROBE_MARKER})


@dataclass
class _StubClient:
    """Stands for a llama client: records each template asked for and answers by hand."""

    endpoint: Endpoint
    asked: list[Deferred[str]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def apply_template(self, body: dict[str, Any]) -> Deferred[str]:
        """A Deferred the test fires."""
        self.bodies.append(body)
        d: Deferred[str] = Deferred()
        self.asked.append(d)
        return d


LATE = (System("s"), User("Hi"), System("Agents: a"))


class LateSystemTests(SynchronousTestCase):
    """L{LateSystem}: each endpoint asked once, its answer kept."""

    def setUp(self) -> None:
        """Two endpoints, a llama-server and an openai one, on a fake clock."""
        self.clock = Clock()
        self.llama = _StubClient(Endpoint(name="tiny", socket="/tmp/t"))
        self.openai = _StubClient(Endpoint(name="o", socket="/tmp/o", kind="openai"))
        clients = cast(dict[str, Client], {"tiny": self.llama, "o": self.openai})
        self.late = LateSystem(self.clock, clients, 50)

    def placed(self, endpoint: str, messages: tuple[ChatMessage, ...]) -> Any:
        """What C{placed} fired with, or the Deferred when it has not fired."""
        d = self.late.placed(endpoint, messages)
        return self.successResultOf(d) if d.called else d

    def test_no_late_system_asks_nothing(self) -> None:
        """A request without a late system message goes as it is, nothing asked."""
        messages = (System("s"), User("u"))
        self.assertEqual(self.placed("tiny", messages), messages)
        self.assertEqual(self.llama.asked, [])

    def test_rendered(self) -> None:
        """
        The template renders the probe's system message: the request goes as it is; the
        answer is kept, so the next request asks nothing; askers meanwhile share the probe.
        """
        first, second = self.placed("tiny", LATE), self.placed("tiny", LATE)
        [probe] = self.llama.asked
        self.assertEqual(self.llama.bodies, [{"messages": list(PROBE_MESSAGES)}])
        probe.callback(f"...{PROBE_MARKER}...")
        self.assertEqual((self.successResultOf(first), self.successResultOf(second)), (LATE, LATE))
        self.assertEqual(self.placed("tiny", LATE), LATE)
        self.assertEqual((len(self.llama.asked), self.late.renders("tiny")), (1, True))

    def test_not_rendered(self) -> None:
        """A template that drops it, or raises (an HTTP error), folds, for good."""
        for outcome in ("no marker here", Http(500, "template error")):
            self.setUp()
            waiting = self.placed("tiny", LATE)
            if isinstance(outcome, str):
                self.llama.asked[0].callback(outcome)
            else:
                self.llama.asked[0].errback(outcome)
            self.assertEqual(self.successResultOf(waiting), fold_late_system(LATE))
            self.assertEqual(self.placed("tiny", LATE), fold_late_system(LATE))
            self.assertEqual((len(self.llama.asked), self.late.renders("tiny")), (1, False))

    def test_probe_unanswered(self) -> None:
        """
        A probe that cannot be asked (refused) or is not answered within the timeout folds
        the waiting request and leaves the question open: the next request asks again.
        """
        waiting = self.placed("tiny", LATE)
        self.llama.asked[0].errback(ConnectionRefusedError())
        self.assertEqual(self.successResultOf(waiting), fold_late_system(LATE))
        self.assertIsNone(self.late.renders("tiny"))
        waiting = self.placed("tiny", LATE)
        self.clock.advance(0.05)
        self.assertEqual(self.successResultOf(waiting), fold_late_system(LATE))
        self.assertEqual(len(self.llama.asked), 2)
        self.placed("tiny", LATE)
        self.assertEqual(len(self.llama.asked), 3)

    def test_openai_endpoint_folds(self) -> None:
        """An openai endpoint has no template route: folded, nothing asked."""
        self.assertEqual(self.placed("o", LATE), fold_late_system(LATE))
        self.assertEqual(self.openai.asked, [])

    def test_cancelled_asker(self) -> None:
        """A request cancelled while the probe runs leaves the probe to the others."""
        gone, staying = self.late.placed("tiny", LATE), self.late.placed("tiny", LATE)
        gone.cancel()
        self.failureResultOf(gone)
        self.llama.asked[0].callback(PROBE_MARKER)
        self.assertEqual(self.successResultOf(staying), LATE)


def _messages_body(*messages: dict[str, Any]) -> bytes:
    """A Messages body of C{messages}."""
    return json.dumps(
        {"model": "tiny", "max_tokens": 20, "system": "s", "messages": list(messages)}
    ).encode()


class GatewayPlacementTests(SynchronousTestCase):
    """Claude Code's late system message through the gateway, to two kinds of template."""

    def send(self, template_answer: Any) -> list[list[dict[str, Any]]]:
        """
        Two turns of a Claude-Code-shaped conversation to a server whose template answers
        C{template_answer}; the messages each turn sent upstream.
        """
        harness = GatewayHarness()
        harness.fake.script("POST", "/apply-template", template_answer)
        harness.fake.set_default("POST", CHAT, answer({"content": "Hello"}))
        user = {"role": "user", "content": "Hi"}
        later = {"role": "system", "content": "Agents: a"}
        turns = [
            _messages_body(user, later),
            _messages_body(user, later, {"role": "assistant", "content": "Hello"}, user),
        ]
        for body in turns:
            connection = harness.connect()
            connection.request("POST", "/v1/messages", body, ["Content-Type: application/json"])
            harness.advance(1)
            self.assertEqual(connection.response().status, 200)
        self.assertEqual(len(harness.fake.requests_to("POST", "/apply-template")), 1)
        sent = []
        for request in harness.fake.requests_to("POST", CHAT):
            assert request.json is not None
            sent.append(request.json["messages"])
        return sent

    def test_rendered_in_place(self) -> None:
        """A template that renders it gets the system message where it stands."""
        first, second = self.send(json_reply(200, {"prompt": f"...{PROBE_MARKER}..."}))
        self.assertEqual(first[2], {"role": "system", "content": "Agents: a"})
        self.assertEqual(second[:3], first)

    def test_folded(self) -> None:
        """
        A template that raises on it gets it folded into the user turn before it, the same
        on both turns, so the second turn's prompt begins with the first's.
        """
        first, second = self.send(json_reply(500, {"error": {"message": "roles"}}))
        self.assertEqual(
            first,
            [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "Hi\n\nAgents: a"},
            ],
        )
        self.assertEqual(second[:2], first)
