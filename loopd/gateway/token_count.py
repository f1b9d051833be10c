# -*- test-case-name: loopd.test.test_gateway_token_count -*-
"""
C{POST /v1/messages/count_tokens} (issue 14 item 1): how many input tokens a Messages
request would be, counted with the endpoint's own chat template and tokenizer.

The body is read by L{MessagesDoor.read_count} (a Messages request whose C{max_tokens} is
optional); the endpoint is the one the request would go to (a named endpoint; for C{auto},
a group or no model, the first the router would try; C{mesh} counts as C{auto}); its
server makes the prompt (C{POST /apply-template} with the request's messages, placed as a
chat request's are (L{loopd.gateway.late_system}), tools and thinking switch) and tokenizes
it (C{POST /tokenize}, special tokens added as a completion adds them), and the answer is
C{{"input_tokens": N}}. An C{openai}-kind
endpoint has neither route: its request is a 400 that says so. Every error is in
Anthropic's shape (L{anthropic_error}). Counting takes no slot and no lease.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from loopd.gateway.doors.door import Header
from loopd.gateway.doors.messages import MessagesDoor, anthropic_error
from loopd.gateway.errors import GatewayError, error_for
from loopd.gateway.late_system import LateSystem
from loopd.gateway.request import GatewayRequest
from loopd.gateway.web import write_json
from loopd.llama import Client
from loopd.llama.request import render_messages, render_tools
from loopd.llama.types import ChatMessage
from loopd.moa.roles import VIRTUAL_MODEL_NAME as MESH_MODEL
from loopd.settings import Endpoint

__all__ = ["CountHost", "CountTokens", "template_body"]

_log = Logger(namespace="loopd.gateway.token_count")


class CountHost(Protocol):
    """What counting uses of its gateway (L{loopd.gateway.site.Gateway} has it)."""

    @property
    def clients(self) -> Mapping[str, Client]:
        """The llama client of each endpoint, by name."""

    @property
    def late_system(self) -> LateSystem:
        """Where each endpoint's template puts system messages after the first."""

    def endpoint_for(self, model: str | None) -> Endpoint:
        """
        The endpoint a request's C{model} names.

        @raise GatewayError: 404 for a model no endpoint serves.
        """

    def route_auto(self, request: GatewayRequest) -> tuple[Endpoint, ...] | None:
        """The endpoints to try, in order, for an C{auto} request; C{None} for any other."""


def template_body(request: GatewayRequest) -> dict[str, Any]:
    """
    The C{/apply-template} body of C{request}: its messages, its tools, its tool choice
    and its thinking switch, which are what the chat template renders.
    """
    body: dict[str, Any] = {
        "messages": render_messages(request.messages),
        "chat_template_kwargs": {"enable_thinking": request.thinking},
    }
    if request.tools:
        body["tools"] = render_tools(request.tools)
        if request.tool_choice is not None:
            body["tool_choice"] = request.tool_choice
    if not request.thinking:
        body["reasoning_effort"] = "none"
    return body


class CountTokens(Resource):
    """The C{count_tokens} route of one gateway: C{POST} answers C{{"input_tokens": N}}."""

    isLeaf = True

    def __init__(self, host: CountHost, door: MessagesDoor | None = None) -> None:
        """
        @param host: the gateway whose endpoints count.
        @param door: reads the body (a fresh L{MessagesDoor} by default).
        """
        super().__init__()
        self._host = host
        self._door = door if door is not None else MessagesDoor()

    def render_POST(self, request: Request) -> bytes | int:
        """Count the body's input tokens; answer when the server has."""
        content = request.content
        body = content.read() if content is not None else b""
        counting = maybeDeferred(self.count, body, request.getHeader)
        gone: list[Failure] = []
        request.notifyFinish().addErrback(gone.append)
        request.notifyFinish().addErrback(lambda _: counting.cancel())

        def answer(outcome: tuple[int, object]) -> None:
            # twisted.web refuses to finish a request whose client has left.
            if not gone:
                request.write(write_json(request, *outcome))
                request.finish()

        counting.addCallbacks(
            lambda tokens: (200, {"input_tokens": tokens}), self._failed
        ).addCallback(answer)
        return NOT_DONE_YET

    def count(self, body: bytes, header: Header) -> Deferred[int]:
        """
        The input tokens of the Messages request C{body} with headers C{header}.

        @raise GatewayError: 400 for a bad body or an C{openai}-kind endpoint, 404 for a
            model no endpoint serves, the router's errors.
        """
        parsed = self._door.read_count(body, header)
        endpoint = self._endpoint(parsed)
        if endpoint.kind == "openai":
            raise GatewayError(
                400,
                f"endpoint {endpoint.name} is an openai-kind endpoint, which has no tokenizer "
                "route: loopd cannot count its tokens",
                "invalid_request_error",
                "count_unsupported",
            )
        client = self._host.clients[endpoint.name]

        def count(messages: tuple[ChatMessage, ...]) -> Deferred[int]:
            """Count the request with its messages placed as the endpoint takes them."""
            placed = dataclasses.replace(parsed, messages=messages)
            return client.prompt_tokens(template_body(placed))

        counting: Deferred[int] = self._host.late_system.placed(
            endpoint.name, parsed.messages
        ).addCallback(count)
        return counting

    def _endpoint(self, request: GatewayRequest) -> Endpoint:
        """The endpoint C{request} would go to first."""
        if request.model == MESH_MODEL:
            request = dataclasses.replace(request, model=None)
        candidates = self._host.route_auto(request)
        if candidates is None:
            return self._host.endpoint_for(request.model)
        return candidates[0]

    def _failed(self, failure: Failure) -> tuple[int, object]:
        """The status and Anthropic error body of a count that failed."""
        error = error_for(failure.value or Exception(failure.getErrorMessage()))
        if error.status == 500 and not failure.check(CancelledError):
            _log.failure("count_tokens failed", failure)
        return anthropic_error(error)
