"""What travels in ``job.meta["taskdedup"]``: written by the queue, read back by the worker
(which therefore needs no configuration of its own), marked when an execution is skipped."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from rq.job import Job

from ..approximate import Approximate
from ..core import GateResult, skipped_value
from ..events import logger
from ..exceptions import ConfigurationError
from ..policy import Policy, is_disabled

__all__ = ["META_KEY", "Guard", "guard_of", "meta_entry", "skip_result", "skipped_info"]

META_KEY: Final = "taskdedup"
"""``job.meta`` entry: ``{"task", "key", "mode", "ttl", "lease", "on_store_error"}`` (and
``"window": [capacity, error_rate, slices, partitions]`` under an approximate window), or
``{"off": True}`` for a call made with ``dedup=False``; ``"skipped"`` is added to a job whose
execution was skipped as a duplicate."""

@dataclass(frozen=True, slots=True)
class Guard:
    """What the worker needs to guard one job, read back from ``job.meta``."""

    name: str
    key: str
    policy: Policy


def meta_entry(name: str, key: str, policy: Policy) -> dict[str, Any]:
    """The ``job.meta`` entry of a gated call: its identity and the policy fields the worker
    needs."""
    entry: dict[str, Any] = {
        "task": name, "key": key, "mode": policy.mode.value, "ttl": policy.ttl,
        "lease": policy.lease, "on_store_error": policy.on_store_error.value,
    }
    window = policy.window
    if window is not None:
        entry["window"] = [window.capacity, window.error_rate, window.slices,
                           window.partitions]
    return entry


@functools.lru_cache(maxsize=256)
def _worker_policy(
    mode: Any, ttl: Any, lease: Any, on_store_error: Any, window: Any = None
) -> Policy:
    approximate = None
    if window is not None:
        capacity, error_rate, slices, partitions = window
        approximate = Approximate(capacity, error_rate, slices, partitions)
    return Policy(mode=mode, ttl=ttl, lease=lease, on_store_error=on_store_error,
                  window=approximate)


def guard_of(job: Job) -> Guard | None:
    """The guard carried by ``job``, or None: no taskdedup meta, ``dedup=False``, disabled."""
    meta = job.meta if isinstance(job.meta, dict) else {}
    raw = meta.get(META_KEY)
    if not isinstance(raw, Mapping) or raw.get("off") or is_disabled():
        return None
    key = raw.get("key")
    if not isinstance(key, str) or not key:
        return None
    try:
        window = raw.get("window")
        policy = _worker_policy(raw.get("mode"), raw.get("ttl"), raw.get("lease"),
                                raw.get("on_store_error"),
                                None if window is None else tuple(window))
    except (ConfigurationError, TypeError, ValueError) as exc:
        logger.warning("taskdedup: job %s carries unreadable dedup meta (%s); not guarded",
                       job.id, exc)
        return None
    return Guard(str(raw.get("task") or job.func_name), key, policy)


def skipped_info(job: Job) -> dict[str, Any] | None:
    """``{"existing_id", "state"}`` when ``job`` was skipped as a duplicate execution, else None.

    A skipped job is FINISHED (not failed): its body did not run because ``existing_id`` held
    the identity (``state`` ``queued``, ``running`` or ``done``).
    """
    raw = job.meta.get(META_KEY) if isinstance(job.meta, dict) else None
    skipped = raw.get("skipped") if isinstance(raw, Mapping) else None
    return dict(skipped) if isinstance(skipped, Mapping) else None


def skip_result(job: Job, result: GateResult) -> dict[str, Any]:
    """Mark ``job`` skipped in its meta; the dict is also its return value (JSON-friendly)."""
    value = skipped_value(result.existing_id, result.state)  # as Celery's skipped result
    entry = dict(job.meta.get(META_KEY) or {})
    entry["skipped"] = {"existing_id": value["existing_id"], "state": value["state"]}
    job.meta[META_KEY] = entry
    job.save_meta()  # type: ignore[no-untyped-call]
    return value
