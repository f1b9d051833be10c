# -*- test-case-name: loopd.test.test_llama_client -*-
"""
L{Client}: the llama client's front, one per endpoint. A chat goes through the slot gate,
then L{ChatCall}; C{chat_with_retry} repeats what is worth repeating. C{health}, C{props},
C{slots} and C{tokenize} ask the server about itself; C{save_slot} and C{restore_slot} write a
slot's KV cache to a file of the server's C{--slot-save-path} and load it back
(L{loopd.llama.slot_files}).

Every connection the client makes to its endpoint, chats, C{/slots} polls, the
reasoning_end control, C{/props}, C{/health}, C{/tokenize}, goes through the endpoint's
L{Pacer} (L{loopd.llama.pacing}), so loopd stays under the accept limits of the endpoint's
inferproxy. The C{/slots} polls of its waiting chats share one poll in flight, as do
concurrent C{health} checks (L{SharedRequest}).

A chat that does not wait for its slot makes one connection: the request itself. A chat
whose answer has not started after C{poll_ms} shares a C{/slots} poll per C{poll_ms}; a chat
whose prompt is silent until shortly before C{liveness_ms} shares one then, and one per
C{liveness_ms} less C{poll_ms} while C{/slots} shows it processing (L{ChatCall}); a chat
that reaches the thinking cap makes one more for the control, and a resumed answer one
C{/apply-template} per continuation. Nothing else is asked per request (C{/props} is asked
once at start).
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from loopd import http
from loopd.errors import Protocol, Stalled
from loopd.llama.chat import ChatCall, EventSink
from loopd.llama.flow import Flow
from loopd.llama.gate import ISlotGate, SlotGate
from loopd.llama.info import (
    Health,
    SharedRequest,
    SlotState,
    check_health,
    count_tokens,
    get_json,
    parse_slots,
)
from loopd.llama.pacing import PacedOpener, Pacer
from loopd.llama.request import chat_body, chat_max_tokens
from loopd.llama.resume import (
    Continued,
    Delivered,
    continuation,
    merge,
    resume_plan,
    resume_refusal,
)
from loopd.llama.retry import is_retryable, with_retry
from loopd.llama.router import RouterModel, model_path, parse_router_models
from loopd.llama.slot_files import (
    SlotAction,
    SlotFile,
    check_filename,
    parse_slot_file,
    slot_action_path,
)
from loopd.llama.types import ChatEvent, ChatRequest, Completion
from loopd.reactor import IUnixReactor
from loopd.settings import Config, Endpoint

__all__ = ["Client"]

#: How many times the JSON body sent to C{/apply-template} its answer may be: the prompt
#: is about the messages, and JSON escapes (C{\u0001}: six bytes for one) at most this.
_PROMPT_GROWTH = 6

_log = Logger(namespace="loopd.llama.client")


class Client:
    """
    Talks to one endpoint's server over its Unix socket.

    @ivar config: the limits and request settings in force.
    @ivar endpoint: the server this client talks to.
    @ivar gate: the slot gate every chat passes; by default one in flight per slot.
    @ivar pacer: the pacing of every connection to the endpoint (L{Pacer}).
    """

    def __init__(
        self,
        reactor: IUnixReactor,
        config: Config,
        endpoint: Endpoint,
        gate: ISlotGate | None = None,
        random: Callable[[], float] = _random.random,
        pacer: Pacer | None = None,
    ) -> None:
        """
        @param reactor: provides IReactorTime and IReactorUNIX; every wait uses it.
        @param config: the limits and request settings.
        @param endpoint: the server to talk to.
        @param gate: where chats wait for their slot; a L{SlotGate} of
            C{limits.queue_depth} when not given.
        @param random: the jitter source of retries, returning floats in [0, 1).
        @param pacer: the pacing of the endpoint's inferproxy, shared by the clients of the
            models of one router (one socket, one inferproxy); a new one when not given.
        """
        self._reactor = reactor
        self.config = config
        self.endpoint = endpoint
        self.gate = gate if gate is not None else SlotGate(config.limits.queue_depth)
        self._random = random
        self._caps = http.HttpCaps(config.caps.header_bytes, config.caps.body_bytes)
        self.pacer = pacer if pacer is not None else Pacer.for_endpoint(reactor, endpoint)
        self._open: http.Opener = PacedOpener(reactor, endpoint, self.pacer)
        self._slots_poll = SharedRequest(self._poll_slots)
        self._health = SharedRequest(self._check_health)

    def chat(
        self, request: ChatRequest, on_event: EventSink, *, flow: Flow | None = None
    ) -> Deferred[Completion]:
        """
        One attempt: wait for the slot gate, then run the request. Cancelling the Deferred
        leaves the gate's queue or aborts the request.

        @param flow: the consumer's flow control (L{Flow}): its stream attaches to it, so
            that pausing the flow pauses reading the answer and suspends the liveness limit.
            Without one the answer is read as fast as the server sends it.
        """
        waiting = self.gate.acquire(request.slot, on_event)
        running: list[Deferred[Completion]] = []

        def go(grant: Any) -> Deferred[Completion]:
            """
            The slot is granted: run the request, keeping the call for the canceller, and release
            the grant however the call ends.
            """
            call = ChatCall(
                self._reactor,
                self.config,
                self.endpoint,
                request,
                on_event,
                flow,
                open_http=self._open,
                poll_slots=self._slots_poll,
            ).run()
            running.append(call)

            def release(result: object) -> object:
                grant.release()
                return result

            call.addBoth(release)
            return call

        def cancel(d: Deferred[Completion]) -> None:
            """
            Cancel the running call once the slot was granted, else leave the gate's queue.
            """
            if running:
                running[0].cancel()
            else:
                waiting.cancel()

        result: Deferred[Completion] = Deferred(cancel)
        outcome: Deferred[Any] = waiting.addCallback(go)
        outcome.chainDeferred(result)
        return result

    def chat_with_retry(
        self,
        request: ChatRequest,
        on_event: EventSink,
        retryable: Callable[[BaseException], bool] = is_retryable,
        *,
        flow: Flow | None = None,
    ) -> Deferred[Completion]:
        """
        L{chat}, repeated after the failures worth repeating (seed §4 "Retry"); each
        attempt goes back through the gate and a L{Retrying} event precedes it.

        A retry never repeats what reached C{on_event} (L{loopd.llama.resume}): while no
        piece of the answer was delivered the request is sent again as it was; after one, a
        C{llama-server} endpoint is sent the continuation of the partial answer and the
        completion is the whole answer, and any other case (an C{openai} endpoint, a tool
        call that had started) fails with the attempt's error instead of retrying.

        Before a continuation the server's template renders it (C{POST /apply-template},
        one request per resume): a prompt that ends with the delivered text is continued
        from it; a cut thought it does not leave open is closed and the answer asked for;
        cut content it does not end with is not resumed, and the answer fails with the
        error that cut it (L{resume_plan}). What the continuation streams passes
        L{Continued}: the server's echo of the prefill, and reasoning after a closed
        thought, reach neither C{on_event} nor the completion.

        @param retryable: which failures are worth repeating; L{is_retryable} unless the
            caller narrows it (the mesh does not retry a refused connection: a dead worker
            must fail at once, DESIGN decision 29).
        @param flow: passed to every attempt (see L{chat}); each attempt's stream attaches
            to it in the state the flow is in at that time, paused or not.
        """
        delivered = Delivered()
        limit = chat_max_tokens(request, self.config)
        kind = self.endpoint.kind
        attempts = 0
        guard = Continued(delivered.prefix)
        failed: list[BaseException] = []
        refused = False

        def sink(event: ChatEvent) -> None:
            if guard.passes(event):
                delivered.observe(event)
                on_event(event)

        def attempt() -> Deferred[Completion]:
            nonlocal attempts, guard
            attempts += 1
            if attempts > 1:
                delivered.next_attempt()
            prefix = delivered.prefix
            if prefix.empty:
                guard = Continued(prefix)
                return self.chat(request, sink, flow=flow)
            asked = continuation(request, prefix, limit)
            rendered = self.apply_template(chat_body(asked, self.config, self.endpoint))

            def resume(prompt: str) -> Deferred[Completion]:
                nonlocal guard, refused
                plan = resume_plan(prefix, prompt)
                if plan == "refuse":
                    refused = True
                    _log.warn(
                        "{endpoint}: not resuming a partly delivered answer: the template's"
                        " prompt does not end with the content delivered",
                        endpoint=self.endpoint.name,
                    )
                    raise failed[-1]
                closed = plan == "close"
                guard = Continued(prefix, thought_closed=closed)
                again = continuation(request, prefix, limit, close_thought=closed)
                return self.chat(again, sink, flow=flow)

            return rendered.addCallback(resume)

        def worth_repeating(error: BaseException) -> bool:
            failed.append(error)
            if refused or not retryable(error):
                return False
            refusal = resume_refusal(delivered.partial(), kind, limit)
            if refusal is not None:
                _log.warn(
                    "{endpoint}: not retrying a partly delivered answer ({why}): {error}",
                    endpoint=self.endpoint.name,
                    why=refusal,
                    error=error,
                )
            return refusal is None

        running = with_retry(
            attempt,
            clock=self._reactor,
            policy=self.config.retry,
            on_event=on_event,
            random=self._random,
            retryable=worth_repeating,
        )
        return running.addCallback(
            lambda completion: merge(delivered.prefix, guard.completion(completion))
        )

    def _per_model(self, path: str) -> str:
        """C{path} naming the model when the endpoint is a router's model (C{?model=})."""
        model = self.endpoint.model
        return model_path(path, model) if self.endpoint.router and model else path

    def _model_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """C{body} naming the model when the endpoint is a router's model (C{model})."""
        model = self.endpoint.model
        return {"model": model, **body} if self.endpoint.router and model else body

    def unload_model(self) -> Deferred[None]:
        """
        Ask this endpoint's router to unload its model (C{POST /models/unload}), so that a
        load loopd lets happen evicts the model loopd chose; fails as L{get_json} does (an
        L{Http} 400 when it is not loaded).

        @raise ValueError: at once, for an endpoint that is no router's model.
        """
        if not (self.endpoint.router and self.endpoint.model):
            raise ValueError(f"{self.endpoint.name} is no router's model")
        answer = self._get("POST", "/models/unload", {"model": self.endpoint.model})
        return answer.addCallback(lambda value: None)

    def router_models(self) -> Deferred[tuple[RouterModel, ...]]:
        """
        The models a router knows and whether each is loaded (its C{GET /v1/models},
        L{parse_router_models}); fails as L{get_json} does, and with L{Protocol} for an
        answer of another shape.
        """
        answer = self._get("GET", "/v1/models")
        answer.addCallback(parse_router_models)
        return answer

    def _get(
        self,
        method: str,
        path: str,
        body: object = None,
        answer_bytes: Callable[[int], int] | None = None,
    ) -> Deferred[Any]:
        """
        One JSON request to this endpoint (L{get_json}), connecting within C{limits.poll_ms},
        its answer at most what C{answer_bytes} gives for the size of the body sent
        (default: the C{body_bytes} cap).
        """
        return get_json(
            self._open,
            method,
            path,
            body,
            caps=self._caps,
            connect_timeout=self.config.limits.poll_ms / 1000.0,
            answer_bytes=answer_bytes,
        )

    def _poll_slots(self) -> Deferred[Any]:
        """
        One C{/slots} poll for the waiting chats (their shared poll): its decoded answer,
        failing as L{get_json} does, or with a timeout after C{limits.poll_ms} (which aborts
        its connection).
        """
        polling = self._get("GET", self._per_model("/slots"))
        polling.addTimeout(self.config.limits.poll_ms / 1000.0, self._reactor)
        return polling

    def _check_health(self) -> Deferred[Health]:
        """
        One C{/health} check (L{check_health}), shared by concurrent callers. For a router's
        model the router answering is not enough: its C{/v1/models} must still list the
        model (L{_model_health}).
        """
        seconds = self.config.limits.poll_ms / 1000.0
        checking = check_health(
            self._reactor, self.endpoint, caps=self._caps, timeout=seconds, open_http=self._open
        )
        if not self.endpoint.router:
            return checking

        def listed(health: Health) -> Health | Deferred[Health]:
            return self._model_health(seconds) if health.ok else health

        return checking.addCallback(listed)

    def _model_health(self, seconds: float) -> Deferred[Health]:
        """
        A router's model's health: up while the router lists it (a model whose last load
        failed stays up, saying so: the next request loads it again), down once it does not,
        unreachable when the list does not come within C{seconds}.
        """
        asking = self.router_models()
        asking.addTimeout(seconds, self._reactor)

        def judged(models: tuple[RouterModel, ...]) -> Health:
            found = [m for m in models if m.id == self.endpoint.model]
            if not found:
                return Health(False, "the router no longer lists the model")
            if found[0].failed:
                return Health(True, f"ok ({found[0].status}; its last load failed)")
            return Health(True, f"ok ({found[0].status})")

        def failed(reason: Failure) -> Health | Failure:
            if reason.check(CancelledError):
                return reason
            return Health(False, f"unreachable: /v1/models: {reason.getErrorMessage()}")

        return asking.addCallbacks(judged, failed)

    def health(self) -> Deferred[Health]:
        """
        Whether the server is up: its C{GET /health}, within C{limits.poll_ms} for the
        connection and for the answer. A 200 is L{Health}C{(True, "ok")}, as is any answer
        of an C{openai}-kind endpoint; another status is C{(False, "HTTP <status>")}; no
        connection or no answer in time is C{(False, "unreachable: <why>")}, a refusal by
        the inferproxy C{(False, "refused by its inferproxy: <limit>")}. Checks asked while
        one runs share it. The Deferred never fails, except with C{CancelledError} when
        cancelled.
        """
        answer: Deferred[Health] = self._health()
        return answer

    def props(self) -> Deferred[dict[str, Any]]:
        """
        The server's C{/props}: chat template, per-slot context, number of slots.
        """
        answer = self._get("GET", self._per_model("/props"))
        answer.addCallback(_expect_object, "/props")
        return answer

    def slots(self) -> Deferred[tuple[SlotState, ...]]:
        """
        The server's C{/slots}: which slot is running a task.
        """
        answer = self._get("GET", self._per_model("/slots"))
        answer.addCallback(parse_slots)
        return answer

    def tokenize(self, text: str) -> Deferred[list[int]]:
        """
        The token ids of C{text} (special tokens parsed, none added).
        """
        body = self._model_body({"content": text, "add_special": False})
        answer = self._get("POST", "/tokenize", body)

        def tokens(value: object) -> list[int]:
            """
            The C{tokens} list of the answer; L{Protocol} for anything but an object holding a list
            of integers.
            """
            ids = _expect_object(value, "/tokenize").get("tokens")
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids
            ):
                raise Protocol("/tokenize did not answer a list of token ids")
            return ids

        answer.addCallback(tokens)
        return answer

    def apply_template(
        self, body: dict[str, Any], *, answer_bytes: Callable[[int], int] | None = None
    ) -> Deferred[str]:
        """
        The prompt the server's chat template makes of the chat-completions C{body}
        (C{POST /apply-template}), naming C{endpoint.model} when it is set, as a router
        needs. Fails as L{get_json} does (an L{Http} for a template that raised), and with
        L{Protocol} for an answer without a C{prompt}, or one over what C{answer_bytes}
        gives for the size of the body sent (default:
        the C{body_bytes} cap).
        """
        model = {"model": self.endpoint.model} if self.endpoint.model else {}
        answer = self._get("POST", "/apply-template", {**model, **body}, answer_bytes)

        def prompt(value: object) -> str:
            """The answer's C{prompt}."""
            text = _expect_object(value, "/apply-template").get("prompt")
            if not isinstance(text, str):
                raise Protocol("/apply-template did not answer a prompt")
            return text

        answer.addCallback(prompt)
        return answer

    def prompt_tokens(self, body: dict[str, Any]) -> Deferred[int]:
        """
        How many tokens the server's prompt for the chat-completions C{body} has: the
        prompt its chat template makes (L{apply_template}), tokenized as a completion
        tokenizes it (C{POST /tokenize}, special tokens parsed and added) and counted as
        the answer arrives (L{count_tokens}), so that a prompt of megabytes is counted, its
        ids never held. The template's answer may be as long as the prompt it makes, which
        is about the messages sent, escaped: it is read up to L{_PROMPT_GROWTH} times the
        body's size (at least the C{body_bytes} cap). Fails as L{tokenize} does, and as
        L{apply_template} does. Both requests name C{endpoint.model} when it is set, as a
        router needs.
        """
        model = {"model": self.endpoint.model} if self.endpoint.model else {}

        def tokenize(prompt: str) -> Deferred[int]:
            """Count the tokens of the template's prompt."""
            content = {"content": prompt, "add_special": True}
            return count_tokens(
                self._open,
                {**model, **content},
                caps=self._caps,
                connect_timeout=self.config.limits.poll_ms / 1000.0,
            )

        def prompt_bytes(sent: int) -> int:
            """The most bytes the template's answer for a body of C{sent} bytes may have."""
            return max(self._caps.body_bytes, _PROMPT_GROWTH * sent + 65536)

        return self.apply_template(body, answer_bytes=prompt_bytes).addCallback(tokenize)

    def save_slot(self, slot: int, filename: str) -> Deferred[SlotFile]:
        """
        Write C{slot}'s KV cache to C{filename} under the server's C{--slot-save-path}
        (C{POST /slots/<slot>?action=save}). See L{restore_slot} for the waits and failures.
        """
        return self._slot_file("save", slot, filename)

    def restore_slot(self, slot: int, filename: str) -> Deferred[SlotFile]:
        """
        Load C{filename} (written by L{save_slot}) into C{slot}'s KV cache
        (C{POST /slots/<slot>?action=restore}).

        Like a chat, the request waits at the slot gate for C{slot} and goes through the
        endpoint's pacing; it connects within C{limits.poll_ms} and must be answered within
        C{limits.liveness_ms} (the server answers when the file is written or read).

        @return: fires with what the server did (L{SlotFile}); fails with L{Http} for an error
            status (501: the server has no C{--slot-save-path}; 400: no such file, or no room
            in the KV cache), L{Stalled} for no answer in time, L{Protocol} for an answer of
            another shape, and as a chat does for the gate, the pacing and the connection.
            Cancelling it leaves the gate's queue or aborts the request.
        @raise ValueError: at once, for a negative slot or an unsafe file name
            (L{check_filename}).
        """
        return self._slot_file("restore", slot, filename)

    def _slot_file(self, action: SlotAction, slot: int, filename: str) -> Deferred[SlotFile]:
        """L{save_slot} or L{restore_slot}: the gate, then the request, then the release."""
        path = slot_action_path(slot, action)
        body = self._model_body({"filename": check_filename(filename)})
        waiting = self.gate.acquire(slot, _no_events)
        limit_ms = self.config.limits.liveness_ms

        def go(grant: Any) -> Deferred[SlotFile]:
            """The slot is ours: ask the server, give the slot back however it ends."""
            asking = self._get("POST", path, body)
            asking.addTimeout(limit_ms / 1000.0, self._reactor, _stalled(action, limit_ms))
            asking.addCallback(parse_slot_file, action)

            def release(result: object) -> object:
                grant.release()
                return result

            asking.addBoth(release)
            return asking

        answer: Deferred[SlotFile] = waiting.addCallback(go)
        return answer


def _no_events(event: ChatEvent) -> None:
    """The gate's events for a slot-file request: nobody listens."""


def _stalled(action: str, limit_ms: int) -> Callable[[object, float], object]:
    """The C{onTimeoutCancel} of a slot-file request: no answer in time is L{Stalled}."""

    def timed_out(result: object, timeout: float) -> object:
        if isinstance(result, Failure) and result.check(CancelledError):
            return Failure(Stalled(f"slot {action} gave no answer within {limit_ms} ms"))
        return result

    return timed_out


def _expect_object(value: object, path: str) -> dict[str, Any]:
    """
    C{value} itself if it is a JSON object; else L{Protocol}, naming C{path}.
    """
    if not isinstance(value, dict):
        raise Protocol(f"{path} did not answer a JSON object")
    return value
