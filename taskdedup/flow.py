"""What the second call gets beyond a skip (SPEC §15): how long a waiting call is put off.

``on_busy="wait"``: an execution that finds another id running its identity is put off with
the same republish as a copy of a running message (:func:`taskdedup.core.copy_wait`), not
counted as a retry and holding no worker slot. When the wait started travels with the message
(a Celery header, an RQ job's meta: :data:`WAITING_SINCE`), never an argument value, so a
``busy_timeout`` is measured across republishes and workers. Framework-free: the integrations
ask :func:`busy_wait` and do the republish their own way.
"""

from __future__ import annotations

import math
import time
from typing import Any, Final

from .core import COPY_WAIT_MIN
from .policy import Policy

__all__ = ["BUSY_TOLERANCE", "WAITING_SINCE", "busy_wait", "waiting_since"]

WAITING_SINCE: Final = "taskdedup_waiting"
"""Celery message header / RQ ``job.meta`` entry: the Unix time (float seconds) at which the
call was first put off because its identity was busy."""

BUSY_TOLERANCE: Final = 0.05
"""Seconds: a call that comes back this close to its ``busy_timeout`` ends at once rather
than being put off for a few milliseconds more."""


def waiting_since(value: Any) -> float | None:
    """The carried start of a wait, when it is a plausible Unix time (else None: it starts
    now; a forged value can only shorten or restart the caller's own wait)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    since = float(value)
    if not math.isfinite(since) or since <= 0 or since > time.time() + 60:
        return None
    return since


def busy_wait(policy: Policy, waited: float, redelivery: float | None = None) -> float | None:
    """Seconds until a call that has ``waited`` seconds for a busy identity claims again, or
    None when its ``busy_timeout`` has passed (it ends in :class:`BusyTimeoutError`).

    The delay backs off with the time already waited (half of it: a short holder is followed
    closely, a long one is not polled), at least :data:`~taskdedup.core.COPY_WAIT_MIN`, at
    most a quarter of the lease (a killed holder's lock lapses within its lease: the waiters
    notice soon after), under half of ``redelivery`` (the broker's visibility timeout, so the
    broker does not copy the waiting message), and never past ``busy_timeout``: the last
    put-off lands on it, so the timeout is reported within a second or two of it.
    """
    wait = min(max(COPY_WAIT_MIN, waited / 2), max(COPY_WAIT_MIN, policy.lease / 4))
    if redelivery is not None:
        wait = max(0.1, min(wait, redelivery / 2))
    if policy.busy_timeout is not None:
        left = policy.busy_timeout - waited
        if left <= BUSY_TOLERANCE:
            return None
        wait = min(wait, left)
    return wait
