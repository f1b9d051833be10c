"""
L{loopd.digest} against published SHA-256 test vectors, whole and fed in two pieces.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from loopd.digest import DIGEST_SIZE, Sha256, sha256, sha256_hex

# (message, expected digest): the FIPS 180 examples, the empty message, and messages of
# 55, 56, 63, 64 and 65 bytes, the lengths around SHA-256's 64-byte block and its 8-byte
# length field, where padding goes wrong first.
VECTORS = [
    (b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    (
        b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
    ),
    (b"a" * 55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"),
    (b"a" * 56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a"),
    (b"a" * 63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34"),
    (b"a" * 64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"),
    (b"a" * 65, "635361c48bb9eab14198e76ea8ab7f1a41685d6ad62aa9146d301d4f17eb0ae0"),
    (b"a" * 1_000_000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"),
]


class Sha256Tests(SynchronousTestCase):
    """
    SHA-256 of whole messages and of messages fed in pieces.
    """

    def test_whole(self) -> None:
        """
        Each vector hashes to its published digest, as bytes and as hex.
        """
        for message, expected in VECTORS:
            self.assertEqual(sha256_hex(message), expected)
            self.assertEqual(sha256(message), bytes.fromhex(expected))
            self.assertEqual(len(sha256(message)), DIGEST_SIZE)

    def test_two_pieces(self) -> None:
        """
        Each vector split at every point tried (start, middle, one before the end, end)
        hashes the same as when whole.
        """
        for message, expected in VECTORS:
            for cut in sorted({0, len(message) // 2, max(0, len(message) - 1), len(message)}):
                digest = Sha256(message[:cut]).update(message[cut:]).hexdigest()
                self.assertEqual(digest, expected, f"{len(message)} bytes cut at {cut}")

    def test_digest_midway(self) -> None:
        """
        Reading the digest does not end the hash: feeding may go on afterwards.
        """
        state = Sha256(b"ab")
        state.digest()
        self.assertEqual(state.update(b"c").digest(), bytes.fromhex(VECTORS[1][1]))
