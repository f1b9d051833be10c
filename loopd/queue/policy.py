# -*- test-case-name: loopd.test.test_queue_policy -*-
"""
llm-queue.json into a validated, frozen L{Policy}.

The fields, defaults and messages are the lease protocol seed's: every violation is one line
C{<path> must be <what> (got <value as JSON>)}, all reported at once in a L{PolicyError}.
JSON follows JavaScript semantics (DESIGN §12): C{NaN}/C{Infinity} are not JSON, booleans
are not numbers and C{2.0} is the integer 2. Keys the seed does not read (unknown ones,
C{enabled}/C{match} in C{defaults}, defaults-only fields in a queue entry) are not errors,
since the seed names no error for them: they are left unread and listed in L{Policy.ignored}.
The checks are L{loopd._validate}'s, worded in L{loopd._message_style.JSON_STYLE}.

Which queue a key leads to is L{loopd.queue.routing}'s; models.json is
L{loopd.queue.catalog}'s. Pure apart from L{load_policy} and L{reload_policy} reading the
file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Final

from loopd import strict_json
from loopd._message_style import JSON_STYLE, json_member_path
from loopd._validate import (
    Problems,
    Rule,
    RuleError,
    array_of,
    as_table,
    integer,
    one_of,
    predicate,
    read_fields,
    string,
)

CURRENT_SCHEMA_VERSION: Final = 1
DEFAULT_BLOCKING_TOOLS: Final = tuple(
    "subagent subagent_wait bg_wait ask_user contact_supervisor intercom".split()
)
POLICIES: Final = ("priority-aging", "fifo")


class PolicyError(ValueError):
    """An llm-queue.json is invalid: C{problems} has each violation, in the order found."""

    def __init__(self, problems: tuple[str, ...]) -> None:
        """Record the violations."""
        super().__init__("\n".join(problems))
        self.problems = problems


class PolicySyntaxError(PolicyError):
    """The text is not JSON (a half-written file): a hot reload ignores it silently."""


@dataclass(frozen=True)
class QueueSettings:
    """The scheduling policy of one queue: C{defaults} merged with the queue's own entry."""

    max_streams: int = 1
    policy: str = "priority-aging"
    lease_ttl_ms: int = 30_000
    aging_after_slots: int = 3
    aging_after_ms: int = 60_000
    idle_yield_ms: int = 30_000
    enabled: bool = True
    """False is passthrough: every session is granted at once. C{defaults} never sets it."""


@dataclass(frozen=True)
class Defaults:
    """The C{defaults} object: every queue's settings, plus client- and daemon-side fields."""

    queue: QueueSettings = QueueSettings()
    fail_open: bool = True
    queue_timeout_ms: int | None = None
    """A parent's wait longer than this is warned about; None never warns."""
    blocking_tools: tuple[str, ...] = DEFAULT_BLOCKING_TOOLS
    daemon_idle_exit_ms: int = 0
    log_file: str | None = None


@dataclass(frozen=True)
class QueueEntry:
    """
    One entry of C{queues}: a baseUrl, a provider name, or (with C{match}) a group.

    Each setting is None where the entry does not set it (the default applies).
    """

    key: str
    max_streams: int | None = None
    policy: str | None = None
    lease_ttl_ms: int | None = None
    aging_after_slots: int | None = None
    aging_after_ms: int | None = None
    idle_yield_ms: int | None = None
    enabled: bool = True
    match: tuple[str, ...] | None = None

    @property
    def is_group(self) -> bool:
        """True for an enabled group: a disabled one does not re-key its members."""
        return self.match is not None and self.enabled

    def settings(self, defaults: QueueSettings) -> QueueSettings:
        """This entry's settings over C{defaults}."""
        overrides = {spec.name: getattr(self, spec.name) for spec in fields(QueueSettings)}
        return replace(defaults, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class Policy:
    """A whole validated llm-queue.json."""

    defaults: Defaults = Defaults()
    queues: tuple[QueueEntry, ...] = ()
    """The entries in file order (group precedence among equals is file order)."""
    schema_version: int = CURRENT_SCHEMA_VERSION
    ignored: tuple[str, ...] = field(default=(), compare=False)
    """Paths of keys present in the file that the policy does not read."""

    def entry(self, key: str) -> QueueEntry | None:
        """The entry keyed C{key}, if any."""
        return next((entry for entry in self.queues if entry.key == key), None)

    def settings_for(self, key: str) -> QueueSettings:
        """The settings of the entry keyed C{key}; the defaults for a key not named."""
        entry = self.entry(key)
        base = self.defaults.queue
        return base if entry is None else entry.settings(base)


DEFAULT_POLICY: Final = Policy()


def decode_json(text: str | bytes) -> object:
    """
    Decode JSON text as JavaScript's C{JSON.parse} would (UTF-8 bytes accepted).

    @raise PolicySyntaxError: for anything C{JSON.parse} refuses.
    """
    try:
        return strict_json.decode(text)
    except strict_json.JSONError as error:
        raise PolicySyntaxError((f"not valid JSON: {error}",)) from None


def _is_boolean(value: object) -> bool:
    """True for JSON C{true} and C{false} only."""
    return isinstance(value, bool)


def _is_path(value: object) -> bool:
    """True for a non-empty string."""
    return isinstance(value, str) and value != ""


_BOOLEAN = predicate("a boolean", _is_boolean)
_POSITIVE = integer(1, javascript=True)
_NON_NEGATIVE = integer(0, javascript=True)
_QUEUE_RULES: Final[Mapping[str, Rule]] = {
    "maxStreams": _POSITIVE,
    "policy": one_of(*POLICIES),
    "leaseTtlMs": integer(1000, javascript=True),
    "agingAfterSlots": _NON_NEGATIVE,
    "agingAfterMs": _NON_NEGATIVE,
    "idleYieldMs": _NON_NEGATIVE,
}
_DEFAULTS_RULES: Final[Mapping[str, Rule]] = {
    **_QUEUE_RULES,
    "failOpen": _BOOLEAN,
    "queueTimeoutMs": _POSITIVE,
    "blockingTools": array_of(string(), "an array of strings"),
    "daemonIdleExitMs": _NON_NEGATIVE,
    "logFile": predicate("a non-empty path string", _is_path),
}
_ENTRY_RULES: Final[Mapping[str, Rule]] = {
    **_QUEUE_RULES,
    "enabled": _BOOLEAN,
    "match": array_of(string(), "a non-empty array of strings", non_empty=True),
}
_ROOT_KEYS: Final = ("schemaVersion", "defaults", "queues")


def _attribute(key: str) -> str:
    """The dataclass field a JSON key fills: C{maxStreams} is C{max_streams}."""
    return re.sub("([A-Z])", r"_\1", key).lower()


_SETTINGS: Final = frozenset(_attribute(key) for key in _QUEUE_RULES)


def _read(
    value: object, path: str, rules: Mapping[str, Rule], problems: Problems
) -> dict[str, Any]:
    """The valid values of the object at C{path}, by the field each fills."""
    table = as_table(value, path, problems)
    return {_attribute(key): got for key, got in read_fields(table, path, rules, problems).items()}


def _read_defaults(value: object, problems: Problems) -> Defaults:
    """The C{defaults} object; C{enabled} and C{match} there are not read."""
    values = _read(value, "defaults", _DEFAULTS_RULES, problems)
    queue = {key: values.pop(key) for key in list(values) if key in _SETTINGS}
    return Defaults(queue=QueueSettings(**queue), **values)


def _schema_version(root: Mapping[str, object], problems: Problems) -> int:
    """
    The C{schemaVersion}, the current one when absent or invalid.

    @raise PolicyError: for a newer version, with only that problem: a newer file is not
        this version's to judge.
    """
    if "schemaVersion" not in root:
        return CURRENT_SCHEMA_VERSION
    raw = root["schemaVersion"]
    try:
        version: int = _POSITIVE(raw)
    except RuleError as error:
        problems.broken("schemaVersion", error, raw)
        return CURRENT_SCHEMA_VERSION
    if version > CURRENT_SCHEMA_VERSION:
        upgrade = ": upgrade pi-llm-queue"
        problems.expected("schemaVersion", f"at most {CURRENT_SCHEMA_VERSION}", raw, suffix=upgrade)
        raise PolicyError(problems.lines())
    return version


def parse_policy(document: object) -> Policy:
    """
    Validate a decoded llm-queue.json.

    @raise PolicyError: with every violation; a newer C{schemaVersion} is the only one
        reported, since a newer file is not this version's to judge.
    """
    problems = Problems(JSON_STYLE)
    root = as_table(document, "llm-queue.json", problems)
    version = _schema_version(root, problems)
    defaults = _read_defaults(root["defaults"], problems) if "defaults" in root else Defaults()
    entries = tuple(
        QueueEntry(key, **_read(value, json_member_path("queues", key), _ENTRY_RULES, problems))
        for key, value in as_table(root.get("queues", {}), "queues", problems).items()
    )
    for key in root:
        if key not in _ROOT_KEYS:
            problems.ignore(key)
    if problems:
        raise PolicyError(problems.lines())
    return Policy(defaults, entries, version, problems.ignored())


def parse_policy_text(text: str | bytes) -> Policy:
    """
    Decode and validate the text of an llm-queue.json.

    @raise PolicySyntaxError: when it is not JSON.
    @raise PolicyError: when it is JSON but not a valid policy.
    """
    return parse_policy(decode_json(text))


def _read_file(path: str) -> bytes | str | None:
    """The bytes of a file; None when it does not exist; a problem line when unreadable."""
    try:
        with open(path, "rb") as stream:
            return stream.read()
    except FileNotFoundError:
        return None
    except OSError as error:
        return f"{path}: cannot read: {error.strerror or error}"


def _named(source: str, problems: tuple[str, ...]) -> tuple[str, ...]:
    """Prefix each problem with the file it is about."""
    return tuple(f"{source}: {line}" for line in problems)


def load_policy(path: str | os.PathLike[str]) -> tuple[Policy, tuple[str, ...]]:
    """
    The policy at daemon start: a missing file is the defaults with no error, and a file
    that cannot be read or is invalid falls back to the defaults as a whole (DESIGN §25).

    @return: the policy and the violations to print to stderr (each prefixed by the path).
    """
    return reload_policy(path, DEFAULT_POLICY, quiet_syntax=False)


def reload_policy(
    path: str | os.PathLike[str], current: Policy, *, quiet_syntax: bool = True
) -> tuple[Policy, tuple[str, ...]]:
    """
    The policy after the file changed: a missing file is the defaults; a half-written one
    (not JSON) keeps C{current} silently unless C{quiet_syntax} is false; an unreadable or
    invalid one keeps C{current} and returns its problems.
    """
    source = os.fspath(path)
    raw = _read_file(source)
    if raw is None:
        return DEFAULT_POLICY, ()
    if isinstance(raw, str):
        return current, (raw,)
    try:
        return parse_policy_text(raw), ()
    except PolicySyntaxError as error:
        return current, () if quiet_syntax else _named(source, error.problems)
    except PolicyError as error:
        return current, _named(source, error.problems)
