# -*- test-case-name: loopd.test.test_queue_catalog -*-
"""
models.json into a L{ModelsCatalog}: which provider names serve which baseUrl.

The lease daemon reads it only when given C{--models-json}: it is how a provider-name queue
key reaches its endpoint (DESIGN §24). Only C{providers.<name>.baseUrl} is read; a provider
without one (an override of a built-in provider) is left out silently, and a malformed one
is left out with a problem line in the lease protocol's words
(C{providers.a.baseUrl must be a non-empty string (got 3)}). Nothing here raises: a bad
catalog is an empty one. Pure apart from L{load_models_catalog} reading its file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from loopd import strict_json
from loopd._message_style import JSON_STYLE, json_member_path
from loopd._validate import Problems, Rule, as_table, read_fields, string

__all__ = ["EMPTY_CATALOG", "ModelsCatalog", "load_models_catalog", "parse_models_catalog"]


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

_PROVIDER_RULES: Final[Mapping[str, Rule]] = {"baseUrl": string()}


def parse_models_catalog(document: object) -> tuple[ModelsCatalog, tuple[str, ...]]:
    """
    The catalog in a decoded models.json, C{{"providers": {name: {"baseUrl": url}}}}.

    A provider without a baseUrl (an override of a built-in one) is left out silently, a
    malformed one is left out with a problem line. Never raises.
    """
    problems = Problems(JSON_STYLE)
    root = as_table(document, "models.json", problems)
    found = []
    for name, value in as_table(root.get("providers", {}), "providers", problems).items():
        path = json_member_path("providers", name)
        values = read_fields(as_table(value, path, problems), path, _PROVIDER_RULES, problems)
        if "baseUrl" in values:
            found.append((name, values["baseUrl"]))
    return ModelsCatalog(tuple(found)), problems.lines()


def load_models_catalog(path: str | os.PathLike[str]) -> tuple[ModelsCatalog, tuple[str, ...]]:
    """
    Read the catalog passed as C{--models-json}. Never raises: a missing file is an empty
    catalog, one that cannot be read or is not JSON is an empty catalog and the reason, and
    a malformed provider is left out with its problem; each problem starts with the path.
    """
    source = os.fspath(path)
    try:
        with open(source, "rb") as stream:
            raw = stream.read()
    except FileNotFoundError:
        return EMPTY_CATALOG, ()
    except OSError as error:
        return EMPTY_CATALOG, (f"{source}: cannot read: {error.strerror or error}",)
    try:
        document = strict_json.decode(raw)
    except strict_json.JSONError as error:
        return EMPTY_CATALOG, (f"{source}: not valid JSON: {error}",)
    catalog, problems = parse_models_catalog(document)
    return catalog, tuple(f"{source}: {line}" for line in problems)
