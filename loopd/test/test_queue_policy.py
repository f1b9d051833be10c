"""
Tests for L{loopd.queue.policy}: llm-queue.json's fields, defaults and validation messages,
JavaScript number rules, and the fallback to the defaults.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.policy import (
    CURRENT_SCHEMA_VERSION,
    DEFAULT_BLOCKING_TOOLS,
    DEFAULT_POLICY,
    PolicyError,
    PolicySyntaxError,
    QueueEntry,
    QueueSettings,
    load_policy,
    parse_policy,
    parse_policy_text,
    reload_policy,
)

GPU1 = "http://192.168.1.100:8001/v1"
SEED_EXAMPLE: dict[str, Any] = json.loads(
    """{"defaults": {"maxStreams": 1, "policy": "priority-aging", "leaseTtlMs": 30000,
    "agingAfterSlots": 3, "agingAfterMs": 60000, "failOpen": true, "daemonIdleExitMs": 0,
    "logFile": "/home/marat/.pi/agent/llm-queue.log"}, "queues": {
    "http://192.168.1.100:8001/v1": {"maxStreams": 1}, "zen": {"maxStreams": 3, "policy": "fifo"},
    "free-api": {"enabled": false}, "one-gpu": {"match": ["http://192.168.1.100:8001/v1",
    "http://192.168.1.100:8002/v1"], "maxStreams": 1}, "serial-llama": {"match": ["llamacpp"],
    "maxStreams": 1}}}"""
)
QUEUE_FIELDS = tuple(
    "maxStreams policy leaseTtlMs agingAfterSlots agingAfterMs idleYieldMs".split()
)
DEFAULTS_ONLY = tuple("failOpen queueTimeoutMs blockingTools daemonIdleExitMs logFile".split())
QZ = "queues.zen"
POSITIVE = "must be a positive integer"
NON_NEGATIVE = "must be a non-negative integer"


def snake(name: str) -> str:
    """The attribute for a JSON field name: C{maxStreams} is C{max_streams}."""
    return re.sub("([A-Z])", r"_\1", name).lower()


def problems_of(document: object) -> tuple[str, ...]:
    """The violations parse_policy reports for a document that must be invalid."""
    try:
        parse_policy(document)
    except PolicyError as error:
        return error.problems
    raise AssertionError(f"{document!r} was accepted")


def entry(**fields: object) -> dict[str, Any]:
    """A document whose only content is the queue entry C{zen}."""
    return {"queues": {"zen": fields}}


def defaults(**fields: object) -> dict[str, Any]:
    """A document whose only content is C{defaults}."""
    return {"defaults": fields}


class DefaultsTests(SynchronousTestCase):
    """Every field's default, as the seed gives it."""

    def test_empty_document(self) -> None:
        """An empty object is the default policy, schemaVersion 1."""
        self.assertEqual(parse_policy({}), DEFAULT_POLICY)
        self.assertEqual((DEFAULT_POLICY.schema_version, CURRENT_SCHEMA_VERSION), (1, 1))

    def test_queue_settings(self) -> None:
        """Queues default to one stream, priority-aging, 30 s TTL, aging 3/60 s, yield 30 s."""
        want = QueueSettings(1, "priority-aging", 30_000, 3, 60_000, 30_000, enabled=True)
        self.assertEqual(DEFAULT_POLICY.defaults.queue, want)

    def test_client_and_daemon_side(self) -> None:
        """failOpen true, no wait warning, the six blocking tools, idle exit 0, no log file."""
        got = DEFAULT_POLICY.defaults
        tools = ("subagent", "subagent_wait", "bg_wait", "ask_user", "contact_supervisor")
        self.assertEqual((got.blocking_tools, DEFAULT_BLOCKING_TOOLS), ((*tools, "intercom"),) * 2)
        values = (got.fail_open, got.queue_timeout_ms, got.daemon_idle_exit_ms, got.log_file)
        self.assertEqual(values, (True, None, 0, None))

    def test_entry_inherits(self) -> None:
        """An entry's unset fields take the defaults, its own override them; others default."""
        policy = parse_policy({"defaults": {"leaseTtlMs": 5000}, **entry(maxStreams=3)})
        self.assertEqual(policy.settings_for("zen"), QueueSettings(3, lease_ttl_ms=5000))
        self.assertEqual(policy.settings_for("elsewhere"), QueueSettings(lease_ttl_ms=5000))

    def test_seed_example(self) -> None:
        """The seed's example file is valid and reads as written."""
        policy = parse_policy(SEED_EXAMPLE)
        self.assertEqual(policy.defaults.log_file, "/home/marat/.pi/agent/llm-queue.log")
        self.assertEqual(policy.settings_for("zen"), QueueSettings(max_streams=3, policy="fifo"))
        self.assertFalse(policy.settings_for("free-api").enabled)
        self.assertEqual([e.key for e in policy.queues if e.is_group], ["one-gpu", "serial-llama"])

    def test_ignored_keys(self) -> None:
        """Keys the policy does not read are listed, not rejected, and change nothing."""
        document = {"x": 1, "defaults": {"enabled": False}, "queues": {GPU1: {"failOpen": 0}}}
        policy = parse_policy(document)
        self.assertEqual(policy.ignored, ("defaults.enabled", f'queues["{GPU1}"].failOpen', "x"))
        self.assertEqual(policy.defaults, DEFAULT_POLICY.defaults)
        self.assertTrue(policy.settings_for(GPU1).enabled)


e, d = entry, defaults


def bad(document: object, message: str) -> Callable[[SynchronousTestCase], None]:
    """A test method: C{document} has exactly the one violation C{message}."""

    def test(self: SynchronousTestCase) -> None:
        self.assertEqual(problems_of(document), (message,))

    test.__doc__ = f"The one violation reported is: {message}"
    return test


class MessageTests(SynchronousTestCase):
    """Every validation message, in the seed's template; one test each."""

    test_max_streams = bad(e(maxStreams=0), f"{QZ}.maxStreams {POSITIVE} (got 0)")
    test_max_streams_fraction = bad(d(maxStreams=1.5), f"defaults.maxStreams {POSITIVE} (got 1.5)")
    test_policy = bad(
        e(policy="lifo"), f'{QZ}.policy must be one of "priority-aging", "fifo" (got "lifo")'
    )
    test_lease_ttl = bad(
        e(leaseTtlMs=999), f"{QZ}.leaseTtlMs must be an integer of at least 1000 (got 999)"
    )
    test_aging_slots = bad(e(agingAfterSlots=-1), f"{QZ}.agingAfterSlots {NON_NEGATIVE} (got -1)")
    test_aging_ms = bad(d(agingAfterMs="6"), f'defaults.agingAfterMs {NON_NEGATIVE} (got "6")')
    test_idle_yield = bad(e(idleYieldMs=-5), f"{QZ}.idleYieldMs {NON_NEGATIVE} (got -5)")
    test_enabled = bad(e(enabled=1), f"{QZ}.enabled must be a boolean (got 1)")
    test_match_not_array = bad(
        e(match=GPU1), f'{QZ}.match must be a non-empty array of strings (got "{GPU1}")'
    )
    test_match_empty = bad(e(match=[]), f"{QZ}.match must be a non-empty array of strings (got [])")
    test_match_item = bad(e(match=[GPU1, 7]), f"{QZ}.match[1] must be a non-empty string (got 7)")
    test_fail_open = bad(d(failOpen="yes"), 'defaults.failOpen must be a boolean (got "yes")')
    test_queue_timeout = bad(d(queueTimeoutMs=0), f"defaults.queueTimeoutMs {POSITIVE} (got 0)")
    test_blocking_tools = bad(
        d(blockingTools="ask_user"),
        'defaults.blockingTools must be an array of strings (got "ask_user")',
    )
    test_blocking_tools_item = bad(
        d(blockingTools=["ask_user", None]),
        "defaults.blockingTools[1] must be a non-empty string (got null)",
    )
    test_daemon_idle_exit = bad(
        d(daemonIdleExitMs=-1), f"defaults.daemonIdleExitMs {NON_NEGATIVE} (got -1)"
    )
    test_log_file = bad(d(logFile=""), 'defaults.logFile must be a non-empty path string (got "")')
    test_root = bad([], "llm-queue.json must be an object (got [])")
    test_defaults_object = bad({"defaults": 3}, "defaults must be an object (got 3)")
    test_queues_object = bad({"queues": ["z"]}, 'queues must be an object (got ["z"])')
    test_entry_object = bad({"queues": {"zen": None}}, f"{QZ} must be an object (got null)")
    test_url_key_path = bad(
        {"queues": {GPU1: {"maxStreams": 0}}}, f'queues["{GPU1}"].maxStreams {POSITIVE} (got 0)'
    )
    test_schema_version_type = bad({"schemaVersion": "1"}, f'schemaVersion {POSITIVE} (got "1")')
    test_schema_version_newer = bad(
        {"schemaVersion": 2, "defaults": {"maxStreams": 0}},
        "schemaVersion must be at most 1 (got 2): upgrade pi-llm-queue",
    )
    test_rendered_object = bad(
        e(maxStreams={"n": [1, "x"]}), f'{QZ}.maxStreams {POSITIVE} (got {{"n":[1,"x"]}})'
    )
    test_integral_float_rendered = bad(e(maxStreams=-3.0), f"{QZ}.maxStreams {POSITIVE} (got -3)")
    test_booleans_not_numbers = bad(
        d(idleYieldMs=False), f"defaults.idleYieldMs {NON_NEGATIVE} (got false)"
    )
    test_nan_value = bad(d(maxStreams=float("nan")), f"defaults.maxStreams {POSITIVE} (got NaN)")

    def test_every_violation(self) -> None:
        """All violations are reported at once, defaults first, entries in file order."""
        document = {"defaults": {"failOpen": 0}, "queues": {"b": {"enabled": "no"}, "a": []}}
        want = (
            "defaults.failOpen must be a boolean (got 0)",
            'queues.b.enabled must be a boolean (got "no")',
            "queues.a must be an object (got [])",
        )
        error = self.assertRaises(PolicyError, parse_policy, document)
        self.assertEqual((error.problems, str(error)), (want, "\n".join(want)))

    def test_long_value_shortened(self) -> None:
        """A long value is cut short in the message."""
        (line,) = problems_of(entry(maxStreams="x" * 500))
        self.assertTrue(line.startswith(f'{QZ}.maxStreams {POSITIVE} (got "xxx'))
        self.assertTrue(line.endswith("...)") and len(line) < 200)


class NumberTests(SynchronousTestCase):
    """JSON follows JavaScript semantics (DESIGN §12)."""

    def test_integral_float(self) -> None:
        """2.0 is the integer 2, 1e3 is 1000, -0 is 0, and schemaVersion 1.0 is version 1."""
        text = '{"schemaVersion": 1.0, "defaults": {"maxStreams": 2.0, "leaseTtlMs": 1e3}}'
        policy = parse_policy_text(text.replace("}}", ', "idleYieldMs": -0}}'))
        got = (policy.defaults.queue, policy.schema_version)
        self.assertEqual(got, (QueueSettings(2, lease_ttl_ms=1000, idle_yield_ms=0), 1))
        self.assertIsInstance(policy.defaults.queue.max_streams, int)

    def test_constants_not_json(self) -> None:
        """NaN, Infinity and -Infinity in the file are not JSON."""
        for token in ("NaN", "Infinity", "-Infinity"):
            text = '{"defaults": {"agingAfterMs": ' + token + "}}"
            self.assertRaises(PolicySyntaxError, parse_policy_text, text)

    def test_overflowing_number(self) -> None:
        """1e400 and an integer beyond a double parse to Infinity, which is not an integer."""
        text = '{"defaults": {"idleYieldMs": 1e400}}'
        error = self.assertRaises(PolicyError, parse_policy_text, text)
        self.assertEqual(error.problems, (f"defaults.idleYieldMs {NON_NEGATIVE} (got Infinity)",))

        huge = '{"defaults": {"daemonIdleExitMs": 1' + "0" * 400 + "}}"
        self.assertRaises(PolicyError, parse_policy_text, huge)

    def test_syntax_error_kind(self) -> None:
        """Text that is not JSON raises PolicySyntaxError, a PolicyError."""
        error = self.assertRaises(PolicySyntaxError, parse_policy_text, '{"defaults": {')
        self.assertIsInstance(error, PolicyError)
        self.assertTrue(error.problems[0].startswith("not valid JSON: "))

    def test_bytes_utf8(self) -> None:
        """Bytes are UTF-8; invalid UTF-8 is a syntax error."""
        self.assertEqual(parse_policy_text(b'{"queues": {"\xc3\xa9": {}}}').queues[0].key, "é")
        self.assertRaises(PolicySyntaxError, parse_policy_text, b'{"queues": {"\xff": {}}}')


class FileTests(SynchronousTestCase):
    """load_policy and reload_policy."""

    def setUp(self) -> None:
        """A short temporary directory."""
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        self.path = os.path.join(directory, "llm-queue.json")
        self.current = parse_policy(entry(maxStreams=2))

    def write(self, content: object) -> None:
        """Write the file: a string as it is, anything else as JSON."""
        with open(self.path, "w", encoding="utf-8") as stream:
            stream.write(content if isinstance(content, str) else json.dumps(content))

    def test_missing(self) -> None:
        """A missing file is all defaults with no error, at start and on reload."""
        self.assertEqual(load_policy(self.path), (DEFAULT_POLICY, ()))
        self.assertEqual(reload_policy(self.path, self.current), (DEFAULT_POLICY, ()))

    def test_valid(self) -> None:
        """A valid file is read, at start and on reload."""
        self.write(SEED_EXAMPLE)
        self.assertEqual(load_policy(self.path), (parse_policy(SEED_EXAMPLE), ()))
        self.assertEqual(reload_policy(self.path, self.current), (parse_policy(SEED_EXAMPLE), ()))

    def test_invalid_falls_back_whole(self) -> None:
        """An invalid file at start is the defaults as a whole, its valid fields too."""
        self.write({"defaults": {"maxStreams": 5, "leaseTtlMs": 1}})
        message = f"{self.path}: defaults.leaseTtlMs must be an integer of at least 1000 (got 1)"
        self.assertEqual(load_policy(self.path), (DEFAULT_POLICY, (message,)))

    def test_not_json_at_start(self) -> None:
        """A file that is not JSON at start is the defaults, with the reason reported."""
        self.write('{"defaults": ')
        policy, (error,) = load_policy(self.path)
        self.assertEqual(policy, DEFAULT_POLICY)
        self.assertTrue(error.startswith(f"{self.path}: not valid JSON: "))

    def test_unreadable(self) -> None:
        """A path that cannot be read (a directory) is the defaults, or the current policy."""
        os.mkdir(self.path)
        policy, (error,) = load_policy(self.path)
        self.assertEqual(policy, DEFAULT_POLICY)
        self.assertTrue(error.startswith(f"{self.path}: cannot read: "))
        self.assertIs(reload_policy(self.path, self.current)[0], self.current)

    def test_reload_half_written(self) -> None:
        """A half-written file on reload keeps the last good policy, silently."""
        self.write('{"queues": {"zen"')
        self.assertEqual(reload_policy(self.path, self.current), (self.current, ()))

    def test_reload_invalid(self) -> None:
        """An invalid file on reload keeps the last good policy and reports why."""
        self.write(entry(maxStreams=0))
        message = f"{self.path}: {QZ}.maxStreams {POSITIVE} (got 0)"
        self.assertEqual(reload_policy(self.path, self.current), (self.current, (message,)))


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats()
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
names = st.text(min_size=1, max_size=12)
queue_values = {
    "maxStreams": st.integers(1, 10**6),
    "policy": st.sampled_from(["priority-aging", "fifo"]),
    "leaseTtlMs": st.integers(1000, 10**9) | st.integers(1000, 10**6).map(float),
    "agingAfterSlots": st.integers(0, 100),
    "agingAfterMs": st.integers(0, 10**9),
    "idleYieldMs": st.integers(0, 10**9),
}
defaults_values = {
    **queue_values,
    "failOpen": st.booleans(),
    "queueTimeoutMs": st.integers(1, 10**9),
    "blockingTools": st.lists(names, max_size=4),
    "daemonIdleExitMs": st.integers(0, 2**40),
    "logFile": names,
}
entry_values = {**queue_values, "enabled": st.booleans(), "match": st.lists(names, min_size=1)}
valid_documents = st.fixed_dictionaries(
    {},
    optional={
        "schemaVersion": st.just(1),
        "defaults": st.fixed_dictionaries({}, optional=defaults_values),
        "queues": st.dictionaries(names, st.fixed_dictionaries({}, optional=entry_values)),
    },
)


@st.composite
def broken_documents(draw: st.DrawFn) -> object:
    """A valid document with one value at the top, in defaults or in an entry made junk."""
    document: dict[str, Any] = draw(valid_documents)
    where = [document, document.setdefault("defaults", {})]
    where.append(document.setdefault("queues", {}).setdefault("q", {}))
    keys = [*defaults_values, "enabled", "match", "schemaVersion", "defaults", "queues", "x"]
    draw(st.sampled_from(where))[draw(st.sampled_from(keys))] = draw(json_values)
    return document


def held(value: object) -> object:
    """A JSON value as the policy holds it: arrays as tuples, integral floats as ints."""
    if isinstance(value, list):
        return tuple(value)
    return int(value) if isinstance(value, float) else value


class PropertyTests(SynchronousTestCase):
    """Properties over generated documents."""

    @given(valid_documents)
    def test_valid_round_trip(self, document: dict[str, Any]) -> None:
        """A valid document parses, from text too, and every field reads back or defaults."""
        policy = parse_policy(document)
        self.assertEqual((policy.ignored, parse_policy_text(json.dumps(document))), ((), policy))
        given_defaults = document.get("defaults", {})
        for name in QUEUE_FIELDS + DEFAULTS_ONLY:
            holder: object = policy.defaults
            origin: object = DEFAULT_POLICY.defaults
            if name in QUEUE_FIELDS:
                holder, origin = policy.defaults.queue, DEFAULT_POLICY.defaults.queue
            want = held(given_defaults.get(name, getattr(origin, snake(name))))
            self.assertEqual(getattr(holder, snake(name)), want, name)
        queues = document.get("queues", {})
        self.assertEqual([got.key for got in policy.queues], list(queues))
        for got in policy.queues:
            for name in (*QUEUE_FIELDS, "enabled", "match"):
                unset = getattr(QueueEntry(got.key), snake(name))
                self.assertEqual(getattr(got, snake(name)), held(queues[got.key].get(name, unset)))

    @given(json_values | broken_documents())
    def test_arbitrary_json(self, document: object) -> None:
        """Arbitrary or near-valid JSON parses or raises PolicyError naming what must be."""
        try:
            parse_policy(document)
        except PolicyError as error:
            self.assertTrue(error.problems)
            self.assertTrue(all(" must be " in line for line in error.problems))

    @given(st.text(max_size=40) | st.binary(max_size=40))
    def test_arbitrary_text(self, text: str | bytes) -> None:
        """Arbitrary file text parses or raises PolicyError."""
        try:
            parse_policy_text(text)
        except PolicyError as error:
            self.assertTrue(error.problems)
