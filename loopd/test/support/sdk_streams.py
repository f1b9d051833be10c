"""
What the real SDKs make of a stream loopd wrote: each SDK reads the bytes through a mock HTTP
transport and accumulates them with its own stream helpers, as an agent built on it would.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx2
import openai

__all__ = ["anthropic_message", "chat_completion", "responses_final"]


def _transport(raw: bytes) -> httpx2.Client:
    """An HTTP client whose every request is answered 200 with the event stream C{raw}."""

    def handle(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=raw)

    return httpx2.Client(transport=httpx2.MockTransport(handle))


def anthropic_message(raw: bytes) -> anthropic.types.Message:
    """The message the anthropic SDK's C{messages.stream} accumulates from C{raw}."""
    client = anthropic.Anthropic(
        api_key="k", base_url="http://loopd", max_retries=0, http_client=_transport(raw)
    )
    user: Any = {"role": "user", "content": "Hi"}
    with client.messages.stream(model="m", max_tokens=100, messages=[user]) as stream:
        return stream.get_final_message()


def responses_final(raw: bytes) -> Any:
    """The response the openai SDK's C{responses.stream} accumulates from C{raw}."""
    client = openai.OpenAI(
        api_key="k", base_url="http://loopd/v1", max_retries=0, http_client=_transport(raw)
    )
    with client.responses.stream(model="m", input="hi") as stream:
        for _ in stream:
            pass
        return stream.get_final_response()


def chat_completion(raw: bytes) -> Any:
    """The completion the openai SDK's C{chat.completions.stream} accumulates from C{raw}."""
    client = openai.OpenAI(
        api_key="k", base_url="http://loopd/v1", max_retries=0, http_client=_transport(raw)
    )
    user: Any = {"role": "user", "content": "Hi"}
    with client.chat.completions.stream(model="m", messages=[user]) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()
