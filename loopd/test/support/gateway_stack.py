"""
The real gateway stack of the process-level tests (L{test.test_gateway_e2e},
L{test.test_loopd_queue_e2e}, L{test.test_mesh_e2e}): a real llama.cpp server (xllamacpp)
with the project's tiny model behind a C{twist inferproxy} (L{serve_behind_proxy}), or the
genuine llama-server in router mode over several tiny models behind one
(L{serve_router_behind_proxy}, L{test.test_router_e2e}), the loopd.toml of a C{twist loopd}
in front of it (L{loopd_toml}), a raw HTTP client (L{RawStream}), and the HTTP transport
module of the C{openai} SDK (L{httpx}), and C{twist loopd} on its socket and a TCP listener
(L{start_loopd_tcp}).

Importing it without the test extra raises C{SkipTest}, so a test module that imports it is
skipped, not broken.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.protocol import Protocol
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.trial.unittest import SkipTest, TestCase

from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import spawn_twist, stop_twist

try:
    import openai

    from loopd.demo.llama_binary import ensure_llama_server
    from loopd.demo.real_server import RealServer
    from loopd.demo.router_server import RouterServer, write_models_dir
    from loopd.demo.tiny_model import write_tiny_model
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the real gateway stack needs the test extra: {e}") from None

# The SDK may be built on httpx or on its successor httpx2: take the transport from the
# module its own client class comes from.
httpx: Any = importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__)

#: The server's whole context and its slots; each slot gets an equal share.
N_CTX = 65536
SLOTS = 2
#: A long stream from the model that thinks until told to stop: neither loopd's thinking
#: cap nor its max_tokens ends it while a test watches.
LONG = 30000
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
HI = [{"role": "user", "content": "Hi"}]
#: Seconds a test that may build llama-server first may take: the build (6-9 minutes on
#: 2 cores, longer on a loaded machine) and the apt-get of its tools, with room.
BUILD_TEST_TIMEOUT = 2400
_log = Logger(namespace="loopd.test.gateway_stack")


def loopd_toml(listen: str, socket: str, expect: dict[str, Any] | None, long: bool) -> str:
    """
    A loopd.toml: the gateway on C{listen}, one endpoint C{tiny} at C{socket}, self-tested
    against C{expect} (no self-test when None); C{long} lifts max_tokens and the thinking
    cap to L{LONG}.
    """
    lines = []
    if long:
        lines += [f"max_tokens = {LONG}", "[thinking]", f"cap = {LONG}"]
    lines += ["[server]", f"listen = {json.dumps('unix:' + listen)}"]
    lines += ["[[endpoint]]", 'name = "tiny"', f"socket = {json.dumps(socket)}"]
    lines.append(f"selftest = {'true' if expect is not None else 'false'}")
    if expect is not None:
        lines.append("[endpoint.expect]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in expect.items()]
    return "\n".join(lines) + "\n"


@inlineCallbacks
def serve_behind_proxy(
    test: TestCase, model: str, slots: int, *, n_ctx: int = N_CTX, **options: Any
) -> Any:
    """
    A real llama.cpp server on a fresh tiny C{model} (C{tiny-think.gguf} thinks forever)
    with C{slots} slots sharing C{n_ctx} tokens, and a C{twist inferproxy} in front of it,
    in a short temp dir; all removed after C{test}. Fires with the dir, the server and the
    inferproxy's socket.

    @param options: more of L{RealServer}'s options (C{cache_ram_mib}, C{slot_save_path}).
    """
    reactor = real_reactor()
    directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
    test.addCleanup(shutil.rmtree, directory, True)
    infer = os.path.join(directory, "infer.sock")
    # Writing a tiny model takes milliseconds: each test has its own.
    model_path = os.path.join(directory, model)
    write_tiny_model(model_path, think_forever=model == "tiny-think.gguf")
    server = RealServer(reactor, model_path, n_ctx=n_ctx, parallel=slots, **options)
    test.addCleanup(server.stop)
    port = yield server.start()
    yield _proxy_in_front(test, infer, port)
    return directory, server, infer


@inlineCallbacks
def _proxy_in_front(test: TestCase, infer: str, port: int) -> Any:
    """A C{twist inferproxy} from C{infer} to the server on C{port}, stopped after C{test}."""
    proxy = spawn_twist(
        real_reactor(),
        b"inferproxy listening on",
        *("inferproxy", "--listen", infer, "--upstream", f"127.0.0.1:{port}"),
    )
    test.addCleanup(stop_twist, proxy)
    yield proxy.ready


def ensure_binary() -> Deferred[str]:
    """
    L{ensure_llama_server} in a thread (it blocks, for minutes when it builds), its progress
    in the test log: fires with the path of llama-server b11434, or fails with
    L{loopd.demo.llama_binary.LlamaBuildError} and the reason.
    """
    reactor = real_reactor()

    def progress(line: str) -> None:
        reactor.callFromThread(_log.info, "llama-server kit: {line}", line=line)

    return deferToThread(ensure_llama_server, progress)


@inlineCallbacks
def serve_router_behind_proxy(
    test: TestCase, n_models: int, models_max: int, **options: Any
) -> Any:
    """
    The genuine llama-server b11434 (L{ensure_binary}: from the cache, built there first when
    missing) in router mode over a models dir of C{n_models} fresh tiny models (C{tiny1},
    C{tiny2}, ...), at most C{models_max} loaded at once, and a C{twist inferproxy} in front
    of it, in a short temp dir; all removed after C{test}. Fires with the dir, the
    L{RouterServer}, the inferproxy's socket and the model names.

    @param options: more of L{RouterServer}'s options (C{n_ctx}, C{parallel},
        C{cache_ram_mib}, C{slot_save_path}, C{autoload}, ...).
    """
    binary = yield ensure_binary()
    reactor = real_reactor()
    directory = tempfile.mkdtemp(prefix="lr", dir="/tmp")
    test.addCleanup(shutil.rmtree, directory, True)
    infer = os.path.join(directory, "infer.sock")
    names = [f"tiny{index}" for index in range(1, n_models + 1)]
    models = os.path.join(directory, "models")
    write_models_dir(models, names)
    server = RouterServer(reactor, binary, models, models_max=models_max, **options)
    test.addCleanup(server.stop)
    port = yield server.start()
    yield _proxy_in_front(test, infer, port)
    return directory, server, infer, names


#: The log line that names the TCP listener's URL.
_TCP_URL = re.compile(rb"TCP listener on (http://127\.0\.0\.1:\d+):")


@dataclass(frozen=True)
class TcpLoopd:
    """
    A C{twist loopd} listening on its Unix socket and on a TCP port (L{start_loopd_tcp}).

    @ivar url: the TCP listener's root, C{http://127.0.0.1:PORT}.
    @ivar socket: the Unix socket's path.
    @ivar config: its loopd.toml.
    @ivar token_file: the file of the TCP listener's token.
    @ivar process: the C{twist loopd} child.
    """

    url: str
    socket: str
    config: str
    token_file: str
    process: Any

    def token(self) -> str:
        """The token loopd made (or read) at its start."""
        with open(self.token_file) as f:
            return f.read().strip()


@inlineCallbacks
def start_loopd_tcp(test: TestCase, directory: str, infer: str) -> Any:
    """
    C{twist loopd} in front of the inferproxy at C{infer} (one endpoint C{tiny}, no
    self-test), on C{loopd.sock} in C{directory} and on a free loopback port
    (C{[server] tcp = "127.0.0.1:0"}), its token in C{directory/state/token}; stopped after
    C{test}. Fires with a L{TcpLoopd} once it serves.
    """
    socket = os.path.join(directory, "loopd.sock")
    token_file = os.path.join(directory, "state", "token")
    config = os.path.join(directory, "loopd.toml")
    text = loopd_toml(socket, infer, None, long=False)
    extra = f'tcp = "127.0.0.1:0"\ntoken_file = {json.dumps(token_file)}\n'
    with open(config, "w") as f:
        f.write(text.replace("[[endpoint]]", extra + "[[endpoint]]", 1))
    loopd = spawn_twist(real_reactor(), b"loopd serving", "loopd", "--config", config)
    test.addCleanup(stop_twist, loopd)
    yield loopd.ready
    found = _TCP_URL.search(loopd.output)
    assert found is not None, loopd.output
    return TcpLoopd(found.group(1).decode(), socket, config, token_file, loopd)


class RawStream(Protocol):
    """
    A raw HTTP client: fires C{seen} once C{marker} has arrived C{count} times, and
    C{closed} when the connection is gone.
    """

    def __init__(self, marker: bytes, count: int) -> None:
        """Wait for C{count} times C{marker}."""
        self.marker, self.count = marker, count
        self.received = b""
        self.seen: Deferred[None] = Deferred()
        self.closed: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        """Keep C{data}; fire C{seen} once the marker has come often enough."""
        self.received += data
        if self.received.count(self.marker) >= self.count and not self.seen.called:
            self.seen.callback(None)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        """Fire C{closed}."""
        self.closed.callback(None)
