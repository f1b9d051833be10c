"""
Tests for L{loopd.testing} as a program that embeds loopd sees it: the manual's example
(docs/testing.md) and the examples in the kit's docstrings run, every public object is
documented, and the kit needs nothing but Twisted, treq, prometheus_client and loopd.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
import subprocess
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.trial.reporter import TestResult
from twisted.trial.unittest import SynchronousTestCase

import loopd
from loopd.llama import ChatRequest, Client, Completion, User
from loopd.queue.client import Lease, LeaseClient
from loopd.queue.scheduler_types import QueuePolicy
from loopd.testing.fake_llama import CHAT, FakeLlama
from loopd.testing.gateway import PATH, GatewayHarness, make_config
from loopd.testing.lease_daemon import FakeLeaseDaemon
from loopd.testing.llama_replies import answer
from loopd.testing.memory_net import MemoryNet
from loopd.testing.mesh import ASK, MeshHarness, content_of, says
from loopd.testing.reactor import MemoryLoopdReactor

#: The kit's modules, all public.
KIT = (
    "loopd.testing",
    "loopd.testing.fake_llama",
    "loopd.testing.llama_replies",
    "loopd.testing.memory_net",
    "loopd.testing.lease_daemon",
    "loopd.testing.gateway",
    "loopd.testing.mesh",
    "loopd.testing.reactor",
)

#: The manual's page on the kit, whose one Python block is a test module of its own.
MANUAL = Path(loopd.__file__).parent.parent / "docs" / "testing.md"


def manual_example() -> dict[str, Any]:
    """The names the manual's Python block defines, run as a module."""
    text = MANUAL.read_text(encoding="utf-8")
    (code,) = re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)
    names: dict[str, Any] = {"__name__": "manual_example"}
    exec(compile(code, str(MANUAL), "exec"), names)
    return names


@inlineCallbacks
def ask(client: Client, leases: LeaseClient, text: str) -> Generator[Deferred[Any], Any, Any]:
    """The manual's program under test: one answer from the model, under a lease."""
    lease: Lease = yield leases.acquire("tiny", "me")
    try:
        request = ChatRequest(slot=0, messages=(User(text),))
        completion: Completion = yield client.chat(request, lambda event: None)
    finally:
        yield leases.release(lease)
    return completion.content


class ManualExampleTests(SynchronousTestCase):
    """
    The manual's "Testing a program that embeds loopd" (docs/testing.md), as written there.
    """

    def test_manual_block(self) -> None:
        """The manual's block, run as it is written: its one test passes."""
        case = manual_example()["AskTests"]("test_answer_under_a_lease")
        result = TestResult()
        case.run(result)
        self.assertEqual((result.testsRun, result.errors, result.failures), (1, [], []))

    def test_answer_under_a_lease(self) -> None:
        """The program gets the scripted answer, and took and gave back one lease."""
        reactor = MemoryLoopdReactor()
        net = MemoryNet(reactor)
        llama = FakeLlama(reactor)
        net.listen(PATH, llama)
        llama.script("POST", CHAT, answer({"content": "Hello"}))
        daemon = FakeLeaseDaemon(net)
        config = make_config()
        client = Client(reactor, config, config.endpoints[0])
        d = ask(client, LeaseClient(reactor, daemon.path), "Hi")
        net.advance(1)
        self.assertEqual(self.successResultOf(d), "Hello")
        self.assertEqual([m["op"] for m in daemon.ops()], ["acquire", "release"])
        self.assertEqual(llama.requests[0].json["messages"], [{"role": "user", "content": "Hi"}])

    def test_example_can_fail(self) -> None:
        """The same program against a daemon whose one slot is taken never gets an answer."""
        reactor = MemoryLoopdReactor()
        net = MemoryNet(reactor)
        llama = FakeLlama(reactor)
        net.listen(PATH, llama)
        llama.script("POST", CHAT, answer({"content": "Hello"}))
        daemon = FakeLeaseDaemon(net, policy=QueuePolicy(max_streams=1))
        other = LeaseClient(reactor, daemon.path).acquire("tiny", "someone else")
        config = make_config()
        client = Client(reactor, config, config.endpoints[0])
        d = ask(client, LeaseClient(reactor, daemon.path), "Hi")
        net.advance(1)
        self.successResultOf(other)
        self.assertNoResult(d)
        self.assertEqual((daemon.waiting("tiny"), llama.requests), (["me"], []))


class DocstringExampleTests(SynchronousTestCase):
    """
    The examples in the kit's module docstrings do what they say.
    """

    def test_gateway(self) -> None:
        """L{loopd.testing.gateway}'s example: a whole answer through the gateway."""
        harness = GatewayHarness()
        harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
        connection = harness.post({"messages": [{"role": "user", "content": "Hi"}]})
        harness.advance(1)
        response = connection.response()
        self.assertEqual(response.json()["choices"][0]["message"]["content"], "Hello")

    def test_mesh(self) -> None:
        """L{loopd.testing.mesh}'s example: three agreeing workers, one answer."""
        harness = MeshHarness()
        harness.script(
            llama_70b=says("Paris.", 1.0),
            mistral_7b=says("Paris.", 0.5),
            qwen3_8b=says("Paris.", 0.7),
        )
        response = harness.ask(ASK, 2.0)
        self.assertEqual(response.status, 200, response.body)
        self.assertEqual(content_of(response.json()), "Paris.")

    def test_lease_daemon(self) -> None:
        """L{loopd.testing.lease_daemon}'s example: a grant, then the daemon dies."""
        reactor = MemoryLoopdReactor()
        net = MemoryNet(reactor)
        daemon = FakeLeaseDaemon(net, policy=QueuePolicy(max_streams=1))
        client = LeaseClient(reactor, daemon.path)
        d = client.acquire("gpu", "session-1")
        net.pump()
        lease = self.successResultOf(d)
        self.assertEqual(daemon.holders("gpu"), ["session-1"])
        lost: list[Lease] = []
        lease.add_lost_observer(lost.append)
        daemon.kill()
        net.pump()
        self.assertEqual(lost, [lease])


def public_objects(module: Any) -> list[tuple[str, Any]]:
    """
    The public objects C{module} defines, by dotted name: its C{__all__} names, and the
    public methods and properties of its classes, with C{__init__} (inherited ones left
    out, and a dataclass's generated C{__init__}, which its class docstring documents).
    """
    found: list[tuple[str, Any]] = []
    for name in getattr(module, "__all__", ()):
        value = getattr(module, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            found.append((name, value))
        if inspect.isclass(value):
            for attribute, member in vars(value).items():
                if attribute.startswith("_") and attribute != "__init__":
                    continue
                if attribute == "__init__" and dataclasses.is_dataclass(value):
                    continue
                if isinstance(member, property) or inspect.isfunction(member):
                    found.append((f"{name}.{attribute}", member))
    return found


class PublicKitTests(SynchronousTestCase):
    """
    What makes the kit usable by another program.
    """

    def test_everything_documented(self) -> None:
        """Every module, and every public class, function, method and property, has a docstring."""
        missing = []
        for module_name in KIT:
            module = importlib.import_module(module_name)
            if not (module.__doc__ or "").strip():
                missing.append(module_name)
            for name, value in public_objects(module):
                # __doc__, not inspect.getdoc: an override must not borrow its base's docstring.
                if not (value.__doc__ or "").strip():
                    missing.append(f"{module_name}.{name}")
        self.assertEqual(missing, [])

    def test_all_is_complete(self) -> None:
        """Each kit module's C{__all__} names every public class and function it defines."""
        unlisted = {}
        for module_name in KIT[1:]:
            module = importlib.import_module(module_name)
            defined = {
                name
                for name, value in vars(module).items()
                if not name.startswith("_")
                and (inspect.isclass(value) or inspect.isfunction(value))
                and value.__module__ == module_name
            }
            extra = defined - set(module.__all__)
            if extra:
                unlisted[module_name] = sorted(extra)
        self.assertEqual(unlisted, {})

    def test_needs_only_runtime_dependencies(self) -> None:
        """
        Importing every kit module in a fresh interpreter loads neither hypothesis nor any of
        loopd's own test modules: an embedding program needs only loopd's requirements.
        """
        script = (
            "import importlib, json, sys\n"
            f"for name in {list(KIT)!r}: importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))\n"
        )
        # From the checkout under test: "-c" puts the working directory first on sys.path.
        root = Path(loopd.__file__).parent.parent
        result = subprocess.run(
            [sys.executable, "-c", script], cwd=root, capture_output=True, check=True, timeout=60
        )
        loaded = json.loads(result.stdout)
        forbidden = [
            name
            for name in loaded
            if name.split(".")[0] in ("hypothesis", "gguf", "numpy", "openai", "xllamacpp")
            or name == "loopd.test"
            or name.startswith("loopd.test.")
        ]
        self.assertEqual(forbidden, [])
        self.assertIn("loopd.testing.mesh", loaded)
