"""
The client side of the Agent Client Protocol (ACP), the protocol through which editors
such as Zed drive a coding agent: newline-delimited JSON-RPC 2.0 over the agent's stdio
(C{initialize}, C{session/new} or C{session/load}, C{session/prompt}; the agent streams
C{session/update} notifications and asks C{session/request_permission}). The tests of
real agents use it to continue a Cline task without a terminal
(L{loopd.test.support.agents.AgentHome.acp_turn}).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

__all__ = ["AcpClient", "AcpError"]


class AcpError(Exception):
    """An Agent Client Protocol call was answered with an error, or not at all."""


class AcpClient(ProcessProtocol):
    """
    The client side of the Agent Client Protocol: newline-delimited JSON-RPC 2.0 over the
    agent's stdio. It allows every permission the agent asks for (as an auto-approving
    editor would), refuses other requests, and keeps the text of the agent's messages.

    @ivar texts: the text chunks of the agent's messages (C{agent_message_chunk}) so far.
    @ivar err: the agent's stderr.
    @ivar ended: fires with how the agent's process ended (C{ProcessDone} or
        C{ProcessTerminated}).
    """

    def __init__(self) -> None:
        self.buffer = b""
        self.err = bytearray()
        self.texts: list[str] = []
        self.pending: dict[int, Deferred[dict[str, Any]]] = {}
        self.serial = 0
        self.ended: Deferred[BaseException] = Deferred()

    def call(self, method: str, params: dict[str, Any]) -> Deferred[dict[str, Any]]:
        """Send a request; fires with its result, or fails with L{AcpError}."""
        self.serial += 1
        answer: Deferred[dict[str, Any]] = Deferred()
        self.pending[self.serial] = answer
        self._send({"jsonrpc": "2.0", "id": self.serial, "method": method, "params": params})
        return answer

    def close(self) -> None:
        """Close the agent's input: it exits."""
        if self.transport is not None:
            with contextlib.suppress(ProcessExitedAlready, OSError):
                self.transport.closeStdin()

    def _send(self, message: dict[str, Any]) -> None:
        assert self.transport is not None
        self.transport.write(json.dumps(message).encode() + b"\n")

    def outReceived(self, data: bytes) -> None:
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                self._received(message)

    def _received(self, message: dict[str, Any]) -> None:
        """Dispatch one message: an answer, a request of the agent, or a notification."""
        if "method" not in message and message.get("id") in self.pending:
            answer = self.pending.pop(message["id"])
            if "error" in message:
                answer.errback(AcpError(json.dumps(message["error"])[:2000]))
            else:
                answer.callback(message.get("result") or {})
        elif "method" in message and "id" in message:
            self._answer(message)
        elif message.get("method") == "session/update":
            update = message.get("params", {}).get("update", {})
            if update.get("sessionUpdate") == "agent_message_chunk":
                self.texts.append(str(update.get("content", {}).get("text", "")))

    def _answer(self, request: dict[str, Any]) -> None:
        """Allow a permission the agent asks for; refuse any other request."""
        if request["method"] == "session/request_permission":
            options = request.get("params", {}).get("options", [])
            allow = [o for o in options if str(o.get("kind", "")).startswith("allow")]
            chosen = (allow or options or [{"optionId": ""}])[0]["optionId"]
            outcome = {"outcome": "selected", "optionId": chosen}
            self._send({"jsonrpc": "2.0", "id": request["id"], "result": {"outcome": outcome}})
        else:
            error = {"code": -32601, "message": "not supported by this client"}
            self._send({"jsonrpc": "2.0", "id": request["id"], "error": error})

    def errReceived(self, data: bytes) -> None:
        self.err += data

    def processEnded(self, reason: Failure) -> None:
        for answer in self.pending.values():
            answer.errback(AcpError(f"the agent ended before answering: {reason.value}"))
        self.pending.clear()
        self.ended.callback(reason.value if reason.value is not None else ProcessDone(None))
