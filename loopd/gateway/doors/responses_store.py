# -*- test-case-name: loopd.test.test_doors_responses_store -*-
"""
The finished responses of C{POST /v1/responses} that a later request may continue with
C{previous_response_id} (L{loopd.gateway.doors.responses}).

A bounded store in memory: at most L{MAX_RESPONSES} responses, each for at most
L{MAX_AGE_SECONDS} after it was stored; past either limit the oldest goes first. Nothing
survives a restart, and a response that is gone is an unknown id to the front door (400
C{previous_response_not_found}). Pure: the clock is injected, nothing here schedules or
does I/O (expired responses go when the store is next used).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from loopd.llama.types import Assistant, ChatMessage

__all__ = ["MAX_AGE_SECONDS", "MAX_RESPONSES", "ResponseStore", "StoredResponse"]

MAX_RESPONSES: Final = 1000
"""The most responses the store keeps."""
MAX_AGE_SECONDS: Final = 3600.0
"""How long, in seconds, a stored response can be continued: one hour."""


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


class ResponseStore:
    """
    Finished responses by id, bounded by count and age, oldest evicted first.
    """

    def __init__(
        self,
        now: Callable[[], float],
        max_responses: int = MAX_RESPONSES,
        max_age: float = MAX_AGE_SECONDS,
    ) -> None:
        """
        @param now: the clock, in seconds (C{reactor.seconds}).
        @param max_responses: the most responses kept.
        @param max_age: how long a response is kept, in seconds.
        @raise ValueError: for a limit below 1 response or not above 0 seconds.
        """
        if max_responses < 1 or max_age <= 0:
            raise ValueError("a response store keeps at least 1 response for some time")
        self._now = now
        self._max_responses = max_responses
        self._max_age = max_age
        # Insertion order is age order: a response is stored once, when it finishes.
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    def __len__(self) -> int:
        """How many responses are kept now (expired ones no longer count)."""
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, response: StoredResponse) -> None:
        """
        Keep C{response} under C{response_id} from now on, evicting the oldest past the
        count limit. Storing an id again replaces it and makes it the newest.
        """
        self._entries.pop(response_id, None)
        self._entries[response_id] = (self._now(), response)
        self._expire()
        while len(self._entries) > self._max_responses:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The response stored under C{response_id}, C{None} if it is unknown or expired."""
        self._expire()
        entry = self._entries.get(response_id)
        return None if entry is None else entry[1]

    def _expire(self) -> None:
        """Drop the responses older than the age limit, oldest first."""
        cutoff = self._now() - self._max_age
        while self._entries:
            stored_at, _ = next(iter(self._entries.values()))
            if stored_at > cutoff:
                return
            self._entries.popitem(last=False)
