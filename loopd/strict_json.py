# -*- test-case-name: loopd.test.test_strict_json -*-
"""
JSON read the way loopd's peers mean it: the one decoder of the package.

Python's C{json} module accepts more than JSON: C{NaN}, C{Infinity} and C{-Infinity} are
read as numbers, and a nesting deeper than the interpreter's stack raises C{RecursionError}
rather than C{ValueError}. Every reader in loopd (a chat request's body, a llama-server
chunk, the lease protocol's lines, C{llm-queue.json}, the JSON a mesh worker writes in its
text) reads through L{decode}, which holds to JavaScript's C{JSON.parse}:

  - C{NaN}, C{Infinity} and C{-Infinity} are not JSON;
  - a number too large for a double is C{Infinity} (C{float("inf")}), as C{JSON.parse}
    gives; an integer keeps Python's exact value;
  - a string may hold a lone surrogate written as an escape (C{"\\ud800"}), as in
    JavaScript;
  - bytes must be UTF-8; nesting too deep to parse is not JSON.

C{interoperable=True} narrows this to what every JSON implementation reads the same (the
I-JSON profile, RFC 7493): a number too large for a double and a lone surrogate are refused
too. A chat request's body is read so, because it is written back out as UTF-8 JSON to a
server that would refuse both; so is the JSON a mesh worker writes, as the reference's
Rust parser reads it.

Every failure is a L{JSONError} (a C{ValueError}) whose message says what is wrong. Pure.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["JSONError", "decode", "decode_prefix"]


class JSONError(ValueError):
    """The text is not JSON by the rules of this module; the message says why."""


def _refuse_constant(name: str) -> Any:
    """C{NaN}, C{Infinity} and C{-Infinity} are JavaScript values, not JSON."""
    raise JSONError(f"{name} is not JSON")


def _finite_float(literal: str) -> float:
    """A fraction or exponent that fits a double; a larger one is refused."""
    number = float(literal)
    if not math.isfinite(number):
        raise JSONError(f"number {literal[:40]} is too large")
    return number


_JAVASCRIPT = json.JSONDecoder(parse_constant=_refuse_constant)
_INTEROPERABLE = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def _check_surrogates(text: str, value: object) -> None:
    """
    Refuse a lone surrogate in any string of C{value} (decoded from C{text}). Only an escape
    can spell one, so a text without C{\\u} needs no look.
    """
    if "\\u" not in text:
        return
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise JSONError("a string holds a lone surrogate, which UTF-8 cannot carry") from None


def _as_text(data: str | bytes) -> str:
    """C{data} as text: bytes must be UTF-8."""
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise JSONError(f"not UTF-8 ({error})") from None


def decode(data: str | bytes, *, interoperable: bool = False) -> Any:
    """
    The one JSON value of C{data}, surrounding whitespace allowed.

    @param data: the JSON text, or its UTF-8 bytes.
    @param interoperable: also refuse numbers too large for a double and lone surrogates.
    @raise JSONError: C{data} is not JSON by these rules.
    """
    text = _as_text(data)
    value, _ = _read(text, 0, interoperable, whole=True)
    return value


def decode_prefix(text: str, start: int = 0, *, interoperable: bool = False) -> tuple[Any, int]:
    """
    The JSON value that begins exactly at C{text[start]}, and the index just past it; what
    follows it is not read.

    @raise JSONError: no JSON value begins there, by the rules of L{decode}.
    """
    return _read(text, start, interoperable, whole=False)


def _read(text: str, start: int, interoperable: bool, *, whole: bool) -> tuple[Any, int]:
    """
    The value at C{start} and where it ends: the whole of C{text} (whitespace around it
    allowed) when C{whole}, else just the value. Every failure becomes a L{JSONError}.
    """
    decoder = _INTEROPERABLE if interoperable else _JAVASCRIPT
    try:
        if whole:
            value, end = decoder.decode(text), len(text)
        else:
            value, end = decoder.raw_decode(text, start)
    except RecursionError:
        raise JSONError("JSON nests too deeply") from None
    except JSONError:
        raise
    except ValueError as error:
        raise JSONError(str(error)) from None
    if interoperable:
        _check_surrogates(text[start:end], value)
    return value, end
