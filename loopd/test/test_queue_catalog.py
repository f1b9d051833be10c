"""
Tests for L{loopd.queue.catalog}: models.json's providers and their baseUrls, and reading the
file without ever failing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.catalog import (
    EMPTY_CATALOG,
    ModelsCatalog,
    load_models_catalog,
    parse_models_catalog,
)

GPU1 = "http://192.168.1.100:8001/v1"
GPU2 = "http://192.168.1.100:8002/v1"


class ParseTests(SynchronousTestCase):
    """parse_models_catalog and the catalog's look-ups."""

    def test_parse_catalog(self) -> None:
        """Providers with a baseUrl are listed in file order; malformed ones are left out."""
        providers = {"llamacpp": {"baseUrl": GPU1, "models": []}, "strata": {"baseUrl": GPU1}}
        bad = {"anthropic": {"headers": {}}, "a": {"baseUrl": 3}, "b": []}
        catalog, problems = parse_models_catalog({"providers": {**providers, **bad}})
        self.assertEqual((catalog.base_url("strata"), catalog.base_url("anthropic")), (GPU1, None))
        self.assertEqual(catalog.providers_at(GPU1), ("llamacpp", "strata"))
        want = ("providers.a.baseUrl must be a non-empty string (got 3)",)
        self.assertEqual(problems, (*want, "providers.b must be an object (got [])"))

    def test_not_objects(self) -> None:
        """A document or a providers value that is not an object is an empty catalog, said so."""
        self.assertEqual(
            parse_models_catalog([1]), (EMPTY_CATALOG, ("models.json must be an object (got [1])",))
        )
        self.assertEqual(
            parse_models_catalog({"providers": "x"}),
            (EMPTY_CATALOG, ('providers must be an object (got "x")',)),
        )

    def test_provider_paths(self) -> None:
        """A provider name that is not a plain name is quoted in its path."""
        _, problems = parse_models_catalog({"providers": {"my gpu": {"baseUrl": ""}}})
        self.assertEqual(
            problems, ('providers["my gpu"].baseUrl must be a non-empty string (got "")',)
        )

    def test_empty_catalog(self) -> None:
        """The empty catalog knows no provider and no endpoint."""
        self.assertEqual(
            (EMPTY_CATALOG.base_url("zen"), EMPTY_CATALOG.providers_at(GPU1)), (None, ())
        )

    def test_first_listing_wins(self) -> None:
        """A provider's baseUrl is its first; an endpoint lists every provider serving it."""
        catalog = ModelsCatalog((("zen", GPU1), ("zen", GPU2), ("mini", GPU1)))
        self.assertEqual(
            (catalog.base_url("zen"), catalog.providers_at(GPU1)), (GPU1, ("zen", "mini"))
        )


class FileTests(SynchronousTestCase):
    """load_models_catalog."""

    def setUp(self) -> None:
        """A short temporary directory."""
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        self.path = os.path.join(directory, "models.json")

    def write(self, content: object) -> None:
        """Write the file: a string as it is, anything else as JSON."""
        with open(self.path, "w", encoding="utf-8") as stream:
            stream.write(content if isinstance(content, str) else json.dumps(content))

    def test_catalog_file(self) -> None:
        """A catalog is read; a missing one is empty; an invalid one is empty with the reason."""
        self.assertEqual(load_models_catalog(self.path), (EMPTY_CATALOG, ()))
        self.write({"providers": {"zen": {"baseUrl": GPU2}}})
        self.assertEqual(load_models_catalog(self.path), (ModelsCatalog((("zen", GPU2),)), ()))
        self.write("{not json")
        catalog, (error,) = load_models_catalog(self.path)
        self.assertEqual(catalog, EMPTY_CATALOG)
        self.assertTrue(error.startswith(f"{self.path}: not valid JSON"))

    def test_malformed_provider(self) -> None:
        """A malformed provider is left out, its problem named by the file; the rest is read."""
        self.write({"providers": {"zen": {"baseUrl": GPU2}, "a": {"baseUrl": None}}})
        message = f"{self.path}: providers.a.baseUrl must be a non-empty string (got null)"
        self.assertEqual(
            load_models_catalog(self.path), (ModelsCatalog((("zen", GPU2),)), (message,))
        )

    def test_javascript_json(self) -> None:
        """The file is JSON as JavaScript reads it: NaN is not JSON."""
        self.write('{"providers": {"zen": {"baseUrl": NaN}}}')
        catalog, (error,) = load_models_catalog(self.path)
        self.assertEqual(catalog, EMPTY_CATALOG)
        self.assertEqual(error, f"{self.path}: not valid JSON: NaN is not JSON")

    def test_unreadable(self) -> None:
        """A path that cannot be read (a directory) is an empty catalog with the reason."""
        os.mkdir(self.path)
        catalog, (error,) = load_models_catalog(self.path)
        self.assertEqual(catalog, EMPTY_CATALOG)
        self.assertTrue(error.startswith(f"{self.path}: cannot read: "), error)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
providers = st.dictionaries(
    st.text(max_size=6),
    json_values | st.dictionaries(st.sampled_from(["baseUrl", "models"]), json_values),
)
catalog_documents = json_values | st.fixed_dictionaries({"providers": providers | json_values})


class PropertyTests(SynchronousTestCase):
    """Properties over generated documents."""

    @given(catalog_documents)
    def test_catalog_never_raises(self, document: object) -> None:
        """Any models.json document gives a catalog, every provider in it with a baseUrl."""
        catalog, _ = parse_models_catalog(document)
        self.assertTrue(all(isinstance(url, str) and url for _, url in catalog.providers))

    @given(providers)
    def test_each_provider_listed_skipped_or_reported(self, table: dict[str, object]) -> None:
        """
        A provider with a non-empty baseUrl is listed, in order; one without a baseUrl key is
        left out silently; any other is left out with one problem line.
        """
        catalog, problems = parse_models_catalog({"providers": table})
        listed, reported = [], []
        for name, value in table.items():
            if isinstance(value, dict) and "baseUrl" not in value:
                continue
            url = value["baseUrl"] if isinstance(value, dict) else None
            if isinstance(url, str) and url:
                listed.append((name, url))
            else:
                reported.append(name)
        self.assertEqual((catalog.providers, len(problems)), (tuple(listed), len(reported)))
