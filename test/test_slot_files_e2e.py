"""
Slot files end to end (DESIGN §3 decision 39): a real llama.cpp server (xllamacpp) with one
slot, no RAM prompt cache and a C{--slot-save-path}, behind C{twist inferproxy}, and
C{twist loopd} with C{slot_save = true} (and C{slot_dir}) on that endpoint. A session
switched out of the slot by another finds its prompt cached when it comes back, because
loopd saved it before the switch and restored it before its return (and then deleted its
file); without C{slot_save} it finds next to nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase

from loopd.gateway.slot_store import filename
from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import TwistProcess, spawn_twist, stop_twist

try:
    import openai

    from loopd.test.support.gateway_stack import httpx, loopd_toml, serve_behind_proxy
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the slot-file end-to-end tests need the test extra: {e}") from None

#: A long first message per session: far more tokens than the cache-loss threshold.
WORDS = 400


def conversation(session: str) -> list[dict[str, str]]:
    """C{session}'s first turn: one long user message of its own."""
    return [{"role": "user", "content": " ".join(f"{session}{i}" for i in range(WORDS))}]


def next_turn(session: str) -> list[dict[str, str]]:
    """C{session}'s second turn: its first, an answer, a short question."""
    return [*conversation(session), {"role": "assistant", "content": "ok"}] + [
        {"role": "user", "content": "and then?"}
    ]


class SlotFilesEndToEndTests(TestCase):
    """A switched-out session, restored from its file."""

    timeout = 180

    @inlineCallbacks
    def start(self, slot_save: bool) -> Any:
        """The server (one slot, no RAM cache, a save dir), an inferproxy and twist loopd."""
        reactor = real_reactor()
        self.saves = tempfile.mkdtemp(prefix="ldslots", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.saves, True)
        self.directory, self.server, infer = yield serve_behind_proxy(
            self, "tiny.gguf", 1, cache_ram_mib=0, slot_save_path=self.saves
        )
        self.socket = os.path.join(self.directory, "loopd.sock")
        config = os.path.join(self.directory, "loopd.toml")
        with open(config, "w") as f:
            f.write(loopd_toml(self.socket, infer, None, long=False))
            if slot_save:
                f.write(f"slot_save = true\nslot_dir = {json.dumps(self.saves)}\n")
            f.write("[queue]\ngrace_ms = 0\n")
        self.loopd: TwistProcess = spawn_twist(
            reactor, b"loopd serving", "loopd", "--config", config
        )
        self.addCleanup(stop_twist, self.loopd)
        yield self.loopd.ready

    def ask(self, session: str, messages: list[dict[str, str]]) -> Any:
        """One chat of C{session} through loopd's socket (in a thread: the SDK blocks)."""

        def call() -> Any:
            transport = httpx.HTTPTransport(uds=self.socket)
            client = openai.OpenAI(
                base_url="http://loopd/v1",
                api_key="x",
                max_retries=0,
                http_client=httpx.Client(transport=transport, timeout=60),
            )
            with client:
                return client.chat.completions.create(
                    model="tiny",
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=8,
                    extra_headers={"X-Session-Id": session},
                )

        return deferToThread(call)

    @inlineCallbacks
    def switch_and_return(self) -> Any:
        """a, then b on the one slot, then a again: fire with a's return's cached tokens."""
        yield self.ask("a", conversation("a"))
        yield self.ask("b", conversation("b"))
        back = yield self.ask("a", next_turn("a"))
        return back.usage.prompt_tokens_details.cached_tokens, back.usage.prompt_tokens

    @inlineCallbacks
    def test_restored_after_switch(self) -> Any:
        """With slot_save, a's return reuses nearly all of its prompt, from its file."""
        yield self.start(slot_save=True)
        cached, prompt = yield self.switch_and_return()
        self.assertGreater(cached, prompt - 64)
        # a's file went once it was restored; b's stays for b's return, 0600 (the server
        # wrote it with its umask).
        (kept,) = os.listdir(self.saves)
        self.assertEqual(kept, filename("tiny", "b"))
        self.assertEqual(stat.S_IMODE(os.stat(os.path.join(self.saves, kept)).st_mode), 0o600)

    @inlineCallbacks
    def test_lost_without_slot_save(self) -> Any:
        """The same turns without slot_save: a's return re-evaluates its prompt."""
        yield self.start(slot_save=False)
        cached, prompt = yield self.switch_and_return()
        self.assertLess(cached, 64)
        self.assertGreater(prompt, 1000)
