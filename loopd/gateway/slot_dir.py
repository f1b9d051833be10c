# -*- test-case-name: loopd.test.test_gateway_slot_dir -*-
"""
The directory where llama-server writes slot files (its C{--slot-save-path}, an endpoint's
C{slot_dir}), as loopd keeps it: checked before loopd starts, and loopd's own files in it
made private and deleted when they are of no more use.

A slot file is a session's KV cache: its prompt as token ids, which anyone who can read the
file can turn back into text with the model's vocabulary. llama-server writes it with the
process's umask (0644 as usually run) and never deletes it. So:

 - B{The directory is checked} (L{SlotDirectory.check}): it exists, is yours, and neither
   group nor others may enter it, every directory above it as for a socket
   (L{loopd.runtime_dir.check_private_directory}); otherwise loopd refuses to start, saying
   what to do.
 - B{Each file loopd has the server write is made 0600} (L{SlotDirectory.protect}), in case
   the directory's mode is ever loosened.
 - B{Files are deleted} (L{SlotDirectory.delete}) when the slot table says so
   (L{loopd.gateway.slot_store}): after a restore, when the session is over, beyond the
   disk budget; and at start, the files an earlier run left (L{SlotDirectory.clear_stale}:
   nothing knows whose they are any more). L{open_slot_directories} is that start.

Only names of loopd's own form (C{loopd-} and 32 hex digits, C{.bin}) are touched. A file
that is already gone is not an error; any other failure to delete or chmod is logged, and
the request goes on.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Final

from twisted.logger import Logger

from loopd.runtime_dir import check_private_directory
from loopd.settings import Endpoint

__all__ = ["SlotDirectory", "is_loopd_file", "open_slot_directories"]

_log: Final = Logger(namespace="loopd.gateway.slots")

_LOOPD_FILE: Final = re.compile(r"loopd-[0-9a-f]{32}\.bin")
_FILE_MODE: Final = 0o600


def is_loopd_file(name: str) -> bool:
    """Whether C{name} is a slot file name loopd makes (L{loopd.gateway.slot_store.filename})."""
    return _LOOPD_FILE.fullmatch(name) is not None


class SlotDirectory:
    """One endpoint's slot directory, as seen from loopd's machine."""

    def __init__(self, endpoint: str, path: str) -> None:
        """
        @param endpoint: the endpoint's name, for the messages.
        @param path: the directory (the server's C{--slot-save-path}).
        """
        self.endpoint = endpoint
        self.path = path

    def check(self) -> None:
        """
        Refuse a directory others could read slot files in (module docstring).

        @raise loopd.runtime_dir.DirectoryError: (or its L{UnsafeDirectoryError
            <loopd.runtime_dir.UnsafeDirectoryError>}) with a one-line reason.
        """
        check_private_directory(self.path, f"slot directory of endpoint {self.endpoint}")

    def clear_stale(self) -> tuple[int, int]:
        """
        Delete the slot files an earlier run of loopd left here.

        @return: how many files were deleted, and their bytes.
        """
        count = size = 0
        with os.scandir(self.path) as entries:
            names = [(e.name, e.stat(follow_symlinks=False).st_size) for e in entries]
        for name, bytes_ in names:
            if is_loopd_file(name) and self.delete(name):
                count += 1
                size += bytes_
        return count, size

    def protect(self, name: str) -> None:
        """Make loopd's file C{name} readable and writable by its owner only."""
        if not is_loopd_file(name):
            raise ValueError(f"not a loopd slot file name: {name!r}")
        try:
            # The directory is checked private: nobody else can have put a symlink here.
            os.chmod(os.path.join(self.path, name), _FILE_MODE)
        except FileNotFoundError:
            return
        except OSError as e:
            _log.warn(
                "cannot make slot file {name} of {endpoint} private: {why}",
                name=name,
                endpoint=self.endpoint,
                why=e.strerror,
            )

    def delete(self, name: str) -> bool:
        """
        Delete loopd's file C{name}.

        @return: whether a file was deleted (not one already gone, nor one that could not be).
        """
        if not is_loopd_file(name):
            raise ValueError(f"not a loopd slot file name: {name!r}")
        try:
            os.unlink(os.path.join(self.path, name))
        except FileNotFoundError:
            return False
        except OSError as e:
            _log.warn(
                "cannot delete slot file {name} of {endpoint}: {why}",
                name=name,
                endpoint=self.endpoint,
                why=e.strerror,
            )
            return False
        return True


def open_slot_directories(endpoints: Iterable[Endpoint]) -> list[SlotDirectory]:
    """
    Before loopd starts: check the slot directory of every endpoint that saves slots, and
    delete the files an earlier run left in it (logged with their count and bytes).

    @raise loopd.runtime_dir.DirectoryError: a directory is unsafe or unusable (the first
        one found), with a one-line reason.
    """
    opened = []
    for endpoint in endpoints:
        if not endpoint.slot_save or endpoint.slot_dir is None:
            continue
        directory = SlotDirectory(endpoint.name, endpoint.slot_dir)
        directory.check()
        count, size = directory.clear_stale()
        if count:
            _log.info(
                "deleted {count} slot files ({size} bytes) an earlier run left in {path}",
                count=count,
                size=size,
                path=endpoint.slot_dir,
            )
        opened.append(directory)
    return opened
