"""Tasks of the limits tests (SPEC §16, issue #23), on the shared test app
(:mod:`tests.celery_app`): ``celery -A tests.limits_app worker`` runs them.

Each body is :func:`tests.limits_jobs.hold` (shared with the RQ tests).
"""

from __future__ import annotations

from taskdedup import Concurrency, Policy, Rate
from taskdedup.celery import DedupTask
from tests.celery_app import app, configure
from tests.limits_jobs import hold, tenant_of

__all__ = ["app", "by_tenant", "by_tenant_nodedup", "configure", "drop_rate", "kill_one",
           "rate", "tracked"]


@app.task(base=DedupTask, dedup=Policy(mode="until_executed", ttl=60, lease=8),
          limits=[Concurrency(2, key=tenant_of)])
def by_tenant(label: str, tenant: str, n: int, seconds: float = 0.3, gate: bool = False) -> int:
    return hold(label, tenant, n, seconds, gate)


@app.task(base=DedupTask, dedup=False, limits=[Concurrency(1, key=tenant_of)])
def by_tenant_nodedup(label: str, tenant: str, n: int, seconds: float = 0.3,
                      gate: bool = False) -> int:
    return hold(label, tenant, n, seconds, gate)


@app.task(base=DedupTask, dedup=Policy(mode="while_executing", lease=3),
          limits=[Concurrency(1, key=tenant_of)])
def kill_one(label: str, tenant: str, n: int, seconds: float = 0.3, gate: bool = False) -> int:
    return hold(label, tenant, n, seconds, gate)


@app.task(base=DedupTask, dedup=False,
          limits=[Concurrency(4, key=tenant_of), Rate(3, per=2, key=tenant_of)])
def rate(label: str, tenant: str, n: int, seconds: float = 0.05, gate: bool = False) -> int:
    return hold(label, tenant, n, seconds, gate)


@app.task(base=DedupTask, limits=[Rate(1, per=30, key=tenant_of, on_excess="drop")])
def drop_rate(label: str, tenant: str, n: int, seconds: float = 0.05, gate: bool = False) -> int:
    return hold(label, tenant, n, seconds, gate)


@app.task(base=DedupTask, dedup=Policy(mode="while_executing", lease=8), track_started=True,
          limits=[Concurrency(1, key=tenant_of)])
def tracked(label: str, tenant: str, n: int, seconds: float = 0.05, gate: bool = False) -> int:
    return hold(label, tenant, n, seconds, gate)
