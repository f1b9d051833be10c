"""
The table of the front doors (L{loopd.gateway.doors.table}): each path's door, the one the
Messages door answers C{count_tokens} with, and one response store for every listener.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.chat import ChatDoor
from loopd.gateway.doors.hosted_tools import HostedTools
from loopd.gateway.doors.messages import MessagesDoor
from loopd.gateway.doors.responses import ResponsesDoor
from loopd.gateway.doors.table import CHAT_PATH, MESSAGES_PATH, RESPONSES_PATH, front_doors
from loopd.gateway.errors import GatewayError


class FrontDoorsTests(SynchronousTestCase):
    """L{front_doors}."""

    def test_paths(self) -> None:
        """The three APIs by their paths, each door named after its API."""
        doors = front_doors("drop", Clock().seconds)
        self.assertEqual(
            [(path, type(door), door.name) for path, door in doors.by_path],
            [
                (CHAT_PATH, ChatDoor, "chat"),
                (MESSAGES_PATH, MessagesDoor, "messages"),
                (RESPONSES_PATH, ResponsesDoor, "responses"),
            ],
        )
        self.assertIs(dict(doors.by_path)[MESSAGES_PATH], doors.messages)

    def test_hosted_tools(self) -> None:
        """C{[doors] hosted_tools} reaches the doors that read hosted tools."""
        web_search = b'{"model":"m","input":"hi","tools":[{"type":"web_search"}]}'
        no_headers: dict[bytes, bytes] = {}
        cases: tuple[tuple[HostedTools, tuple[str, ...] | None], ...] = (
            ("drop", ("web_search",)),
            ("refuse", None),
        )
        for choice, dropped in cases:
            responses = dict(front_doors(choice, Clock().seconds).by_path)[RESPONSES_PATH]
            with self.subTest(choice):
                if dropped is None:
                    error = self.assertRaises(
                        GatewayError, responses.read, web_search, no_headers.get, lambda: "c"
                    )
                    self.assertEqual(error.code, "hosted_tool")
                else:
                    request = responses.read(web_search, no_headers.get, lambda: "c")
                    self.assertEqual(request.dropped, dropped)
