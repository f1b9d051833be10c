# -*- test-case-name: loopd.test.test_gateway_late_system -*-
"""
System messages after the start of a conversation (DESIGN §3 decision 43): what an endpoint
gets when a request carries a C{system} or C{developer} message anywhere but first. Claude
Code sends one after its first user turn (the agent types of its C{Agent} tool); Codex CLI
starts with two C{developer} messages; an agent may inject a reminder mid-conversation.

Such a message stays where it stands. An endpoint whose chat template renders a system
message there gets it as one. Which templates do is asked, not guessed: the first request
with a late system message for a C{llama-server} endpoint asks the server's own template
(C{POST /apply-template}) for a probe conversation with a marked system message after an
assistant turn, and the answer, rendered or not, is kept for the endpoint's lifetime in
loopd (a template that raises, or drops the message, does not render it). An C{openai}
endpoint has no template route, so its requests are folded, which every template takes.

Folded (L{fold_late_system}), nothing is dropped and nothing moves ahead of what came before
it, so a session's cached prefix stays the same from turn to turn:

  - the system messages at the start become one system message, their texts joined by a
    blank line;
  - a later one becomes text of a user turn next to it: the start of the user turn right
    after it, else the end of the user turn right before it, else a user turn of its own
    where it stands. Both neighbours are fixed once the message is sent, so later turns
    fold it the same way.

A probe that cannot be asked (the endpoint unreachable, no answer within C{limits.poll_ms})
folds that request and is asked again next time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from loopd.errors import Http
from loopd.llama import Client
from loopd.llama.types import ChatMessage, System, User

__all__ = [
    "PROBE_MARKER",
    "PROBE_MESSAGES",
    "LateSystem",
    "fold_late_system",
    "has_late_system",
    "renders_late_system",
]

_log: Final = Logger(namespace="loopd.gateway")

PROBE_MARKER: Final = "loopd-late-system-probe-7d1c"
"""The text of the probe's late system message, looked for in the rendered prompt."""
PROBE_MESSAGES: Final = (
    {"role": "system", "content": "You are a probe."},
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hello."},
    {"role": "system", "content": PROBE_MARKER},
    {"role": "user", "content": "Again."},
)
"""The conversation whose rendering tells whether a template renders a late system message."""

#: What joins a folded system text to its neighbours.
_JOIN: Final = "\n\n"


def has_late_system(messages: Sequence[ChatMessage]) -> bool:
    """Whether C{messages} has a system message anywhere but first."""
    return any(isinstance(message, System) for message in messages[1:])


def renders_late_system(prompt: str) -> bool:
    """Whether the probe's rendered C{prompt} kept its late system message."""
    return PROBE_MARKER in prompt


def fold_late_system(messages: Sequence[ChatMessage]) -> tuple[ChatMessage, ...]:
    """
    C{messages} with no system message but a first one: the leading system messages joined,
    and each later run of system messages folded into the user turn right after it, else
    the one right before it, else made a user turn of its own (the module docstring says
    why).
    """
    lead = 0
    while lead < len(messages) and isinstance(messages[lead], System):
        lead += 1
    out: list[ChatMessage] = []
    if lead:
        out.append(System(_JOIN.join(_texts(messages[:lead]))))
    index = lead
    while index < len(messages):
        message = messages[index]
        if not isinstance(message, System):
            out.append(message)
            index += 1
            continue
        end = index
        while end < len(messages) and isinstance(messages[end], System):
            end += 1
        text = _JOIN.join(_texts(messages[index:end]))
        after = messages[end] if end < len(messages) else None
        if isinstance(after, User):
            out.append(_with_text(after, text, before=True))
            end += 1
        elif out and isinstance(out[-1], User):
            out[-1] = _with_text(out[-1], text, before=False)
        elif text:
            out.append(User(text))
        index = end
    return tuple(out)


def _texts(run: Sequence[ChatMessage]) -> list[str]:
    """The non-empty texts of a run of system messages."""
    return [message.content for message in run if isinstance(message, System) and message.content]


def _with_text(turn: User, text: str, *, before: bool) -> User:
    """User turn C{turn} with C{text} added at its start or its end."""
    if not text:
        return turn
    joined = f"{text}{_JOIN}{turn.content}" if before else f"{turn.content}{_JOIN}{text}"
    if not turn.content:
        joined = text
    if not turn.parts:
        return User(joined)
    part = {"type": "text", "text": text}
    parts = (part, *turn.parts) if before else (*turn.parts, part)
    return User(joined, parts)


class LateSystem:
    """
    Each endpoint's answer to "does your template render a late system message?", asked
    once per endpoint (the module docstring says how), and the messages each request sends.
    """

    def __init__(
        self, reactor: IReactorTime, clients: Mapping[str, Client], timeout_ms: int
    ) -> None:
        """
        @param reactor: the clock of the probe's timeout.
        @param clients: the llama client of each endpoint, by name.
        @param timeout_ms: how long a probe may take before the request is folded.
        """
        self._reactor = reactor
        self._clients = clients
        self._timeout = timeout_ms / 1000.0
        self._renders: dict[str, bool] = {}
        self._asking: dict[str, list[Deferred[bool]]] = {}

    def renders(self, endpoint: str) -> bool | None:
        """What C{endpoint}'s template was found to do; C{None} before it was asked."""
        return self._renders.get(endpoint)

    def placed(
        self, endpoint: str, messages: tuple[ChatMessage, ...]
    ) -> Deferred[tuple[ChatMessage, ...]]:
        """
        The messages C{endpoint} gets for C{messages}: as they are when they have no late
        system message or the endpoint's template renders one, else folded. Fires at once
        unless the endpoint must be asked first; never fails.
        """
        if not has_late_system(messages):
            return succeed(messages)
        renders = self._renders.get(endpoint)
        if renders is not None:
            return succeed(messages if renders else fold_late_system(messages))
        placing: Deferred[tuple[ChatMessage, ...]] = self._ask(endpoint).addCallback(
            lambda rendered: messages if rendered else fold_late_system(messages)
        )
        return placing

    def _ask(self, endpoint: str) -> Deferred[bool]:
        """Whether C{endpoint} renders a late system message; one probe for every asker."""
        waiter: Deferred[bool] = Deferred()
        waiting = self._asking.get(endpoint)
        if waiting is not None:
            waiting.append(waiter)
            return waiter
        self._asking[endpoint] = [waiter]
        client = self._clients[endpoint]
        if client.endpoint.kind != "llama-server":
            self._answered(True, endpoint, False)
            return waiter
        body: dict[str, Any] = {"messages": list(PROBE_MESSAGES)}
        probing = client.apply_template(body)
        probing.addTimeout(self._timeout, self._reactor)
        probing.addCallbacks(
            lambda prompt: self._answered(True, endpoint, renders_late_system(prompt)),
            lambda reason: self._probe_failed(reason, endpoint),
        )
        return waiter

    def _probe_failed(self, reason: Failure, endpoint: str) -> None:
        """
        A template that raised answers "no" for good; a probe that could not be asked folds
        the waiting requests and leaves the question open.
        """
        if reason.check(Http) is not None:
            self._answered(True, endpoint, False)
            return
        _log.info(
            "endpoint {endpoint}: could not ask its chat template about late system messages "
            "({error}); this request's are folded into user turns",
            endpoint=endpoint,
            error=reason.getErrorMessage(),
        )
        self._answered(False, endpoint, False)

    def _answered(self, known: bool, endpoint: str, renders: bool) -> None:
        """Fire every waiter of C{endpoint} with C{renders}; remember it when C{known}."""
        if known:
            self._renders[endpoint] = renders
            how = "in place" if renders else "folded into user turns"
            _log.info(
                "endpoint {endpoint}: system messages after the first go {how}",
                endpoint=endpoint,
                how=how,
            )
        for waiter in self._asking.pop(endpoint, []):
            waiter.callback(renders)
