# -*- test-case-name: loopd.test.test_config -*-
"""
loopd.toml into a frozen, typed L{Config}.

The file is strict: an unknown key is an error naming its dotted path, a value of the
wrong type or out of range is an error naming the path, what was expected and what was
found, and every violation is reported at once in one L{ConfigError}. Every limit of
the inference path (seed 000, section 4) is a field whose default is the seed's.

Each top-level key is parsed by its own small function listed in L{_SECTIONS}; a later
section ([gateway], [queue], ...) is a new dataclass, a new L{Config} field and one new
entry there. Defaults live only in the dataclasses: a key that is absent from the file
keeps its dataclass default.

Pure apart from L{load_config} reading its file: no reactor, no sockets.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from loopd._message_style import TOML_STYLE, index_path, key_path, render
from loopd._validate import (
    ABSENT,
    Problems,
    Rule,
    RuleError,
    SectionParser,
    array_of,
    as_table,
    boolean,
    integer,
    integer_list,
    number,
    one_of,
    read_fields,
    scalar_parser,
    string,
    table_parser,
    unknown_key,
)
from loopd.settings import (
    Caps,
    Capture,
    Config,
    Doors,
    Endpoint,
    Expect,
    HealthProbe,
    Limits,
    Mesh,
    Queue,
    Retry,
    Sampling,
    Server,
    Telemetry,
    Thinking,
)
from loopd.tcp_address import parse_tcp_address

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

__all__ = [
    "SENT_FIELDS",
    "ConfigError",
    "config_from_mapping",
    "load_config",
    "parse_config",
]

INT32_MAX: Final = 2**31 - 1
UINT32_MAX: Final = 2**32 - 1
RESERVED_NAMES: Final = frozenset({"auto", "mesh"})
"""Model names the gateway routes itself (DESIGN §19), so no endpoint may take them."""

# sun_path holds 108 bytes on Linux and 104 on the BSDs and macOS, NUL included.
SOCKET_PATH_MAX: Final = 107 if sys.platform.startswith("linux") else 103


class ConfigError(ValueError):
    """
    The configuration is invalid. The message has one line per violation.

    @ivar problems: every violation, C{<dotted path>: <what is wrong>}, in file order.
    @ivar source: where the configuration came from (a file name), or None.
    """

    def __init__(self, problems: Sequence[str], source: str | None = None) -> None:
        """Record the violations; the message prefixes each with the source."""
        self.problems = tuple(problems)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + line for line in self.problems))


_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_NAME = re.compile(r"[^\s\x00-\x1f\x7f]+")


def _sha256(value: object) -> str:
    """64 hex digits, returned in lowercase (the case of hexdigest())."""
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise RuleError("64 hexadecimal digits (a SHA-256)")
    return value.lower()


def _endpoint_name(value: object) -> str:
    """A non-empty name without spaces or control characters, not a reserved one."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise RuleError("a non-empty string without spaces or control characters")
    if value in RESERVED_NAMES:
        raise RuleError('a name other than "auto" and "mesh", which the gateway routes')
    return value


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: The headers loopd's HTTP client sets itself, and Dynamo's priority (affinity_priority).
_OWN_HEADERS: Final = frozenset(
    {
        "host",
        "connection",
        "content-length",
        "transfer-encoding",
        "content-type",
        "x-dynamo-request-priority",
    }
)
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
SENT_FIELDS: Final = frozenset(
    {
        "model",
        "messages",
        "tools",
        "stream",
        "stream_options",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "typical_p",
        "repeat_penalty",
        "repeat_last_n",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
        "tool_choice",
        "chat_template_kwargs",
        "reasoning_effort",
    }
)
"""The body fields loopd sends an C{openai} endpoint itself, so no C{affinity_field}."""


def _affinity_header(value: object) -> str:
    """A header name (RFC 9110 token characters), not one that loopd sets itself."""
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise RuleError("a header name (letters, digits and !#$%&'*+-.^_`|~)")
    if value.lower() in _OWN_HEADERS:
        raise RuleError("a header other than " + ", ".join(sorted(_OWN_HEADERS)))
    return value


def _affinity_field(value: object) -> str:
    """A top-level body field name, not one that loopd sends itself."""
    if not isinstance(value, str) or not _FIELD.fullmatch(value):
        raise RuleError("a field name (a letter or _, then letters, digits, _ . or -)")
    if value in SENT_FIELDS:
        raise RuleError("a field loopd does not send itself (such as user)")
    return value


def _socket_path(value: object) -> str:
    """A Unix socket path, C{~} expanded, that fits in a C{sockaddr_un}."""
    if not isinstance(value, str) or not value or "\0" in value:
        raise RuleError("a non-empty path string")
    path = os.path.expanduser(value)
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        raise RuleError(f"a Unix socket path of at most {SOCKET_PATH_MAX} bytes")
    return path


_LIMITS_RULES: Final[Mapping[str, Rule]] = {
    "poll_ms": integer(1),
    "busy_wait_ms": integer(0),
    "load_wait_ms": integer(0),
    "idle_grace_ms": integer(0),
    "liveness_ms": integer(1),
    "prefill_stall_ms": integer(1),
    "queue_depth": integer(0),
}
_THINKING_RULES: Final[Mapping[str, Rule]] = {
    "cap": integer(1),
    "overrun": integer(0),
}
_RETRY_RULES: Final[Mapping[str, Rule]] = {
    "attempts": integer(1),
    "backoff_ms": integer_list(0),
    "jitter": number(0, 1, max_open=True),
    "total_ms": integer(1),
}
_CAPS_RULES: Final[Mapping[str, Rule]] = {
    "header_bytes": integer(1),
    "sse_line_bytes": integer(1),
    "body_bytes": integer(1),
}
_SAMPLING_RULES: Final[Mapping[str, Rule]] = {
    "temperature": number(0, 5),
    "top_p": number(0, 1),
    "top_k": integer(0, INT32_MAX),
    "min_p": number(0, 1),
    "typical_p": number(0, 1),
    "repeat_penalty": number(0, 5, min_open=True),
    "repeat_last_n": integer(-1, INT32_MAX),
    "presence_penalty": number(-2, 2),
    "frequency_penalty": number(-2, 2),
    "seed": integer(0, UINT32_MAX),
}


def _file_path(value: object) -> str:
    """A file path, C{~} expanded."""
    if not isinstance(value, str) or not value or "\0" in value:
        raise RuleError("a non-empty path string")
    return os.path.expanduser(value)


_EXPECT_RULES: Final[Mapping[str, Rule]] = {
    "chat_template_sha256": _sha256,
    "n_ctx": integer(1),
    "total_slots": integer(1),
}
_ENDPOINT_RULES: Final[Mapping[str, Rule]] = {
    "name": _endpoint_name,
    "socket": _socket_path,
    "kind": one_of("llama-server", "llama-server-router", "openai"),
    "model": string(),
    "selftest": boolean,
    "selftest_wait_ms": integer(1, INT32_MAX),
    "size_b": number(0, 1_000_000, min_open=True),
    "vision": boolean,
    "audio": boolean,
    "proxy_max_connections": integer(1, INT32_MAX),
    "proxy_burst": integer(1, INT32_MAX),
    "proxy_refill_per_second": number(0, 1e9, min_open=True),
    "pacing_wait_ms": integer(0, INT32_MAX),
    # A group's name follows an endpoint name's rules; L{_parse_endpoints} keeps them apart.
    "group": _endpoint_name,
    "affinity_header": _affinity_header,
    "affinity_field": _affinity_field,
    "affinity_priority": boolean,
    "slot_save": boolean,
    "slot_dir": _file_path,
    "slot_dir_bytes": integer(1, 2**62),
    "models": array_of(_endpoint_name, "a non-empty array of model ids", non_empty=True),
    "models_max": integer(1),
    "swap_wait_ms": integer(1, INT32_MAX),
}
#: The keys only a llama-server-router endpoint takes.
_ROUTER_ONLY: Final = ("models", "models_max")
#: The keys only an openai endpoint takes: a llama-server's affinity is loopd's own slot pin.
_OPENAI_ONLY: Final = ("affinity_header", "affinity_field", "affinity_priority")


_UNIX_LISTEN: Final = 'a Unix socket, "unix:PATH"'


def _tcp_suggestion(listen: str) -> str:
    """
    What to write instead of a strports TCP description (C{tcp:8080:interface=127.0.0.1}):
    C{tcp = "127.0.0.1:8080"}, loopback unless the description named another interface.
    """
    parts = [part.replace("\\:", ":") for part in re.split(r"(?<!\\):", listen)[1:]]
    options = dict(part.split("=", 1) for part in parts if "=" in part)
    plain = [part for part in parts if "=" not in part]
    port = options.get("port") or (plain[0] if plain else "8080")
    host = options.get("interface", "::1" if listen.lower().startswith("tcp6") else "127.0.0.1")
    host = f"[{host}]" if ":" in host else host
    return f'tcp = "{host}:{port}"'


def _listen(value: object) -> str:
    """
    C{[server] listen}: the gateway's Unix socket. A strports TCP description (what
    C{listen} took before the token, DESIGN decision 41) is refused with what to write.
    """
    if not isinstance(value, str) or not value:
        raise RuleError(_UNIX_LISTEN)
    if value.startswith("unix:"):
        return value
    if re.match(r"(?i)(tcp6?|ssl|tls):", value):
        raise RuleError(
            f"{_UNIX_LISTEN}; a TCP listener is now {_tcp_suggestion(value)} in [server], "
            "where every request carries loopd's token (printed by `loopd token`)"
        )
    raise RuleError(_UNIX_LISTEN)


def _tcp(value: object) -> str:
    """C{[server] tcp}: C{HOST:PORT} (L{parse_tcp_address}), kept as written."""
    if not isinstance(value, str):
        raise RuleError('HOST:PORT, such as "127.0.0.1:8080"')
    try:
        parse_tcp_address(value)
    except ValueError as error:
        raise RuleError(str(error)) from None
    return value


_SERVER_RULES: Final[Mapping[str, Rule]] = {
    "listen": _listen,
    "tcp": _tcp,
    "allow_remote": boolean,
    "token_file": _file_path,
    "body_bytes": integer(1),
    "header_timeout_ms": integer(1, INT32_MAX),
    "body_timeout_ms": integer(1, INT32_MAX),
    "body_min_bytes_per_s": integer(0, INT32_MAX),
    "max_connections": integer(1, INT32_MAX),
    "keepalive_ms": integer(1, INT32_MAX),
    "backlog": integer(1, INT32_MAX),
}


_QUEUE_RULES: Final[Mapping[str, Rule]] = {
    "serve": boolean,
    "socket": _socket_path,
    "config": _file_path,
    "models_json": _file_path,
    "sweep_ms": integer(1, INT32_MAX),
    "grace_ms": integer(0, INT32_MAX),
}
_HEALTH_RULES: Final[Mapping[str, Rule]] = {
    "up_interval_ms": integer(1, INT32_MAX),
    "down_interval_ms": integer(1, INT32_MAX),
    "timeout_ms": integer(1, INT32_MAX),
}


def _parse_expect(value: object, path: str, problems: Problems) -> Expect:
    """[endpoint.expect]: optional, and so is each of its keys."""
    if value is ABSENT:
        return Expect()
    table = as_table(value, path, problems)
    return Expect(**read_fields(table, path, _EXPECT_RULES, problems))


def _parse_endpoint(
    value: object, path: str, problems: Problems, first_use: dict[str, str]
) -> Endpoint | None:
    """
    One [[endpoint]] table; None when its name, socket or kind is unusable.

    @param first_use: the path of the endpoint that first used each name so far.
    """
    if not isinstance(value, Mapping):
        problems.expected(path, "a table", value)
        return None
    table: Mapping[str, object] = value
    values = read_fields(
        table,
        path,
        _ENDPOINT_RULES,
        problems,
        required=("name", "socket"),
        handled=("expect",),
    )
    name = values.get("name")
    if name in first_use:
        problems.add(
            key_path(path, "name"),
            f"duplicate endpoint name {render(name)} (first used by {first_use[name]})",
        )
    elif name is not None:
        first_use[name] = path
    kind = values.get("kind", "llama-server")
    if kind == "openai" and values.get("selftest") is True:
        problems.add(
            key_path(path, "selftest"),
            "must be false for an openai endpoint: the self-test needs /props",
        )
    values.setdefault("selftest", kind != "openai")
    for key in _OPENAI_ONLY:
        if kind != "openai" and values.get(key) not in (None, False):
            problems.add(
                key_path(path, key),
                "only for an openai endpoint: loopd pins a llama-server's slot itself",
            )
    for key in _ROUTER_ONLY:
        if kind != "llama-server-router" and key in values:
            problems.add(key_path(path, key), "only for a llama-server-router endpoint")
    if kind == "llama-server-router" and "model" in values:
        problems.add(
            key_path(path, "model"),
            "not for a llama-server-router endpoint: each of its models is named in "
            "models (or all it lists are served)",
        )
    if "models" in values and len(set(values["models"])) != len(values["models"]):
        problems.add(key_path(path, "models"), "a model id is listed twice")
    if kind == "openai" and values.get("slot_save") is True:
        problems.add(
            key_path(path, "slot_save"),
            "must be false for an openai endpoint: slot files need llama-server's /slots",
        )
    if kind != "openai" and values.get("slot_save") is True and "slot_dir" not in values:
        problems.add(
            key_path(path, "slot_dir"),
            "needed with slot_save = true: the server's --slot-save-path, which loopd checks "
            "(slot files hold prompts) and cleans",
        )
    if "slot_dir" in values and values.get("slot_save") is not True:
        problems.add(
            key_path(path, "slot_dir"),
            "only with slot_save = true (the slot files' directory)",
        )
    expect = table.get("expect", ABSENT)
    values["expect"] = _parse_expect(expect, key_path(path, "expect"), problems)
    kind_invalid = "kind" in table and "kind" not in values
    if kind_invalid or "name" not in values or "socket" not in values:
        return None
    return Endpoint(**values)


def _parse_endpoints(value: object, path: str, problems: Problems) -> Any:
    """The [[endpoint]] array: at least one table, names unique."""
    if value is ABSENT or (isinstance(value, (list, tuple)) and not value):
        problems.add(path, "at least one [[endpoint]] table is required")
        return ABSENT
    if not isinstance(value, (list, tuple)):
        problems.expected(path, "an array of tables ([[endpoint]])", value)
        return ABSENT
    endpoints: list[Endpoint] = []
    first_use: dict[str, str] = {}
    for index, item in enumerate(value):
        endpoint = _parse_endpoint(item, index_path(path, index), problems, first_use)
        if endpoint is not None:
            endpoints.append(endpoint)
    for index, item in enumerate(value):
        group = item.get("group") if isinstance(item, Mapping) else None
        if isinstance(group, str) and group in first_use:
            problems.add(
                key_path(index_path(path, index), "group"),
                f"group {render(group)} is the name of an endpoint ({first_use[group]}): "
                "a model name must say which it means",
            )
    return tuple(endpoints)


def _parse_server(value: object, path: str, problems: Problems) -> Any:
    """
    [server]: its keys by their rules, and a C{tcp} address that is not a loopback one
    refused unless C{allow_remote} is true.
    """
    if value is ABSENT:
        return ABSENT
    values = read_fields(as_table(value, path, problems), path, _SERVER_RULES, problems)
    tcp = values.get("tcp")
    if tcp is not None and not values.get("allow_remote") and not parse_tcp_address(tcp).loopback:
        problems.add(
            key_path(path, "tcp"),
            f"{render(tcp)} is not a loopback address (127.0.0.1, [::1], localhost); to listen "
            f"there anyway, set {key_path(path, 'allow_remote')} = true (the token is still "
            "required)",
        )
        del values["tcp"]
    return Server(**values)


_REQUEST_TARGET = re.compile(r"/[!-~]*")


def _request_target(value: object) -> str:
    """An HTTP request target: C{/} then printable ASCII without spaces."""
    if not isinstance(value, str) or not _REQUEST_TARGET.fullmatch(value):
        raise RuleError('a request target: "/" then printable ASCII without spaces')
    return value


_TELEMETRY_RULES: Final[Mapping[str, Rule]] = {
    "enabled": boolean,
    "service_name": string(),
    "socket": _socket_path,
    "path": _request_target,
    "export_interval_ms": integer(1, INT32_MAX),
    "max_batch": integer(1, INT32_MAX),
    "max_queue": integer(1, INT32_MAX),
    "export_timeout_ms": integer(1, INT32_MAX),
    "stop_wait_ms": integer(0, INT32_MAX),
    "session_ids": one_of("hash", "plain"),
}


def _parse_telemetry(value: object, path: str, problems: Problems) -> Any:
    """
    [telemetry]: its keys by their rules; C{enabled = true} needs the collector's
    C{socket}, and a batch is no larger than the queue.
    """
    if value is ABSENT:
        return ABSENT
    values = read_fields(as_table(value, path, problems), path, _TELEMETRY_RULES, problems)
    if values.get("enabled") and "socket" not in values:
        problems.add(
            key_path(path, "socket"),
            "needed with enabled = true: the Unix socket of the OTLP/HTTP collector, or of a "
            "`twist inferproxy` in front of one that listens on TCP",
        )
    batch = values.get("max_batch", Telemetry.max_batch)
    queue = values.get("max_queue", Telemetry.max_queue)
    if batch > queue:
        if "max_batch" in values:
            where, rule = "max_batch", f"at most max_queue ({queue})"
        else:
            where, rule = "max_queue", f"at least max_batch ({batch})"
        problems.add(
            key_path(path, where),
            f"{rule}: a batch is taken from the queue (got {values[where]})",
        )
    return Telemetry(**values)


_CAPTURE_RULES: Final[Mapping[str, Rule]] = {
    "dir": _file_path,
    "max_bytes": integer(1, 2**62),
    "prompts": boolean,
}


def _parse_capture(value: object, path: str, problems: Problems) -> Any:
    """[capture]: C{dir} is needed, since a capture table says to capture."""
    if value is ABSENT:
        return ABSENT
    table = as_table(value, path, problems)
    values = read_fields(table, path, _CAPTURE_RULES, problems)
    if "dir" not in table:
        problems.add(
            key_path(path, "dir"),
            "missing: the directory of the capture files (remove [capture] to capture nothing)",
        )
    return Capture(**values)


@dataclass(frozen=True)
class _Section:
    """A known top-level key: the L{Config} field it fills and its parser."""

    attribute: str
    parse: SectionParser


_SECTIONS: Final[Mapping[str, _Section]] = {
    "max_tokens": _Section("max_tokens", scalar_parser(integer(1, INT32_MAX))),
    "cache_loss_tokens": _Section("cache_loss_tokens", scalar_parser(integer(0))),
    "limits": _Section("limits", table_parser(Limits, _LIMITS_RULES)),
    "thinking": _Section("thinking", table_parser(Thinking, _THINKING_RULES)),
    "retry": _Section("retry", table_parser(Retry, _RETRY_RULES)),
    "caps": _Section("caps", table_parser(Caps, _CAPS_RULES)),
    "sampling": _Section("sampling", table_parser(Sampling, _SAMPLING_RULES)),
    "endpoint": _Section("endpoints", _parse_endpoints),
    "server": _Section("server", _parse_server),
    "queue": _Section("queue", table_parser(Queue, _QUEUE_RULES)),
    "mesh": _Section("mesh", table_parser(Mesh, {"strong_patience_ms": integer(0, INT32_MAX)})),
    "health": _Section("health", table_parser(HealthProbe, _HEALTH_RULES)),
    "doors": _Section("doors", table_parser(Doors, {"hosted_tools": one_of("drop", "refuse")})),
    "telemetry": _Section("telemetry", _parse_telemetry),
    "capture": _Section("capture", _parse_capture),
}


def config_from_mapping(data: Mapping[str, object], source: str | None = None) -> Config:
    """
    Validate an already decoded document (what tomllib returns) into a L{Config}.

    @raise ConfigError: listing every violation, in document order.
    """
    problems = Problems(TOML_STYLE)
    values: dict[str, Any] = {}
    table = as_table(data, "(top level)", problems)
    if problems:
        raise ConfigError(problems.lines(), source)
    for key, value in table.items():
        section = _SECTIONS.get(key) if isinstance(key, str) else None
        if section is None:
            problems.add(key_path("", key), unknown_key(key, _SECTIONS))
            continue
        result = section.parse(value, key, problems)
        if result is not ABSENT:
            values[section.attribute] = result
    for key, section in _SECTIONS.items():
        if key not in table:
            result = section.parse(ABSENT, key, problems)
            if result is not ABSENT:
                values[section.attribute] = result
    if problems:
        raise ConfigError(problems.lines(), source)
    return Config(**values)


def parse_config(text: str, source: str = "<string>") -> Config:
    """
    Parse the text of a loopd.toml into a L{Config}.

    @param source: names the text in error messages (a file name).
    @raise ConfigError: for a TOML syntax error (with its line) or any violation.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError([f"invalid TOML: {error}"], source) from None
    return config_from_mapping(data, source)


def load_config(path: str | os.PathLike[str]) -> Config:
    """
    Read and parse the loopd.toml at C{path}.

    @raise ConfigError: when the file cannot be read, is not UTF-8, or is invalid.
    """
    source = os.fspath(path)
    try:
        with open(source, "rb") as stream:
            raw = stream.read()
    except OSError as error:
        reason = error.strerror or str(error)
        raise ConfigError([f"cannot read the file: {reason}"], source) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        message = f"not UTF-8 text (byte {error.start})"
        raise ConfigError([message], source) from None
    return parse_config(text, source)
