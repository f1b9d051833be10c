# -*- test-case-name: loopd.test.test_llama_token_list -*-
"""
How many token ids a C{POST /tokenize} answer holds, counted as its bytes arrive, without
holding them: llama-server answers C{{"tokens": [id, id, ...]}}, some 7 bytes an id, so the
ids of a multi-megabyte prompt are tens of megabytes of JSON and, decoded, a Python list
many times that. L{TokenListCounter} reads the answer in pieces, keeps a few bytes, and says
how many ids there were, or raises L{Protocol} for an answer of another shape.

Pure: bytes in, a count out.
"""

from __future__ import annotations

import re
from typing import Final

from loopd.errors import Protocol

__all__ = ["TokenListCounter"]

#: The answer up to its array: C{{"tokens": [}, any JSON whitespace between.
_OPENING: Final = re.compile(rb'[ \t\r\n]*\{[ \t\r\n]*"tokens"[ \t\r\n]*:[ \t\r\n]*\[')
#: What may follow the array: the object's end, whitespace around it.
_CLOSING: Final = re.compile(rb"[ \t\r\n]*\}[ \t\r\n]*")
#: The most bytes kept before the array or after it (the opening is some 15 bytes).
_EDGE_BYTES: Final = 64
#: The bytes an array of non-negative integer ids may hold.
_ARRAY_BYTES: Final = b"0123456789, \t\r\n"


class TokenListCounter:
    """
    Counts the ids of one C{/tokenize} answer fed in pieces (L{feed}), then L{count}.
    """

    def __init__(self) -> None:
        """Nothing read yet."""
        self._head = b""
        self._in_array = False
        self._after = b""
        self._closed = False
        self._commas = 0
        self._digits = False
        # The array's last byte that is not whitespace, "[" before the first.
        self._last = b"["

    def feed(self, data: bytes) -> None:
        """
        The next piece of the answer.

        @raise Protocol: the answer is not C{{"tokens": [ids]}}.
        """
        if self._closed:
            self._after += data
            if len(self._after) > _EDGE_BYTES:
                raise Protocol("/tokenize answered more than its list of token ids")
            return
        if not self._in_array:
            self._head += data
            found = _OPENING.match(self._head)
            if found is None:
                if len(self._head) > _EDGE_BYTES or not _could_open(self._head):
                    raise Protocol("/tokenize did not answer a list of token ids")
                return
            self._in_array = True
            data, self._head = self._head[found.end() :], b""
        end = data.find(b"]")
        inside = data if end < 0 else data[:end]
        if inside.translate(None, _ARRAY_BYTES):
            raise Protocol("/tokenize answered something other than token ids")
        compact = inside.translate(None, b" \t\r\n")
        joined = self._last + compact
        if b",," in joined or joined.startswith(b"[,"):
            raise Protocol("/tokenize answered a list with an empty item")
        if compact:
            self._last = compact[-1:]
            self._commas += compact.count(b",")
            self._digits = self._digits or bool(compact.strip(b","))
        if end >= 0:
            if self._last == b",":
                raise Protocol("/tokenize answered a list with an empty item")
            self._closed = True
            self.feed(data[end + 1 :])

    def count(self) -> int:
        """
        The number of ids, once the whole answer was fed.

        @raise Protocol: the answer ended before its list did, or with more than its end.
        """
        if not self._closed or not _CLOSING.fullmatch(self._after):
            raise Protocol("/tokenize answered an unfinished list of token ids")
        return self._commas + 1 if self._digits else 0


def _could_open(head: bytes) -> bool:
    """Whether C{head} may still become the answer's opening (it is a prefix of one)."""
    compact = b"".join(head.split())
    return b'{"tokens":['.startswith(compact)
