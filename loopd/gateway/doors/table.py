# -*- test-case-name: loopd.test.test_doors_table -*-
"""
Which path is which front door: the one table the site builds its door routes from, and the
HTTP channel and the TCP token guard their error shapes (so that every refusal under a
door's path is in that door's shape). A fourth API is one more entry here, with its reader
and writer (L{loopd.gateway.doors}).

Pure: values, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loopd.gateway.doors.chat import ChatDoor
from loopd.gateway.doors.door import Door
from loopd.gateway.doors.hosted_tools import HostedTools
from loopd.gateway.doors.messages import MessagesDoor
from loopd.gateway.doors.responses import ResponsesDoor
from loopd.gateway.doors.responses_store import ResponseStore

__all__ = ["CHAT_PATH", "MESSAGES_PATH", "RESPONSES_PATH", "FrontDoors", "front_doors"]

CHAT_PATH = b"/v1/chat/completions"
"""OpenAI chat completions."""
MESSAGES_PATH = b"/v1/messages"
"""Anthropic Messages (and, under it, C{count_tokens})."""
RESPONSES_PATH = b"/v1/responses"
"""OpenAI Responses."""


@dataclass(frozen=True)
class FrontDoors:
    """
    One gateway's front doors.

    @ivar by_path: each door by the path it answers, in the order the index lists them.
    @ivar messages: the Messages door, which also reads C{/v1/messages/count_tokens}.
    """

    by_path: tuple[tuple[bytes, Door], ...]
    messages: MessagesDoor


def front_doors(hosted_tools: HostedTools, seconds: Callable[[], float]) -> FrontDoors:
    """
    The front doors of one gateway, shared by all its listeners (a Responses follow-up may
    come on another socket than the response it continues).

    @param hosted_tools: what a hosted tool does to a request, C{[doors] hosted_tools}.
    @param seconds: the clock the stored responses expire by (the reactor's C{seconds}).
    """
    messages = MessagesDoor(hosted_tools)
    return FrontDoors(
        by_path=(
            (CHAT_PATH, ChatDoor()),
            (MESSAGES_PATH, messages),
            (RESPONSES_PATH, ResponsesDoor(ResponseStore(seconds), hosted_tools)),
        ),
        messages=messages,
    )
