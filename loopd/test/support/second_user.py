"""
A second Unix user for the tests of directory and socket ownership: files given to another
uid (as root, with C{chown}), and filesystem steps run as that user in a child process.

Both need root. Without it the tests that use them skip with L{NOT_ROOT} as the reason.
"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
import traceback
from collections.abc import Callable

__all__ = [
    "NOT_ROOT",
    "OTHER_GID",
    "OTHER_UID",
    "as_other_user",
    "give_away",
    "is_root",
    "shared_temp_dir",
]

NOT_ROOT = "needs root: only root can make files owned by another user or run as one"


def _other() -> tuple[int, int]:
    """The uid and gid of C{nobody}, the unprivileged user every system has, else 65534."""
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        return 65534, 65534
    return entry.pw_uid, entry.pw_gid


OTHER_UID, OTHER_GID = _other()
"""The second user: neither the tests' user nor root."""


def is_root() -> bool:
    """Whether the tests run as root (and so may act as L{OTHER_UID})."""
    return os.geteuid() == 0


def give_away(path: str) -> None:
    """Make C{path} (not what a symlink points to) owned by the second user."""
    os.lchown(path, OTHER_UID, OTHER_GID)


def shared_temp_dir(cleanup: Callable[..., object]) -> str:
    """
    A short new directory that every user may create entries in, as in C{/tmp}: owned by
    root, mode 1777 (sticky). C{cleanup} is the test's C{addCleanup}.
    """
    directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
    os.chmod(directory, 0o1777)
    cleanup(shutil.rmtree, directory, True)
    return directory


def as_other_user(step: Callable[[], object]) -> None:
    """
    Run C{step} as the second user (groups dropped) in a forked child, and wait for it. The
    child only makes system calls and exits with C{os._exit}: nothing of the parent's
    reactor runs in it. (A forked child, not a new interpreter: the interpreter may sit
    where the second user cannot read it.)

    @raise AssertionError: C{step} raised; the message holds the child's traceback.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(OTHER_GID)
            os.setuid(OTHER_UID)
            os.umask(0o022)
            step()
            status = 0
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            os.write(write_end, traceback.format_exc().encode())
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise AssertionError(f"as uid {OTHER_UID}: {report or 'the child failed'}")
