"""
Config documents for the tests of L{loopd.config}: TOML snippets, writers that turn a Config
back into a decoded document or TOML text, and hypothesis strategies for valid configs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from hypothesis import strategies as st

from loopd import config as config_module
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

EP = '[[endpoint]]\nname = "local"\nsocket = "/tmp/ld/infer.sock"\n'
"""The smallest valid endpoint, added to documents that test other sections."""
OPENAI = '[[endpoint]]\nname = "o"\nsocket = "/tmp/o"\nkind = "openai"\n'
"""The smallest valid openai endpoint."""
SECTION_TYPES: dict[str, type] = {
    "limits": Limits,
    "thinking": Thinking,
    "retry": Retry,
    "caps": Caps,
    "sampling": Sampling,
    "server": Server,
    "queue": Queue,
    "mesh": Mesh,
    "health": HealthProbe,
    "doors": Doors,
    "telemetry": Telemetry,
    "capture": Capture,
}
"""
Each top-level table of a document other than [[endpoint]], with its dataclass. A document
has [capture] only when it captures (its C{dir} is needed there).
"""
CAPTURE_DIR = "/tmp/ld/capture"
"""The capture directory of the generated documents that capture."""


def minimal_mapping() -> dict[str, object]:
    """A fresh decoded document with one endpoint and nothing else."""
    return {"endpoint": [{"name": "local", "socket": "/tmp/ld/infer.sock"}]}


def table_of(value: Any) -> dict[str, Any]:
    """The keys of a section dataclass that are set, as a decoded TOML table."""
    out = {}
    for item in fields(value):
        got = getattr(value, item.name)
        if isinstance(got, Expect):
            got = table_of(got)
        elif isinstance(got, tuple):
            got = list(got)
        if got is not None:
            out[item.name] = got
    return out


def mapping_of(config: Config) -> dict[str, object]:
    """The decoded TOML document that describes C{config} completely."""
    return {
        "max_tokens": config.max_tokens,
        "cache_loss_tokens": config.cache_loss_tokens,
        **{
            name: table_of(getattr(config, name))
            for name in SECTION_TYPES
            if name != "capture" or config.capture.dir is not None
        },
        "endpoint": [table_of(endpoint) for endpoint in config.endpoints],
    }


def toml_value(value: object) -> str:
    """Spell a scalar or an array as TOML (finite floats only)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, str):
        return '"' + "".join(toml_char(char) for char in value) + '"'
    return repr(value)


def toml_char(char: str) -> str:
    """One character of a TOML basic string, escaped where TOML needs it."""
    if char in '"\\':
        return "\\" + char
    if ord(char) < 0x20 or ord(char) == 0x7F:
        return f"\\u{ord(char):04x}"
    return char


def toml_text(document: Any) -> str:
    """Write a document shaped like L{mapping_of}'s as TOML text."""

    def pairs(table: dict[str, object]) -> list[str]:
        return [f"{k} = {toml_value(v)}" for k, v in table.items() if k != "expect"]

    lines = pairs({k: v for k, v in document.items() if isinstance(v, int)})
    for name in SECTION_TYPES:
        if name in document:
            lines += [f"[{name}]", *pairs(document[name])]
    for endpoint in document["endpoint"]:
        lines += ["[[endpoint]]", *pairs(endpoint)]
        lines += ["[endpoint.expect]", *pairs(endpoint["expect"])]
    return "\n".join(lines) + "\n"


def bad_document(dotted: str, value: str) -> tuple[str, str]:
    """A valid document but for C{dotted} set to C{value}; and that key's path."""
    section, _, key = dotted.rpartition(".")
    endpoint = {"name": '"local"', "socket": '"/tmp/ld/infer.sock"'}
    head = tail = ""
    if section == "endpoint":
        endpoint[key] = value
    elif section == "endpoint.expect":
        tail = f"[endpoint.expect]\n{key} = {value}\n"
    elif section:
        head = f"[{section}]\n{key} = {value}\n"
    else:
        head = f"{key} = {value}\n"
    text = head + "[[endpoint]]\n"
    text += "".join(f"{k} = {v}\n" for k, v in endpoint.items()) + tail
    return text, dotted.replace("endpoint", "endpoint[0]", 1)


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The strategy's values or None (unset)."""
    return st.none() | strategy


def counts(minimum: int) -> st.SearchStrategy[int]:
    """Integers from C{minimum} up, large ones included."""
    return st.integers(minimum, 2**40)


def reals(
    low: int, high: int, open_low: bool = False, open_high: bool = False
) -> st.SearchStrategy[float | int]:
    """Finite numbers in a range, ints among them (TOML allows 1 for 1.0)."""
    floats = st.floats(low, high, exclude_min=open_low, exclude_max=open_high)
    return floats | st.integers(low + open_low, high - open_high)


names = st.text(st.characters(categories=["L", "N", "P", "S"]), min_size=1, max_size=12).filter(
    lambda name: name not in ("auto", "mesh")
)
"""Valid endpoint names: no spaces or control characters, not a routing word."""
expects = st.builds(
    Expect,
    chat_template_sha256=optional(st.text("0123456789abcdef", min_size=64, max_size=64)),
    n_ctx=optional(counts(1)),
    total_slots=optional(counts(1)),
)
"""Valid [endpoint.expect] tables, any key unset."""


def endpoints_of(kind: str, selftest: st.SearchStrategy[bool]) -> st.SearchStrategy[Endpoint]:
    """Valid endpoints of one kind; an openai one may name its engine's affinity."""
    openai = kind == "openai"
    headers = ["x-smg-routing-key", "X-Dynamo-Session-ID", "x-session-token"] if openai else []
    return st.builds(
        Endpoint,
        kind=st.just(kind),
        selftest=selftest,
        name=names,
        socket=st.text("abcz09._-/", max_size=40).map(lambda tail: "/tmp/" + tail),
        model=optional(st.text(min_size=1, max_size=20)),
        expect=expects,
        size_b=optional(reals(0, 1_000_000, open_low=True)),
        vision=st.booleans(),
        audio=st.booleans(),
        affinity_header=st.sampled_from([None, *headers]),
        affinity_field=st.sampled_from([None, "user"] if openai else [None]),
        affinity_priority=st.booleans() if openai else st.just(False),
        slot_save=st.booleans() if kind == "llama-server" else st.just(False),
        slot_dir_bytes=st.integers(1, 2**62),
    ).flatmap(_with_slot_dir)


def _with_slot_dir(endpoint: Endpoint) -> st.SearchStrategy[Endpoint]:
    """An endpoint that saves slots names their directory; one that does not, none."""
    if not endpoint.slot_save:
        return st.just(endpoint)
    directories = st.text("abcz09._-/", min_size=1, max_size=30).map(lambda tail: "/tmp/" + tail)
    return directories.map(lambda path: dataclasses.replace(endpoint, slot_dir=path))


endpoints = endpoints_of("llama-server", st.booleans()) | endpoints_of("openai", st.just(False))
"""Valid endpoints of either kind (openai ones never self-test)."""
configs = st.builds(
    Config,
    endpoints=st.lists(endpoints, min_size=1, max_size=3, unique_by=lambda e: e.name).map(tuple),
    max_tokens=st.integers(1, 2**31 - 1),
    cache_loss_tokens=counts(0),
    limits=st.builds(
        Limits,
        poll_ms=counts(1),
        busy_wait_ms=counts(0),
        load_wait_ms=counts(0),
        idle_grace_ms=counts(0),
        liveness_ms=counts(1),
        prefill_stall_ms=counts(1),
        queue_depth=counts(0),
    ),
    thinking=st.builds(Thinking, cap=counts(1), overrun=counts(0)),
    retry=st.builds(
        Retry,
        attempts=counts(1),
        total_ms=counts(1),
        backoff_ms=st.lists(counts(0), min_size=1, max_size=5).map(tuple),
        jitter=reals(0, 1, open_high=True),
    ),
    caps=st.builds(Caps, header_bytes=counts(1), sse_line_bytes=counts(1), body_bytes=counts(1)),
    sampling=st.builds(
        Sampling,
        temperature=optional(reals(0, 5)),
        top_p=optional(reals(0, 1)),
        top_k=optional(st.integers(0, 2**31 - 1)),
        min_p=optional(reals(0, 1)),
        typical_p=optional(reals(0, 1)),
        repeat_penalty=optional(reals(0, 5, open_low=True)),
        repeat_last_n=optional(st.integers(-1, 2**31 - 1)),
        presence_penalty=optional(reals(-2, 2)),
        frequency_penalty=optional(reals(-2, 2)),
        seed=optional(st.integers(0, 2**32 - 1)),
    ),
    server=st.builds(
        Server,
        body_bytes=counts(1),
        header_timeout_ms=st.integers(1, 2**31 - 1),
        body_timeout_ms=st.integers(1, 2**31 - 1),
        body_min_bytes_per_s=st.integers(0, 2**31 - 1),
        max_connections=st.integers(1, 2**31 - 1),
        keepalive_ms=st.integers(1, 2**31 - 1),
    ),
    mesh=st.builds(Mesh, strong_patience_ms=st.integers(0, 2**31 - 1)),
    health=st.builds(
        HealthProbe,
        up_interval_ms=st.integers(1, 2**31 - 1),
        down_interval_ms=st.integers(1, 2**31 - 1),
        timeout_ms=st.integers(1, 2**31 - 1),
    ),
    doors=st.builds(Doors, hosted_tools=st.sampled_from(["drop", "refuse"])),
    telemetry=st.integers(1, 2**31 - 1).flatmap(
        lambda queue: st.builds(
            Telemetry,
            enabled=st.booleans(),
            service_name=st.text(min_size=1, max_size=12),
            socket=st.just("/tmp/ld/otlp.sock"),
            path=st.from_regex(r"/[!-~]{0,20}", fullmatch=True),
            export_interval_ms=st.integers(1, 2**31 - 1),
            max_queue=st.just(queue),
            max_batch=st.integers(1, queue),
            export_timeout_ms=st.integers(1, 2**31 - 1),
            stop_wait_ms=st.integers(0, 2**31 - 1),
            session_ids=st.sampled_from(["hash", "plain"]),
        )
    ),
    queue=st.builds(
        Queue,
        serve=st.booleans(),
        socket=optional(st.just("/tmp/ld/llm-queue.sock")),
        config=optional(st.just("/tmp/ld/llm-queue.json")),
        models_json=optional(st.just("/tmp/ld/models.json")),
        sweep_ms=st.integers(1, 2**31 - 1),
        grace_ms=st.integers(0, 2**31 - 1),
    ),
    capture=st.just(Capture())
    | st.builds(
        Capture,
        dir=st.just(CAPTURE_DIR),
        max_bytes=st.integers(1, 2**62),
        prompts=st.booleans(),
    ),
)
"""Valid configurations, every key set to a value the loader accepts."""
json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
"""Any value a decoder could hand over, valid or not (None included, which TOML lacks)."""

TABLES: list[tuple[str, Callable[[Any], Any], set[str]]] = [
    ("", lambda doc: doc, set(config_module._SECTIONS)),
    *[
        (name, lambda doc, name=name: doc[name], {f.name for f in fields(cls)})
        for name, cls in SECTION_TYPES.items()
        if name != "capture"
    ],
    (
        "capture",
        lambda doc: doc.setdefault("capture", {"dir": CAPTURE_DIR}),
        {f.name for f in fields(Capture)},
    ),
    ("endpoint[0]", lambda doc: doc["endpoint"][0], {f.name for f in fields(Endpoint)}),
    (
        "endpoint[0].expect",
        lambda doc: doc["endpoint"][0]["expect"],
        {f.name for f in fields(Expect)},
    ),
]
"""Where an unknown key can go: its table's dotted path, how to reach it, its keys."""
INTEGER_KEYS: list[tuple[str, str | None]] = [
    ("max_tokens", None),
    ("cache_loss_tokens", None),
    *[(s, f.name) for s in ("limits", "thinking", "caps") for f in fields(SECTION_TYPES[s])],
    *[("retry", k) for k in ("attempts", "total_ms")],
    *[("sampling", k) for k in ("top_k", "repeat_last_n", "seed")],
    *[("server", k) for k in ("body_bytes", "backlog")],
]
"""Every integer key as (section, key); key None for a top-level key."""
