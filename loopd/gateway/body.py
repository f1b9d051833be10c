# -*- test-case-name: loopd.test.test_gateway_translate -*-
"""
What every front door's reader shares: the body decoded into a JSON object, the 400 that
names a field, and a client's value quoted in a message. Pure: no I/O.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

from loopd import strict_json
from loopd.gateway.errors import GatewayError

__all__ = ["decode_body", "fail", "show"]


def decode_body(body: bytes) -> dict[str, Any]:
    """
    The body's JSON object (L{strict_json}'s interoperable profile: no C{NaN}, no number too
    large for a double, no lone surrogate).

    @raise GatewayError: 400 C{invalid_json} or C{not_an_object}.
    """
    try:
        document = strict_json.decode(body, interoperable=True)
    except strict_json.JSONError as error:
        raise GatewayError(
            400, f"body: not valid UTF-8 JSON ({error})", "invalid_request_error", "invalid_json"
        ) from None
    if not isinstance(document, dict):
        raise GatewayError(
            400, "body: expected a JSON object", "invalid_request_error", "not_an_object"
        )
    return document


def fail(code: str, path: str, problem: str) -> NoReturn:
    """
    Raise the 400 C{invalid_request_error} C{code} for the field at C{path}, which is also
    its C{param}.
    """
    raise GatewayError(400, f"{path}: {problem}", "invalid_request_error", code, param=path)


def show(value: object) -> str:
    """A client's value quoted for a message, shortened when long."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:56] + '..."'
