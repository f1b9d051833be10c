"""
Tests for L{loopd.status_show}: fixed status documents and the text C{loopd status} prints
for them, and any JSON at all printed without an error.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.status_show import REQUESTS_SHOWN, SESSIONS_SHOWN, render_document

NOW = 1_700_007_384.0


def request(number: int, **changes: Any) -> dict[str, Any]:
    """A finished request's entry of the document, C{number} seconds before L{NOW}."""
    entry = {
        "id": number,
        "door": "chat",
        "session": "s1",
        "agent": "pi/0.9",
        "model": None,
        "endpoint": "tiny",
        "mesh": False,
        "stream": True,
        "status": 200,
        "outcome": "ok",
        "error": None,
        "started": NOW - number,
        "seconds": 1.5,
        "first_token_seconds": 0.25,
        "lease_wait_seconds": 0.0,
        "calls": 1,
        "retries": 0,
        "thinking_capped": False,
        "reused_tokens": 12000,
        "evaluated_tokens": 40,
        "generated_tokens": 300,
    }
    entry.update(changes)
    return entry


DOCUMENT: dict[str, Any] = {
    "loopd": {"version": "1.2.0", "started": NOW - 7384, "now": NOW},
    "endpoints": [
        {
            "name": "tiny",
            "kind": "llama-server",
            "model": "qwen3-0.6b",
            "health": "up",
            "why": "a request was answered",
            "prompt_tokens_per_second": 1234.5,
            "generation_tokens_per_second": 50.0,
            "slots": [
                {"id": 0, "state": "running", "session": "s1", "tokens_cached": 12340},
                {"id": 1, "state": "grace", "session": "s2", "tokens_cached": 800},
                {"id": 2, "state": "idle", "session": None, "tokens_cached": 0},
            ],
        },
        {
            "name": "big",
            "kind": "openai",
            "model": "big",
            "health": "down",
            "why": "connection refused",
            "prompt_tokens_per_second": None,
            "generation_tokens_per_second": None,
            "slots": [{"id": 0, "state": "idle", "session": None, "tokens_cached": 0}],
        },
    ],
    "sessions": [
        {
            "id": "s1",
            "agent": "pi/0.9",
            "anonymous": False,
            "turns": 14,
            "reused_tokens": 152000,
            "evaluated_tokens": 3100,
            "generated_tokens": 5000,
            "reuse": 0.98,
            "saved_seconds": 123.456,
            "thinking_capped": 2,
            "errors": 1,
            "last_seen": NOW - 5,
            "home": "tiny",
        },
        {
            "id": "conn-7",
            "agent": None,
            "anonymous": True,
            "turns": 1,
            "reused_tokens": 0,
            "evaluated_tokens": 50,
            "generated_tokens": 8,
            "reuse": 0.0,
            "saved_seconds": 0.0,
            "thinking_capped": 0,
            "errors": 0,
            "last_seen": NOW - 3725,
            "home": None,
        },
    ],
    "leases": [
        {
            "queueKey": "tiny",
            "maxStreams": 3,
            "switches": 4,
            "holders": [
                {"sessionKey": "s1", "role": "parent", "group": None},
                {"sessionKey": "s2", "role": "child", "group": None},
            ],
            "waiting": [{"sessionKey": "s3", "role": "parent", "group": None}],
        }
    ],
    "in_flight": [
        {
            "id": 16,
            "door": "messages",
            "session": "s1",
            "agent": "claude-cli/2.0",
            "model": "tiny",
            "mesh": False,
            "seconds": 2.25,
            "calls": [
                {
                    "endpoint": "tiny",
                    "role": "answer",
                    "slot": 0,
                    "waiting_for_lease": False,
                    "ended": False,
                }
            ],
        },
        {
            "id": 17,
            "door": "chat",
            "session": "s3",
            "agent": None,
            "model": "mesh",
            "mesh": True,
            "seconds": 0.5,
            "calls": [
                {
                    "endpoint": "tiny",
                    "role": "worker",
                    "slot": None,
                    "waiting_for_lease": True,
                    "ended": False,
                },
                {
                    "endpoint": "big",
                    "role": "worker",
                    "slot": None,
                    "waiting_for_lease": False,
                    "ended": True,
                },
            ],
        },
    ],
    "mesh_turns": 1,
    "requests": [
        request(15, thinking_capped=True),
        request(
            14,
            session="s2",
            model="big",
            endpoint="big",
            status=503,
            outcome="endpoint_unavailable",
            error="endpoint big is down",
            seconds=0.0,
            reused_tokens=0,
            evaluated_tokens=0,
            generated_tokens=0,
        ),
    ],
    "totals": {
        "requests": 15,
        "reused_tokens": 152000,
        "evaluated_tokens": 3150,
        "generated_tokens": 5008,
        "reuse": 0.9797,
        "saved_seconds": 123.456,
        "thinking_capped": 2,
        "errors": 1,
    },
    "series": {"minute_starts": [], "tokens_per_second": [], "reuse": []},
}

TEXT = """\
loopd 1.2.0, up 2h03m

endpoints
  tiny  llama-server  model qwen3-0.6b  up  prompt 1,234.5 tokens/s  generation 50.0 tokens/s
    slot 0  running  s1  12,340 tokens cached
    slot 1  grace    s2  800 tokens cached
    slot 2  idle     -   0 tokens cached
  big  openai  model big  down (connection refused)
    slot 0  idle  -  0 tokens cached

sessions (2)
  SESSION             AGENT   TURNS   REUSED   EVAL  REUSE   SAVED  CAPS  ERRORS  SEEN       HOME
  s1                  pi/0.9     14  152,000  3,100    98%  123.5s     2       1  5s ago     tiny
  conn-7 (anonymous)  -           1        0     50     0%    0.0s     0       0  1h02m ago  -

lease queues
  tiny: 2/3 slots, switches 4
    holding  s1 parent
    holding  s2 child
    waiting  1 (parent 1, child 0), in enqueue order:
      1. s3 parent

in flight (2; mesh turns 1)
  #16  messages  s1  tiny  2.2s  tiny slot 0
  #17  chat      s3  mesh  0.5s  tiny (worker) waiting for a lease, big (worker) ended

last requests (2 of 2 kept)
  ID      AGO  DOOR  SESSION  MODEL        STATUS  REUSED  EVAL  GEN   TIME  OUTCOME
  15  15s ago  chat  s1       tiny (auto)     200  12,000    40  300  1.50s  ok, thinking capped
  14  14s ago  chat  s2       big             503       0     0    0  0.00s  endpoint_unavailable
        endpoint big is down

totals
  requests 15, errors 1, thinking caps 2
  prompt tokens 152,000 reused, 3,150 evaluated (98% reused); generated 5,008; prefill saved 123.5s
"""


class RenderTests(SynchronousTestCase):
    """The text of fixed documents."""

    def test_document(self) -> None:
        """A document with every section is printed as a person reads it."""
        self.assertEqual(render_document(DOCUMENT), TEXT)

    def test_empty_gateway(self) -> None:
        """A gateway that has served nothing yet says so in each section."""
        document = copy.deepcopy(DOCUMENT)
        document.update(sessions=[], leases=[], in_flight=[], mesh_turns=0, requests=[])
        text = render_document(document)
        self.assertIn("sessions (0)\n  none yet\n", text)
        self.assertIn("lease queues\n  no queues yet", text)
        self.assertIn("in flight (0; mesh turns 0)\n  nothing\n", text)
        self.assertIn("last requests (0 of 0 kept)\n  none yet\n", text)

    def test_no_leases(self) -> None:
        """A loopd without leases (C{leases: null}) says it takes none."""
        document = {**DOCUMENT, "leases": None}
        self.assertIn(
            "lease queues\n  none: this loopd takes no leases\n", render_document(document)
        )

    def test_shown_at_most(self) -> None:
        """At most L{REQUESTS_SHOWN} requests and L{SESSIONS_SHOWN} sessions; the rest counted."""
        session = DOCUMENT["sessions"][0]
        sessions = [{**session, "id": f"s{n}"} for n in range(SESSIONS_SHOWN + 5)]
        requests = [request(n) for n in range(50)]
        text = render_document({**DOCUMENT, "sessions": sessions, "requests": requests})
        self.assertIn(f"sessions ({SESSIONS_SHOWN + 5})", text)
        self.assertIn("  ... and 5 more\n", text)
        self.assertIn(f"last requests ({REQUESTS_SHOWN} of 50 kept)", text)
        self.assertIn("\n   9  9s ago", text)
        self.assertNotIn("\n  10  10s ago", text)

    def test_long_and_hostile_names(self) -> None:
        """
        A long session id is cut (the cut marked); a newline or an escape sequence in an
        agent's id never reaches the terminal.
        """
        session = {**DOCUMENT["sessions"][0], "id": "x" * 40, "agent": "evil\x1b[2J\nagent\x9b"}
        document = {
            **DOCUMENT,
            "sessions": [session],
            "requests": [request(1, session="a\x1b]0;title\x07b")],
        }
        document["leases"] = [{**DOCUMENT["leases"][0], "holders": [{"sessionKey": "\x1bq"}]}]
        text = render_document(document)
        self.assertIn("x" * 21 + "...", text)
        self.assertNotIn("x" * 24, text)
        self.assertIn("evil [2J agent ", text)
        for control in ("\x1b", "\x07", "\x9b"):
            self.assertNotIn(control, text)
        self.assertEqual(text.count("\n"), len(text.splitlines()))

    def test_durations(self) -> None:
        """Ages and the uptime read in two units at most."""
        for seconds, shown in [
            (0, "0s"),
            (59.9, "59s"),
            (187, "3m07s"),
            (7384, "2h03m"),
            (4 * 86400 + 3600, "4d01h"),
        ]:
            document = {"loopd": {"version": "1", "started": NOW - seconds, "now": NOW}}
            self.assertEqual(render_document(document).splitlines()[0], f"loopd 1, up {shown}")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=25,
)
KEYS = [
    "loopd",
    "endpoints",
    "sessions",
    "leases",
    "in_flight",
    "mesh_turns",
    "requests",
    "totals",
]


def mangled(document: dict[str, Any]) -> st.SearchStrategy[Any]:
    """L{DOCUMENT} with some of its values, at any depth, replaced by any JSON."""

    def replace(value: Any) -> st.SearchStrategy[Any]:
        if isinstance(value, dict):
            fields = {k: replace(v) for k, v in value.items()}
            return json_values | st.fixed_dictionaries(fields)
        if isinstance(value, list):
            return json_values | st.tuples(*[replace(v) for v in value]).map(list)
        return json_values | st.just(value)

    return replace(document)


class AnyDocumentTests(SynchronousTestCase):
    """Whatever a socket answers, the text is printed, never an error."""

    @settings(max_examples=300)
    @given(st.dictionaries(st.sampled_from(KEYS), json_values) | json_values)
    def test_any_json(self, document: Any) -> None:
        """Any JSON value renders to text."""
        self.assertIsInstance(render_document(document), str)

    @settings(max_examples=300)
    @given(mangled(DOCUMENT))
    def test_any_field(self, document: Any) -> None:
        """A real document with any of its fields, at any depth, of another type renders."""
        self.assertIsInstance(render_document(document), str)
