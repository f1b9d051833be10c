# -*- test-case-name: loopd.test.test_digest -*-
"""
SHA-256 of bytes, whole or fed in pieces: the hash that the startup self-test compares with
C{[endpoint.expect] chat_template_sha256}.
"""

from __future__ import annotations

import hashlib

__all__ = ["DIGEST_SIZE", "Sha256", "sha256", "sha256_hex"]

#: The length of a SHA-256 digest, in bytes.
DIGEST_SIZE = 32


class Sha256:
    """
    An incremental SHA-256: feed pieces with L{update}, read the digest at any point.
    """

    def __init__(self, data: bytes = b"") -> None:
        """
        @param data: a first piece, if any.
        """
        self._state = hashlib.sha256(data)

    def update(self, data: bytes) -> Sha256:
        """
        Feed one more piece; returns C{self} so calls can be chained.
        """
        self._state.update(data)
        return self

    def digest(self) -> bytes:
        """
        The 32-byte digest of everything fed so far; feeding may go on afterwards.
        """
        return self._state.digest()

    def hexdigest(self) -> str:
        """
        L{digest} as 64 lowercase hex digits.
        """
        return self._state.hexdigest()


def sha256(data: bytes) -> bytes:
    """
    The 32-byte SHA-256 digest of C{data}.
    """
    return hashlib.sha256(data).digest()


def sha256_hex(data: bytes) -> str:
    """
    The SHA-256 digest of C{data} as 64 lowercase hex digits.
    """
    return hashlib.sha256(data).hexdigest()
