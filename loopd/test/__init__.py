"""
Unit tests for loopd, run with trial.

hypothesis runs with a deterministic profile here, as Twisted's own test package does: a
fixed seed so a run never finds an unrelated bug by chance, and no deadline because shared CI
machines have timing outliers.
"""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "loopd",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("loopd")
