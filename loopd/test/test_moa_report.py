"""
Tests for L{loopd.moa.report}: the mesh turn's ids and its C{x-moa-*} headers.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.moa.report import (
    TurnLabel,
    TurnReport,
    call_id,
    moa_headers,
    moa_id,
)


class IdTests(SynchronousTestCase):
    """'"chatcmpl-moa-" + hex(nanoseconds since epoch)' and '"call_"+hex(nanos)' (§1.12)."""

    def test_moa_id(self) -> None:
        """The completion id is the prefix plus the nanoseconds in lowercase hex."""
        self.assertEqual(moa_id(0xABCDEF0123), "chatcmpl-moa-abcdef0123")

    def test_call_id(self) -> None:
        """The tool call id is C{call_} plus the nanoseconds in lowercase hex."""
        self.assertEqual(call_id(0xDEADBEEF), "call_deadbeef")

    def test_zero(self) -> None:
        """Zero nanoseconds is C{0} in hex, not an empty suffix."""
        self.assertEqual((moa_id(0), call_id(0)), ("chatcmpl-moa-0", "call_0"))

    def test_negative(self) -> None:
        """A negative count of nanoseconds is refused rather than written with a sign."""
        self.assertRaises(ValueError, moa_id, -1)
        self.assertRaises(ValueError, call_id, -1)

    @given(st.integers(min_value=0, max_value=2**80))
    def test_round_trip(self, nanoseconds: int) -> None:
        """The hex suffix reads back as the nanoseconds given."""
        self.assertEqual(int(moa_id(nanoseconds).removeprefix("chatcmpl-moa-"), 16), nanoseconds)
        self.assertEqual(int(call_id(nanoseconds).removeprefix("call_"), 16), nanoseconds)


class _Sneaky(int):
    """An int whose text smuggles a header break (to show values are cleaned)."""

    def __str__(self) -> str:
        return "7\r\nx-evil: 1\n"


class HeaderTests(SynchronousTestCase):
    """The x-moa-* headers (§1.12, decision 33): names, order, values, CR/LF stripped."""

    def test_order_and_values(self) -> None:
        """The six headers come in the reference's order with their values as bytes."""
        report = TurnReport(
            elapsed_ms=1234,
            turn=TurnLabel.EARLY_EXIT,
            workers=3,
            workers_ok=2,
            reducer_used=False,
            reducer_attempts=0,
        )
        self.assertEqual(
            moa_headers(report),
            [
                (b"x-moa-elapsed-ms", b"1234"),
                (b"x-moa-turn", b"early-exit"),
                (b"x-moa-workers", b"3"),
                (b"x-moa-workers-ok", b"2"),
                (b"x-moa-reducer", b"false"),
                (b"x-moa-reducer-attempts", b"0"),
            ],
        )

    def test_labels(self) -> None:
        """Each turn label is written as the reference spells it."""
        spelled = {
            TurnLabel.EARLY_EXIT: b"early-exit",
            TurnLabel.FANOUT: b"fanout",
            TurnLabel.TOOL_RESULT: b"tool-result",
            TurnLabel.FAILED: b"failed",
        }
        for label, value in spelled.items():
            with self.subTest(label=label):
                report = TurnReport(0, label, 1, 1, True, 1)
                self.assertEqual(dict(moa_headers(report))[b"x-moa-turn"], value)

    def test_reducer_true(self) -> None:
        """A used reducer is C{true}; decision 33's tool-result turn reports one worker."""
        headers = dict(moa_headers(TurnReport(50, TurnLabel.TOOL_RESULT, 1, 1, True, 2)))
        self.assertEqual(headers[b"x-moa-reducer"], b"true")
        self.assertEqual(headers[b"x-moa-workers"], b"1")
        self.assertEqual(headers[b"x-moa-reducer-attempts"], b"2")

    def test_crlf_stripped(self) -> None:
        """'CR/LF are stripped from values': a value with line breaks cannot split a header."""
        report = TurnReport(_Sneaky(7), TurnLabel.FANOUT, _Sneaky(3), 0, False, _Sneaky(1))
        headers = moa_headers(report)
        for _name, value in headers:
            self.assertNotIn(b"\r", value)
            self.assertNotIn(b"\n", value)
        self.assertEqual(dict(headers)[b"x-moa-elapsed-ms"], b"7x-evil: 1")
        self.assertEqual(len(headers), 6)
