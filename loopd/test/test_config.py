"""
Tests for L{loopd.config}: loopd.toml into a frozen, typed Config (defaults, the example
files, valid documents and generated ones), and its errors: every violation of a loopd.toml
is reported at once, each named by its dotted path.
"""

from __future__ import annotations

import os
import socket
from dataclasses import fields, replace
from pathlib import Path

from hypothesis import assume, given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd import config as config_module
from loopd._message_style import key_path, render
from loopd.config import (
    SOCKET_PATH_MAX,
    ConfigError,
    config_from_mapping,
    load_config,
    parse_config,
)
from loopd.settings import (
    Caps,
    Capture,
    Config,
    Endpoint,
    Expect,
    HealthProbe,
    Limits,
    Retry,
    Sampling,
    Server,
    Telemetry,
    Thinking,
)
from loopd.test.support.config_docs import (
    EP,
    INTEGER_KEYS,
    OPENAI,
    SECTION_TYPES,
    TABLES,
    bad_document,
    configs,
    json_like,
    mapping_of,
    minimal_mapping,
    toml_text,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "config"


class DefaultsTests(SynchronousTestCase):
    """The defaults are seed 000's limits."""

    def test_limits(self) -> None:
        """The request limits default to seed 000 section 4."""
        self.assertEqual(
            (Limits(), Thinking(), Config(endpoints=()).max_tokens),
            (
                Limits(
                    poll_ms=5000,
                    busy_wait_ms=600_000,
                    load_wait_ms=180_000,
                    idle_grace_ms=30_000,
                    liveness_ms=30_000,
                    prefill_stall_ms=600_000,
                    queue_depth=8,
                ),
                Thinking(cap=4096, overrun=256),
                8192,
            ),
        )

    def test_retry_caps_cache(self) -> None:
        """Retry schedule, size caps and cache-loss threshold default to the seed's."""
        self.assertEqual(
            Retry(),
            Retry(
                attempts=4,
                backoff_ms=(2000, 8000, 30_000),
                jitter=0.25,
                total_ms=300_000,
            ),
        )
        self.assertEqual(Caps(), Caps(header_bytes=16_384, sse_line_bytes=2**20, body_bytes=2**22))
        self.assertEqual(Config(endpoints=()).cache_loss_tokens, 64)

    def test_server_backlog(self) -> None:
        """The listen backlog is the platform's largest unless [server] backlog names one."""
        self.assertEqual(Server().backlog, socket.SOMAXCONN)
        self.assertEqual(parse_config("[server]\nbacklog = 200\n" + EP).server.backlog, 200)

    def test_health_probe(self) -> None:
        """The health probe runs every 5 s while up, every 1 s while down, 2 s for an answer."""
        self.assertEqual(
            Config(endpoints=()).health,
            HealthProbe(up_interval_ms=5000, down_interval_ms=1000, timeout_ms=2000),
        )
        parsed = parse_config("[health]\ndown_interval_ms = 250\n" + EP).health
        self.assertEqual(parsed.down_interval_ms, 250)

    def test_sampling_unset(self) -> None:
        """Every sampling setting is unset by default, so nothing is sent upstream."""
        self.assertEqual(Sampling().request_fields(), {})
        self.assertEqual({getattr(Sampling(), f.name) for f in fields(Sampling)}, {None})

    def test_frozen(self) -> None:
        """Config values cannot be changed after they are made."""
        config = Config(endpoints=())
        self.assertRaises(AttributeError, setattr, config, "max_tokens", 1)

    def test_tables_match_dataclasses(self) -> None:
        """Each Config field has one section parser; each section field has a rule."""
        attributes = [s.attribute for s in config_module._SECTIONS.values()]
        self.assertEqual(sorted(attributes), sorted(f.name for f in fields(Config)))
        rules = {
            Limits: config_module._LIMITS_RULES,
            Thinking: config_module._THINKING_RULES,
            Retry: config_module._RETRY_RULES,
            Caps: config_module._CAPS_RULES,
            Sampling: config_module._SAMPLING_RULES,
            Expect: config_module._EXPECT_RULES,
            HealthProbe: config_module._HEALTH_RULES,
            Telemetry: config_module._TELEMETRY_RULES,
            Capture: config_module._CAPTURE_RULES,
        }
        for cls, table in rules.items():
            self.assertEqual(set(table), {f.name for f in fields(cls)}, cls)


class FixtureTests(SynchronousTestCase):
    """The example files in fixtures/config."""

    def test_minimal(self) -> None:
        """A file with a single endpoint and nothing else gives the defaults."""
        config = load_config(FIXTURES / "minimal.toml")
        endpoint = Endpoint(name="local", socket="/run/loopd/infer.sock")
        self.assertEqual(config, Config(endpoints=(endpoint,)))
        self.assertEqual((endpoint.kind, endpoint.selftest), ("llama-server", True))

    def test_full_is_the_defaults(self) -> None:
        """Every section of the full example equals its default."""
        config = load_config(str(FIXTURES / "full.toml"))
        self.assertEqual(replace(config, endpoints=()), Config(endpoints=()))

    def test_full_endpoint(self) -> None:
        """The full example's endpoint sets every key, the socket's ~ expanded."""
        (endpoint,) = load_config(FIXTURES / "full.toml").endpoints
        expected = Endpoint(
            name="qwen3:8b",
            socket=os.path.expanduser("~/.loopd/qwen3.sock"),
            kind="llama-server",
            model="qwen3-8b",
            selftest=True,
            expect=Expect(chat_template_sha256="0" * 64, n_ctx=32768, total_slots=4),
        )
        self.assertEqual(endpoint, expected)

    def test_full_names_every_key(self) -> None:
        """The full example names every table and key (sampling commented out)."""
        text = (FIXTURES / "full.toml").read_text().replace("\n# ", "\n")
        headers = [f"[{name}]" for name in SECTION_TYPES]
        for header in [*headers, "[[endpoint]]", "[endpoint.expect]"]:
            self.assertIn(f"\n{header}\n", text)
        keys = {"max_tokens", "cache_loss_tokens"}
        for cls in [*SECTION_TYPES.values(), Endpoint, Expect]:
            # router is set by loopd on a router's model endpoints, not a key of the file.
            keys |= {f.name for f in fields(cls)} - {"expect", "router"}
        for key in keys:
            self.assertIn(f"\n{key} = ", text, key)

    def test_full_sampling_examples_are_valid(self) -> None:
        """Uncommenting the sampling examples of the full file sets every setting."""
        text = (FIXTURES / "full.toml").read_text()
        for item in fields(Sampling):
            text = text.replace(f"\n# {item.name} = ", f"\n{item.name} = ")
        sent = parse_config(text).sampling.request_fields()
        self.assertEqual(list(sent), [f.name for f in fields(Sampling)])


class ValidDocumentTests(SynchronousTestCase):
    """Valid values are taken, converted where the type says so."""

    def test_sections(self) -> None:
        """Set keys replace defaults; keys left out keep theirs."""
        config = parse_config(
            "max_tokens = 9\n[limits]\npoll_ms = 50\n[retry]\nbackoff_ms = [1]\n" + EP
        )
        self.assertEqual(config.max_tokens, 9)
        self.assertEqual(config.limits, Limits(poll_ms=50))
        self.assertEqual(config.retry, Retry(backoff_ms=(1,)))

    def test_zero_where_allowed(self) -> None:
        """Waits, queue depth, overrun, cache loss, backoff, jitter, body rate floor may be 0."""
        config = parse_config(
            "cache_loss_tokens = 0\n[limits]\nbusy_wait_ms = 0\nload_wait_ms = 0\n"
            "idle_grace_ms = 0\nqueue_depth = 0\n[thinking]\noverrun = 0\n"
            "[retry]\nbackoff_ms = [0]\njitter = 0\n[server]\nbody_min_bytes_per_s = 0\n" + EP
        )
        self.assertEqual(config.server.body_min_bytes_per_s, 0)
        self.assertEqual((config.limits.queue_depth, config.limits.busy_wait_ms), (0, 0))
        self.assertEqual((config.thinking.overrun, config.cache_loss_tokens), (0, 0))
        self.assertEqual((config.retry.backoff_ms, config.retry.jitter), ((0,), 0.0))

    def test_sampling_only_set_fields_are_sent(self) -> None:
        """Only set sampling keys reach the request; 0 is set, ints become floats."""
        text = "[sampling]\ntemperature = 0\ntop_k = 40\nseed = 7\n" + EP
        sent = parse_config(text).sampling.request_fields()
        self.assertEqual(sent, {"temperature": 0.0, "top_k": 40, "seed": 7})
        self.assertIsInstance(sent["temperature"], float)

    def test_endpoint_names(self) -> None:
        """Endpoint names may contain ':' and '.', and are looked up by name."""
        config = parse_config(EP + EP.replace("local", "qwen3:0.6b"))
        self.assertEqual([e.name for e in config.endpoints], ["local", "qwen3:0.6b"])
        self.assertIs(config.endpoint("qwen3:0.6b"), config.endpoints[1])
        self.assertRaises(KeyError, config.endpoint, "nope")

    def test_groups(self) -> None:
        """Endpoints sharing a group are its members, in file order; groups listed once."""
        text = "".join(
            EP.replace("local", name) + group
            for name, group in [
                ("a", 'group = "qwen"\n'),
                ("b", ""),
                ("c", 'group = "qwen"\n'),
                ("d", 'group = "llama"\n'),
            ]
        )
        config = parse_config(text)
        self.assertEqual(config.groups, ("qwen", "llama"))
        self.assertEqual([e.name for e in config.members("qwen")], ["a", "c"])
        self.assertEqual(config.members("b"), ())
        self.assertEqual(config.endpoint("b").group, None)

    def test_affinity(self) -> None:
        """An openai endpoint takes an affinity header, field and priority as written."""
        text = OPENAI + 'affinity_header = "X-Dynamo-Session-ID"\naffinity_field = "user"\n'
        (endpoint,) = parse_config(text + "affinity_priority = true\n").endpoints
        self.assertEqual(
            (endpoint.affinity_header, endpoint.affinity_field, endpoint.affinity_priority),
            ("X-Dynamo-Session-ID", "user", True),
        )
        (plain,) = parse_config(EP + "affinity_priority = false\n").endpoints
        self.assertEqual(
            (plain.affinity_header, plain.affinity_field, plain.affinity_priority),
            (None, None, False),
        )

    def test_socket_home_expanded(self) -> None:
        """A socket path starting with ~ is expanded to the home directory."""
        config = parse_config(EP.replace("/tmp/ld/", "~/"))
        self.assertEqual(config.endpoints[0].socket, os.path.expanduser("~/infer.sock"))
        self.assertFalse(config.endpoints[0].socket.startswith("~"))

    def test_selftest_defaults(self) -> None:
        """Self-test is on for llama-server, off for openai; both may say false."""
        self.assertTrue(parse_config(EP).endpoints[0].selftest)
        self.assertFalse(parse_config(EP + "selftest = false").endpoints[0].selftest)
        self.assertFalse(parse_config(OPENAI).endpoints[0].selftest)
        self.assertFalse(parse_config(OPENAI + "selftest = false").endpoints[0].selftest)

    def test_router(self) -> None:
        """A llama-server-router endpoint: its models, models_max, a self-test by default."""
        router = EP + 'kind = "llama-server-router"\nmodels = ["a", "b:7b"]\nmodels_max = 1\n'
        endpoint = parse_config(router).endpoints[0]
        self.assertEqual(
            (endpoint.kind, endpoint.models, endpoint.models_max, endpoint.selftest),
            ("llama-server-router", ("a", "b:7b"), 1, True),
        )
        plain = parse_config(EP + 'kind = "llama-server-router"\n').endpoints[0]
        self.assertEqual((plain.models, plain.models_max, plain.router), (None, None, None))

    def test_slot_save(self) -> None:
        """slot_save is off unless a llama-server endpoint says true; openai may say false."""
        self.assertFalse(parse_config(EP).endpoints[0].slot_save)
        endpoint = parse_config(EP + 'slot_save = true\nslot_dir = "~/slots"').endpoints[0]
        self.assertTrue(endpoint.slot_save)
        self.assertEqual(endpoint.slot_dir, os.path.expanduser("~/slots"))
        self.assertEqual(endpoint.slot_dir_bytes, 16 * 1024**3)
        self.assertFalse(parse_config(OPENAI + "slot_save = false").endpoints[0].slot_save)

    def test_capture(self) -> None:
        """
        Nothing is captured without [capture]; with it, dir (~ expanded) turns capture on,
        with a 256 MiB budget and no prompts unless said.
        """
        self.assertEqual(parse_config(EP).capture, Capture())
        self.assertIsNone(Capture().dir)
        capture = parse_config('[capture]\ndir = "~/cap"\n' + EP).capture
        self.assertEqual(capture, Capture(dir=os.path.expanduser("~/cap")))
        self.assertEqual((capture.max_bytes, capture.prompts), (256 * 1024**2, False))
        text = '[capture]\ndir = "/c"\nmax_bytes = 1000\nprompts = true\n' + EP
        self.assertEqual(
            parse_config(text).capture, Capture(dir="/c", max_bytes=1000, prompts=True)
        )

    def test_expect_partial_and_case(self) -> None:
        """Expect keys are optional one by one; the SHA-256 is stored in lowercase."""
        sha = "AB" * 32
        config = parse_config(EP + f'[endpoint.expect]\nchat_template_sha256 = "{sha}"')
        self.assertEqual(config.endpoints[0].expect, Expect(chat_template_sha256="ab" * 32))

    def test_from_mapping(self) -> None:
        """config_from_mapping takes an already decoded document."""
        config = config_from_mapping(minimal_mapping())
        self.assertEqual(config.endpoints, (Endpoint(name="local", socket="/tmp/ld/infer.sock"),))


class PropertyTests(SynchronousTestCase):
    """Properties over generated documents."""

    @given(configs)
    def test_mapping_round_trip(self, config: Config) -> None:
        """Any valid configuration, written as a mapping, reads back equal."""
        self.assertEqual(config_from_mapping(mapping_of(config)), config)

    @given(configs)
    def test_toml_round_trip(self, config: Config) -> None:
        """Any valid configuration, written as TOML text, reads back equal."""
        self.assertEqual(parse_config(toml_text(mapping_of(config))), config)

    @given(
        configs,
        st.sampled_from(TABLES),
        st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True),
        json_like,
    )
    def test_unknown_key_named(self, config, table, key, value) -> None:
        """Any unknown key anywhere is the one problem, named by its dotted path."""
        where, reach, known = table
        assume(key not in known)
        document = mapping_of(config)
        reach(document)[key] = value
        (problem,) = self.assertRaises(ConfigError, config_from_mapping, document).problems
        self.assertTrue(problem.startswith(f"{key_path(where, key)}: unknown key"))

    @given(st.sampled_from(INTEGER_KEYS), json_like.filter(lambda v: type(v) is not int))
    def test_integers_only(self, path, value) -> None:
        """No value but an int is an integer: not a bool, float, string or array."""
        section, key = path
        document = minimal_mapping()
        document[section] = value if key is None else {key: value}
        (problem,) = self.assertRaises(ConfigError, config_from_mapping, document).problems
        dotted = section if key is None else f"{section}.{key}"
        self.assertTrue(problem.startswith(f"{dotted}: expected "), problem)
        self.assertTrue(problem.endswith(f", got {render(value)}"), problem)

    @given(st.sampled_from([*config_module._SECTIONS, "other"]), json_like)
    def test_any_value_gives_config_or_error(self, key, value) -> None:
        """Whatever a top-level key holds, the outcome is a Config or a ConfigError."""
        document = minimal_mapping()
        document[key] = value
        try:
            self.assertIsInstance(config_from_mapping(document), Config)
        except ConfigError as error:
            self.assertTrue(error.problems)


NAME = "a non-empty string without spaces or control characters"
HEADER = "a header name (letters, digits and !#$%&'*+-.^_`|~)"
OWN_HEADER = (
    "a header other than connection, content-length, content-type, host, transfer-encoding, "
    "x-dynamo-request-priority"
)
FIELD = "a field name (a letter or _, then letters, digits, _ . or -)"
LLAMA_AFFINITY = "only for an openai endpoint: loopd pins a llama-server's slot itself"
JITTER = "a number x with 0 <= x < 1"
BACKOFF = "a non-empty array of non-negative integers"
# (dotted key, a bad TOML value for it, what the error says was expected)
BAD_VALUES = [
    ("max_tokens", "0", "an integer from 1 to 2147483647"),
    ("max_tokens", "1.5", "an integer from 1 to 2147483647"),
    ("cache_loss_tokens", "-1", "a non-negative integer"),
    ("limits", "5", "a table"),
    ("limits.poll_ms", "0", "a positive integer"),
    ("limits.poll_ms", "5000.0", "a positive integer"),
    ("limits.liveness_ms", "true", "a positive integer"),
    ("limits.busy_wait_ms", "-1", "a non-negative integer"),
    ("limits.queue_depth", '"8"', "a non-negative integer"),
    ("thinking.cap", "0", "a positive integer"),
    ("thinking.overrun", "[1]", "a non-negative integer"),
    ("retry.attempts", "0", "a positive integer"),
    ("retry.total_ms", "false", "a positive integer"),
    *[("retry.jitter", bad, JITTER) for bad in ("1.0", "1", "-0.1", "nan", "inf")],
    ("retry.jitter", "true", JITTER),
    *[("retry.backoff_ms", bad, BACKOFF) for bad in ("[]", "[1, -1]", "[1.5]")],
    *[("retry.backoff_ms", bad, BACKOFF) for bad in ("[true]", "2000", '"2000"')],
    ("caps.body_bytes", "0", "a positive integer"),
    ("server.body_bytes", "0", "a positive integer"),
    ("server.header_timeout_ms", "0", "an integer from 1 to 2147483647"),
    ("server.header_timeout_ms", "10000.0", "an integer from 1 to 2147483647"),
    ("server.body_timeout_ms", "0", "an integer from 1 to 2147483647"),
    ("server.body_min_bytes_per_s", "-1", "an integer from 0 to 2147483647"),
    ("server.body_min_bytes_per_s", "true", "an integer from 0 to 2147483647"),
    ("server.max_connections", "0", "an integer from 1 to 2147483647"),
    ("server.max_connections", "2147483648", "an integer from 1 to 2147483647"),
    ("caps.header_bytes", "16384.0", "a positive integer"),
    ("server.backlog", "0", "an integer from 1 to 2147483647"),
    ("server.backlog", "4096.0", "an integer from 1 to 2147483647"),
    ("server.backlog", "true", "an integer from 1 to 2147483647"),
    ("server.backlog", "2147483648", "an integer from 1 to 2147483647"),
    ("health.up_interval_ms", "0", "an integer from 1 to 2147483647"),
    ("health.down_interval_ms", "1000.5", "an integer from 1 to 2147483647"),
    ("health.timeout_ms", "true", "an integer from 1 to 2147483647"),
    ("sampling.temperature", "-0.1", "a number from 0 to 5"),
    ("sampling.top_p", "1.5", "a number from 0 to 1"),
    ("sampling.min_p", "nan", "a number from 0 to 1"),
    ("sampling.top_k", "-1", "an integer from 0 to 2147483647"),
    ("sampling.top_k", "40.0", "an integer from 0 to 2147483647"),
    ("sampling.repeat_penalty", "0", "a number x with 0 < x <= 5"),
    ("sampling.repeat_last_n", "-2", "an integer from -1 to 2147483647"),
    ("sampling.presence_penalty", "3", "a number from -2 to 2"),
    ("sampling.seed", "4294967296", "an integer from 0 to 4294967295"),
    ("sampling.seed", "true", "an integer from 0 to 4294967295"),
    ("endpoint.name", '""', NAME),
    ("endpoint.name", '"my model"', NAME),
    ("endpoint.name", "7", NAME),
    (
        "endpoint.name",
        '"auto"',
        'a name other than "auto" and "mesh", which the gateway routes',
    ),
    ("endpoint.socket", '""', "a non-empty path string"),
    ("endpoint.kind", '"vllm"', 'one of "llama-server", "llama-server-router", "openai"'),
    ("endpoint.model", '""', "a non-empty string"),
    ("endpoint.selftest", "1", "a boolean (true or false)"),
    ("endpoint.expect", "1", "a table"),
    ("endpoint.proxy_max_connections", "0", "an integer from 1 to 2147483647"),
    ("endpoint.proxy_burst", "1.5", "an integer from 1 to 2147483647"),
    ("endpoint.proxy_refill_per_second", "0", "a number x with 0 < x <= 1e+09"),
    ("endpoint.pacing_wait_ms", "-1", "an integer from 0 to 2147483647"),
    ("endpoint.selftest_wait_ms", "0", "an integer from 1 to 2147483647"),
    ("endpoint.group", '""', NAME),
    ("endpoint.group", '"my group"', NAME),
    *[
        ("endpoint.group", bad, 'a name other than "auto" and "mesh", which the gateway routes')
        for bad in ('"auto"', '"mesh"')
    ],
    *[("endpoint.affinity_header", bad, HEADER) for bad in ('""', '"x session"', '"a:b"', "1")],
    ("endpoint.affinity_header", '"x-é"', HEADER),
    *[
        ("endpoint.affinity_header", bad, OWN_HEADER)
        for bad in ('"Host"', '"content-type"', '"X-Dynamo-Request-Priority"')
    ],
    *[("endpoint.affinity_field", bad, FIELD) for bad in ('""', '"a b"', '"1st"', "true")],
    *[
        ("endpoint.affinity_field", bad, "a field loopd does not send itself (such as user)")
        for bad in ('"model"', '"messages"', '"max_tokens"')
    ],
    ("endpoint.affinity_priority", '"yes"', "a boolean (true or false)"),
    ("endpoint.slot_save", '"yes"', "a boolean (true or false)"),
    ("endpoint.slot_dir", '""', "a non-empty path string"),
    ("endpoint.models", "[]", "a non-empty array of model ids"),
    ("endpoint.models_max", "0", "a positive integer"),
    ("endpoint.slot_dir_bytes", "0", "an integer from 1 to 4611686018427387904"),
    ("endpoint.expect.n_ctx", '"8192"', "a positive integer"),
    ("endpoint.expect.total_slots", "0", "a positive integer"),
    (
        "endpoint.expect.chat_template_sha256",
        '"abc"',
        "64 hexadecimal digits (a SHA-256)",
    ),
]
# (a document with exactly one violation, that violation)
OTHER_PROBLEMS = [
    ("colour = 1\n" + EP, "colour: unknown key"),
    ("[gateway]\nx = 1\n" + EP, "gateway: unknown key"),
    (
        "[limits]\npol_ms = 1\n" + EP,
        'limits.pol_ms: unknown key (did you mean "poll_ms"?)',
    ),
    ('[limits]\n"a.b" = 1\n' + EP, 'limits."a.b": unknown key'),
    (EP + "port = 1", "endpoint[0].port: unknown key"),
    (
        EP + EP.replace("local", "b") + "[endpoint.expect]\nslots = 1",
        "endpoint[1].expect.slots: unknown key",
    ),
    ('[[endpoint]]\nname = "a"', "endpoint[0].socket: missing (this key is required)"),
    (
        OPENAI + "selftest = true",
        "endpoint[0].selftest: must be false for an openai endpoint: the self-test needs /props",
    ),
    *[
        (EP + line, f"endpoint[0].{line.split(' = ')[0]}: {LLAMA_AFFINITY}")
        for line in ('affinity_header = "x-smg-routing-key"', 'affinity_field = "user"')
    ],
    (EP + "affinity_priority = true", f"endpoint[0].affinity_priority: {LLAMA_AFFINITY}"),
    (
        EP + EP.replace("local", "b") + 'group = "local"',
        'endpoint[1].group: group "local" is the name of an endpoint (endpoint[0]): '
        "a model name must say which it means",
    ),
    (
        EP + 'group = "b"\n' + EP.replace("local", "b"),
        'endpoint[0].group: group "b" is the name of an endpoint (endpoint[1]): '
        "a model name must say which it means",
    ),
    (EP + 'models = ["a"]', "endpoint[0].models: only for a llama-server-router endpoint"),
    (OPENAI + "models_max = 2", "endpoint[0].models_max: only for a llama-server-router endpoint"),
    (
        EP + 'kind = "llama-server-router"\nmodel = "a"',
        "endpoint[0].model: not for a llama-server-router endpoint: each of its models is "
        "named in models (or all it lists are served)",
    ),
    (
        EP + 'kind = "llama-server-router"\nmodels = ["a", "a"]',
        "endpoint[0].models: a model id is listed twice",
    ),
    (
        EP + "slot_save = true",
        "endpoint[0].slot_dir: needed with slot_save = true: the server's --slot-save-path, "
        "which loopd checks (slot files hold prompts) and cleans",
    ),
    (
        EP + 'slot_dir = "/tmp/slots"',
        "endpoint[0].slot_dir: only with slot_save = true (the slot files' directory)",
    ),
    (
        OPENAI + "slot_save = true",
        "endpoint[0].slot_save: must be false for an openai endpoint: slot files need "
        "llama-server's /slots",
    ),
    (
        "[capture]\nprompts = true\n" + EP,
        "capture.dir: missing: the directory of the capture files (remove [capture] to capture "
        "nothing)",
    ),
    (
        '[capture]\ndir = "/tmp/c"\nmax_bytes = 0\n' + EP,
        "capture.max_bytes: expected an integer from 1 to 4611686018427387904, got 0",
    ),
    (
        '[capture]\ndir = "/tmp/c"\nprompts = 1\n' + EP,
        "capture.prompts: expected a boolean (true or false), got 1",
    ),
    ("max_tokens = 5", "endpoint: at least one [[endpoint]] table is required"),
    ("endpoint = []", "endpoint: at least one [[endpoint]] table is required"),
    (
        EP.replace("[[endpoint]]", "[endpoint]"),
        "endpoint: expected an array of tables ([[endpoint]]), got a table",
    ),
]


def problems_of(case: SynchronousTestCase, text: str) -> tuple[str, ...]:
    """Parse C{text}, which must be invalid, and return its problem lines."""
    error: ConfigError = case.assertRaises(ConfigError, parse_config, text)
    return error.problems


class ErrorTests(SynchronousTestCase):
    """Every kind of violation names its dotted path."""

    def test_message_format(self) -> None:
        """A wrong value's message names its path, what was expected and what came."""
        self.assertEqual(
            problems_of(self, EP + '[endpoint.expect]\nn_ctx = "8192"'),
            ('endpoint[0].expect.n_ctx: expected a positive integer, got "8192"',),
        )

    def test_bad_values(self) -> None:
        """Each wrong type or out-of-range value of BAD_VALUES is the one problem."""
        for dotted, value, expected in BAD_VALUES:
            document, path = bad_document(dotted, value)
            problem = f"{path}: expected {expected}, got {value}"
            self.assertEqual(problems_of(self, document), (problem,), document)

    def test_other_problems(self) -> None:
        """Each document of OTHER_PROBLEMS reports exactly its one problem."""
        for document, problem in OTHER_PROBLEMS:
            self.assertEqual(problems_of(self, document), (problem,), document)

    def test_duplicate_endpoint_names(self) -> None:
        """Each endpoint reusing a name is an error at its own index."""
        self.assertEqual(
            problems_of(self, EP * 3),
            tuple(
                f'endpoint[{i}].name: duplicate endpoint name "local" (first used by endpoint[0])'
                for i in (1, 2)
            ),
        )

    def test_endpoint_not_a_table(self) -> None:
        """An endpoint that is not a table is named by its index."""
        self.assertEqual(
            problems_of(self, "endpoint = [1]"),
            ("endpoint[0]: expected a table, got 1",),
        )

    def test_socket_too_long(self) -> None:
        """A socket path longer than a sockaddr_un holds is an error, not truncated."""
        document = EP.replace("infer.sock", "s" * SOCKET_PATH_MAX)
        (problem,) = problems_of(self, document)
        self.assertTrue(
            problem.startswith(
                "endpoint[0].socket: expected a Unix socket path of at most"
                f" {SOCKET_PATH_MAX} bytes, got "
            ),
            problem,
        )

    def test_bad_toml(self) -> None:
        """A TOML syntax error is a ConfigError naming the line."""
        (problem,) = problems_of(self, "[limits]\npoll_ms = 1\nliveness_ms = \n")
        self.assertTrue(problem.startswith("invalid TOML: "), problem)
        self.assertIn("line 3", problem)

    def test_several_errors_together(self) -> None:
        """Every violation is reported at once, one per line, in file order."""
        text = (
            "max_tokens = 1.5\n[limits]\npol_ms = 1\nliveness_ms = false\n"
            '[[endpoint]]\nname = ""\nsocket = 5\n'
        )
        error = self.assertRaises(ConfigError, parse_config, text, "loopd.toml")
        lines = str(error).split("\n")
        self.assertEqual(
            [line.split(": ")[:2] for line in lines],
            [
                ["loopd.toml", "max_tokens"],
                ["loopd.toml", "limits.pol_ms"],
                ["loopd.toml", "limits.liveness_ms"],
                ["loopd.toml", "endpoint[0].name"],
                ["loopd.toml", "endpoint[0].socket"],
            ],
        )

    def test_error_type(self) -> None:
        """ConfigError is a ValueError carrying the problems and the source."""
        error = self.assertRaises(ConfigError, parse_config, "", "x.toml")
        self.assertIsInstance(error, ValueError)
        self.assertEqual(error.source, "x.toml")
        self.assertEqual(str(error), "x.toml: " + error.problems[0])

    def test_mapping_errors(self) -> None:
        """Errors from a mapping carry no source; a non-table document is reported."""
        error = self.assertRaises(ConfigError, config_from_mapping, {"x": 1})
        self.assertEqual(
            str(error).split("\n"),
            ["x: unknown key", "endpoint: at least one [[endpoint]] table is required"],
        )
        error = self.assertRaises(ConfigError, config_from_mapping, [1])
        self.assertEqual(error.problems, ("(top level): expected a table, got [1]",))

    def test_unreadable_file(self) -> None:
        """A missing file, or one that is not UTF-8, is a ConfigError naming it."""
        path = Path(self.mktemp())
        error = self.assertRaises(ConfigError, load_config, path)
        self.assertEqual(str(error), f"{path}: cannot read the file: No such file or directory")
        path.write_bytes(b"max_tokens = 1 # \xff\n")
        error = self.assertRaises(ConfigError, load_config, path)
        self.assertEqual(error.problems, ("not UTF-8 text (byte 17)",))


class TcpListenerConfigTests(SynchronousTestCase):
    """
    C{[server] tcp}, C{allow_remote}, C{token_file}, and C{listen}, which no longer takes a
    TCP listener (DESIGN decision 41).
    """

    def server(self, lines: str) -> Server:
        """The [server] of a document with C{lines} in it."""
        return parse_config(f"[server]\n{lines}\n" + EP).server

    def problems(self, lines: str) -> tuple[str, ...]:
        """The problems of a document with C{lines} in [server]."""
        error = self.assertRaises(ConfigError, parse_config, f"[server]\n{lines}\n" + EP)
        problems: tuple[str, ...] = error.problems
        return problems

    def test_defaults(self) -> None:
        """No TCP listener, no remote, the default token file."""
        server = parse_config(EP).server
        self.assertEqual((server.tcp, server.allow_remote, server.token_file), (None, False, None))

    def test_loopback_addresses(self) -> None:
        """127.0.0.1, [::1] and localhost are taken, port 0 too, kept as written."""
        for text in ("127.0.0.1:8080", "[::1]:0", "localhost:65535", "127.0.0.2:1"):
            self.assertEqual(self.server(f'tcp = "{text}"').tcp, text)

    def test_not_loopback(self) -> None:
        """Another address is an error naming server.tcp and allow_remote."""
        for text in ("0.0.0.0:8080", "[::]:8080", "192.168.1.2:80"):
            (line,) = self.problems(f'tcp = "{text}"')
            self.assertTrue(line.startswith(f'server.tcp: "{text}" is not a loopback'), line)
            self.assertIn("set server.allow_remote = true", line)

    def test_allow_remote(self) -> None:
        """With allow_remote = true another address is taken."""
        server = self.server('tcp = "0.0.0.0:8080"\nallow_remote = true')
        self.assertEqual((server.tcp, server.allow_remote), ("0.0.0.0:8080", True))

    def test_bad_values(self) -> None:
        """Each malformed value is one error naming its key and what was expected."""
        cases = {
            'tcp = "127.0.0.1"': "server.tcp: expected HOST:PORT",
            'tcp = "127.0.0.1:70000"': "with a port from 0 to 65535",
            'tcp = "example.com:80"': "the host is an IP address or localhost",
            'tcp = "::1:80"': "server.tcp: expected HOST:PORT",
            'tcp = "[127.0.0.1]:80"': "brackets hold an IPv6 address",
            "tcp = 8080": "server.tcp: expected HOST:PORT",
            'allow_remote = "yes"': "server.allow_remote: expected a boolean",
            'token_file = ""': "server.token_file: expected a non-empty path string",
        }
        for lines, expected in cases.items():
            (line,) = self.problems(lines)
            self.assertIn(expected, line, lines)

    def test_listen_unix_only(self) -> None:
        """listen takes unix:PATH; a TCP description says what to write instead."""
        self.assertEqual(self.server('listen = "unix:/tmp/l.sock"').listen, "unix:/tmp/l.sock")
        # Whole lines: a bare "tcp:..." string would read as a TCP client to the invariant's test.
        cases = {
            'listen = "tcp:8080:interface=127.0.0.1"': 'tcp = "127.0.0.1:8080"',
            'listen = "tcp:port=9000"': 'tcp = "127.0.0.1:9000"',
            'listen = "tcp6:9:interface=\\\\:\\\\:1"': 'tcp = "[::1]:9"',
        }
        for listen, suggestion in cases.items():
            (line,) = self.problems(listen)
            self.assertIn("server.listen: expected a Unix socket", line)
            self.assertIn(f"a TCP listener is now {suggestion} in [server]", line)
            self.assertIn("loopd token", line)
        (line,) = self.problems('listen = "/tmp/l.sock"')
        self.assertIn('server.listen: expected a Unix socket, "unix:PATH"', line)

    def test_token_file(self) -> None:
        """token_file is a path, ~ expanded."""
        path = self.server('token_file = "~/t"').token_file
        self.assertEqual(path, os.path.expanduser("~/t"))


class TelemetryConfigTests(SynchronousTestCase):
    """
    C{[telemetry]}: OpenTelemetry traces, off by default, exported to a collector's Unix
    socket (DESIGN decision 48).
    """

    def telemetry(self, lines: str) -> Telemetry:
        """The [telemetry] of a document with C{lines} in it."""
        return parse_config(f"[telemetry]\n{lines}\n" + EP).telemetry

    def problems(self, lines: str) -> tuple[str, ...]:
        """The problems of a document with C{lines} in [telemetry]."""
        return problems_of(self, f"[telemetry]\n{lines}\n" + EP)

    def test_defaults(self) -> None:
        """Off; service loopd; OTLP's path; OpenTelemetry's batch defaults; sessions hashed."""
        self.assertEqual(parse_config(EP).telemetry, Telemetry())
        self.assertEqual(
            Telemetry(),
            Telemetry(
                enabled=False,
                service_name="loopd",
                socket=None,
                path="/v1/traces",
                export_interval_ms=5000,
                max_batch=512,
                max_queue=2048,
                export_timeout_ms=10_000,
                stop_wait_ms=2000,
                session_ids="hash",
            ),
        )

    def test_enabled(self) -> None:
        """Every key is read; the socket's ~ is expanded."""
        telemetry = self.telemetry(
            'enabled = true\nservice_name = "gw"\nsocket = "~/otlp.sock"\npath = "/otlp/v1/t"\n'
            "export_interval_ms = 100\nmax_batch = 10\nmax_queue = 10\n"
            'export_timeout_ms = 50\nstop_wait_ms = 0\nsession_ids = "plain"'
        )
        expected = Telemetry(
            enabled=True,
            service_name="gw",
            socket=os.path.expanduser("~/otlp.sock"),
            path="/otlp/v1/t",
            export_interval_ms=100,
            max_batch=10,
            max_queue=10,
            export_timeout_ms=50,
            stop_wait_ms=0,
            session_ids="plain",
        )
        self.assertEqual(telemetry, expected)

    def test_socket_needed(self) -> None:
        """Enabled without a socket is one error saying what the socket is."""
        self.assertEqual(
            self.problems("enabled = true"),
            (
                "telemetry.socket: needed with enabled = true: the Unix socket of the "
                "OTLP/HTTP collector, or of a `twist inferproxy` in front of one that listens "
                "on TCP",
            ),
        )
        # Disabled, a socket may be named or not.
        self.assertIsNone(self.telemetry("enabled = false").socket)

    def test_batch_within_queue(self) -> None:
        """A batch larger than the queue is an error at the key that was set."""
        self.assertEqual(
            self.problems("max_batch = 4096"),
            (
                "telemetry.max_batch: at most max_queue (2048): a batch is taken from the "
                "queue (got 4096)",
            ),
        )
        self.assertEqual(
            self.problems("max_queue = 100"),
            (
                "telemetry.max_queue: at least max_batch (512): a batch is taken from the "
                "queue (got 100)",
            ),
        )

    def test_bad_values(self) -> None:
        """Each malformed value is the one error, naming its key and what was expected."""
        cases = {
            'enabled = "yes"': 'telemetry.enabled: expected a boolean (true or false), got "yes"',
            'service_name = ""': 'telemetry.service_name: expected a non-empty string, got ""',
            'socket = ""': 'telemetry.socket: expected a non-empty path string, got ""',
            f'socket = "/{"s" * SOCKET_PATH_MAX}"': "telemetry.socket: expected a Unix socket",
            'path = "v1/traces"': 'telemetry.path: expected a request target: "/" then',
            'path = "/v1 traces"': 'telemetry.path: expected a request target: "/" then',
            "export_interval_ms = 0": "telemetry.export_interval_ms: expected an integer from 1",
            "max_batch = 0": "telemetry.max_batch: expected an integer from 1",
            "max_queue = 1.5": "telemetry.max_queue: expected an integer from 1",
            "export_timeout_ms = 0": "telemetry.export_timeout_ms: expected an integer from 1",
            "stop_wait_ms = -1": "telemetry.stop_wait_ms: expected an integer from 0",
            'session_ids = "sha256"': 'telemetry.session_ids: expected one of "hash", "plain"',
            'sampler = "always_on"': "telemetry.sampler: unknown key",
        }
        for lines, expected in cases.items():
            (line,) = self.problems(lines)
            self.assertTrue(line.startswith(expected), (lines, line))
