"""
Tests for L{loopd.config}'s errors: every violation of a loopd.toml is reported at once, each
named by its dotted path.
"""

from __future__ import annotations

from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from loopd.config import (
    SOCKET_PATH_MAX,
    ConfigError,
    config_from_mapping,
    load_config,
    parse_config,
)
from loopd.test.support.config_docs import EP, OPENAI, bad_document

NAME = "a non-empty string without spaces or control characters"
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
    ("caps.header_bytes", "16384.0", "a positive integer"),
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
    ("endpoint.kind", '"vllm"', 'one of "llama-server", "openai"'),
    ("endpoint.model", '""', "a non-empty string"),
    ("endpoint.selftest", "1", "a boolean (true or false)"),
    ("endpoint.expect", "1", "a table"),
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
