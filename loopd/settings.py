# -*- test-case-name: loopd.test.test_config -*-
"""
The typed values of a loopd.toml: one frozen dataclass per section, each default the
specification's. L{loopd.config} builds them from a file; everything else reads them.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field, fields
from typing import Literal

__all__ = [
    "Capture",
    "Caps",
    "Config",
    "Doors",
    "Endpoint",
    "EndpointKind",
    "Expect",
    "HealthProbe",
    "Limits",
    "Mesh",
    "Queue",
    "Retry",
    "Sampling",
    "Server",
    "Telemetry",
    "Thinking",
]

EndpointKind = Literal["llama-server", "llama-server-router", "openai"]
"""What an endpoint speaks: llama.cpp's server, llama.cpp's server in router mode (several
models, loaded on demand: DESIGN decision 46), or any OpenAI-compatible server."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    """The waits and the queue bound of one request (seed 000, section 4)."""

    poll_ms: int = 5000
    """Read timeout before the first byte; each one polls /slots (> 0)."""
    busy_wait_ms: int = 600_000
    """How long a busy slot may keep a request waiting before WaitTimeout (>= 0)."""
    load_wait_ms: int = 180_000
    """How long a loading or restarting server may take before LoadTimeout (>= 0)."""
    idle_grace_ms: int = 30_000
    """Silence allowed while the slot is idle, before Stalled (>= 0)."""
    liveness_ms: int = 30_000
    """Silence allowed after the first byte, before Stalled (> 0); before the first delta
    a llama-server slot that /slots shows processing extends it (see prefill_stall_ms)."""
    prefill_stall_ms: int = 600_000
    """Before the first delta: how long a slot that /slots shows processing may go without
    advancing (no byte, no progress event, no /slots counter moving), before Stalled (> 0)."""
    queue_depth: int = 8
    """Requests that may wait at loopd's own slot gate; beyond that Busy (>= 0)."""


@dataclass(frozen=True, kw_only=True)
class Thinking:
    """The thinking cap: end reasoning after C{cap} tokens, give up after C{overrun}."""

    cap: int = 4096
    """Reasoning tokens after which loopd asks the server to end reasoning (> 0)."""
    overrun: int = 256
    """Reasoning tokens tolerated after asking to end; then ThinkingOverrun (>= 0)."""


@dataclass(frozen=True, kw_only=True)
class Retry:
    """The retry schedule of chat_with_retry."""

    attempts: int = 4
    """Attempts in all, the first included; 1 means no retry (> 0)."""
    backoff_ms: tuple[int, ...] = (2000, 8000, 30_000)
    """Wait before retry n; the last value repeats if there are more retries (>= 0)."""
    jitter: float = 0.25
    """Each wait is scaled by a random factor in [1 - x, 1 + x] (0 <= x < 1)."""
    total_ms: int = 300_000
    """No retry starts after this much time since the first attempt (> 0)."""


@dataclass(frozen=True, kw_only=True)
class Caps:
    """Size caps of the HTTP client; exceeding one is a Protocol error."""

    header_bytes: int = 16_384
    """Status line and headers together (> 0)."""
    sse_line_bytes: int = 1_048_576
    """One SSE line (> 0)."""
    body_bytes: int = 4_194_304
    """A response body that is not a stream (> 0)."""


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """
    Sampling settings sent upstream. None means unset: the server's default applies
    and the field is not sent at all (see L{request_fields}).
    """

    temperature: float | None = None
    """0 to 5; 0 is greedy."""
    top_p: float | None = None
    """Nucleus sampling, 0 to 1 (1 disables)."""
    top_k: int | None = None
    """Keep the k most likely tokens, >= 0 (0 disables)."""
    min_p: float | None = None
    """Drop tokens below this fraction of the best one, 0 to 1 (0 disables)."""
    typical_p: float | None = None
    """Locally typical sampling, 0 to 1 (1 disables)."""
    repeat_penalty: float | None = None
    """Penalty on repeated tokens, 0 < x <= 5 (1 disables)."""
    repeat_last_n: int | None = None
    """Tokens considered for the repeat penalty, >= -1 (-1 is the context size)."""
    presence_penalty: float | None = None
    """OpenAI presence penalty, -2 to 2."""
    frequency_penalty: float | None = None
    """OpenAI frequency penalty, -2 to 2."""
    seed: int | None = None
    """RNG seed, 0 to 4294967295; unset lets the server pick one per request."""

    def request_fields(self) -> dict[str, int | float]:
        """The settings that are set, by their request field name, in field order."""
        values = ((f.name, getattr(self, f.name)) for f in fields(self))
        return {name: value for name, value in values if value is not None}


@dataclass(frozen=True, kw_only=True)
class Expect:
    """What the startup self-test requires of the server's /props (None: unchecked)."""

    chat_template_sha256: str | None = None
    """SHA-256 of the chat template, 64 lowercase hex digits."""
    n_ctx: int | None = None
    """Context size of one slot."""
    total_slots: int | None = None
    """Number of slots of the server."""


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    """
    One model server, reached through a Unix socket (an inferproxy's listening socket).

    Direct construction is not validated; L{config_from_mapping} is.
    """

    name: str
    """The name sessions use as the model; unique; may contain C{:} and C{.}."""
    socket: str
    """Path of the Unix socket, C{~} expanded."""
    kind: EndpointKind = "llama-server"
    """What the server speaks; an C{openai} server has no /slots, /props, control."""
    model: str | None = None
    """The model id sent upstream, or None to send none."""
    selftest: bool = True
    """Run the startup self-test (only for C{llama-server} endpoints)."""
    selftest_wait_ms: int = 10_000
    """How long the self-test waits for the endpoint while it cannot be reached (no socket,
    connection refused, refused by its inferproxy, no answer) before its check fails (> 0);
    a server that answers 503 while loading is waited for up to C{limits.load_wait_ms}."""
    size_b: float | None = None
    """The model's size in billions of parameters; below 10 is the small tier for mesh roles
    and the auto router. None: the tier comes from the name (a single-digit-B name is small)."""
    vision: bool = False
    """The model takes images (the auto router sends image requests only to such endpoints)."""
    audio: bool = False
    """The model takes audio (likewise for audio requests)."""
    proxy_max_connections: int = 8
    """The connection cap of the endpoint's inferproxy (its C{--max-connections}): loopd
    keeps at most this many of its own connections to the endpoint open (> 0)."""
    proxy_burst: int = 10
    """The accept bucket size of the endpoint's inferproxy (its C{--burst}) (> 0)."""
    proxy_refill_per_second: float = 2.0
    """The accept bucket refill of the endpoint's inferproxy (its C{--refill}): loopd opens
    connections to the endpoint no faster than this, after the burst (> 0)."""
    pacing_wait_ms: int = 10_000
    """How long one of loopd's connections may wait for the pacing (a token, or a free place
    under the cap) before it fails with Busy (>= 0)."""
    slot_save: bool = False
    """The server was started with C{--slot-save-path}: loopd saves a session's slot to a file
    there before another session takes the slot, and restores it when the session comes back
    to a slot that does not hold it (only for C{llama-server} endpoints; needs C{slot_dir})."""
    slot_dir: str | None = None
    """The server's C{--slot-save-path} as loopd sees it (the server runs on loopd's machine, as
    the same user). Slot files hold prompts: loopd refuses to start unless the directory is
    the user's and neither group nor others may enter it, makes each file 0600, and deletes a
    session's file once it is restored or the session is over. Needed with C{slot_save}."""
    slot_dir_bytes: int = 16 * 1024**3
    """The disk budget of loopd's slot files on this endpoint: when the files it keeps exceed
    it, the least recently saved go first (> 0)."""
    models: tuple[str, ...] | None = None
    """A C{llama-server-router} endpoint only: the router's models loopd serves, by id;
    None: every model the router lists in C{/v1/models} when loopd starts."""
    models_max: int | None = None
    """A C{llama-server-router} endpoint only: how many of its models the router keeps
    loaded at once (its C{--models-max}); None: what its C{/props} says
    (C{max_instances})."""
    swap_wait_ms: int = 30_000
    """For a C{llama-server-router} endpoint (its models inherit it; other endpoints do not
    use it): the longest a request for a model that is not loaded waits while the loaded
    ones' sessions are mid-task, before it makes the router swap (> 0)."""
    router: str | None = None
    """Not a config key: set on the endpoint loopd makes of each model of a
    C{llama-server-router} endpoint (L{loopd.llama.router}), the router's name. Such an
    endpoint names its C{model} in every per-model call (C{?model=} on a GET, C{model} in a
    POST body)."""
    expect: Expect = field(default_factory=Expect)
    """What the self-test checks in /props."""
    group: str | None = None
    """The group the endpoint belongs to: endpoints serving the same model share one, and a
    request naming the group is routed among them as C{auto} is (DESIGN §3 decision 42).
    Not an endpoint's name, nor C{auto} or C{mesh}. None: in no group."""
    affinity_header: str | None = None
    """An C{openai} endpoint only: the request header that carries the session's id to the
    engine's own session affinity (C{x-smg-routing-key} for SGLang's gateway,
    C{X-Dynamo-Session-ID} for Dynamo, C{x-session-token} for llm-d). None: no header."""
    affinity_field: str | None = None
    """An C{openai} endpoint only: the top-level body field that carries the session's id
    (C{user} for mesh-llm and vLLM's router). None: no field."""
    affinity_priority: bool = False
    """An C{openai} endpoint only: send the session's tier as Dynamo's request priority,
    C{x-dynamo-request-priority} (1 for a parent, 0 for a child: higher goes first)."""


@dataclass(frozen=True, kw_only=True)
class Server:
    """Where the gateway listens and what it accepts ([server])."""

    listen: str | None = None
    """The gateway's Unix socket, C{unix:PATH}; None: C{loopd.sock} in the default directory.
    (A TCP listener is C{tcp}, with a token; C{listen} no longer takes one.)"""
    tcp: str | None = None
    """A TCP listener besides the Unix socket, C{HOST:PORT} (C{127.0.0.1:8080},
    C{[::1]:8080}, C{localhost:8080}; port 0: any free one), on which every request carries
    loopd's token (DESIGN decision 41). Loopback only unless C{allow_remote}. None: none."""
    allow_remote: bool = False
    """Let C{tcp} name an address other than a loopback one (loopd warns at start)."""
    token_file: str | None = None
    """The file of the TCP listener's token, C{~} expanded; None: C{token} in loopd's state
    directory (L{loopd.access_token.default_token_path})."""
    body_bytes: int = 8 * 1024 * 1024
    """The largest request body the gateway accepts; a larger one is refused with 413 as soon
    as its declared or received length passes this, and the connection closed."""
    header_timeout_ms: int = 10_000
    """How long the whole header block of a request may take from its first byte; past it
    the request is refused with 408 and the connection closed."""
    body_timeout_ms: int = 10_000
    """The window of the body's rate floor: each such window, the body must grow by at least
    C{body_min_bytes_per_s} times its length in seconds (and by one byte at least), or the
    request is refused with 408 and the connection closed."""
    body_min_bytes_per_s: int = 1024
    """The body's rate floor, in bytes per second over each C{body_timeout_ms} window."""
    max_connections: int = 256
    """The open connections the listener keeps at most; a newer one is answered 503 and
    closed, while the open ones carry on."""
    keepalive_ms: int = 15_000
    """While a streamed answer has no token yet (a queue or slot wait, a long prompt being
    processed), a no-op event of its API goes out after this long without one, headers
    first if none went yet: agents' stream timers count events, not SSE comments (Codex
    CLI's gives up after 300 s, Qwen Code's after 240 s)."""
    backlog: int = socket.SOMAXCONN
    """
    The listen backlog of loopd's Unix sockets (the gateway's and the lease socket):
    connections the kernel holds before loopd accepts them. By default the platform's
    largest; the kernel caps it at C{net.core.somaxconn}.
    """


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """The mixture of agents, C{model: "mesh"} ([mesh])."""

    strong_patience_ms: int = 20_000
    """How long a small-tier consensus waits for a still-running big-tier Strong worker."""


@dataclass(frozen=True, kw_only=True)
class Queue:
    """The lease scheduler inside loopd ([queue])."""

    serve: bool = True
    """Serve the lease protocol on C{socket} for outside clients."""
    socket: str | None = None
    """The lease socket; None: C{llm-queue.sock} beside the gateway's socket."""
    config: str | None = None
    """An C{llm-queue.json} to apply and hot-reload; None: the defaults."""
    models_json: str | None = None
    """A C{models.json} that maps provider names to endpoints (as C{--models-json})."""
    sweep_ms: int = 1000
    """How often lapsed leases are evicted and idle holders yielded."""
    grace_ms: int = 3000
    """How long a session keeps its lease after its request ended (switch-free next turn)."""


@dataclass(frozen=True, kw_only=True)
class HealthProbe:
    """The background probe of each endpoint's C{/health} ([health], DESIGN decision 38)."""

    up_interval_ms: int = 5000
    """Between probes of an endpoint that is up."""
    down_interval_ms: int = 1000
    """Between probes of an endpoint that is down or probing (also the least C{Retry-After})."""
    timeout_ms: int = 2000
    """A probe with no answer within this is a failed probe."""


@dataclass(frozen=True, kw_only=True)
class Doors:
    """What the front doors do with what a local model cannot honour ([doors], decision 43)."""

    hosted_tools: Literal["drop", "refuse"] = "drop"
    """A tool the API's own servers run (OpenAI's C{web_search}, C{file_search},
    C{code_interpreter} ...; Anthropic's C{web_search_*}, C{web_fetch_*},
    C{code_execution_*} ...): C{drop} leaves it out of what the model sees and names it in
    the answer's C{X-Loopd-Dropped} header, the log and C{loopd_dropped_tools_total};
    C{refuse} answers the request with a 400 C{hosted_tool} naming it."""


@dataclass(frozen=True, kw_only=True)
class Telemetry:
    """
    OpenTelemetry traces of the gateway's requests ([telemetry], DESIGN decision 48): off
    by default; on, they go as OTLP/HTTP (protobuf) to a collector on a Unix socket, since
    loopd opens no TCP connection (a collector on TCP gets a C{twist inferproxy} in front).
    Needs the C{telemetry} extra (C{pip install 'loopd[telemetry]'}).
    """

    enabled: bool = False
    """Make a trace of every request and export it (needs C{socket})."""
    service_name: str = "loopd"
    """The traces' C{service.name}."""
    socket: str | None = None
    """The Unix socket of the OTLP/HTTP collector (or of the inferproxy in front of it),
    C{~} expanded; needed when C{enabled}."""
    path: str = "/v1/traces"
    """The request target the spans are POSTed to (OTLP/HTTP's own by default)."""
    export_interval_ms: int = 5000
    """How often the spans gathered are sent, at most C{max_batch} per request (> 0)."""
    max_batch: int = 512
    """The most spans one request carries; more wait for the next (1 to C{max_queue})."""
    max_queue: int = 2048
    """The most spans kept while the collector is slow or away; beyond, the oldest are
    dropped and counted (> 0)."""
    export_timeout_ms: int = 10_000
    """How long one export may take, connecting included, before it is abandoned and its
    spans dropped (> 0)."""
    stop_wait_ms: int = 2000
    """When loopd stops, how long it waits for the spans left to be sent (>= 0)."""
    session_ids: Literal["hash", "plain"] = "hash"
    """How a span names its session: C{hash}, the first 16 hex digits of the id's SHA-256
    (a pseudonym: the same session keeps it, the id is not in the trace); C{plain}, the id
    as the agent sent it (as the log and C{/v1/status} show it)."""


@dataclass(frozen=True, kw_only=True)
class Capture:
    """
    Request capture ([capture], DESIGN decision 48): off unless C{dir} is set. Prompts and
    answers are written only with C{prompts = true}.
    """

    dir: str | None = None
    """The directory of the capture files, C{~} expanded: yours, mode 0700 (made so when it
    is missing and its parent is safe), else loopd refuses to start. None: no capture."""
    max_bytes: int = 256 * 1024**2
    """The capture files' disk budget: beyond it the oldest files are deleted (> 0)."""
    prompts: bool = False
    """Also write each request's body as the agent sent it and the answer's text, reasoning
    and tool calls. False: a line has the request's figures and no text at all."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole of loopd.toml."""

    endpoints: tuple[Endpoint, ...]
    """At least one endpoint, in file order, names unique."""
    max_tokens: int = 8192
    """The backstop on generated tokens per request (> 0)."""
    cache_loss_tokens: int = 64
    """A turn whose cache reuse falls short by more than this is a cache loss (>= 0)."""
    limits: Limits = field(default_factory=Limits)
    """The waits and the queue bound."""
    thinking: Thinking = field(default_factory=Thinking)
    """The thinking cap."""
    retry: Retry = field(default_factory=Retry)
    """The retry schedule."""
    caps: Caps = field(default_factory=Caps)
    """The HTTP client's size caps."""
    sampling: Sampling = field(default_factory=Sampling)
    """Sampling settings; only the ones set are sent upstream."""
    server: Server = field(default_factory=Server)
    """The gateway's listener."""
    queue: Queue = field(default_factory=Queue)
    """The lease scheduler."""
    mesh: Mesh = field(default_factory=Mesh)
    """The mixture of agents."""
    health: HealthProbe = field(default_factory=HealthProbe)
    """The endpoints' health probe."""
    doors: Doors = field(default_factory=Doors)
    """The front doors."""
    telemetry: Telemetry = field(default_factory=Telemetry)
    """OpenTelemetry traces, off by default."""

    capture: Capture = field(default_factory=Capture)
    """Request capture."""

    def endpoint(self, name: str) -> Endpoint:
        """Return the endpoint called C{name}; raise KeyError if there is none."""
        for endpoint in self.endpoints:
            if endpoint.name == name:
                return endpoint
        raise KeyError(name)

    @property
    def groups(self) -> tuple[str, ...]:
        """The endpoint groups' names, each once, in the order of their first member."""
        return tuple(dict.fromkeys(e.group for e in self.endpoints if e.group is not None))

    def members(self, group: str) -> tuple[Endpoint, ...]:
        """The endpoints of group C{group}, in file order; empty for a name no group has."""
        return tuple(e for e in self.endpoints if e.group == group)
