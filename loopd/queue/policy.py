# -*- test-case-name: loopd.test.test_queue_policy -*-
"""
llm-queue.json into a validated, frozen L{Policy}; models.json into a L{ModelsCatalog}.

The fields, defaults and messages are the lease protocol seed's: every violation is one line
C{<path> must be <what> (got <value as JSON>)}, all reported at once in a L{PolicyError}.
JSON follows JavaScript semantics (DESIGN §12): C{NaN}/C{Infinity} are not JSON, booleans
are not numbers and C{2.0} is the integer 2. Keys the seed does not read (unknown ones,
C{enabled}/C{match} in C{defaults}, defaults-only fields in a queue entry) are not errors,
since the seed names no error for them: they are left unread and listed in L{Policy.ignored}.

L{address_endpoint} and L{address_model} are the one addressing rule for the daemon and the
client (DESIGN §24). Pure apart from the C{load_*} functions reading their files.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Final

from loopd import strict_json
from loopd._validate import ABSENT

CURRENT_SCHEMA_VERSION: Final = 1
DEFAULT_BLOCKING_TOOLS: Final = tuple(
    "subagent subagent_wait bg_wait ask_user contact_supervisor intercom".split()
)
POLICIES: Final = ("priority-aging", "fifo")
_RENDER_LIMIT = 120


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


def _js_integer(value: object) -> int | None:
    """The value as an integer if JavaScript's C{Number.isInteger} holds for it."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        try:
            float(value)
        except OverflowError:  # beyond a double: JSON.parse makes it Infinity
            return None
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _plain(value: object) -> object:
    """The value with integral floats made ints, as JavaScript would print them."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _render(value: object) -> str:
    """A value as compact JSON for a message (NaN stays C{NaN}), shortened when long."""
    try:
        text = json.dumps(_plain(value), ensure_ascii=False, separators=(",", ":"), default=str)
    except RecursionError:
        text = "an object" if isinstance(value, Mapping) else "an array"
    return text if len(text) <= _RENDER_LIMIT else text[: _RENDER_LIMIT - 3] + "..."


def decode_json(text: str | bytes) -> object:
    """
    Decode JSON text as JavaScript's C{JSON.parse} would (UTF-8 bytes accepted).

    @raise PolicySyntaxError: for anything C{JSON.parse} refuses.
    """
    try:
        return strict_json.decode(text)
    except strict_json.JSONError as error:
        raise PolicySyntaxError((f"not valid JSON: {error}",)) from None


class _Reader:
    """Collects the violations and the ignored keys of one document."""

    def __init__(self) -> None:
        """Start with nothing found."""
        self.problems: list[str] = []
        self.ignored: list[str] = []

    def bad(self, path: str, what: str, value: object, suffix: str = "") -> Any:
        """Record that the value at C{path} must be C{what}; return L{ABSENT}."""
        self.problems.append(f"{path} must be {what} (got {_render(value)}){suffix}")
        return ABSENT

    def as_object(self, value: object, path: str) -> Mapping[str, object]:
        """The value as a JSON object, or an empty one after recording a problem."""
        if isinstance(value, Mapping):
            return value
        self.bad(path, "an object", value)
        return {}

    def read(self, table: object, path: str, known: _Fields) -> dict[str, Any]:
        """Check each key of the object C{table} that C{known} names; return the valid values."""
        values: dict[str, Any] = {}
        for key, value in self.as_object(table, path).items():
            where = _member_path(path, key)
            if key not in known:
                self.ignored.append(where)
                continue
            attribute, check = known[key]
            checked = check(self, where, value)
            if checked is not ABSENT:
                values[attribute] = checked
        return values


_Check = Callable[[_Reader, str, object], Any]
_Fields = Mapping[str, tuple[str, _Check]]


def _rule(phrase: str, test: Callable[[object], bool]) -> _Check:
    """A check that keeps a value passing C{test} and reports any other."""

    def check(reader: _Reader, path: str, value: object) -> Any:
        return value if test(value) else reader.bad(path, phrase, value)

    return check


def _integer(minimum: int, phrase: str) -> _Check:
    """A check for a JavaScript integer of at least C{minimum}."""

    def check(reader: _Reader, path: str, value: object) -> Any:
        number = _js_integer(value)
        return reader.bad(path, phrase, value) if number is None or number < minimum else number

    return check


def _strings(non_empty: bool) -> _Check:
    """A check for an array of non-empty strings (a non-empty array when C{non_empty})."""
    kind = "a non-empty array of strings" if non_empty else "an array of strings"

    def check(reader: _Reader, path: str, value: object) -> Any:
        if not isinstance(value, list) or (non_empty and not value):
            return reader.bad(path, kind, value)
        bad = [
            reader.bad(f"{path}[{index}]", "a non-empty string", item)
            for index, item in enumerate(value)
            if not isinstance(item, str) or not item
        ]
        return ABSENT if bad else tuple(value)

    return check


_ONE_OF: Final = "one of " + ", ".join(f'"{name}"' for name in POLICIES)
_BOOLEAN = _rule("a boolean", lambda v: isinstance(v, bool))
_POSITIVE = _integer(1, "a positive integer")
_NON_NEGATIVE = _integer(0, "a non-negative integer")
_PATH = _rule("a non-empty path string", lambda v: isinstance(v, str) and v != "")
_QUEUE_FIELDS: Final[dict[str, tuple[str, _Check]]] = {
    "maxStreams": ("max_streams", _POSITIVE),
    "policy": ("policy", _rule(_ONE_OF, lambda v: isinstance(v, str) and v in POLICIES)),
    "leaseTtlMs": ("lease_ttl_ms", _integer(1000, "an integer of at least 1000")),
    "agingAfterSlots": ("aging_after_slots", _NON_NEGATIVE),
    "agingAfterMs": ("aging_after_ms", _NON_NEGATIVE),
    "idleYieldMs": ("idle_yield_ms", _NON_NEGATIVE),
}
_DEFAULTS_ONLY: Final[dict[str, tuple[str, _Check]]] = {
    "failOpen": ("fail_open", _BOOLEAN),
    "queueTimeoutMs": ("queue_timeout_ms", _POSITIVE),
    "blockingTools": ("blocking_tools", _strings(non_empty=False)),
    "daemonIdleExitMs": ("daemon_idle_exit_ms", _NON_NEGATIVE),
    "logFile": ("log_file", _PATH),
}
_ENTRY_ONLY: Final[dict[str, tuple[str, _Check]]] = {
    "enabled": ("enabled", _BOOLEAN),
    "match": ("match", _strings(non_empty=True)),
}


def _member_path(parent: str, key: str) -> str:
    """C{parent.key}, or C{parent["key"]} for a key that is not a plain name (a URL)."""
    if re.fullmatch(r"[A-Za-z0-9_$-]+", key):
        return f"{parent}.{key}" if parent else key
    return f"{parent}[{json.dumps(key, ensure_ascii=False)}]"


def _read_defaults(reader: _Reader, value: object) -> Defaults:
    """The C{defaults} object; C{enabled} and C{match} there are not read."""
    values = reader.read(value, "defaults", _DEFAULTS_FIELDS)
    queue = {key: values.pop(key) for key in list(values) if key in _SETTINGS}
    return Defaults(queue=QueueSettings(**queue), **values)


_DEFAULTS_FIELDS: Final = {**_QUEUE_FIELDS, **_DEFAULTS_ONLY}
_ENTRY_FIELDS: Final = {**_QUEUE_FIELDS, **_ENTRY_ONLY}
_SETTINGS: Final = frozenset(attribute for attribute, _ in _QUEUE_FIELDS.values())


def parse_policy(document: object) -> Policy:
    """
    Validate a decoded llm-queue.json.

    @raise PolicyError: with every violation; a newer C{schemaVersion} is the only one
        reported, since a newer file is not this version's to judge.
    """
    reader = _Reader()
    root = reader.as_object(document, "llm-queue.json")
    version = CURRENT_SCHEMA_VERSION
    if "schemaVersion" in root:
        raw = root["schemaVersion"]
        number = _js_integer(raw)
        if number is None or number < 1:
            reader.bad("schemaVersion", "a positive integer", raw)
        elif number > CURRENT_SCHEMA_VERSION:
            upgrade = ": upgrade pi-llm-queue"
            reader.bad("schemaVersion", f"at most {CURRENT_SCHEMA_VERSION}", raw, upgrade)
            raise PolicyError(tuple(reader.problems))
        else:
            version = number
    defaults = _read_defaults(reader, root["defaults"]) if "defaults" in root else Defaults()
    entries = tuple(
        QueueEntry(key, **reader.read(value, _member_path("queues", key), _ENTRY_FIELDS))
        for key, value in reader.as_object(root.get("queues", {}), "queues").items()
    )
    reader.ignored.extend(key for key in root if key not in ("schemaVersion", "defaults", "queues"))
    if reader.problems:
        raise PolicyError(tuple(reader.problems))
    return Policy(defaults, entries, version, tuple(reader.ignored))


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


@dataclass(frozen=True)
class ModelsCatalog:
    """models.json's providers and their baseUrls, in file order."""

    providers: tuple[tuple[str, str], ...] = ()

    def base_url(self, provider: str) -> str | None:
        """The baseUrl of C{provider}, or None when the catalog does not list it."""
        return next((url for name, url in self.providers if name == provider), None)

    def providers_at(self, base_url: str) -> tuple[str, ...]:
        """The providers serving C{base_url}, in file order."""
        return tuple(name for name, url in self.providers if url == base_url)


EMPTY_CATALOG: Final = ModelsCatalog()
"""The catalog without C{--models-json}: no provider name reaches an endpoint."""


def parse_models_catalog(document: object) -> tuple[ModelsCatalog, tuple[str, ...]]:
    """
    The catalog in a decoded models.json, C{{"providers": {name: {"baseUrl": url}}}}.

    A provider without a baseUrl (an override of a built-in one) is left out silently, a
    malformed one is left out with a problem line. Never raises.
    """
    reader = _Reader()
    root = reader.as_object(document, "models.json")
    found = []
    for name, value in reader.as_object(root.get("providers", {}), "providers").items():
        path = _member_path("providers", name)
        url = reader.as_object(value, path).get("baseUrl", ABSENT)
        if isinstance(url, str) and url:
            found.append((name, url))
        elif url is not ABSENT:
            reader.bad(f"{path}.baseUrl", "a non-empty string", url)
    return ModelsCatalog(tuple(found)), tuple(reader.problems)


def load_models_catalog(path: str | os.PathLike[str]) -> tuple[ModelsCatalog, tuple[str, ...]]:
    """
    Read the catalog passed as C{--models-json}: a missing file is an empty catalog, and an
    unreadable or invalid one is an empty catalog plus its problems, never a crash.
    """
    source = os.fspath(path)
    raw = _read_file(source)
    if raw is None or isinstance(raw, str):
        return EMPTY_CATALOG, () if raw is None else (raw,)
    try:
        catalog, problems = parse_models_catalog(decode_json(raw))
    except PolicyError as error:
        return EMPTY_CATALOG, _named(source, error.problems)
    return catalog, _named(source, problems)


@dataclass(frozen=True)
class Route:
    """Where a queue key leads: the queue that owns its slots, and that queue's settings."""

    queue_key: str
    settings: QueueSettings


def _group_naming(policy: Policy, name: str) -> QueueEntry | None:
    """The first enabled group whose C{match} names C{name} exactly."""
    return next((e for e in policy.queues if e.is_group and name in (e.match or ())), None)


def address_model(policy: Policy, provider: str, base_url: str) -> str:
    """
    The queue key a client acquires with for a model: the group naming its provider
    (split), else the group naming its endpoint (merge), else its baseUrl.
    """
    group = _group_naming(policy, provider) or _group_naming(policy, base_url)
    return group.key if group is not None else base_url


def address_endpoint(policy: Policy, key: str, catalog: ModelsCatalog = EMPTY_CATALOG) -> Route:
    """
    The queue a daemon client's C{queueKey} names (DESIGN §24).

    A group's own name is that group; a key that a group's C{match} names exactly belongs
    to the first such group, ahead of the key's own entry. A provider name reaches its
    endpoint only through C{catalog}, and the endpoint then belongs to the group naming
    it, else to its own queue. An endpoint's queue takes its own entry's settings, else
    those of the first entry of a provider serving it (a baseUrl key wins), else the
    defaults; a key nothing names is a queue of its own with the defaults.
    """
    base = policy.defaults.queue
    own = policy.entry(key)
    group = own if own is not None and own.match is not None else _group_naming(policy, key)
    url = catalog.base_url(key)
    if group is None and url is not None:
        group = _group_naming(policy, url)
    if group is not None:
        return Route(group.key, group.settings(base))
    endpoint = key if url is None else url
    serving = set(catalog.providers_at(endpoint))
    entry = policy.entry(endpoint) or next(
        (e for e in policy.queues if e.match is None and e.key in serving), None
    )
    return Route(endpoint, base if entry is None else entry.settings(base))
