"""Tasks of the second-call tests (SPEC §15: wait, coalesce), on the shared test app
(:mod:`tests.celery_app`): ``celery -A tests.second_call_app worker`` runs them and every
task of that app.

Each body is :func:`tests.second_call_jobs.hold` (shared with the RQ tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kombu.exceptions import OperationalError

from taskdedup import Concurrency, Policy
from taskdedup.celery import DedupTask
from taskdedup.celery.task import NO_RESERVE
from tests.celery_app import app, configure, lock_key
from tests.effects import r
from tests.second_call_jobs import hold

__all__ = [
    "app", "busy_timeout", "configure", "hold", "limited_refused", "lock_key", "wait_busy",
    "wait_refused", "wait_until_executed",
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


class RefusedPutOff(DedupTask):  # type: ignore[misc]
    """A DedupTask whose put-off republish (``apply_async`` with taskdedup's no-reserve option,
    as ``DedupTask._defer`` sends it) fails while ``putoff-refused:<label>`` exists: a broker
    that refuses the publish after kombu's own retries."""

    def apply_async(self, args: Sequence[Any] | None = None, *rest: Any, **options: Any) -> Any:
        if options.get(NO_RESERVE) and args and r().exists(f"putoff-refused:{args[0]}"):
            raise OperationalError("the broker refused the put-off (test)")
        return super().apply_async(args, *rest, **options)


def label_of(label: str, n: int, gated: bool = False) -> str:
    return label


@app.task(base=RefusedPutOff, dedup=Policy(mode="while_executing", lease=8, include=["label"],
                                           on_busy="wait"))
def wait_refused(label: str, n: int, gated: bool = False) -> int:
    return hold(label, n, gated)


@app.task(base=RefusedPutOff, dedup=Policy(mode="until_executed", ttl=60, lease=8),
          limits=[Concurrency(1, key=label_of)])
def limited_refused(label: str, n: int, gated: bool = False) -> int:
    return hold(label, n, gated)
