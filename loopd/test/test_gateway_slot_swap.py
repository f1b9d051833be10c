"""
Tests for L{loopd.gateway.slot_swap} in the leased call: on a C{slot_save} endpoint, the
session a slot holds is saved before another takes it, a returning session's file is
restored before its request, and a restore that fails or does nothing falls back to a plain
request; the files on disk are 0600 and deleted once of no use (restored, failed, the
session over, beyond the budget). Against the fake llama-server's slot files (L{SlotFiles})
written in a temporary directory. Each outcome is counted in C{/metrics} as
C{loopd_slot_files_total}.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.slot_store import filename
from loopd.gateway.upstream import CallKeys
from loopd.llama.types import ChatRequest, Completion, User
from loopd.testing.fake_llama import CHAT, SlotFiles, error_reply, json_reply
from loopd.testing.gateway import GatewayHarness, make_config
from loopd.testing.llama_replies import answer

REQUEST = ChatRequest(slot=-1, messages=(User("Hi"),))
#: A turn that found its cache (or a restored one): 900 of 910 prompt tokens reused.
HIT = {"cache_n": 900, "prompt_n": 10, "predicted_n": 2}
#: A turn that found nothing: the whole prompt evaluated.
MISS = {"cache_n": 0, "prompt_n": 910, "predicted_n": 2}


def file_of(session: str) -> str:
    """The file of C{session} on C{tiny}."""
    return filename("tiny", session)


class SwapCase(SynchronousTestCase):
    """One slot_save endpoint, C{tiny}, with one slot; calls made without leases."""

    slot_save = True
    #: The endpoint's slot_dir_bytes.
    budget = 16 * 1024**3

    def setUp(self) -> None:
        config = make_config(slots=1)
        self.directory = self.mktemp()
        os.makedirs(self.directory, 0o700)
        endpoint = dataclasses.replace(
            config.endpoints[0],
            slot_save=self.slot_save,
            slot_dir=self.directory if self.slot_save else None,
            slot_dir_bytes=self.budget,
        )
        self.harness = GatewayHarness(dataclasses.replace(config, endpoints=(endpoint,)))
        self.fake = self.harness.fake
        self.files = SlotFiles(self.fake, 1, directory=self.directory)
        self.upstreams = self.harness.gateway.upstreams

    def call(self, session: str, timings: dict[str, Any] = HIT) -> Deferred[Completion]:
        """Start one call of C{session}, its answer reporting C{timings}; let it run."""
        self.fake.script("POST", CHAT, answer({"content": session}, timings=timings))
        d = self.upstreams.call("tiny", REQUEST, CallKeys(session))
        self.harness.advance(0.5)
        if not d.called:
            # Past the inferproxy's burst, connections are paced (2 a second).
            self.harness.advance(1.0)
        # The slot now holds this session's conversation, as a real server's would.
        self.files.tokens[0] = 910
        return d

    def turn(self, session: str, timings: dict[str, Any] = HIT) -> Completion:
        """One whole call of C{session}."""
        return self.successResultOf(self.call(session, timings))

    def counted(self) -> dict[tuple[str, str], float]:
        """C{/metrics}' C{loopd_slot_files_total} of C{tiny}, by (action, outcome)."""
        found = {}
        for (name, labels), value in self.harness.scrape().items():
            if name == "loopd_slot_files_total":
                named = dict(labels)
                self.assertEqual(named["endpoint"], "tiny")
                found[named["action"], named["outcome"]] = value
        return found

    def on_disk(self) -> dict[str, int]:
        """The files in the slot directory, by name: their mode bits."""
        return {
            name: stat.S_IMODE(os.stat(os.path.join(self.directory, name)).st_mode)
            for name in os.listdir(self.directory)
        }

    def sent(self) -> list[str]:
        """What reached the fake, in order: C{chat} or the slot action."""
        return [
            "chat" if r.path == CHAT else r.query.removeprefix("action=")
            for r in self.fake.requests
        ]


class SwapTests(SwapCase):
    """Save on switch-away, restore on return."""

    def test_save_on_switch_away(self) -> None:
        """b takes a's slot: a is saved to its file first, then b's request goes."""
        self.turn("a")
        self.turn("b")
        self.assertEqual(self.sent(), ["chat", "save", "chat"])
        self.assertEqual(self.files.actions, [("save", 0, file_of("a"))])
        self.assertEqual(self.files.files, {file_of("a"): 910})
        self.assertEqual(self.counted(), {("save", "saved"): 1.0})

    def test_restore_on_return(self) -> None:
        """a comes back to the slot b holds: b is saved, a restored, then a's request."""
        for session in ("a", "b", "a"):
            self.turn(session)
        self.assertEqual(self.sent(), ["chat", "save", "chat", "save", "restore", "chat"])
        self.assertEqual(self.files.actions[-1], ("restore", 0, file_of("a")))
        self.assertFalse(self.upstreams.slot_swap.store.has_file("tiny", "a"))
        self.assertEqual(self.upstreams.slot_swap.store.resident("tiny", 0), "a")
        expected = {("save", "saved"): 2.0, ("restore", "worked"): 1.0}
        self.assertEqual(self.counted(), {**expected, ("delete", "restored"): 1.0})
        # a's file went once it was in the slot; b's stays, for b's return, readable by
        # its owner only.
        self.assertEqual(self.on_disk(), {file_of("b"): 0o600})

    def test_own_slot_nothing_asked(self) -> None:
        """A session whose slot still holds it: no slot action at all."""
        self.turn("a")
        self.turn("a")
        self.assertEqual(self.sent(), ["chat", "chat"])

    def test_restored_saved_again(self) -> None:
        """
        A restored conversation is saved again when another session comes, even when it has
        not run since (its file was deleted at the restore): b's request after a's failed
        one saves a, and a comes back from that file.
        """
        for session in ("a", "b"):
            self.turn(session)
        self.fake.script("POST", CHAT, error_reply(400, "invalid_request_error", "bad"))
        failing = self.upstreams.call("tiny", REQUEST, CallKeys("a"))
        self.harness.advance(0.5)
        self.failureResultOf(failing)
        self.turn("b")
        self.turn("a")
        expected = ["chat", "save", "chat", "save", "restore", "chat", "save", "restore", "chat"]
        self.assertEqual(self.sent(), [*expected, "save", "restore", "chat"])
        self.assertEqual(self.counted()[("restore", "worked")], 2.0)

    def test_closed_anonymous_session_not_saved(self) -> None:
        """A session that ended (its connection closed) is not saved when another comes."""
        self.turn("anonymous:1")
        self.upstreams.end_session("anonymous:1")
        self.turn("b")
        self.assertEqual(self.sent(), ["chat", "chat"])


class FallbackTests(SwapCase):
    """A save or restore that fails or does nothing: the request goes as it is."""

    def test_failed_restore_plain_request(self) -> None:
        """A restore the server refuses: logged, the request still runs, the file dropped."""
        for session in ("a", "b"):
            self.turn(session)
        self.files.files.clear()  # the server lost a's file
        with capturedLogs() as events:
            completion = self.turn("a", MISS)
        self.assertEqual(completion.content, "a")
        self.assertEqual(self.sent()[-3:], ["save", "restore", "chat"])
        text = [formatEvent(e) for e in events]
        self.assertTrue(any("slot restore failed for session a on tiny slot 0" in t for t in text))
        self.assertTrue(any("Unable to restore slot" in t for t in text))
        self.assertFalse(self.upstreams.slot_swap.store.has_file("tiny", "a"))
        expected = {("save", "saved"): 2.0, ("restore", "failed"): 1.0}
        # What the server still had on disk of a's file is deleted.
        self.assertEqual(self.counted(), {**expected, ("delete", "failed"): 1.0})

    def test_restore_that_did_nothing(self) -> None:
        """
        A restore after which the answer reused nothing did nothing: logged, and the file is
        not restored again until a is saved anew.
        """
        for session in ("a", "b"):
            self.turn(session)
        with capturedLogs() as events:
            self.turn("a", MISS)
        text = [formatEvent(e) for e in events]
        self.assertTrue(any("slot restore did nothing for session a" in t for t in text))
        self.assertFalse(self.upstreams.slot_swap.store.has_file("tiny", "a"))
        expected = {("save", "saved"): 2.0, ("restore", "did_nothing"): 1.0}
        self.assertEqual(self.counted(), {**expected, ("delete", "restored"): 1.0})

    def test_restore_of_nothing(self) -> None:
        """A restore that loaded 0 tokens counts as failed at once."""
        for session in ("a", "b"):
            self.turn(session)
        self.files.files[file_of("a")] = 0
        self.turn("a")
        self.assertFalse(self.upstreams.slot_swap.store.has_file("tiny", "a"))
        expected = {("save", "saved"): 2.0, ("restore", "empty"): 1.0}
        self.assertEqual(self.counted(), {**expected, ("delete", "failed"): 1.0})

    def test_failed_save_request_goes_on(self) -> None:
        """A save the server refuses (no --slot-save-path after all): b's request still runs."""
        self.files.enabled = False
        self.turn("a")
        with capturedLogs() as events:
            self.assertEqual(self.turn("b").content, "b")
        text = [formatEvent(e) for e in events]
        self.assertTrue(any("slot save failed for session a on tiny slot 0" in t for t in text))
        self.assertEqual(self.sent(), ["chat", "save", "chat"])
        self.assertEqual(self.counted(), {("save", "failed"): 1.0})
        # a has no file, so its return asks no restore.
        self.turn("a")
        self.assertEqual(self.sent()[-2:], ["save", "chat"])

    def test_silent_save_bounded(self) -> None:
        """A save that is never answered gives up after liveness_ms; the request goes."""
        self.turn("a")
        silent = dataclasses.replace(json_reply(200, {}), headers_delay=math.inf)
        self.fake.script("POST", "/slots/0", silent)
        self.fake.script("POST", CHAT, answer({"content": "b"}, timings=HIT))
        d = self.upstreams.call("tiny", REQUEST, CallKeys("b"))
        self.harness.advance(0.05)
        self.assertEqual(self.sent(), ["chat", "save"])
        self.harness.advance(0.5)
        self.assertEqual(self.successResultOf(d).content, "b")

    def test_cancel_during_save(self) -> None:
        """Cancelling the call while the save runs aborts it; no request goes upstream."""
        self.turn("a")
        silent = dataclasses.replace(json_reply(200, {}), headers_delay=math.inf)
        self.fake.script("POST", "/slots/0", silent)
        d = self.upstreams.call("tiny", REQUEST, CallKeys("b"))
        self.harness.net.pump()
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.harness.advance(1.0)
        self.assertEqual(self.sent(), ["chat", "save"])
        self.assertTrue(self.fake.connections[-1].client_closed)
        self.assertFalse(self.upstreams.clients["tiny"].gate.in_flight(0))


#: The bytes of one session's file in these tests (910 tokens).
ONE_FILE = 910 * SlotFiles.BYTES_PER_TOKEN


class DeleteTests(SwapCase):
    """The files on disk: private, and deleted once of no use."""

    #: Room for three sessions' files.
    budget = 3 * ONE_FILE

    def test_saved_file_is_private(self) -> None:
        """The server writes a file 0644 (its umask); loopd makes it 0600 at once."""
        self.turn("a")
        self.turn("b")
        self.assertEqual(self.on_disk(), {file_of("a"): 0o600})

    def test_session_over_deletes_its_file(self) -> None:
        """An anonymous session whose connection closed: its file is deleted."""
        self.turn("anonymous:1")
        self.turn("b")
        self.assertEqual(list(self.on_disk()), [file_of("anonymous:1")])
        self.upstreams.end_session("anonymous:1")
        self.assertEqual(self.on_disk(), {})
        self.assertEqual(self.counted()[("delete", "ended")], 1.0)

    def test_failed_restore_deletes_the_file(self) -> None:
        """A restore after which the answer reused nothing: the file is deleted too."""
        for session in ("a", "b"):
            self.turn(session)
        self.turn("a", MISS)
        self.assertNotIn(file_of("a"), self.on_disk())

    def test_budget_keeps_the_newest(self) -> None:
        """
        Sixty sessions taking turns on one slot (the probe's case: 58 files left, never
        deleted): the files on disk stay within the budget, the least recently saved
        deleted first.
        """
        sessions = [f"s{n}" for n in range(60)]
        for session in sessions:
            self.turn(session)
        kept = self.on_disk()
        self.assertEqual(sorted(kept), sorted(file_of(s) for s in sessions[-4:-1]))
        self.assertLessEqual(
            sum(os.path.getsize(os.path.join(self.directory, n)) for n in kept), self.budget
        )
        self.assertEqual(self.upstreams.slot_swap.store.kept_bytes("tiny"), self.budget)
        self.assertEqual(self.counted()[("delete", "budget")], 56.0)
        # The newest come back from their files; the oldest start afresh, asking nothing.
        self.harness.advance(10.0)  # the inferproxy's pacing refills its burst
        self.turn("s58")
        self.assertEqual(self.sent()[-3:], ["save", "restore", "chat"])
        self.turn("s0")
        self.assertEqual(self.sent()[-2:], ["save", "chat"])

    def test_a_file_over_the_budget_alone(self) -> None:
        """A session larger than the whole budget is saved, then its file deleted at once."""
        self.turn("a")
        self.files.tokens[0] = 4 * 910
        self.turn("b")
        self.assertEqual(self.on_disk(), {})
        self.assertEqual(self.counted()[("delete", "budget")], 1.0)


class DisabledTests(SwapCase):
    """Without slot_save, nothing but the chats reaches the server."""

    slot_save = False

    def test_no_slot_actions(self) -> None:
        """Sessions taking turns on one slot: chats only."""
        for session in ("a", "b", "a"):
            self.turn(session)
        self.assertEqual((self.sent(), self.counted()), (["chat", "chat", "chat"], {}))
