# -*- test-case-name: loopd.test.test_runtime_dir -*-
"""
A socket's directory that nobody but you and root controls: checked before loopd listens or
connects, created with mode 0700 when missing, refused with a one-line reason otherwise.

A Unix socket is only as private as its directory: whoever may write in the directory can
rename the socket away and listen in its place, and whoever owns a directory above it can
swap the whole branch. The rules are the ones OpenSSH applies to the files it trusts
(C{safe_path}) and systemd to the paths it follows as root (C{CHASE_SAFE}):

 - Every directory from C{/} down to the socket's own belongs to you or root and is not
   writable by its group or others. Above the socket's own directory a sticky one such as
   C{/tmp} is fine: in a sticky directory only an entry's owner may rename or remove it.
 - The socket's own directory belongs to you or root and is not writable by its group or
   others. Sticky is not enough there, since anyone could bind the socket's name first.
 - A symlink on the way is followed only when it belongs to you or root (it sits in a
   directory already checked, so nobody else can replace it), and where it points is
   checked by the same rules. Another user's link, such as C{/tmp/loopd-0} pointing into
   their home, is refused, and so is their directory.

L{prepare_directory} (before listening) creates each missing directory, intermediate ones
included, with mode 0700 whatever the umask, one component at a time inside a directory
already checked. It repairs one thing: the socket's own directory when it is yours but
writable by group or others, and only when every entry in it is yours, both before and
after the C{chmod 700} (then nobody else has put anything in it, and after the chmod nobody
else can); the repair is logged. A sticky directory that others may write to, such as
C{/tmp} itself, is shared on purpose and never repaired. Anything else is refused and left
as it is.
L{check_directory} (before connecting) creates nothing and repairs nothing.
L{check_private_directory} is the stricter rule for a directory of files others must not
read (llama-server's slot files): it must exist, be yours, and be closed to group and others.
"""

from __future__ import annotations

import os
import pwd
import stat

from twisted.logger import Logger

__all__ = [
    "DirectoryError",
    "UnsafeDirectoryError",
    "check_directory",
    "check_private_directory",
    "describe",
    "describe_owner",
    "prepare_directory",
]

_log = Logger(namespace="loopd.runtime_dir")

_DIRECTORY_MODE = 0o700
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_GROUP_OTHERS = stat.S_IRWXG | stat.S_IRWXO
# As many symlinks as Linux follows in one path before ELOOP.
_MAX_LINKS = 40


class DirectoryError(Exception):
    """
    A directory cannot hold a socket (not a directory, cannot be created); the message is
    one line that says why.
    """


class UnsafeDirectoryError(DirectoryError):
    """
    Someone other than you and root controls the directory, a directory above it, or a
    symlink on the way; the message names the path, its owner and mode, and what to do.
    """


def describe_owner(uid: int) -> str:
    """
    C{"alice (uid 1000)"}, or C{"uid 1000"} for a uid without a user name.
    """
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _kind(mode: int) -> str:
    """What a file of C{mode} is, in words."""
    kinds = (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISFIFO, "FIFO"),
    )
    for test, name in kinds:
        if test(mode):
            return name
    return "device"


def describe(info: os.stat_result) -> str:
    """
    C{"a directory owned by alice (uid 1000), mode 0777"}: the kind, owner and mode of an
    C{lstat} result.
    """
    mode = f"{stat.S_IMODE(info.st_mode):04o}"
    return f"a {_kind(info.st_mode)} owned by {describe_owner(info.st_uid)}, mode {mode}"


def _trusted() -> frozenset[int]:
    """The owners a socket's path may have: the effective user and root."""
    return frozenset({os.geteuid(), 0})


def _owners() -> str:
    """Who may own the path, in words."""
    me = os.geteuid()
    return "you (root)" if me == 0 else f"you ({describe_owner(me)}) or root"


def _lstat(path: str) -> os.stat_result | None:
    """C{os.lstat(path)}, C{None} when it does not exist."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DirectoryError(f"cannot check {path}: {e.strerror}") from None


def _make(path: str) -> None:
    """
    Create the directory C{path} with mode 0700 (not the umask's); someone else creating it
    first is not an error here, since what is there is checked next like anything found.
    """
    try:
        os.mkdir(path, _DIRECTORY_MODE)
    except FileExistsError:
        return
    except OSError as e:
        raise DirectoryError(f"cannot create directory {path}: {e.strerror}") from None
    # The parent was checked: nobody else can have replaced what mkdir just made.
    os.chmod(path, _DIRECTORY_MODE)


def _check_above(directory: str, path: str, info: os.stat_result, what: str) -> None:
    """
    The rule for a directory above the socket's own: yours or root's, and not writable by
    others unless sticky.
    """
    if info.st_uid not in _trusted():
        raise UnsafeDirectoryError(
            f"unsafe {what} {directory}: {path} above it is {describe(info)}, "
            f"not owned by {_owners()}; use a directory of your own"
        )
    if info.st_mode & _OTHERS_WRITE and not info.st_mode & stat.S_ISVTX:
        raise UnsafeDirectoryError(
            f"unsafe {what} {directory}: {path} above it is {describe(info)}, "
            f"writable by others and not sticky; chmod go-w {path} or use another directory"
        )


def _foreign_entry(directory: str) -> tuple[str, os.stat_result] | None:
    """The first entry of C{directory} that is not the effective user's, if any."""
    me = os.geteuid()
    with os.scandir(directory) as entries:
        for entry in entries:
            info = entry.stat(follow_symlinks=False)
            if info.st_uid != me:
                return entry.path, info
    return None


def _check_own(directory: str, info: os.stat_result, repair: bool, what: str) -> None:
    """
    The rule for the socket's own directory: yours or root's and not writable by others;
    with C{repair}, a directory of yours writable by others that holds only your files is
    tightened to 0700.
    """
    if info.st_uid not in _trusted():
        raise UnsafeDirectoryError(
            f"unsafe {what} {directory}: it is {describe(info)}, not owned by "
            f"{_owners()}; remove it (as its owner or root) or use another directory"
        )
    if not info.st_mode & _OTHERS_WRITE:
        return
    if info.st_mode & stat.S_ISVTX:
        # Sticky and open: shared on purpose, as /tmp is; never tightened.
        raise UnsafeDirectoryError(
            f"unsafe {what} {directory}: it is {describe(info)}, a shared "
            "directory that anyone may create names in; put the socket in a directory of "
            "your own (mode 0700) below it"
        )
    if not repair or info.st_uid != os.geteuid():
        raise UnsafeDirectoryError(
            f"unsafe {what} {directory}: it is {describe(info)}, writable by "
            f"others; chmod 700 {directory} (if it is yours) or use a directory of your own"
        )
    foreign = _foreign_entry(directory)
    if foreign is None:
        os.chmod(directory, _DIRECTORY_MODE)
        foreign = _foreign_entry(directory)
    if foreign is not None:
        entry, entry_info = foreign
        raise UnsafeDirectoryError(
            f"unsafe {what} {directory}: it is {describe(info)}, writable by "
            f"others, and holds {entry}, {describe(entry_info)}; remove what is not yours, "
            f"then chmod 700 {directory}"
        )
    _log.warn(
        "{what} {directory} was writable by others (mode {mode:04o}) and held "
        "only your files: now mode 0700",
        what=what,
        directory=directory,
        mode=stat.S_IMODE(info.st_mode),
    )


def _walk(directory: str, *, listening: bool, what: str = "socket directory") -> str | None:
    """
    Check C{directory} and every directory above it from C{/}, following the symlinks that
    may be followed. Listening, create what is missing (mode 0700) and repair the socket's
    own directory where that is provably safe; connecting, stop at the first missing one.

    @param what: the directory's use, for the messages.
    @return: the directory's path with its symlinks resolved; C{None} when it is missing.
    """
    # Not os.path.abspath: ".." must go up from where a symlink led, as the kernel does.
    path = directory if os.path.isabs(directory) else os.path.join(os.getcwd(), directory)
    pending = [part for part in path.split("/") if part not in ("", ".")]
    resolved = "/"
    root = _lstat("/")
    assert root is not None
    _check_above(directory, "/", root, what)
    links = 0
    while pending:
        name = pending.pop(0)
        if name == "..":
            resolved = os.path.dirname(resolved)
            continue
        candidate = os.path.join(resolved, name)
        info = _lstat(candidate)
        if info is None:
            if not listening:
                return None
            _make(candidate)
            info = _lstat(candidate)
            assert info is not None
        if stat.S_ISLNK(info.st_mode):
            links += 1
            target = os.readlink(candidate)
            if info.st_uid not in _trusted():
                raise UnsafeDirectoryError(
                    f"unsafe {what} {directory}: {candidate} is {describe(info)} "
                    f"(to {target}), not owned by {_owners()}; remove it (as its owner or "
                    "root) or use another directory"
                )
            if links > _MAX_LINKS:
                raise DirectoryError(f"cannot use {directory} for a socket: too many symlinks")
            pending[:0] = [part for part in target.split("/") if part not in ("", ".")]
            if target.startswith("/"):
                resolved = "/"
            continue
        if not stat.S_ISDIR(info.st_mode):
            doing = "create directory" if listening else f"use {what}"
            raise DirectoryError(
                f"cannot {doing} {directory}: {candidate} is {describe(info)}, not a directory"
            )
        if pending:
            _check_above(directory, candidate, info, what)
        resolved = candidate
    own = _lstat(resolved)
    assert own is not None
    _check_own(directory, own, repair=listening, what=what)
    return resolved


def prepare_directory(directory: str) -> None:
    """
    Make C{directory} fit to hold a listening socket: create it and any missing directory
    above it with mode 0700, check it and every directory above it, and repair its mode
    when that is provably safe (see the module's docstring).

    @raise UnsafeDirectoryError: someone other than you and root controls it.
    @raise DirectoryError: it cannot be created or is not a directory.
    """
    _walk(directory, listening=True)


def check_directory(directory: str) -> None:
    """
    Check that C{directory}, if it exists, and every directory above it are controlled by
    you and root only, before connecting to a socket in it. Nothing is created or changed.

    @raise UnsafeDirectoryError: someone other than you and root controls it.
    @raise DirectoryError: a path on the way is not a directory or cannot be checked.
    """
    _walk(directory, listening=False)


def check_private_directory(directory: str, what: str) -> None:
    """
    Check that C{directory} exists, passes L{check_directory}'s rules, belongs to you and
    that neither its group nor others may enter or read it (mode 0700 or tighter): a
    directory for files that hold what others must not read (llama-server's slot files
    hold prompts). Nothing is created or changed.

    @param what: the directory's use, for the messages (C{"slot directory"}).
    @raise UnsafeDirectoryError: someone else controls it, or may read in it.
    @raise DirectoryError: it does not exist, is not a directory or cannot be checked.
    """
    resolved = _walk(directory, listening=False, what=what)
    if resolved is None:
        raise DirectoryError(
            f"{what} {directory} does not exist; create it with mkdir -m 700 {directory}"
        )
    info = _lstat(resolved)
    assert info is not None
    if info.st_uid != os.geteuid():
        raise UnsafeDirectoryError(
            f"unsafe {what} {directory}: it is {describe(info)}, not yours "
            f"({describe_owner(os.geteuid())}); use a directory of your own with mode 0700"
        )
    if stat.S_IMODE(info.st_mode) & _GROUP_OTHERS:
        raise UnsafeDirectoryError(
            f"unsafe {what} {directory}: it is {describe(info)}, open to group or others, "
            f"who could read what is in it; chmod 700 {directory}"
        )
