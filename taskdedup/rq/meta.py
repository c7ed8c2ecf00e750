"""What travels in ``job.meta["taskdedup"]``: written by the queue, read back by the worker
(which therefore needs no configuration of its own), marked when an execution is skipped.

The meta is input the worker does not trust (SPEC §8): :func:`trusted_guard` uses the lock key
it names only when it is one the worker's own deduplicator could have made for the job's
function, and otherwise recomputes the identity from the job's arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, cast

from rq.job import Job

from ..approximate import Approximate
from ..core import MAX_KEY_LENGTH, Deduplicator, GateResult, check_hint, skipped_value
from ..events import logger
from ..exceptions import ConfigurationError
from ..policy import Debounce, OnBusy, OnDuplicate, Policy, is_disabled
from .call import job_task

__all__ = [
    "META_KEY", "Guard", "guard_of", "meta_entry", "skip_result", "skipped_info", "trusted_guard",
]

META_KEY: Final = "taskdedup"
"""``job.meta`` entry: ``{"task", "key", "mode", "ttl", "lease", "on_store_error"}`` (and
``"window": [capacity, error_rate, slices, partitions]`` under an approximate window;
``"scope"``, ``"include"``, ``"exclude"``, ``"on_busy"``, ``"busy_timeout"``,
``"on_duplicate": "coalesce"`` or ``"debounce": [wait, max_wait]`` when the policy sets them;
``"gen"``/``"next"``: a debounced call's / a coalesced follow-up's generation), or
``{"off": True}``
for a call made with ``dedup=False``; ``"skipped"`` is added to a job whose execution was
skipped as a duplicate."""

_GUARD_ATTR: Final = "_taskdedup_guard"
"""Where :func:`trusted_guard` keeps its answer on a job object (checked once per job)."""
_UNCHECKED: Final = object()


@dataclass(frozen=True, slots=True)
class Guard:
    """What the worker needs to guard one job, read back from ``job.meta``."""

    name: str
    key: str
    policy: Policy
    check: str = ""
    """The argument check the reservation holds (an explicit key's), as the meta says: a
    hint for the claim's first command, never trusted for its outcome."""


def meta_entry(name: str, key: str, policy: Policy, check: str = "") -> dict[str, Any]:
    """The ``job.meta`` entry of a gated call: its identity and the policy fields the worker
    needs (to check the key, and to recompute it from the arguments when it fails the check);
    ``check``: an explicit key's argument digest, which the worker's claim expects."""
    entry: dict[str, Any] = {
        "task": name, "key": key, "mode": policy.mode.value, "ttl": policy.ttl,
        "lease": policy.lease, "on_store_error": policy.on_store_error.value,
    }
    if check:
        entry["check"] = check
    window = policy.window
    if window is not None:
        entry["window"] = [window.capacity, window.error_rate, window.slices,
                           window.partitions]
    if policy.scope is not None:
        entry["scope"] = policy.scope
    if policy.include is not None:
        entry["include"] = sorted(policy.include)
    if policy.exclude is not None:
        entry["exclude"] = sorted(policy.exclude)
    if policy.on_busy is not OnBusy.SKIP:
        entry["on_busy"] = policy.on_busy.value
        if policy.busy_timeout is not None:
            entry["busy_timeout"] = policy.busy_timeout
    if policy.on_duplicate is OnDuplicate.COALESCE:
        entry["on_duplicate"] = policy.on_duplicate.value
    if policy.debounce is not None:
        entry["debounce"] = [policy.debounce.wait, policy.debounce.max_wait]
    return entry


@functools.lru_cache(maxsize=256)
def _worker_policy(
    mode: Any, ttl: Any, lease: Any, on_store_error: Any, window: Any = None,
    scope: Any = None, include: Any = None, exclude: Any = None, on_busy: Any = None,
    busy_timeout: Any = None, on_duplicate: Any = None, debounce: Any = None,
) -> Policy:
    approximate = None
    if window is not None:
        capacity, error_rate, slices, partitions = window
        approximate = Approximate(capacity, error_rate, slices, partitions)
    return Policy(mode=mode, ttl=ttl, lease=lease, on_store_error=on_store_error,
                  window=approximate, scope=scope, include=include, exclude=exclude,
                  on_busy=on_busy or OnBusy.SKIP, busy_timeout=busy_timeout,
                  on_duplicate=on_duplicate or OnDuplicate.RETURN,
                  debounce=None if debounce is None else Debounce(*debounce))


def _names(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"a list of argument names, not {type(value).__name__}")
    return tuple(value)


def _carried(job: Job) -> tuple[Mapping[str, Any], Policy] | None:
    """The job's meta entry and the policy it names, or None: no taskdedup meta,
    ``dedup=False``, gating disabled, or policy fields no Policy can be built from."""
    meta = job.meta if isinstance(job.meta, dict) else {}
    raw = meta.get(META_KEY)
    if not isinstance(raw, Mapping) or raw.get("off") or is_disabled():
        return None
    try:
        window = raw.get("window")
        policy = _worker_policy(raw.get("mode"), raw.get("ttl"), raw.get("lease"),
                                raw.get("on_store_error"),
                                None if window is None else tuple(window),
                                raw.get("scope"), _names(raw.get("include")),
                                _names(raw.get("exclude")), raw.get("on_busy"),
                                raw.get("busy_timeout"),
                                "coalesce" if raw.get("on_duplicate") == "coalesce" else None,
                                None if raw.get("debounce") is None
                                else tuple(raw["debounce"]))
    except (ConfigurationError, TypeError, ValueError) as exc:
        logger.warning("taskdedup: job %s carries unreadable dedup meta (%s); not guarded",
                       job.id, exc)
        return None
    return raw, policy


def guard_of(job: Job) -> Guard | None:
    """The guard carried by ``job`` as its meta says, or None: no taskdedup meta,
    ``dedup=False``, disabled, or no key. Unchecked: for releases only (fenced by the job id,
    they cannot touch a lock another job holds); what claims a lock uses
    :func:`trusted_guard`."""
    carried = _carried(job)
    if carried is None:
        return None
    raw, policy = carried
    key = raw.get("key")
    if type(key) is not str or not key or len(key) > MAX_KEY_LENGTH:
        return None
    return Guard(str(raw.get("task") or job.func_name), key, policy)


def trusted_guard(job: Job, dedup: Deduplicator) -> Guard | None:
    """The guard of ``job`` with a key ``dedup`` trusts (SPEC §8), or None (not guarded: no
    taskdedup meta, ``dedup=False``, disabled, unreadable policy fields).

    The task name is the job's own function's (never the meta's word for it); the carried key
    is used when :meth:`~taskdedup.core.Deduplicator.trusted_key` accepts it for that task.
    Anything else (another task's key, a key outside the prefix, not a ``str``, too long) is
    ignored with a WARNING — which names neither the key nor any argument — and the identity
    is recomputed from the job's arguments. Checked once per job object.
    """
    cached = getattr(job, _GUARD_ATTR, _UNCHECKED)
    if cached is not _UNCHECKED:
        return cast("Guard | None", cached)
    guard = _check(job, dedup)
    setattr(job, _GUARD_ATTR, guard)
    return guard


def _check(job: Job, dedup: Deduplicator) -> Guard | None:
    carried = _carried(job)
    if carried is None:
        return None
    raw, policy = carried
    try:
        name, func = job_task(job)
    except Exception as exc:  # RQ fails the job when it cannot load it either
        logger.warning("taskdedup: job %s: its function cannot be read here (%s); not "
                       "guarded (it cannot run either)", job.id, type(exc).__name__)
        return None
    key = dedup.trusted_key(name, policy, raw.get("key")) if raw.get("task") == name else None
    if key is not None:
        return Guard(name, key, policy, check_hint(raw.get("check")))
    given = raw.get("key")
    logger.warning(
        "taskdedup: job %s (%s) carries a lock key in its meta that is not one of this task's "
        "(%s); ignored, the identity is recomputed from the job's arguments",
        job.id, name, f"a str of {len(given)} characters" if isinstance(given, str)
        else f"a {type(given).__name__}",
    )
    identity = dedup.identity(name, policy, job.args, job.kwargs, func=func)
    return Guard(name, identity.key, policy)


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
