"""
Tests for L{loopd.access_token}: the token file (0600, made once, the race of two starts,
read back, refused when others may read it) and the check of what a request presents.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading

from twisted.trial.unittest import SynchronousTestCase

from loopd.access_token import (
    TokenError,
    _publish,
    default_token_path,
    load_or_create_token,
    new_token,
    presented_tokens,
    token_matches,
    token_path,
)
from loopd.settings import Server


class TokenFileTests(SynchronousTestCase):
    """
    L{load_or_create_token} makes the file once and reads it ever after.
    """

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="ldt", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.path = os.path.join(self.directory, "state", "loopd", "token")

    def test_made_private(self) -> None:
        """The first call makes a 0600 file in a 0700 directory, and nothing else."""
        token, created = load_or_create_token(self.path)
        self.assertTrue(created)
        self.assertTrue(token.startswith("loopd-"))
        self.assertEqual(stat.S_IMODE(os.stat(self.path).st_mode), 0o600)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(self.path)).st_mode), 0o700)
        self.assertEqual(os.listdir(os.path.dirname(self.path)), ["token"])
        with open(self.path) as f:
            self.assertEqual(f.read(), token + "\n")

    def test_read_back(self) -> None:
        """A later call reads the same token and makes nothing."""
        first, _ = load_or_create_token(self.path)
        second, created = load_or_create_token(self.path)
        self.assertEqual((second, created), (first, False))

    def test_own_token(self) -> None:
        """A token one wrote oneself (0600) is read as it is, whitespace stripped."""
        os.makedirs(os.path.dirname(self.path), mode=0o700)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"  my-own-token-0123456789\n")
        os.close(fd)
        self.assertEqual(load_or_create_token(self.path), ("my-own-token-0123456789", False))

    def test_publish_never_replaces(self) -> None:
        """Linking a second token where one is already leaves the first, and no temp file."""
        os.makedirs(os.path.dirname(self.path), mode=0o700)
        self.assertTrue(_publish(self.path, "a" * 20))
        self.assertFalse(_publish(self.path, "b" * 20))
        self.assertEqual(load_or_create_token(self.path), ("a" * 20, False))
        self.assertEqual(os.listdir(os.path.dirname(self.path)), ["token"])

    def test_race(self) -> None:
        """Sixteen starts at once all get the same token; exactly one made it."""
        barrier = threading.Barrier(16)
        results: list[tuple[str, bool]] = []

        def start() -> None:
            barrier.wait()
            results.append(load_or_create_token(self.path))

        threads = [threading.Thread(target=start) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        self.assertEqual(len(results), 16)
        self.assertEqual(len({token for token, _ in results}), 1)
        self.assertEqual(sum(created for _, created in results), 1)
        self.assertEqual(os.listdir(os.path.dirname(self.path)), ["token"])

    def test_readable_by_others_refused(self) -> None:
        """A token file group or others may read is refused, saying what to do."""
        load_or_create_token(self.path)
        os.chmod(self.path, 0o644)
        error = self.assertRaises(TokenError, load_or_create_token, self.path)
        self.assertIn("mode 0644", str(error))
        self.assertIn("remove it and loopd makes a new one", str(error))
        self.assertIn(f"chmod 600 {self.path}", str(error))

    def test_symlink_refused(self) -> None:
        """A symlink in the token file's place is not followed."""
        os.makedirs(os.path.dirname(self.path), mode=0o700)
        target = os.path.join(self.directory, "elsewhere")
        _publish(target, "t" * 20)
        os.symlink(target, self.path)
        error = self.assertRaises(TokenError, load_or_create_token, self.path)
        self.assertIn("is a symlink", str(error))

    def test_not_a_token_refused(self) -> None:
        """A file that holds no token (too short, spaces) is refused."""
        os.makedirs(os.path.dirname(self.path), mode=0o700)
        for text in (b"", b"short", b"has some spaces in it\n"):
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, text)
            os.close(fd)
            error = self.assertRaises(TokenError, load_or_create_token, self.path)
            self.assertIn("does not hold a token", str(error))

    def test_unsafe_directory_refused(self) -> None:
        """A directory others may write to is refused, as a socket's would be."""
        shared = os.path.join(self.directory, "shared")
        os.mkdir(shared)
        os.chmod(shared, 0o777)
        path = os.path.join(shared, "sub", "token")
        error = self.assertRaises(TokenError, load_or_create_token, path)
        self.assertIn(f"token file {path}", str(error))
        self.assertFalse(os.path.exists(path))


class PathTests(SynchronousTestCase):
    """
    Where the token file is.
    """

    def test_default(self) -> None:
        """In loopd's state directory: $XDG_STATE_HOME/loopd, else ~/.local/state/loopd."""
        self.assertEqual(
            default_token_path({"XDG_STATE_HOME": "/s"}), os.path.join("/s", "loopd", "token")
        )
        home = os.path.expanduser("~")
        expected = os.path.join(home, ".local", "state", "loopd", "token")
        self.assertEqual(default_token_path({}), expected)

    def test_config(self) -> None:
        """[server] token_file wins over the default."""
        self.assertEqual(token_path(Server(token_file="/x/t")), "/x/t")
        self.assertEqual(token_path(Server(), {"XDG_STATE_HOME": "/s"}), "/s/loopd/token")

    def test_new_tokens_differ(self) -> None:
        """Each new token is fresh: 256 random bits after the prefix."""
        tokens = {new_token() for _ in range(50)}
        self.assertEqual(len(tokens), 50)
        self.assertTrue(all(len(token) == len("loopd-") + 43 for token in tokens))


class CheckTests(SynchronousTestCase):
    """
    L{presented_tokens} and L{token_matches}.
    """

    def test_presented(self) -> None:
        """Bearer (any case, extra blanks) and x-api-key are read; other schemes are not."""
        self.assertEqual(presented_tokens(b"Bearer abc", None), [b"abc"])
        self.assertEqual(presented_tokens(b"bearer  abc ", None), [b"abc"])
        self.assertEqual(presented_tokens(None, b"xyz"), [b"xyz"])
        self.assertEqual(presented_tokens(b"BEARER a", b"b"), [b"a", b"b"])
        self.assertEqual(presented_tokens(b"Basic abc", None), [])
        self.assertEqual(presented_tokens(b"Bearer", b" "), [])
        self.assertEqual(presented_tokens(None, None), [])

    def test_matches(self) -> None:
        """The token matches itself only; any one of several presented may be it."""
        token = "loopd-" + "x" * 43
        self.assertTrue(token_matches(token, [token.encode()]))
        self.assertTrue(token_matches(token, [b"wrong", token.encode()]))
        self.assertFalse(token_matches(token, [token.encode()[:-1]]))
        self.assertFalse(token_matches(token, [token.encode() + b"x"]))
        self.assertFalse(token_matches(token, []))
