"""
Image and audio parts in a chat request (L{loopd.gateway.translate}): a user turn keeps them
as sent, so that an endpoint that takes them (the C{auto} router's C{vision} and C{audio})
gets them; anywhere else, or malformed, they are refused with a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.errors import GatewayError
from loopd.gateway.translate import parse_request
from loopd.llama.types import User

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


class MediaPartTests(SynchronousTestCase):
    """A user turn may carry image and audio parts, kept as sent."""

    def test_user_parts_kept(self) -> None:
        """Text parts are joined into content; every part, in order, is kept."""
        parts: list[dict[str, Any]] = [
            {"type": "text", "text": "Listen "},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            {"type": "text", "text": "and look"},
            {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}},
        ]
        body = json.dumps({"messages": [{"role": "user", "content": parts}]}).encode()
        (message,) = parse_request(body).messages
        self.assertEqual(message, User("Listen and look", tuple(parts)))

    def test_text_only_has_no_parts(self) -> None:
        """A turn of text parts only is plain text, with no parts kept."""
        parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        body = json.dumps({"messages": [{"role": "user", "content": parts}]}).encode()
        self.assertEqual(parse_request(body).messages, (User("ab"),))


class MediaRefusalTests(SynchronousTestCase):
    """Media where it cannot go, or malformed, is a 400 naming the field."""

    def refused(self, message: dict[str, Any], field: str, code: str) -> None:
        """A conversation of C{message} alone is refused with C{code}, naming C{field}."""
        body = json.dumps({"messages": [message]}).encode()
        error = self.assertRaises(GatewayError, parse_request, body)
        self.assertEqual((error.status, error.code), (400, code))
        self.assertIn(field, error.message)

    def test_media_outside_a_user_turn(self) -> None:
        """An image in a system, assistant or tool message is unsupported_content."""
        for role in ("system", "assistant", "tool"):
            message = {"role": role, "content": [IMAGE], "tool_call_id": "c1"}
            with self.subTest(role):
                self.refused(message, "messages[0].content[0].type", "unsupported_content")

    def test_malformed_media(self) -> None:
        """An image or audio part without its object or its string fields names the field."""
        cases = {
            "image_url": ({"type": "image_url"}, ".image_url"),
            "url": ({"type": "image_url", "image_url": {"url": 1}}, ".image_url.url"),
            "format": (
                {"type": "input_audio", "input_audio": {"data": "AAAA"}},
                ".input_audio.format",
            ),
        }
        for name, (part, field) in cases.items():
            message = {"role": "user", "content": [{"type": "text", "text": "a"}, part]}
            with self.subTest(name):
                self.refused(message, "messages[0].content[1]" + field, "invalid_message")
