# -*- test-case-name: loopd.test.test_doors_fields -*-
"""
The one field reader of the front doors: a body decoded into its JSON object
(L{decode_body}), the 400 that names a field (L{fail}), a client's value quoted in a message
(L{show}), and the checks every door makes of a request's plain fields (a boolean, a string,
an object, a number in a range, a whole number), each failing with a 400
C{invalid_request_error} that names the field's path (also its C{param}) and carries the
door's own error code (L{Fields}).

JSON numbers are read as the clients' JavaScript writes them: an integral number such as
C{2.0} is an integer (L{integral}, the one place that says so), and a boolean is no number.

Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NoReturn

from loopd import strict_json
from loopd.gateway.errors import GatewayError

__all__ = ["Fields", "decode_body", "fail", "integral", "show"]


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


def integral(value: object) -> object:
    """C{value} with an integral float (C{2.0}) made an C{int}; any other value as it is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _whole_phrase(low: int) -> str:
    """How a count's error names what it expects."""
    if low == 1:
        return "expected a positive integer"
    return f"expected an integer >= {low}"


@dataclass(frozen=True)
class Fields:
    """
    One door's field reader.

    @ivar shape: the error code of a part of the wrong shape (a message, an input item or a
        block that is not the object or string it must be): C{invalid_message} on chat
        completions and Messages, C{invalid_input} on Responses.
    @ivar value: the error code of a parameter with a wrong value.
    """

    shape: str
    value: str = "invalid_parameter"

    def flag(self, value: object, path: str, default: bool = False) -> bool:
        """An optional boolean, C{default} when absent."""
        if value is None:
            return default
        if not isinstance(value, bool):
            fail(self.value, path, "expected true or false")
        return value

    def string(self, value: object, path: str, code: str | None = None) -> str:
        """A required string; a wrong one fails with C{code}, else the door's shape code."""
        if not isinstance(value, str):
            fail(code or self.shape, path, "expected a string")
        return value

    def mapping(
        self, value: object, path: str, code: str | None = None, *, optional: bool = False
    ) -> dict[str, Any]:
        """
        A JSON object (empty when absent and C{optional}); a wrong one fails with C{code},
        else the door's shape code.
        """
        if optional and value is None:
            return {}
        if not isinstance(value, dict):
            fail(code or self.shape, path, "expected an object")
        return value

    def number(self, value: object, path: str, high: int) -> float | None:
        """An optional number from 0 to C{high}."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= high:
            fail(self.value, path, f"expected a number from 0 to {high}")
        return float(value)

    def count(self, value: object, path: str, *, low: int = 1) -> int:
        """A required whole number of at least C{low} (L{integral}: C{2.0} is one)."""
        value = integral(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            fail(self.value, path, _whole_phrase(low))
        return value
