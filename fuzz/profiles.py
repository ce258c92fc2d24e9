"""Hypothesis settings of the property-based fuzz tests (tests/reliability/test_fuzz_hypothesis.py).

    SURGEON_FUZZ_PROFILE=ci    (default) a bounded, derandomised run: same examples every CI run
    SURGEON_FUZZ_PROFILE=long  many more examples, random seed, failures kept in .hypothesis/
    SURGEON_FUZZ_EXAMPLES=N    override the example count of whichever profile is active
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.filter_too_much])

settings.register_profile("ci", derandomize=True, database=None, print_blob=True, **_COMMON)
settings.register_profile("long", derandomize=False, print_blob=True, **_COMMON)

PROFILE = os.environ.get("SURGEON_FUZZ_PROFILE", "ci")

# examples per test in each profile (tests scale these by their own cost)
_EXAMPLES = {"ci": 1.0, "long": 50.0}


def examples(ci_count: int) -> int:
    """The example count for a test that runs `ci_count` examples in CI."""
    override = os.environ.get("SURGEON_FUZZ_EXAMPLES")
    if override:
        return int(override)
    return max(1, int(ci_count * _EXAMPLES.get(PROFILE, 1.0)))


def fuzz_settings(ci_count: int) -> settings:
    """Settings for one test (applied per test, so that other tests' hypothesis settings are
    left alone): the active profile with the scaled example count."""
    return settings(settings.get_profile(PROFILE), max_examples=examples(ci_count))
