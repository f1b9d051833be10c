"""
Tests for L{loopd.queue.host.QueueHost}: the policy it starts with, reloads that keep the
last good policy, loopd's endpoints as queues, and its sweep on a C{task.Clock}.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.host import QueueHost
from loopd.queue.policy import DEFAULT_POLICY, parse_policy
from loopd.queue.scheduler_types import Grant, QueueEvent


class HostTestCase(SynchronousTestCase):
    """A temp dir for the config file, a clock, and what the host tells."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.path = os.path.join(self.directory, "llm-queue.json")
        self.clock = Clock()
        self.grants: list[Grant] = []
        self.events: list[QueueEvent] = []

    def write(self, document: object) -> None:
        """Write the config file: C{document} as JSON, or a string as it is."""
        text = document if isinstance(document, str) else json.dumps(document)
        with open(self.path, "w") as f:
            f.write(text)

    def host(self, **kwargs: Any) -> QueueHost:
        """A host over the config file, reporting to this test's lists."""
        options: dict[str, Any] = {"config_path": self.path}
        options.update(kwargs)
        return QueueHost(self.clock, self.grants.append, on_event=self.events.append, **options)

    def granted(self) -> list[str]:
        """The session keys granted so far, in order."""
        return [g.session_key for g in self.grants]


class StartTests(HostTestCase):
    """
    The policy at start: the file's, or the defaults when it is missing or invalid.
    """

    def test_no_config_path(self) -> None:
        """Without a config path the defaults apply, and reload changes nothing."""
        host = self.host(config_path=None)
        self.assertEqual(host.policy, DEFAULT_POLICY)
        self.assertEqual(host.reload(), ("unchanged", ()))
        self.assertEqual(host.problems, ())

    def test_missing_file(self) -> None:
        """A config file that does not exist is the defaults, silently."""
        host = self.host()
        self.assertEqual((host.policy, host.problems), (DEFAULT_POLICY, ()))
        self.assertFalse(host.config_invalid)

    def test_valid_file(self) -> None:
        """A valid file is the policy; its queue gets the streams it names."""
        document = {"queues": {"q": {"maxStreams": 2}}}
        self.write(document)
        host = self.host()
        self.assertEqual(host.policy, parse_policy(document))
        host.scheduler.acquire("c", "q", "a")
        self.assertEqual(host.scheduler.status()[0]["maxStreams"], 2)

    def test_invalid_file(self) -> None:
        """An invalid file at start: the defaults, and each problem to print."""
        self.write({"defaults": {"maxStreams": 0, "leaseTtlMs": 5}})
        host = self.host()
        self.assertEqual(host.policy, DEFAULT_POLICY)
        self.assertTrue(host.config_invalid)
        self.assertEqual(
            list(host.problems),
            [
                f"{self.path}: defaults.maxStreams must be a positive integer (got 0)",
                f"{self.path}: defaults.leaseTtlMs must be an integer of at least 1000 (got 5)",
            ],
        )

    def test_not_json_at_start(self) -> None:
        """A file that is not JSON at start: the defaults, and the reason to print."""
        self.write('{"queues": {')
        host = self.host()
        self.assertEqual(host.policy, DEFAULT_POLICY)
        self.assertTrue(host.problems[0].startswith(f"{self.path}: "))

    def test_endpoint_slots(self) -> None:
        """An endpoint's queue has its slot count as maxStreams, unless the policy names it."""
        self.write({"queues": {"big": {"maxStreams": 1}}})
        host = self.host(slot_counts={"tiny": 3, "big": 4})
        for key in ("tiny", "big", "other"):
            host.scheduler.acquire("c", key, "a")
        streams = {q["queueKey"]: q["maxStreams"] for q in host.scheduler.status()}
        self.assertEqual(streams, {"tiny": 3, "big": 1, "other": 1})


class ForgetTests(HostTestCase):
    """
    A queue the config does not name, and that is not one of loopd's endpoints, is dropped
    once it has no holder and no waiter; the named ones stay.
    """

    def keys(self, host: QueueHost) -> list[str]:
        """The queue keys status lists."""
        return [q["queueKey"] for q in host.scheduler.status()]

    def test_unnamed_goes_named_stay(self) -> None:
        """After each key is acquired and released only the named queues are listed."""
        catalog = os.path.join(self.directory, "models.json")
        with open(catalog, "w") as f:
            json.dump({"providers": {"zen": {"baseUrl": "http://z/v1"}}}, f)
        self.write(
            {"queues": {"q": {"maxStreams": 1}, "gpu": {"match": ["http://g/v1"]}, "zen": {}}}
        )
        host = self.host(slot_counts={"tiny": 2}, models_json=catalog)
        for key in ("q", "http://g/v1", "tiny", "zen", "other", "http://x/v1"):
            host.scheduler.acquire("c", key, "a")
            host.scheduler.release(key, "a")
        self.assertEqual(self.keys(host), ["q", "gpu", "tiny", "http://z/v1"])
        self.assertEqual(host.scheduler.counters().forgotten_queues, 2)

    def test_reload_that_unnames_forgets(self) -> None:
        """An idle queue whose entry an edit removed goes at the reload."""
        self.write({"queues": {"q": {"maxStreams": 1}}})
        host = self.host()
        host.scheduler.acquire("c", "q", "a")
        host.scheduler.release("q", "a")
        self.assertEqual(self.keys(host), ["q"])
        self.write({"queues": {}})
        self.assertEqual(host.reload(), ("applied", ()))
        self.assertEqual(self.keys(host), [])


class ReloadTests(HostTestCase):
    """
    A reload applies a valid edit to the live queues and keeps the last good policy
    otherwise.
    """

    def setUp(self) -> None:
        super().setUp()
        self.write({"queues": {"q": {"maxStreams": 1}}})
        self.queue_host = self.host()
        scheduler = self.queue_host.scheduler
        scheduler.acquire("c1", "q", "a")
        scheduler.acquire("c2", "q", "b")

    def test_widened(self) -> None:
        """A widened queue grants its waiter at the reload."""
        self.assertEqual(self.granted(), ["a"])
        self.write({"queues": {"q": {"maxStreams": 2}}})
        self.assertEqual(self.queue_host.reload(), ("applied", ()))
        self.assertEqual(self.granted(), ["a", "b"])
        (queue,) = self.queue_host.scheduler.status()
        self.assertEqual((queue["maxStreams"], queue["waiting"]), (2, []))

    def test_unchanged(self) -> None:
        """A file rewritten with the same policy is no change."""
        before = self.queue_host.policy
        self.write({"queues": {"q": {"maxStreams": 1}}})
        self.assertEqual(self.queue_host.reload(), ("unchanged", ()))
        self.assertIs(self.queue_host.policy, before)

    def test_half_written(self) -> None:
        """A file that is not JSON (half-written) keeps the last good policy, silently."""
        before = self.queue_host.policy
        self.write('{"queues": {"q": {"maxStr')
        self.assertEqual(self.queue_host.reload(), ("unchanged", ()))
        self.assertIs(self.queue_host.policy, before)
        self.assertEqual(self.granted(), ["a"])

    def test_invalid(self) -> None:
        """An invalid policy keeps the last good one, and prints why."""
        before = self.queue_host.policy
        self.write({"queues": {"q": {"maxStreams": 0}}})
        problem = f"{self.path}: queues.q.maxStreams must be a positive integer (got 0)"
        self.assertEqual(self.queue_host.reload(), ("rejected", (problem,)))
        self.assertIs(self.queue_host.policy, before)
        self.assertEqual(self.granted(), ["a"])

    def test_removed(self) -> None:
        """A removed file is the defaults again."""
        os.remove(self.path)
        self.assertEqual(self.queue_host.reload(), ("applied", ()))
        self.assertEqual(self.queue_host.policy, DEFAULT_POLICY)


class SweepTests(HostTestCase):
    """
    The sweep runs on the reactor's clock between start() and stop().
    """

    def setUp(self) -> None:
        super().setUp()
        self.write({"queues": {"q": {"leaseTtlMs": 1000}}})
        self.queue_host = self.host(sweep_ms=100)
        self.queue_host.scheduler.acquire("c", "q", "a")

    def evictions(self) -> list[tuple[str | None, str | None]]:
        """The sessions evicted so far, each with its reason."""
        return [(e.session_key, e.reason) for e in self.events if e.event == "evict"]

    def test_not_started(self) -> None:
        """Before start() no timer runs: a lapsed lease stays until someone asks."""
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.clock.advance(5)
        self.assertEqual(self.evictions(), [])

    def test_sweeps(self) -> None:
        """Started, the sweep evicts a lapsed lease on its next tick."""
        self.queue_host.start()
        self.queue_host.start()
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        self.clock.pump([0.1] * 9)
        self.assertEqual(self.evictions(), [])
        self.clock.pump([0.1] * 2)
        self.assertEqual(self.evictions(), [("a", "ttl")])

    def test_stop(self) -> None:
        """stop() cancels the sweep's timer; stopping twice is harmless."""
        self.queue_host.start()
        self.queue_host.stop()
        self.queue_host.stop()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.clock.advance(5)
        self.assertEqual(self.evictions(), [])
