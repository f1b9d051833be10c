"""
Tests for L{loopd.gateway.doors.params}: which chat fields reach the server, which loopd keeps,
which it refuses.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.params import (
    IGNORED_FIELDS,
    LLAMA_FIELDS,
    LOOPD_FIELDS,
    MANAGED_FIELDS,
    OPENAI_FIELDS,
    UNSUPPORTED_FIELDS,
    refusal,
    refused_fields,
    split_fields,
)
from loopd.gateway.errors import GatewayError
from loopd.llama.request import LLAMA_ONLY_FIELDS

#: A value of the right type for each kind.
SAMPLE: dict[str, Any] = {
    "number": 0.5,
    "integer": 3,
    "boolean": True,
    "object": {"type": "json_object"},
    "string": 'root ::= "a"',
    "array": [{"id": 0, "scale": 1.0}],
    "json": [1, 2],
}


def refused(extras: dict[str, Any]) -> GatewayError:
    """The error L{split_fields} raises for C{extras}."""
    try:
        split_fields(extras)
    except GatewayError as error:
        return error
    raise AssertionError(f"not refused: {extras!r}")


class SplitTests(SynchronousTestCase):
    """L{split_fields} sorts a body's unmodelled fields."""

    def test_every_passed_field(self) -> None:
        """Every OpenAI and llama.cpp field passes as sent, in the body's order."""
        kinds = {**OPENAI_FIELDS, **LLAMA_FIELDS}
        extras = {name: SAMPLE[kind] for name, kind in kinds.items()}
        extras["n"] = 2
        fields, rest = split_fields(extras)
        self.assertEqual((list(fields.items()), rest), (list(extras.items()), {}))

    def test_kept_fields(self) -> None:
        """loopd's own and the ignored fields stay out of the fields, kept as sent."""
        extras: dict[str, Any] = {"user": "u", "return_progress": True, "cache_prompt": True}
        extras |= {"timings_per_token": True}
        extras |= {"store": False, "metadata": {"k": "v"}, "service_tier": "auto"}
        extras |= {"prediction": {"type": "content", "content": "x"}, "modalities": ["text"]}
        extras |= {"prompt_cache_key": "k", "safety_identifier": "s"}
        self.assertEqual(split_fields(extras), ({}, extras))
        self.assertLessEqual(set(extras), LOOPD_FIELDS | IGNORED_FIELDS)

    def test_nulls_and_one_choice(self) -> None:
        """A null is absent; n of 1 (or 1.0) is dropped, n of 2 passes."""
        self.assertEqual(split_fields({"seed": None, "audio": None, "n": 1}), ({}, {}))
        self.assertEqual(split_fields({"n": 1.0}), ({}, {}))
        self.assertEqual(split_fields({"n": 2.0}), ({"n": 2}, {}))

    def test_types(self) -> None:
        """A value of the wrong type is invalid_parameter naming the field."""
        cases = {"seed": 1.5, "top_k": "40", "min_p": True, "logprobs": 1, "grammar": {}}
        cases |= {"response_format": "json", "json_schema": [], "lora": {}, "n": "2"}
        cases |= {"return_progress": "yes", "cache_prompt": 1, "timings_per_token": 1}
        for name, value in cases.items():
            error = refused({name: value})
            self.assertEqual((error.status, error.code), (400, "invalid_parameter"), name)
            self.assertTrue(error.message.startswith(f"{name}: expected "), error.message)

    def test_server_checks_values(self) -> None:
        """Values of the right type pass whatever they mean: the server judges them."""
        extras = {"top_k": -5, "n": 99, "response_format": {"type": "xml"}, "grammar": "["}
        self.assertEqual(split_fields(extras), (extras, {}))

    def test_refused_fields(self) -> None:
        """
        Managed, unsupported and unknown fields are one unsupported_parameter naming each
        with why.
        """
        for name in [*MANAGED_FIELDS, *UNSUPPORTED_FIELDS, "frobnicate"]:
            error = refused({name: 1})
            self.assertEqual((error.status, error.code), (400, "unsupported_parameter"))
            self.assertTrue(error.message.startswith(f"{name}: "), error.message)
        error = refused({"id_slot": 0, "seed": 1, "audio": {}, "zzz": 0})
        self.assertEqual(error.message.count(": "), 3)
        for name in ("id_slot", "audio", "zzz"):
            self.assertIn(name, error.message)

    def test_values_loopd_cannot_honour(self) -> None:
        """modalities asking for audio and cache_prompt false are refused."""
        for extras in ({"modalities": ["text", "audio"]}, {"cache_prompt": False}):
            self.assertEqual(refused(extras).code, "unsupported_parameter")

    def test_disjoint(self) -> None:
        """No field is in two of the lists."""
        lists = [set(OPENAI_FIELDS), set(LLAMA_FIELDS), set(LOOPD_FIELDS)]
        lists += [set(IGNORED_FIELDS), set(MANAGED_FIELDS), set(UNSUPPORTED_FIELDS)]
        self.assertEqual(sum(map(len, lists)), len(set().union(*lists)))

    def test_loopd_sets_the_managed(self) -> None:
        """The fields loopd sets on its upstream requests are never a client's to pass."""
        passed = set(OPENAI_FIELDS) | set(LLAMA_FIELDS)
        self.assertFalse(passed & (LLAMA_ONLY_FIELDS - {"chat_template_kwargs"}))


class RefusedTests(SynchronousTestCase):
    """L{refused_fields}: what an endpoint kind cannot take."""

    FIELDS: dict[str, Any] = {"seed": 1, "top_k": 40, "response_format": {}, "grammar": "g"}

    def test_llama_server(self) -> None:
        """A llama-server takes every field."""
        self.assertEqual(refused_fields(self.FIELDS, "llama-server"), ())

    def test_openai(self) -> None:
        """An openai endpoint takes OpenAI's fields only."""
        self.assertEqual(refused_fields(self.FIELDS, "openai"), ("grammar", "top_k"))

    def test_mesh(self) -> None:
        """The mesh takes none."""
        names = refused_fields(self.FIELDS, "mesh")
        self.assertEqual(names, ("grammar", "response_format", "seed", "top_k"))
        error = refusal(names[:2], "on model mesh")
        self.assertEqual((error.status, error.code), (400, "unsupported_parameter"))
        self.assertEqual(error.message, "grammar, response_format: not supported on model mesh")
