# -*- test-case-name: loopd.test.test_gateway_translate -*-
"""
A chat request's body into its JSON object: UTF-8 JSON with JavaScript's limits, decoded
once per request and then read by both the C{auto} router and the request check.
"""

from __future__ import annotations

from typing import Any

from loopd import strict_json
from loopd.gateway.errors import GatewayError

__all__ = ["decode_request"]


def _refuse(code: str, problem: str) -> GatewayError:
    """The 400 for a body that is not a JSON object."""
    return GatewayError(400, f"body: {problem}", "invalid_request_error", code)


def decode_request(body: bytes) -> dict[str, Any]:
    """
    Decode a request body into its JSON object (no NaN, no infinities, no lone surrogates).

    @raise GatewayError: 400 C{invalid_json} or C{not_an_object}.
    """
    try:
        document = strict_json.decode(body, interoperable=True)
    except strict_json.JSONError as error:
        raise _refuse("invalid_json", f"not valid UTF-8 JSON ({error})") from None
    if not isinstance(document, dict):
        raise _refuse("not_an_object", "expected a JSON object")
    return document
