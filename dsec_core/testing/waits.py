"""Waiting on the event a test stands for, instead of sleeping for as long as it usually takes.

A sleep that is long enough on a quiet machine is too short on a loaded one (the suite runs
several workers on two cores) and too long everywhere else. ``until`` and ``async_until`` poll a
predicate and return its first true value, or fail the test saying what did not happen.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["async_until", "until"]

T = TypeVar("T")


def until(
    predicate: Callable[[], T], timeout: float = 10.0, what: str = "", every: float = 0.02
) -> T:
    """The first true value of ``predicate()``, polled every ``every`` seconds; an
    ``AssertionError`` naming ``what`` if ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout}s: {what or predicate!r}")
        time.sleep(every)


async def async_until(
    predicate: Callable[[], T], timeout: float = 10.0, what: str = "", every: float = 0.02
) -> T:
    """``until`` on the event loop: the loop runs between polls."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout}s: {what or predicate!r}")
        await asyncio.sleep(every)
