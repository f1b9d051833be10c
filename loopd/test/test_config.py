"""
Tests for L{loopd.config}: loopd.toml into a frozen, typed Config (defaults, the example
files, valid documents and generated ones). The error cases are in L{test_config_errors}.
"""

from __future__ import annotations

import os
from dataclasses import fields, replace
from pathlib import Path

from hypothesis import assume, given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd import config as config_module
from loopd._message_style import key_path, render
from loopd.config import (
    Caps,
    Config,
    ConfigError,
    Endpoint,
    Expect,
    Limits,
    Retry,
    Sampling,
    Thinking,
    config_from_mapping,
    load_config,
    parse_config,
)
from loopd.test.support.config_docs import (
    EP,
    INTEGER_KEYS,
    OPENAI,
    SECTION_TYPES,
    TABLES,
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
            keys |= {f.name for f in fields(cls)} - {"expect"}
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
        """Waits, queue depth, overrun, cache loss, backoff and jitter may be 0."""
        config = parse_config(
            "cache_loss_tokens = 0\n[limits]\nbusy_wait_ms = 0\nload_wait_ms = 0\n"
            "idle_grace_ms = 0\nqueue_depth = 0\n[thinking]\noverrun = 0\n"
            "[retry]\nbackoff_ms = [0]\njitter = 0\n" + EP
        )
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
