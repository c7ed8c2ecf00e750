"""Tasks of the coalesce and debounce tests (SPEC §15, issue #22 parts 2-3), on the shared
test app (:mod:`tests.celery_app`): ``celery -A tests.flow_app worker`` runs them and every
task of that app. Each body is :func:`tests.flow_jobs.run` (shared with the RQ tests)."""

from __future__ import annotations

from taskdedup import Debounce, Policy
from taskdedup.celery import DedupTask
from tests.celery_app import app, configure
from tests.flow_jobs import run

__all__ = ["app", "coalesced", "coalesced_window", "configure", "debounced", "debounced_max",
           "run"]


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", lease=8, include=["label"],
                                       on_duplicate="coalesce"))
def coalesced(label: str, n: int, gate: str = "") -> int:
    return run(label, n, gate)


@app.task(base=DedupTask, dedup=Policy(mode="until_expired", ttl=300, lease=8,
                                       include=["label"], on_duplicate="coalesce"))
def coalesced_window(label: str, n: int, gate: str = "") -> int:
    return run(label, n, gate)


@app.task(base=DedupTask, dedup=Policy(mode="until_expired", ttl=300, lease=8,
                                       include=["label"], debounce=Debounce(1.5)))
def debounced(label: str, n: int, gate: str = "") -> int:
    return run(label, n, gate)


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", lease=8, include=["label"],
                                       debounce=Debounce(1.0, max_wait=2.5)))
def debounced_max(label: str, n: int, gate: str = "") -> int:
    return run(label, n, gate)
