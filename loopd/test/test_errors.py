"""
L{loopd.errors}: the error family of talking to a model server.
"""

from __future__ import annotations

import json

from twisted.trial.unittest import SynchronousTestCase

from loopd import errors


class InferErrorTests(SynchronousTestCase):
    """
    The error kinds are one family, reachable as attributes of the base as the design names
    them.
    """

    def test_kinds_are_attributes(self) -> None:
        """
        C{InferError.Http} and its siblings are the module's classes and subclass the base.
        """
        for name in (
            "Busy",
            "Connect",
            "WaitTimeout",
            "LoadTimeout",
            "Stalled",
            "StreamClosedEarly",
            "ThinkingOverrun",
            "Http",
            "Protocol",
        ):
            kind = getattr(errors.InferError, name)
            self.assertIs(kind, getattr(errors, name))
            self.assertTrue(issubclass(kind, errors.InferError))

    def test_http_body_capped(self) -> None:
        """
        An error body is kept to 4 KiB, never cutting a character in half.
        """
        error = errors.Http(500, "é" * 5000)
        self.assertLessEqual(len(error.body.encode("utf-8")), errors.HTTP_BODY_CAP)
        self.assertEqual(set(error.body), {"é"})

    def test_context_exceeded(self) -> None:
        """
        A 400 of type exceed_context_size_error is flagged; other errors are not.
        """
        body = {
            "error": {
                "code": 400,
                "message": "request (9000 tokens) exceeds the available context size",
                "type": "exceed_context_size_error",
                "n_prompt_tokens": 9000,
                "n_ctx": 8192,
            }
        }
        self.assertTrue(errors.Http(400, json.dumps(body)).context_exceeded)
        other = {"error": {"code": 400, "message": "x", "type": "invalid_request_error"}}
        self.assertFalse(errors.Http(400, json.dumps(other)).context_exceeded)
        self.assertFalse(errors.Http(500, json.dumps(body)).context_exceeded)
        self.assertFalse(errors.Http(400, "not json").context_exceeded)

    def test_long_context_error_recognised(self) -> None:
        """A context error body longer than the 4 KiB kept is still flagged."""
        body = {
            "error": {
                "code": 400,
                "message": "request exceeds the available context size " + "x" * 5000,
                "type": "exceed_context_size_error",
            }
        }
        error = errors.Http(400, json.dumps(body))
        self.assertTrue(error.context_exceeded)
        self.assertLessEqual(len(error.body.encode("utf-8")), errors.HTTP_BODY_CAP)
