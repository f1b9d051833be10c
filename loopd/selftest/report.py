# -*- test-case-name: loopd.test.test_selftest -*-
"""
The self-test's outcome (part of L{loopd.selftest}): each check's result and its line, the
report of one endpoint, and the error that stops C{twist loopd} when a report failed.

Pure values.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CheckResult", "SelftestFailed", "SelftestReport"]


@dataclass(frozen=True)
class CheckResult:
    """
    The outcome of one check.

    @ivar name: C{props}, C{tools} or C{cache}.
    @ivar expected: what the check required, with its values.
    @ivar actual: what the server did, with its values; the error text when the check
        could not reach the server.
    @ivar detail: for a check that compares several values, each with its own
        expectation, the comparison spelled out value by value; the line shows it in place
        of the plain "expected ... got ...".
    """

    name: str
    passed: bool
    expected: str
    actual: str
    detail: str = ""

    def line(self) -> str:
        """
        One human line: PASS or FAIL, the check's name, what was expected and what came.
        """
        verdict = "PASS" if self.passed else "FAIL"
        comparison = self.detail or f"expected {self.expected} got {self.actual}"
        return f"{verdict} {self.name}: {comparison}"


@dataclass(frozen=True)
class SelftestReport:
    """
    The self-test of one endpoint: its checks, in the order they ran.
    """

    endpoint: str
    checks: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        """
        Whether every check passed.
        """
        return all(check.passed for check in self.checks)

    @property
    def failures(self) -> tuple[CheckResult, ...]:
        """
        The checks that failed, in order.
        """
        return tuple(check for check in self.checks if not check.passed)

    def lines(self) -> list[str]:
        """
        One human line per check (L{CheckResult.line}).
        """
        return [check.line() for check in self.checks]


class SelftestFailed(Exception):  # noqa: N818 - the name the design gives it
    """
    An endpoint failed its self-test, so loopd must not start.

    @ivar report: the first failing endpoint's report.
    @ivar reports: the reports of every endpoint that was tested.
    """

    def __init__(self, report: SelftestReport, reports: tuple[SelftestReport, ...] = ()) -> None:
        """
        @param report: the first failing report; the message names its failing checks.
        @param reports: every report, the failing one included.
        """
        failing = "; ".join(check.line() for check in report.failures)
        super().__init__(f"self-test of endpoint {report.endpoint} failed: {failing}")
        self.report = report
        self.reports = reports or (report,)
