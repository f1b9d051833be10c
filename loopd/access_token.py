# -*- test-case-name: loopd.test.test_access_token -*-
"""
The token of loopd's TCP listener (DESIGN decision 41): its file, and the check of what a
request presents.

The file is made once and read ever after. L{load_or_create_token} writes a new token into
a private temporary file (C{O_CREAT | O_EXCL | O_NOFOLLOW}, mode 0600) and publishes it with
C{link()}, which never replaces an existing file: of two starts racing, one links its token
and the other finds the file there and reads it, so both use the same token and neither
reads a half-written one. A file that is not a regular file of yours, or that group or
others may read or write, is refused rather than repaired: its token may have leaked, and
the message says to remove it (a new one is made) or C{chmod 600} it.

By default the file is C{$XDG_STATE_HOME/loopd/token} (else C{~/.local/state/loopd/token}):
state that outlives a reboot, so an agent's settings that hold the token keep working, and
not in the config directory, which people often keep in a public dotfiles repository.
C{[server] token_file} names another.

L{token_matches} is pure: it compares in constant time (C{hmac.compare_digest}).
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import stat
from collections.abc import Mapping
from typing import Final

from loopd.runtime_dir import DirectoryError, describe, prepare_directory
from loopd.settings import Server

__all__ = [
    "TokenError",
    "default_token_path",
    "load_or_create_token",
    "new_token",
    "presented_tokens",
    "token_matches",
    "token_path",
]

#: What a token file may hold: printable ASCII without spaces (one may write one's own).
_TOKEN_TEXT: Final = re.compile(r"[\x21-\x7e]{16,1024}")
#: The most a token file is read: a token and its newline, with room to spare.
_READ_LIMIT: Final = 4096
_BEARER: Final = re.compile(rb"[Bb][Ee][Aa][Rr][Ee][Rr][ \t]+(\S+)[ \t]*")


class TokenError(Exception):
    """The token file cannot be used; the message is one line that names it and says why."""


def default_token_path(environ: Mapping[str, str] | None = None) -> str:
    """
    C{token} in loopd's state directory: C{$XDG_STATE_HOME/loopd/}, else
    C{~/.local/state/loopd/}.
    """
    env = os.environ if environ is None else environ
    state = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "loopd", "token")


def token_path(server: Server, environ: Mapping[str, str] | None = None) -> str:
    """The token file of a config's C{[server]}: C{token_file}, else L{default_token_path}."""
    return server.token_file or default_token_path(environ)


def new_token() -> str:
    """A fresh token: C{loopd-} and 256 random bits, URL-safe (secret scanners see the prefix)."""
    return "loopd-" + secrets.token_urlsafe(32)


def load_or_create_token(path: str) -> tuple[str, bool]:
    """
    The token in the file at C{path}, made first (with L{new_token}) if there is none, its
    directory too (0700, checked as a socket's directory is: L{prepare_directory}).

    @return: the token, and whether this call made the file.
    @raise TokenError: the directory or the file cannot be used (unsafe, unreadable, not a
        token); the message says what to do.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        prepare_directory(directory)
    except DirectoryError as error:
        raise TokenError(f"token file {path}: {error}") from None
    if os.path.lexists(path):
        return _read(path), False
    created = _publish(path, new_token())
    return _read(path), created


def _publish(path: str, token: str) -> bool:
    """
    Write C{token} to a private temporary file beside C{path} and link it to C{path};
    C{False} when another process linked its token first (the file exists).
    """
    temporary = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(temporary, flags, 0o600)
    except OSError as error:
        raise TokenError(f"token file {path}: cannot create it: {error.strerror}") from None
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (token + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temporary, path)
        except FileExistsError:
            return False
        except OSError as error:
            raise TokenError(f"token file {path}: cannot create it: {error.strerror}") from None
        return True
    finally:
        os.unlink(temporary)


def _read(path: str) -> str:
    """
    The token in the file at C{path}, which must be a regular file of yours that nobody else
    may read or write, holding 16 to 1024 printable characters without spaces.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as error:
        if os.path.islink(path):
            raise TokenError(f"token file {path} is a symlink; loopd does not follow one") from None
        raise TokenError(f"token file {path}: cannot read it: {error.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TokenError(f"token file {path} is not a regular file ({describe(info)})")
        if info.st_uid != os.getuid():
            raise TokenError(
                f"token file {path} is not yours ({describe(info)}); remove it and loopd makes "
                "a new one"
            )
        if info.st_mode & 0o077:
            raise TokenError(
                f"token file {path} may be read or written by others "
                f"(mode {stat.S_IMODE(info.st_mode):04o}), so its token may have leaked: "
                "remove it and loopd makes a new one (or, if nobody else could read it, "
                f"chmod 600 {path})"
            )
        raw = os.read(fd, _READ_LIMIT)
    finally:
        os.close(fd)
    text = raw.decode("ascii", errors="replace").strip()
    if not _TOKEN_TEXT.fullmatch(text):
        raise TokenError(
            f"token file {path} does not hold a token (16 to 1024 printable characters "
            "without spaces); remove it and loopd makes a new one"
        )
    return text


def presented_tokens(authorization: bytes | None, api_key: bytes | None) -> list[bytes]:
    """
    The tokens a request presents: the one of C{Authorization: Bearer TOKEN} (the scheme in
    any case) and the value of C{x-api-key}, each when there is one.
    """
    found = []
    if authorization is not None:
        match = _BEARER.fullmatch(authorization.strip())
        if match is not None:
            found.append(match.group(1))
    if api_key is not None and api_key.strip():
        found.append(api_key.strip())
    return found


def token_matches(token: str, presented: list[bytes]) -> bool:
    """
    Whether one of C{presented} is C{token}, each compared in constant time; every one is
    compared, so the time does not say which matched.
    """
    expected = token.encode("ascii")
    matched = False
    for candidate in presented:
        matched |= hmac.compare_digest(expected, candidate)
    return matched
