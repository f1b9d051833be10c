"""
A mesh request with an image or audio: only the endpoints that take it are workers
(L{loopd.gateway.mesh_calls.mesh_pool}), as the C{auto} router's media filter decides.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from loopd.config import Config
from loopd.test.support.mesh_harness import THREE, MeshHarness, content_of, mesh_config, says

IMAGE: dict[str, Any] = {
    "model": "mesh",
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in the picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        }
    ],
}


def with_vision(*names: str) -> Config:
    """L{mesh_config} of L{THREE} where the endpoints C{names} take images."""
    config = mesh_config(THREE)
    endpoints = tuple(dataclasses.replace(e, vision=e.name in names) for e in config.endpoints)
    return dataclasses.replace(config, endpoints=endpoints)


class MediaPoolTests(SynchronousTestCase):
    """Which endpoints an image request reaches under C{model: "mesh"}."""

    def test_only_vision_workers(self) -> None:
        """Two endpoints take images: they are the committee, the third is never called."""
        harness = MeshHarness(with_vision("llama-70b", "qwen3-8b"))
        harness.script(llama_70b=says("A cat on a mat.", 1.0), qwen3_8b=says("A cat", 0.5))
        response = harness.ask(IMAGE, 1.0)
        self.assertEqual(response.status, 200, response.body)
        self.assertEqual(content_of(response.json()), "A cat on a mat.")
        self.assertEqual(response.headers["x-moa-workers"], "2")
        self.assertEqual(harness.served(), {"llama-70b": 1, "mistral-7b": 0, "qwen3-8b": 1})
        # Strong gets the message with its image (and the text again, as v1 packs a
        # multipart turn); Fast gets the last user text only.
        (strong,) = harness.chat_bodies("llama-70b")
        self.assertIn(IMAGE["messages"][0], strong["messages"])
        (fast,) = harness.chat_bodies("qwen3-8b")
        self.assertEqual(fast["messages"][-1]["content"], "What is in the picture?")

    def test_one_vision_endpoint_alone(self) -> None:
        """One endpoint takes images: it serves the request alone, under its own name."""
        harness = MeshHarness(with_vision("qwen3-8b"))
        harness.script(qwen3_8b=says("A cat", 0.5))
        response = harness.ask(IMAGE, 1.0)
        self.assertEqual(response.status, 200, response.body)
        self.assertEqual(response.json()["model"], "qwen3-8b")
        self.assertEqual(harness.served(), {"llama-70b": 0, "mistral-7b": 0, "qwen3-8b": 1})

    def test_no_vision_endpoint(self) -> None:
        """No endpoint takes images: 400 media_unsupported, and nobody is called."""
        harness = MeshHarness(with_vision())
        response = harness.ask(IMAGE, 1.0)
        self.assertEqual(response.status, 400)
        self.assertEqual(response.json()["error"]["code"], "media_unsupported")
        self.assertEqual(harness.served(), {name: 0 for name in THREE})
