# -*- test-case-name: loopd.test.test_llama_slot_files -*-
"""
llama-server's slot files: C{POST /slots/{id}?action=save|restore} with C{{"filename": ...}}
writes a slot's KV cache to a file under the server's C{--slot-save-path}, or loads one into
a slot (reference/llama-server-api.md §4). This module is their wire format: the path, the
answer (L{SlotFile}) and which file names loopd sends.

A file name is a single path component of letters, digits, C{.}, C{_} and C{-}, not starting
with a dot (L{check_filename}); llama-server refuses others too (400 C{Invalid filename}),
but loopd never sends one. Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

from loopd.errors import Protocol

__all__ = ["SlotAction", "SlotFile", "check_filename", "parse_slot_file", "slot_action_path"]

SlotAction = Literal["save", "restore"]
"""What a slot-file request does: write the slot to the file, or load the file into it."""

_FILENAME: Final = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
# The answer's count of tokens, by action.
_COUNT: Final[dict[str, str]] = {"save": "n_saved", "restore": "n_restored"}
_SIZE: Final[dict[str, str]] = {"save": "n_written", "restore": "n_read"}


@dataclass(frozen=True)
class SlotFile:
    """
    What a slot save or restore did, as the server answered.

    @ivar slot: the slot it acted on.
    @ivar filename: the file, under the server's C{--slot-save-path}.
    @ivar tokens: how many tokens of KV cache were written or read (0: the slot or the file
        held nothing).
    @ivar size: how many bytes were written or read.
    @ivar ms: how long the server took, when it said.
    """

    slot: int
    filename: str
    tokens: int
    size: int
    ms: float | None = None


def check_filename(filename: str) -> str:
    """
    C{filename} itself when it is one safe path component (module docstring).

    @raise ValueError: it is empty, too long (over 128 characters), starts with a dot, or
        holds a character outside C{[A-Za-z0-9._-]} (a path separator, for instance).
    """
    if not _FILENAME.fullmatch(filename):
        raise ValueError(
            f"slot file name {filename!r} is not 1 to 128 of [A-Za-z0-9._-], not starting with '.'"
        )
    return filename


def slot_action_path(slot: int, action: SlotAction) -> str:
    """
    The request target of C{action} on C{slot}: C{/slots/<slot>?action=<action>}.

    @raise ValueError: C{slot} is negative (llama-server would answer 400 C{Invalid slot ID}).
    """
    if slot < 0:
        raise ValueError(f"slot must be >= 0, got {slot}")
    return f"/slots/{slot}?action={action}"


def parse_slot_file(value: object, action: SlotAction) -> SlotFile:
    """
    Read the answer of a save (C{n_saved}, C{n_written}) or a restore (C{n_restored},
    C{n_read}); C{timings.save_ms} or C{timings.restore_ms} when present.

    @raise Protocol: it is not an object with an integer C{id_slot}, a string C{filename}
        and integer counts.
    """
    if not isinstance(value, dict):
        raise Protocol(f"slot {action} did not answer a JSON object")
    slot, filename = value.get("id_slot"), value.get("filename")
    tokens, size = value.get(_COUNT[action]), value.get(_SIZE[action])
    if not all(_is_count(n) for n in (slot, tokens, size)) or not isinstance(filename, str):
        raise Protocol(
            f"slot {action} answer lacks id_slot, filename, {_COUNT[action]} or {_SIZE[action]}"
        )
    assert isinstance(slot, int) and isinstance(tokens, int) and isinstance(size, int)
    timings = value.get("timings")
    ms = timings.get(f"{action}_ms") if isinstance(timings, dict) else None
    if not isinstance(ms, (int, float)) or isinstance(ms, bool):
        ms = None
    return SlotFile(slot, filename, tokens, size, None if ms is None else float(ms))


def _is_count(value: object) -> bool:
    """Whether C{value} is a JSON integer >= 0 (a JSON boolean is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
