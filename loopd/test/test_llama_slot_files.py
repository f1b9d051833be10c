"""
Tests for L{loopd.llama.slot_files} and the client's C{save_slot} / C{restore_slot}, in
memory on a clock against the fake llama-server's slot files (L{SlotFiles}): the requests
that arrive, the answers read, the gate, the bounded wait, cancellation and the failures.
"""

from __future__ import annotations

import dataclasses
import math

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError
from twisted.trial.unittest import SynchronousTestCase

from loopd.errors import Busy, Http, Protocol, Stalled
from loopd.llama import Client, SlotGate
from loopd.llama.slot_files import SlotFile, check_filename, parse_slot_file, slot_action_path
from loopd.settings import Config, Endpoint, Limits
from loopd.testing.fake_llama import FakeLlama, SlotFiles, json_reply
from loopd.testing.memory_net import MemoryNet
from loopd.testing.reactor import MemoryLoopdReactor

PATH = "/tmp/ld-memory/llama.sock"
LIMITS = Limits(poll_ms=100, liveness_ms=100, queue_depth=1)


class WireTests(SynchronousTestCase):
    """The path, the file names loopd sends and the answers it reads."""

    def test_path(self) -> None:
        """The target names the slot and the action; a negative slot is a ValueError."""
        self.assertEqual(slot_action_path(3, "save"), "/slots/3?action=save")
        self.assertEqual(slot_action_path(0, "restore"), "/slots/0?action=restore")
        self.assertRaises(ValueError, slot_action_path, -1, "save")

    def test_safe_names(self) -> None:
        """Hex digests, dots inside, dashes and underscores pass unchanged."""
        for name in ("loopd-0123abcd.bin", "a", "A_b-c.d", "x" * 128):
            self.assertEqual(check_filename(name), name)

    def test_unsafe_names(self) -> None:
        """Empty, dot-first, too long, and anything with a path part or odd byte: ValueError."""
        bad = ["", ".", "..", ".hidden", "../x", "a/b", "/abs", "a\\b", "a b", "a\0", "é"]
        for name in [*bad, "x" * 129]:
            error = self.assertRaises(ValueError, check_filename, name)
            self.assertIn("slot file name", str(error))

    @given(st.text(max_size=40))
    def test_never_a_path(self, name: str) -> None:
        """Whatever passes is one path component that cannot climb out of the directory."""
        try:
            check_filename(name)
        except ValueError:
            return
        self.assertNotIn("/", name)
        self.assertNotIn("\\", name)
        self.assertFalse(name.startswith("."))

    def test_parse(self) -> None:
        """A save's and a restore's answer, with and without timings."""
        saved = {"id_slot": 1, "filename": "f.bin", "n_saved": 9, "n_written": 900}
        saved["timings"] = {"save_ms": 1.5}
        self.assertEqual(parse_slot_file(saved, "save"), SlotFile(1, "f.bin", 9, 900, 1.5))
        restored = {"id_slot": 0, "filename": "f.bin", "n_restored": 0, "n_read": 12}
        self.assertEqual(parse_slot_file(restored, "restore"), SlotFile(0, "f.bin", 0, 12))

    def test_parse_wrong_shape(self) -> None:
        """Not an object, a missing or boolean or negative count, no filename: Protocol."""
        good = {"id_slot": 1, "filename": "f", "n_saved": 9, "n_written": 9}
        bad = [
            [],
            {**good, "n_saved": True},
            {**good, "n_saved": -1},
            {**good, "filename": 3},
            {k: v for k, v in good.items() if k != "n_written"},
            {**good, "id_slot": "1"},
        ]
        for value in bad:
            self.assertRaises(Protocol, parse_slot_file, value, "save")
        # A save's answer is not a restore's.
        self.assertRaises(Protocol, parse_slot_file, good, "restore")


class ClientSlotFileTests(SynchronousTestCase):
    """save_slot and restore_slot against the fake's slot files."""

    def setUp(self) -> None:
        self.reactor = MemoryLoopdReactor()
        self.fake = FakeLlama(self.reactor)
        self.net = MemoryNet(self.reactor)
        self.net.listen(PATH, self.fake)
        self.files = SlotFiles(self.fake, 2)
        endpoint = Endpoint(name="tiny", socket=PATH)
        self.client = Client(self.reactor, Config(endpoints=(endpoint,), limits=LIMITS), endpoint)

    def assert_quiet(self) -> None:
        """No timer is left, every connection is closed and no slot is held."""
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        self.assertEqual(self.net.open_connections(), [])
        self.assertFalse(any(self.client.gate.in_flight(slot) for slot in (0, 1)))

    def test_save_then_restore(self) -> None:
        """A save posts the file name to the slot's save action; a restore loads it back."""
        self.files.tokens[0] = 2319
        saving = self.client.save_slot(0, "s.bin")
        self.net.pump()
        self.assertEqual(self.successResultOf(saving), SlotFile(0, "s.bin", 2319, 2319 * 512, 1.5))
        restoring = self.client.restore_slot(1, "s.bin")
        self.net.pump()
        self.assertEqual(self.successResultOf(restoring).tokens, 2319)
        self.assertEqual(self.files.tokens[1], 2319)
        self.assertEqual(self.files.actions, [("save", 0, "s.bin"), ("restore", 1, "s.bin")])
        [sent, _] = self.fake.requests
        self.assertEqual((sent.method, sent.target), ("POST", "/slots/0?action=save"))
        self.assertEqual(sent.json, {"filename": "s.bin"})
        self.assert_quiet()

    def test_restore_of_unknown_file(self) -> None:
        """A file the server cannot load is Http 400 with llama-server's message."""
        restoring = self.client.restore_slot(0, "never.bin")
        self.net.pump()
        error = self.failureResultOf(restoring, Http).value
        self.assertEqual(error.status, 400)
        self.assertIn("Unable to restore slot", error.body)
        self.assert_quiet()

    def test_not_enabled(self) -> None:
        """A server started without --slot-save-path answers 501: Http 501."""
        self.files.enabled = False
        saving = self.client.save_slot(0, "s.bin")
        self.net.pump()
        self.assertEqual(self.failureResultOf(saving, Http).value.status, 501)
        self.assert_quiet()

    def test_unsafe_name_never_sent(self) -> None:
        """An unsafe name or slot is a ValueError at once; nothing reaches the server."""
        self.assertRaises(ValueError, self.client.save_slot, 0, "../etc/x")
        self.assertRaises(ValueError, self.client.restore_slot, -1, "ok.bin")
        self.assertEqual(self.fake.requests, [])
        self.assert_quiet()

    def test_wrong_shape(self) -> None:
        """An answer of another shape is Protocol."""
        self.fake.script("POST", "/slots/0", json_reply(200, {"id_slot": 0}))
        saving = self.client.save_slot(0, "s.bin")
        self.net.pump()
        self.failureResultOf(saving, Protocol)
        self.assert_quiet()

    def test_waits_at_the_gate(self) -> None:
        """The action waits while a chat holds the slot, and goes when it is released."""
        gate = self.client.gate
        assert isinstance(gate, SlotGate)
        held = self.successResultOf(gate.acquire(0, lambda event: None))
        saving = self.client.save_slot(0, "s.bin")
        self.net.pump()
        self.assertEqual(self.fake.requests, [])
        # The gate's queue (depth 1) is full now: one more is Busy at once.
        self.failureResultOf(self.client.restore_slot(0, "s.bin"), Busy)
        held.release()
        self.net.pump()
        self.successResultOf(saving)
        self.assert_quiet()

    def test_no_answer_in_time_is_stalled(self) -> None:
        """No answer within liveness_ms: Stalled, the connection closed, the slot given back."""
        silent = dataclasses.replace(json_reply(200, {}), headers_delay=math.inf)
        self.fake.script("POST", "/slots/1", silent)
        restoring = self.client.restore_slot(1, "s.bin")
        self.net.advance(0.099)
        self.assertNoResult(restoring)
        self.net.advance(0.002)
        error = self.failureResultOf(restoring, Stalled).value
        self.assertIn("slot restore gave no answer within 100 ms", str(error))
        self.net.pump()
        self.assert_quiet()

    def test_cancel_running(self) -> None:
        """Cancelling aborts the request and gives the slot back; a chat can go then."""
        silent = dataclasses.replace(json_reply(200, {}), headers_delay=math.inf)
        self.fake.script("POST", "/slots/0", silent)
        saving = self.client.save_slot(0, "s.bin")
        self.net.pump()
        self.assertTrue(self.fake.connections[0].open)
        saving.cancel()
        self.failureResultOf(saving, CancelledError)
        self.net.pump()
        self.assertTrue(self.fake.connections[0].client_closed)
        self.assert_quiet()

    def test_cancel_waiting(self) -> None:
        """Cancelling while it waits at the gate takes it out of the queue: nothing is sent."""
        gate = self.client.gate
        assert isinstance(gate, SlotGate)
        held = self.successResultOf(gate.acquire(0, lambda event: None))
        saving = self.client.save_slot(0, "s.bin")
        saving.cancel()
        self.failureResultOf(saving, CancelledError)
        self.assertEqual(gate.waiting(0), 0)
        held.release()
        self.net.pump()
        self.assertEqual(self.fake.requests, [])
        self.assert_quiet()
