# -*- test-case-name: loopd.test.test_doors_responses_store -*-
"""
The finished responses of C{POST /v1/responses} that a later request may continue with
C{previous_response_id} (L{loopd.gateway.doors.responses}).

A bounded store in memory: at most L{MAX_RESPONSES} responses holding at most
L{MAX_TEXT} characters of text between them (each stored response counts its whole
conversation, L{text_size}: a client that sends its whole input every turn stores it again
every turn), each for at most L{MAX_AGE_SECONDS} after it was stored; past any limit the
oldest goes first, and a response whose text alone is over the budget is not kept. Nothing
survives a restart, and a response that is gone is an unknown id to the front door (400
C{previous_response_not_found}). Pure: the clock is injected, nothing here schedules or
does I/O (expired responses go when the store is next used).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from loopd.llama.types import Assistant, ChatMessage, System, Tool, User

__all__ = [
    "MAX_AGE_SECONDS",
    "MAX_RESPONSES",
    "MAX_TEXT",
    "ResponseStore",
    "StoredResponse",
    "text_size",
]

MAX_RESPONSES: Final = 1000
"""The most responses the store keeps."""
MAX_AGE_SECONDS: Final = 3600.0
"""How long, in seconds, a stored response can be continued: one hour."""
MAX_TEXT: Final = 64 * 1024 * 1024
"""The most characters of text the stored responses hold between them (64 Mi)."""


@dataclass(frozen=True)
class StoredResponse:
    """
    What a follow-up needs of one finished response: the whole conversation again.

    @ivar conversation: the messages that produced it, in order, without the request's
        C{instructions} (a follow-up gives its own, as in OpenAI's API).
    @ivar answer: the assistant turn it answered with.
    """

    conversation: tuple[ChatMessage, ...]
    answer: Assistant

    @property
    def messages(self) -> tuple[ChatMessage, ...]:
        """The conversation with the answer after it: what a follow-up's input continues."""
        return (*self.conversation, self.answer)


def text_size(messages: tuple[ChatMessage, ...]) -> int:
    """
    The characters of text C{messages} hold: contents, thinking, tool calls (ids, names,
    arguments), tool results, and a user turn's parts (an image's data URL) as JSON.
    """
    size = 0
    for message in messages:
        if isinstance(message, Assistant):
            size += len(message.content or "") + len(message.reasoning_content or "")
            size += sum(len(c.id) + len(c.name) + len(c.arguments) for c in message.tool_calls)
        elif isinstance(message, User):
            size += len(message.content)
            size += sum(len(json.dumps(part)) for part in message.parts)
        elif isinstance(message, Tool):
            size += len(message.content) + len(message.tool_call_id)
        elif isinstance(message, System):
            size += len(message.content)
    return size


class ResponseStore:
    """
    Finished responses by id, bounded by count, text and age, oldest evicted first.
    """

    def __init__(
        self,
        now: Callable[[], float],
        max_responses: int = MAX_RESPONSES,
        max_age: float = MAX_AGE_SECONDS,
        max_text: int = MAX_TEXT,
    ) -> None:
        """
        @param now: the clock, in seconds (C{reactor.seconds}).
        @param max_responses: the most responses kept.
        @param max_age: how long a response is kept, in seconds.
        @param max_text: the most characters of text kept between them (L{text_size}).
        @raise ValueError: for a limit below 1 response, 1 character or not above 0 seconds.
        """
        if max_responses < 1 or max_age <= 0 or max_text < 1:
            raise ValueError("a response store keeps at least 1 response for some time")
        self._now = now
        self._max_responses = max_responses
        self._max_age = max_age
        # Insertion order is age order: a response is stored once, when it finishes.
        self._max_text = max_text
        self._text = 0
        self._entries: OrderedDict[str, tuple[float, StoredResponse, int]] = OrderedDict()

    def __len__(self) -> int:
        """How many responses are kept now (expired ones no longer count)."""
        self._expire()
        return len(self._entries)

    @property
    def text(self) -> int:
        """The characters of text kept now (L{text_size} of every response kept)."""
        return self._text

    def put(self, response_id: str, response: StoredResponse) -> bool:
        """
        Keep C{response} under C{response_id} from now on, evicting the oldest past the
        count or the text limit. Storing an id again replaces it and makes it the newest.

        @return: whether it is kept: not when its text alone is over the limit.
        """
        self._drop(response_id)
        size = text_size(response.messages)
        if size > self._max_text:
            return False
        self._entries[response_id] = (self._now(), response, size)
        self._text += size
        self._expire()
        while len(self._entries) > self._max_responses or self._text > self._max_text:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The response stored under C{response_id}, C{None} if it is unknown or expired."""
        self._expire()
        entry = self._entries.get(response_id)
        return None if entry is None else entry[1]

    def _drop(self, response_id: str) -> None:
        """Forget the response stored under C{response_id}, if any."""
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._text -= entry[2]

    def _expire(self) -> None:
        """Drop the responses older than the age limit, oldest first."""
        cutoff = self._now() - self._max_age
        while self._entries:
            response_id, (stored_at, _, _) = next(iter(self._entries.items()))
            if stored_at > cutoff:
                return
            self._drop(response_id)
