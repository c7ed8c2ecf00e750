"""Tasks of the second-call tests (SPEC §15: wait, coalesce), on the shared test app
(:mod:`tests.celery_app`): ``celery -A tests.second_call_app worker`` runs them and every
task of that app.

Each body is :func:`tests.second_call_jobs.hold` (shared with the RQ tests).
"""

from __future__ import annotations

from taskdedup import Policy
from taskdedup.celery import DedupTask
from tests.celery_app import app, configure, lock_key
from tests.second_call_jobs import hold

__all__ = [
    "app", "busy_timeout", "configure", "hold", "lock_key", "wait_busy", "wait_until_executed",
]


@app.task(base=DedupTask, dedup=Policy(mode="while_executing", lease=8, include=["label"],
                                       on_busy="wait"))
def wait_busy(label: str, n: int, gated: bool = False) -> int:
    return hold(label, n, gated)


@app.task(base=DedupTask, dedup=Policy(mode="while_executing", lease=8, include=["label"],
                                       on_busy="wait", busy_timeout=3))
def busy_timeout(label: str, n: int, gated: bool = False) -> int:
    return hold(label, n, gated)


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60, lease=8,
                                       include=["label"], on_busy="wait"))
def wait_until_executed(label: str, n: int, gated: bool = False) -> int:
    return hold(label, n, gated)
