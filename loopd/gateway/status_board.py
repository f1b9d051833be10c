# -*- test-case-name: loopd.test.test_gateway_status_board -*-
"""
What C{/v1/status} says of the gateway's past (DESIGN decision 48): a watcher of its
activity (L{loopd.gateway.activity}) that keeps, within fixed bounds,

 - each session's figures: the agent that named it, its turns, the prompt tokens the
   server reused and evaluated and the tokens generated, the prefill time the reuse saved,
   its thinking caps, its errors, when it was last seen and its home endpoint (where its
   last completion ran, so where its cache is);
 - each endpoint slot's last session and the tokens its cache holds, and which slots run
   a request now;
 - the last requests (door, session, model, status, tokens, times, error: never text);
 - the requests and mesh turns under way;
 - a minute-by-minute series over the last hour of tokens generated and of cache reuse,
   for the page's plot.

The prefill time saved is estimated: the tokens reused divided by the endpoint's measured
prompt speed as it stood before the request (L{loopd.gateway.grace.PrefillSpeed}, the
estimator the grace prices switches with: the prompt tokens the endpoint's requests
evaluated over the time they took, recent ones weighing more), else unknown (counted as none
saved). The board writes it on the call's record (C{CallRecord.saved_seconds}), where the
answer's cache report reads it. A request's own speed is not used for its own saving:
measured on a few tokens at the end of a long context it is far below the speed of
evaluating that context from the start (an agent's 17,529 reused tokens came out at 6.8 s by
its own speed; the cold prefill of that prompt took 2.3 s), and a long prompt's tokens,
weighing most in the sum, set the endpoint's speed. Pure: no I/O, no clock of its own (the
records carry the times).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from loopd.gateway.activity import ActivityWatcher, CallRecord, RequestRecord
from loopd.gateway.grace import PrefillSpeed
from loopd.gateway.sessions import DEFAULT_MAX_SESSIONS
from loopd.llama.types import Timings

__all__ = [
    "MAX_UNDER_WAY",
    "RECENT_REQUESTS",
    "SERIES_MINUTES",
    "SessionFigures",
    "StatusBoard",
    "saved_seconds",
]

#: How many finished requests the board lists.
RECENT_REQUESTS = 50
#: How many minutes the series covers.
SERIES_MINUTES = 60
#: The weight of a new sample in an endpoint's running mean of generation speeds.
_SPEED_WEIGHT = 0.3
#: The most requests the board lists as under way (a safety bound: each ends its record).
MAX_UNDER_WAY = 10_000


@dataclass
class SessionFigures:
    """
    One session's figures since loopd started (or since the board last forgot it).

    @ivar last_seen: the wall clock's time of its last request's arrival.
    @ivar home: the endpoint of its last completion.
    """

    agent: str | None = None
    anonymous: bool = False
    turns: int = 0
    reused_tokens: int = 0
    evaluated_tokens: int = 0
    generated_tokens: int = 0
    saved_seconds: float = 0.0
    thinking_capped: int = 0
    errors: int = 0
    last_seen: float = 0.0
    home: str | None = None

    def as_json(self, session: str) -> dict[str, Any]:
        """The session's entry of the status document."""
        prompt = self.reused_tokens + self.evaluated_tokens
        return {
            "id": session,
            "agent": self.agent,
            "anonymous": self.anonymous,
            "turns": self.turns,
            "reused_tokens": self.reused_tokens,
            "evaluated_tokens": self.evaluated_tokens,
            "generated_tokens": self.generated_tokens,
            "reuse": round(self.reused_tokens / prompt, 4) if prompt else None,
            "saved_seconds": round(self.saved_seconds, 3),
            "thinking_capped": self.thinking_capped,
            "errors": self.errors,
            "last_seen": self.last_seen,
            "home": self.home,
        }


@dataclass
class _Minute:
    """One minute of the series."""

    generated: int = 0
    reused: int = 0
    evaluated: int = 0


@dataclass(frozen=True)
class _Slot:
    """An endpoint slot's last session and the tokens its cache holds after it."""

    session: str
    holder: str
    cached: int


def saved_seconds(timings: Timings, speed: float | None) -> float:
    """
    The prefill seconds C{timings}' reused tokens saved at C{speed}, the endpoint's prompt
    tokens per second (L{PrefillSpeed}); none when it is not known.
    """
    if not speed or speed <= 0:
        return 0.0
    return timings.cache_n / speed


class StatusBoard(ActivityWatcher):
    """
    The gateway's past, as L{loopd.gateway.status} reports it; see the module docstring.
    """

    def __init__(
        self,
        recent: int = RECENT_REQUESTS,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        minutes: int = SERIES_MINUTES,
    ) -> None:
        """
        @param recent: how many finished requests to list.
        @param max_sessions: how many sessions to keep figures for (the least recently
            seen is forgotten first).
        @param minutes: how many minutes the series covers.
        """
        self._max_sessions = max_sessions
        self._minutes = minutes
        self.sessions: OrderedDict[str, SessionFigures] = OrderedDict()
        self._recent: deque[dict[str, Any]] = deque(maxlen=recent)
        self._running: dict[tuple[str, int], tuple[str, str]] = {}
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._prompt_speed: dict[str, PrefillSpeed] = {}
        self._generation_speed: dict[str, float] = {}
        self._under_way: dict[int, RequestRecord] = {}
        self._series: OrderedDict[int, _Minute] = OrderedDict()
        self.requests = 0
        self.totals = SessionFigures()

    # -- the watcher's steps ----------------------------------------------------------

    def request_started(self, record: RequestRecord) -> None:
        """Count the request under way; its session was seen now."""
        self._under_way[record.id] = record
        if len(self._under_way) > MAX_UNDER_WAY:
            del self._under_way[next(iter(self._under_way))]
        if record.session:
            figures = self._session(record.session)
            figures.last_seen = record.wall_started
            figures.anonymous = record.anonymous
            if record.agent:
                figures.agent = record.agent

    def call_sent(self, record: RequestRecord, call: CallRecord) -> None:
        """C{call}'s slot runs a request now."""
        if call.slot is not None:
            self._running[(call.endpoint, call.slot)] = (record.session, call.holder)

    def call_ended(self, record: RequestRecord, call: CallRecord) -> None:
        """
        C{call}'s slot is free again; a completed call's counts go to its session, its
        endpoint's speeds, its slot's cache and the series.
        """
        if call.slot is not None:
            self._running.pop((call.endpoint, call.slot), None)
        timings = call.timings
        if timings is None:
            return
        prefill = self._prompt_speed.setdefault(call.endpoint, PrefillSpeed())
        saved = saved_seconds(timings, prefill.value)
        call.saved_seconds = saved
        prefill.add(timings)
        if timings.predicted_per_second:
            self._generation_speed[call.endpoint] = _mean(
                self._generation_speed.get(call.endpoint), timings.predicted_per_second
            )
        if call.slot is not None:
            self._slots[(call.endpoint, call.slot)] = _Slot(
                record.session, call.holder, timings.total
            )
        for figures in self._figures_of(record):
            figures.reused_tokens += timings.cache_n
            figures.evaluated_tokens += timings.prompt_n
            figures.generated_tokens += timings.predicted_n
            figures.saved_seconds += saved
            figures.thinking_capped += int(call.thinking_capped)
            figures.home = call.endpoint
        ended_at = record.wall_started + ((call.ended or record.started) - record.started)
        minute = self._minute(int(ended_at // 60))
        minute.generated += timings.predicted_n
        minute.reused += timings.cache_n
        minute.evaluated += timings.prompt_n

    def request_ended(self, record: RequestRecord) -> None:
        """List the request; count its turn or its error."""
        self._under_way.pop(record.id, None)
        self.requests += 1
        for figures in self._figures_of(record):
            if record.outcome == "ok":
                figures.turns += 1
            elif record.outcome != "client_gone":
                figures.errors += 1
        self._recent.append(request_entry(record))

    # -- what the document reads ------------------------------------------------------

    def recent(self) -> list[dict[str, Any]]:
        """The last requests, the newest first."""
        return list(reversed(self._recent))

    def under_way(self) -> list[RequestRecord]:
        """The requests under way, the oldest first."""
        return list(self._under_way.values())

    def slot(self, endpoint: str, slot: int) -> tuple[bool, str | None, str, int]:
        """
        C{endpoint}'s C{slot}: whether a request runs on it, the session it serves or
        served last (C{None}: nobody yet), that session's lease key, and the tokens its
        cache holds after the last completion there.
        """
        last = self._slots.get((endpoint, slot))
        cached = last.cached if last is not None else 0
        running = self._running.get((endpoint, slot))
        if running is not None:
            return True, running[0], running[1], cached
        if last is None:
            return False, None, "", 0
        return False, last.session, last.holder, cached

    def prompt_speed(self, endpoint: str) -> float | None:
        """C{endpoint}'s measured prompt speed, tokens per second; C{None} before one."""
        prefill = self._prompt_speed.get(endpoint)
        return None if prefill is None else prefill.value

    def speeds(self, endpoint: str) -> tuple[float | None, float | None]:
        """C{endpoint}'s measured prompt and generation speeds, tokens per second."""
        return self.prompt_speed(endpoint), self._generation_speed.get(endpoint)

    def series(self, now: float) -> dict[str, Any]:
        """
        The last hour, a point per minute ending with C{now}'s (wall clock): the minute's
        start, tokens generated per second over it, and the share of its prompt tokens the
        cache reused (C{None} for a minute without prompts).
        """
        last = int(now // 60)
        starts, rates, reuse = [], [], []
        for index in range(last - self._minutes + 1, last + 1):
            minute = self._series.get(index, _Minute())
            prompt = minute.reused + minute.evaluated
            starts.append(index * 60)
            rates.append(round(minute.generated / 60.0, 3))
            reuse.append(round(minute.reused / prompt, 4) if prompt else None)
        return {"minute_starts": starts, "tokens_per_second": rates, "reuse": reuse}

    def session_list(self) -> list[dict[str, Any]]:
        """Every session's entry, the most recently seen first."""
        return [f.as_json(s) for s, f in reversed(self.sessions.items())]

    # -- bookkeeping ------------------------------------------------------------------

    def _session(self, session: str) -> SessionFigures:
        """C{session}'s figures, made if new, as the most recently seen."""
        figures = self.sessions.pop(session, None) or SessionFigures()
        self.sessions[session] = figures
        while len(self.sessions) > self._max_sessions:
            self.sessions.popitem(last=False)
        return figures

    def _figures_of(self, record: RequestRecord) -> Iterable[SessionFigures]:
        """The figures a request counts in: the totals, and its session's if it has one."""
        yield self.totals
        if record.session:
            yield self._session(record.session)

    def _minute(self, index: int) -> _Minute:
        """The series' minute C{index} (minutes since the epoch); minutes too old go."""
        minute = self._series.get(index)
        if minute is None:
            minute = self._series[index] = _Minute()
            while self._series and next(iter(self._series)) <= index - self._minutes:
                self._series.popitem(last=False)
        return minute


def request_entry(record: RequestRecord) -> dict[str, Any]:
    """A finished request's entry of the document's list: figures and times, no text."""
    totals = record.totals()
    started = record.started

    def since(at: float | None) -> float | None:
        return None if at is None else round(at - started, 3)

    waits = [c.lease_wait for c in record.calls if c.lease_wait is not None]
    return {
        "id": record.id,
        "door": record.door,
        "session": record.session or None,
        "agent": record.agent,
        "model": record.model,
        "endpoint": record.endpoint,
        "mesh": record.mesh,
        "stream": record.stream,
        "status": record.status,
        "outcome": record.outcome,
        "error": _public_error(record),
        "started": record.wall_started,
        "seconds": since(record.ended),
        "first_token_seconds": since(record.first_token),
        "lease_wait_seconds": round(sum(waits), 3) if waits else None,
        "calls": len(record.calls),
        "retries": sum(c.retries for c in record.calls),
        "thinking_capped": any(c.thinking_capped for c in record.calls),
        "reused_tokens": totals.cache_n,
        "evaluated_tokens": totals.prompt_n,
        "generated_tokens": totals.predicted_n,
    }


def _public_error(record: RequestRecord) -> str | None:
    """
    A failed request's message as the status lists it: loopd's own words, but never the
    model server's text (it may quote the prompt or the answer), which only its code and
    a note stand for.
    """
    if record.error is None or not record.error_from_server:
        return record.error
    return f"the model server's error ({record.outcome}); its text is left out here"


def _mean(old: float | None, new: float) -> float:
    """A running mean: C{new} the first time, then weighted by L{_SPEED_WEIGHT}."""
    return new if old is None else old + _SPEED_WEIGHT * (new - old)
