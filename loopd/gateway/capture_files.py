# -*- test-case-name: loopd.test.test_gateway_capture_files -*-
"""
The files of the request capture (C{[capture]}, DESIGN decision 48): a directory of JSON
lines that nobody else may read, kept under a byte budget.

 - B{The directory} (L{open_capture_directory}) is checked before loopd starts: it is
   yours and neither group nor others may enter it (mode 0700), and so is every directory
   above it as for a socket (L{loopd.runtime_dir.check_private_directory}); it is not a
   symlink (set C{dir} to where the link points). A missing directory is made, mode 0700,
   when its parent exists (and is then checked like any other). Otherwise loopd refuses to
   start with a one-line reason. loopd keeps the directory open and makes, writes and
   deletes its files through it, so its files stay in the directory it checked.
 - B{The files} are named by the UTC time of their first line and a counter
   (C{loopd-capture-20261207T101500Z-000001.jsonl}, so their names sort in the order they
   were written), made mode 0600, never through a symlink and never over an existing file.
   One is open at a time; each line goes out in one C{write} (no buffer to flush). A file
   ends when the next line would take it past an eighth of the budget
   (L{FILES_PER_BUDGET}), and the next is begun.
 - B{The budget} (L{CaptureFiles.max_bytes}) counts every capture file in the directory,
   an earlier run's included (they are kept: a capture is for later): while they exceed
   it, the oldest files are deleted. So the directory holds at most the budget and one
   line (the line just written, which may be longer than the budget).
 - B{A failure} to write (a full disk, the directory removed) loses that request's line,
   never the request: it is logged once, and when lines go out again that is logged with
   the count of those lost. A line cut short ends its file (the next line begins a new
   one); a directory gone is opened and checked again at the next line, but not made
   again (it may be a disk that was unmounted). A file deleted under loopd is noticed at
   the next line, which begins a new one.

Only names of the capture's own form are counted, read or deleted.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from twisted.logger import Logger

from loopd.runtime_dir import DirectoryError, UnsafeDirectoryError, check_private_directory

__all__ = [
    "FILES_PER_BUDGET",
    "CaptureFiles",
    "capture_file_names",
    "is_capture_file",
    "open_capture_directory",
]

_log: Final = Logger(namespace="loopd.gateway.capture")

_CAPTURE_FILE: Final = re.compile(r"loopd-capture-\d{8}T\d{6}Z-\d{6}\.jsonl")
_FILE_MODE: Final = 0o600
_DIRECTORY_MODE: Final = 0o700
_GROUP_OTHERS: Final = stat.S_IRWXG | stat.S_IRWXO
#: A file ends before it passes this share of the budget: the budget is kept in eighths.
FILES_PER_BUDGET: Final = 8
_WHAT: Final = "capture directory"
_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC

Write = Callable[[int, bytes], int]


def is_capture_file(name: str) -> bool:
    """Whether C{name} is a capture file's name (L{CaptureFiles} makes no other)."""
    return _CAPTURE_FILE.fullmatch(name) is not None


def capture_file_names(names: list[str]) -> list[str]:
    """The capture files among C{names}, oldest first."""
    return sorted(name for name in names if is_capture_file(name))


def open_capture_directory(path: str, *, make: bool = True) -> int:
    """
    Check the capture directory C{path} (with C{make}, made first, mode 0700, if it is
    missing and its parent exists) and open it (module docstring).

    @return: the directory's file descriptor, for the files' calls.
    @raise DirectoryError: (or L{UnsafeDirectoryError}) with a one-line reason and what to
        do.
    """
    made = _make_if_missing(path) if make else False
    try:
        check_private_directory(path, _WHAT)
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            target = os.path.realpath(path)
            raise UnsafeDirectoryError(
                f"{_WHAT} {path} is a symlink (to {target}): set [capture] dir to {target} itself"
            )
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise DirectoryError(f"cannot open {_WHAT} {path}: {e.strerror}") from None
    except DirectoryError:
        if made:
            _remove_made(path)
        raise
    opened = os.fstat(fd)
    # What was opened is what was checked: nobody else could have swapped it in between.
    if opened.st_uid != os.geteuid() or stat.S_IMODE(opened.st_mode) & _GROUP_OTHERS:
        os.close(fd)
        raise UnsafeDirectoryError(f"{_WHAT} {path} changed while loopd checked it; try again")
    return fd


def _make_if_missing(path: str) -> bool:
    """
    Make the directory C{path}, mode 0700, when nothing is there and its parent exists.

    @return: whether it was made here.
    @raise DirectoryError: nothing is there and its parent is missing too, or it cannot be
        made.
    """
    if os.path.lexists(path):
        return False
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise DirectoryError(
            f"{_WHAT} {path} does not exist, nor does its parent {parent}; create it with "
            f"mkdir -m 700 -p {path}"
        )
    try:
        os.mkdir(path, _DIRECTORY_MODE)
    except FileExistsError:
        # Someone made it first: it is checked like anything found.
        return False
    except OSError as e:
        raise DirectoryError(f"cannot create {_WHAT} {path}: {e.strerror}") from None
    os.chmod(path, _DIRECTORY_MODE)
    _log.info("made the capture directory {path} (mode 0700)", path=path)
    return True


def _remove_made(path: str) -> None:
    """Remove the empty directory made for a capture that was then refused."""
    try:
        os.rmdir(path)
    except OSError:
        pass


class CaptureFiles:
    """
    The capture's files in its directory: L{write} appends a line, beginning files and
    deleting the oldest as the budget says (module docstring).

    @ivar path: the directory.
    @ivar max_bytes: the budget of all the capture files in it, in bytes.
    @ivar file_bytes: the size a file ends before (L{FILES_PER_BUDGET}).
    @ivar files: every capture file's size by name, oldest first.
    @ivar lost: the lines lost since the last that went out.
    """

    def __init__(
        self,
        path: str,
        max_bytes: int,
        *,
        wall_clock: Callable[[], float] = time.time,
        write: Write = os.write,
        directory: int | None = None,
    ) -> None:
        """
        Open the directory (L{open_capture_directory}) unless given, and count its files.

        @param wall_clock: names the files.
        @param write: writes to a file descriptor (C{os.write}; replaced in tests).
        @param directory: the directory's descriptor, already opened and checked.
        @raise DirectoryError: the directory is unsafe or unusable.
        """
        self.path = path
        self.max_bytes = max_bytes
        self.file_bytes = max(1, max_bytes // FILES_PER_BUDGET)
        self.files: OrderedDict[str, int] = OrderedDict()
        self.lost = 0
        self._wall_clock = wall_clock
        self._write = write
        self._directory: int | None = None
        self._directory_made: bool | None = None
        self._file: int | None = None
        self._name = ""
        self._size = 0
        self._counter = 0
        self._failing = False
        self._closed = False
        self._open_directory(directory)

    @property
    def total(self) -> int:
        """The bytes of every capture file in the directory."""
        return sum(self.files.values())

    @property
    def current(self) -> str | None:
        """The file lines go to now, once one was begun."""
        return self._name if self._file is not None else None

    def write(self, line: bytes) -> bool:
        """
        Append C{line} (one JSON line, its newline included) to the current file, after
        beginning a new one if it would pass L{file_bytes} or is gone; then delete the
        oldest files beyond the budget. A failure is logged once and loses the line.

        @return: whether the line went out; never once L{close}d (a request that ends while
            loopd stops is not captured, and nothing is opened again).
        """
        if self._closed:
            return False
        try:
            if self._directory is None:
                self._open_directory(None)
            if self._file is not None:
                self._check_current()
            if self._file is None or self._size + len(line) > self.file_bytes:
                self._begin()
            self._write_all(line)
        except (OSError, DirectoryError) as e:
            self._failed(e)
            return False
        self._size += len(line)
        self.files[self._name] = self._size
        self._keep_budget()
        if self._failing:
            self._failing = False
            _log.info(
                "capture: writing to {path} again; {lost} requests were not captured",
                path=self.path,
                lost=self.lost,
            )
        self.lost = 0
        return True

    def close(self) -> None:
        """Close the current file and the directory, for good."""
        self._closed = True
        self._close_file()
        if self._directory is not None:
            os.close(self._directory)
            self._directory = None

    # -- inside ------------------------------------------------------------------------

    def _open_directory(self, directory: int | None) -> None:
        """Open and check the directory (unless given), and count the files already in it."""
        # Made only at start: a directory gone later (say, a disk unmounted) is not made
        # again where it was, but waited for.
        if directory is None:
            fd = open_capture_directory(self.path, make=self._directory_made is None)
        else:
            fd = directory
        self._directory_made = True
        try:
            names = os.listdir(fd)
            files: OrderedDict[str, int] = OrderedDict()
            for name in capture_file_names(names):
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISREG(info.st_mode):
                    files[name] = info.st_size
        except OSError as e:
            os.close(fd)
            raise DirectoryError(f"cannot read {_WHAT} {self.path}: {e.strerror}") from None
        self._directory = fd
        self.files = files
        self._keep_budget()

    def _check_current(self) -> None:
        """
        End the current file if it was deleted under loopd, or holds a line cut short by a
        failed write (the next line would be joined to it).
        """
        assert self._file is not None
        info = os.fstat(self._file)
        if info.st_nlink == 0:
            self.files.pop(self._name, None)
            self._close_file()
        elif info.st_size != self._size:
            self.files[self._name] = info.st_size
            self._close_file()

    def _begin(self) -> None:
        """Close the current file (if any) and make the next, mode 0600."""
        self._close_file()
        assert self._directory is not None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._wall_clock()))
        while True:
            self._counter += 1
            name = f"loopd-capture-{stamp}-{self._counter:06d}.jsonl"
            try:
                fd = os.open(name, _FLAGS, _FILE_MODE, dir_fd=self._directory)
            except FileExistsError:
                continue
            except FileNotFoundError:
                # The directory itself is gone: open (and check) it again next time.
                os.close(self._directory)
                self._directory = None
                raise
            break
        # The umask may have taken bits away, never added any; 0600 whatever it is.
        os.fchmod(fd, _FILE_MODE)
        self._file, self._name, self._size = fd, name, 0
        self.files[name] = 0

    def _write_all(self, line: bytes) -> None:
        """Write all of C{line} to the current file."""
        assert self._file is not None
        view = memoryview(line)
        while view:
            written = self._write(self._file, bytes(view))
            if written <= 0:
                raise OSError(errno.EIO, "nothing written")
            view = view[written:]

    def _keep_budget(self) -> None:
        """Delete the oldest files while they all exceed the budget (never the current)."""
        total = self.total
        while total > self.max_bytes and len(self.files) > 1:
            oldest, size = next(iter(self.files.items()))
            if oldest == self._name and self._file is not None:
                break
            try:
                assert self._directory is not None
                os.unlink(oldest, dir_fd=self._directory)
            except FileNotFoundError:
                pass
            except OSError as e:
                _log.warn(
                    "capture: cannot delete {name} in {path}: {why}",
                    name=oldest,
                    path=self.path,
                    why=e.strerror,
                )
                break
            del self.files[oldest]
            total -= size

    def _failed(self, error: Exception) -> None:
        """A line was lost: say so the first time."""
        self.lost += 1
        if self._failing:
            return
        self._failing = True
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        _log.warn(
            "capture: cannot write to {path}: {why}; requests are not captured until it "
            "can again (said once)",
            path=self.path,
            why=why,
        )

    def _close_file(self) -> None:
        """Close the current file, if one is open."""
        if self._file is not None:
            try:
                os.close(self._file)
            except OSError:
                pass
            self._file = None
