"""RQ integration: ``DedupQueue`` (the enqueue gate), ``DedupWorker`` (the execution guard) and
``DedupJob`` (cancel/delete release the lock).

Usage::

    q = DedupQueue("default", connection=redis, dedup=Policy(ttl=600))
    job = q.enqueue(send_email, 42)                    # a duplicate returns the original Job
    job = q.enqueue(send_email, 42, dedup_key="welcome-42")

    $ rq worker -w taskdedup.rq.DedupWorker --job-class taskdedup.rq.DedupJob default

The queue computes the identity, reserves it (one round trip) and writes the lock key into
``job.meta["taskdedup"]`` together with the few policy fields the worker needs (mode, ttl,
lease, on_store_error), so the worker never recomputes the identity and needs no
configuration of its own. Inside the work-horse, :meth:`DedupWorker.perform_job` claims the
lock before the body runs (a duplicate finishes without running it), and RQ's own
``handle_job_success`` / ``handle_job_failure`` / ``handle_job_retry`` complete, release or
re-reserve it. ``handle_job_failure`` also runs in the worker's main process when the horse
was killed, so a lost horse releases its lock at once; a worker killed as a whole loses its
heartbeat and the lock frees itself within ``lease``.

Jobs without ``meta["taskdedup"]`` (enqueued by a plain ``Queue``, ``enqueue_many`` or
``enqueue_job``) are not guarded: the worker never guesses a policy.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import redis
from redis.cluster import RedisCluster
from rq.defaults import DEFAULT_RESULT_TTL
from rq.exceptions import DuplicateJobError, InvalidJobOperation, NoSuchJobError
from rq.executions import Execution
from rq.job import JOB_ID_PATTERN, Job, JobStatus, Retry
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.timeouts import BaseDeathPenalty, UnixSignalDeathPenalty
from rq.utils import import_attribute, now, resolve_function_reference
from rq.worker import Worker

from . import stats
from .core import (
    DEFAULT_PREFIX,
    Deduplicator,
    GateResult,
    Identity,
    Verdict,
    resolve_duplicate,
)
from .events import logger
from .exceptions import ConfigurationError, DuplicateTaskError, StoreUnavailableError
from .policy import Mode, OnDuplicate, Policy, PolicyLike, is_disabled
from .stores.base import LockState, Store
from .stores.redis import RedisStore, may_have_run, reserve_and_run

__all__ = [
    "META_KEY", "DedupJob", "DedupQueue", "DedupWorker", "get_deduplicator", "skipped_info",
]

META_KEY: Final = "taskdedup"
"""``job.meta`` entry: ``{"task", "key", "mode", "ttl", "lease", "on_store_error"}``, or
``{"off": True}`` for a call made with ``dedup=False``; ``"skipped"`` is added to a job whose
execution was skipped as a duplicate."""

_WORKFLOW_OPTIONS: Final = ("depends_on", "on_success", "on_failure", "on_stopped")
_DEAD_STATUSES: Final = frozenset(
    {JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED}
)
_NOT_STARTED: Final = frozenset(
    {
        JobStatus.CREATED, JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED,
        JobStatus.READY_TO_ENQUEUE, JobStatus.RATE_LIMITED,
    }
)
_CREATE_JOB_PARAMS: Final = frozenset(inspect.signature(Queue.create_job).parameters) - {"self"}
_ENQUEUE_CALL_SIGNATURE: Final = inspect.signature(Queue.enqueue_call)
_STATE_WORDS: Final = {LockState.QUEUED: "queued", LockState.RUNNING: "running",
                       LockState.DONE: "done"}


# -- configuration --------------------------------------------------------------------------


_by_client: weakref.WeakKeyDictionary[Any, dict[str, Deduplicator]] = weakref.WeakKeyDictionary()
_by_url: dict[tuple[str, str], Deduplicator] = {}


def get_deduplicator(
    connection: redis.Redis, store: Store | redis.Redis | str | None = None,
    prefix: str | None = None,
) -> Deduplicator:
    """The :class:`~taskdedup.core.Deduplicator` for an RQ connection.

    Store: ``store`` (a Store, a ready ``redis.Redis`` client or a URL), else the
    ``TASKDEDUP_URL`` environment variable, else ``connection`` itself (RQ's own Redis).
    Prefix: ``prefix``, else ``TASKDEDUP_PREFIX``, else ``taskdedup`` (the worker and the CLI
    read the same variables).
    Deduplicators on a URL or a connection are shared per process, so their counters add up.
    """
    prefix = prefix or os.environ.get("TASKDEDUP_PREFIX") or DEFAULT_PREFIX
    if isinstance(store, Store):
        return _new_deduplicator(store, prefix)
    if store is not None and not isinstance(store, (redis.Redis, str)):
        raise ConfigurationError(
            f"dedup_store must be a taskdedup Store, a redis.Redis client or a redis:// URL, "
            f"got {type(store).__name__}"
        )
    url = store if isinstance(store, str) else None
    if store is None:
        url = os.environ.get("TASKDEDUP_URL") or None
    if url is not None:
        dedup = _by_url.get((url, prefix))
        if dedup is None:
            dedup = _by_url[(url, prefix)] = _new_deduplicator(RedisStore.from_url(url), prefix)
        return dedup
    client = store if isinstance(store, redis.Redis) else connection
    per_prefix = _by_client.setdefault(client, {})
    dedup = per_prefix.get(prefix)
    if dedup is None:
        dedup = per_prefix[prefix] = _new_deduplicator(RedisStore(client), prefix)
    return dedup


def _new_deduplicator(store: Store, prefix: str) -> Deduplicator:
    """A Deduplicator whose counters are flushed to Redis off the hot path (taskdedup stats)."""
    dedup = Deduplicator(store, prefix=prefix)
    stats.attach(dedup)
    return dedup


# -- what travels in job.meta ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Guard:
    """What the worker needs to guard one job, read back from ``job.meta``."""

    name: str
    key: str
    policy: Policy


def _meta_entry(name: str, key: str, policy: Policy) -> dict[str, Any]:
    return {
        "task": name, "key": key, "mode": policy.mode.value, "ttl": policy.ttl,
        "lease": policy.lease, "on_store_error": policy.on_store_error.value,
    }


@functools.lru_cache(maxsize=256)
def _worker_policy(mode: Any, ttl: Any, lease: Any, on_store_error: Any) -> Policy:
    return Policy(mode=mode, ttl=ttl, lease=lease, on_store_error=on_store_error)


def _guard_of(job: Job) -> _Guard | None:
    """The guard carried by ``job``, or None: no taskdedup meta, ``dedup=False``, disabled."""
    meta = job.meta if isinstance(job.meta, dict) else {}
    raw = meta.get(META_KEY)
    if not isinstance(raw, Mapping) or raw.get("off") or is_disabled():
        return None
    key = raw.get("key")
    if not isinstance(key, str) or not key:
        return None
    try:
        policy = _worker_policy(raw.get("mode"), raw.get("ttl"), raw.get("lease"),
                                raw.get("on_store_error"))
    except (ConfigurationError, TypeError) as exc:
        logger.warning("taskdedup: job %s carries unreadable dedup meta (%s); not guarded",
                       job.id, exc)
        return None
    return _Guard(str(raw.get("task") or job.func_name), key, policy)


def skipped_info(job: Job) -> dict[str, Any] | None:
    """``{"existing_id", "state"}`` when ``job`` was skipped as a duplicate execution, else None.

    A skipped job is FINISHED (not failed): its body did not run because ``existing_id`` held
    the identity (``state`` ``queued``, ``running`` or ``done``).
    """
    raw = job.meta.get(META_KEY) if isinstance(job.meta, dict) else None
    skipped = raw.get("skipped") if isinstance(raw, Mapping) else None
    return dict(skipped) if isinstance(skipped, Mapping) else None


def _skip_result(job: Job, result: GateResult) -> dict[str, Any]:
    """Mark ``job`` skipped in its meta; the dict is also its return value (JSON-friendly)."""
    state = _STATE_WORDS.get(result.state) if result.state else None
    info = {"existing_id": result.existing_id, "state": state}
    entry = dict(job.meta.get(META_KEY) or {})
    entry["skipped"] = info
    job.meta[META_KEY] = entry
    job.save_meta()  # type: ignore[no-untyped-call]
    return {"taskdedup": "skipped duplicate", **info}


# -- identity of an RQ call -----------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _import_quietly(path: str) -> Callable[..., Any] | None:
    try:
        return import_attribute(path)
    except Exception:  # not importable here: identity from the arguments as given
        return None


def _task_of(func: Any) -> tuple[str, Callable[..., Any] | None]:
    """The identity name of an RQ function reference and the callable to bind arguments to.

    A function is ``module.qualname`` (RQ's ``func_name``); a string reference is itself
    (and is bound when it can be imported here); a bound method or a callable instance is
    ``module.Class.method`` — the instance itself is not part of the identity.
    """
    instance, func_name = resolve_function_reference(func)
    if isinstance(func, str):
        return func, _import_quietly(func)
    if instance is not None:
        cls = type(instance)
        return f"{cls.__module__}.{cls.__qualname__}.{func_name}", func
    return func_name, func


def _is_job_id(value: str) -> bool:
    """Whether ``value`` can be an RQ job id (a lock owner may be anyone's id, or garbage)."""
    return bool(JOB_ID_PATTERN.fullmatch(value))


def _alive(status: str | None) -> bool:
    """Whether a job with this status (None: no such job) exists and has not ended."""
    return status is not None and status not in _DEAD_STATUSES


def _decode_hash(flat: list[Any] | None) -> dict[str, Any]:
    """A job hash as HGETALL in Lua answers it (a flat list), with text keys; the status
    under ``"status"`` as text too. Values stay bytes (``Job.restore`` reads them so)."""
    if not flat:
        return {}
    items = iter(flat)
    data = {_as_text(field): value for field, value in zip(items, items, strict=True)}
    if "status" in data:
        data["status"] = _as_text(data["status"])
    return data


def _as_text(value: Any) -> Any:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def _delay_seconds(when: datetime) -> float:
    """Seconds until ``when``; a naive datetime is local time, as RQ's scheduler reads it."""
    aware = when if when.tzinfo else when.astimezone()
    return max(0.0, (aware - datetime.now(UTC)).total_seconds())


# -- the queue ------------------------------------------------------------------------------


class DedupJob(Job):
    """An RQ job whose ``cancel()`` and ``delete()`` release its reservation.

    Only a job that has not started is released (queued, scheduled, deferred): a running job
    keeps its lock until the worker completes or releases it, and a finished job keeps its
    ``until_expired`` window. The release is compare-and-delete by the job id, so it never
    touches a lock another job holds. Use it as the worker's ``--job-class`` and wherever
    jobs are fetched (:class:`DedupQueue` uses it by default).
    """

    _taskdedup: Deduplicator | None = None

    @property
    def dedup(self) -> Deduplicator:
        """The deduplicator of the queue that made or fetched this job, else the default."""
        if self._taskdedup is None:
            self._taskdedup = get_deduplicator(self.connection)
        return self._taskdedup

    @property
    def success_callback(self) -> Any:
        """No ``on_success`` callback for a skipped duplicate: its body did not run."""
        if skipped_info(self) is not None:
            return None
        return super().success_callback

    def cancel(
        self, pipeline: Any = None, enqueue_dependents: bool = False,
        remove_from_dependencies: bool = False,
    ) -> dict[str, list[str]]:
        """Cancel the job (RQ) and release its reservation if it had not started."""
        guard = self._unstarted_guard(pipeline)
        result = super().cancel(
            pipeline=pipeline, enqueue_dependents=enqueue_dependents,
            remove_from_dependencies=remove_from_dependencies,
        )
        if guard is not None:
            self.dedup.release(guard.name, guard.key, self.id, reason="canceled",
                               only_queued=True)
        return result

    def delete(
        self, pipeline: Any = None, remove_from_queue: bool = True, delete_dependents: bool = False
    ) -> None:
        """Delete the job (RQ) and release its reservation if it had not started."""
        guard = self._unstarted_guard(pipeline)
        super().delete(pipeline=pipeline, remove_from_queue=remove_from_queue,
                       delete_dependents=delete_dependents)
        if guard is not None:
            self.dedup.release(guard.name, guard.key, self.id, reason="deleted",
                               only_queued=True)

    def _unstarted_guard(self, pipeline: Any) -> _Guard | None:
        """The guard to release after cancel/delete: only without a caller's pipeline (RQ's
        own cleanup passes one; an unexecuted pipeline must not release anything) and only
        for a job that has not started."""
        guard = _guard_of(self) if pipeline is None else None
        if guard is None:
            return None
        raw = self.connection.hget(self.key, "status")
        status = raw.decode() if isinstance(raw, bytes) else raw
        return guard if status in _NOT_STARTED else None


class DedupQueue(Queue):
    """An RQ queue whose ``enqueue``, ``enqueue_call``, ``enqueue_at`` and ``enqueue_in`` are
    gated per :class:`taskdedup.Policy`.

    Args:
        dedup: the queue's default policy (a Policy or a dict of its fields); ``None`` means
            ``Policy()``, ``False`` turns gating off unless a call passes ``dedup=``.
        dedup_store: where locks live (a Store, a ``redis.Redis`` or a URL); default the
            ``TASKDEDUP_URL`` environment variable, else the queue's own connection.
        dedup_prefix: the first component of lock keys (default ``taskdedup``).

    The other arguments are RQ's. Per call, the enqueue methods also take ``dedup=``
    (a Policy, a dict, or ``False`` to bypass both the gate and the worker guard) and
    ``dedup_key=`` (an explicit idempotency key); both are removed before RQ sees the call.

    Raises:
        ConfigurationError: ``dedup`` or ``dedup_store`` is invalid.
    """

    job_class: type[Job] = DedupJob
    heal_grace: float = 1.0
    """Seconds a duplicate enqueue waits for a queued holder's job to appear before it calls
    the lock stale (a holder reserves, then writes its job: this covers that gap)."""

    def __init__(
        self,
        name: str = "default",
        connection: redis.Redis | None = None,
        default_timeout: int | None = None,
        is_async: bool = True,
        job_class: str | type[Job] | None = None,
        serializer: Any = None,
        death_penalty_class: type[BaseDeathPenalty] | None = UnixSignalDeathPenalty,
        *,
        dedup: PolicyLike = None,
        dedup_store: Store | redis.Redis | str | None = None,
        dedup_prefix: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            name, connection=connection, default_timeout=default_timeout, is_async=is_async,
            job_class=job_class, serializer=serializer, death_penalty_class=death_penalty_class,
            **kwargs,
        )
        self.dedup_policy: Policy | None = Policy() if dedup is None else Policy.coerce(dedup)
        try:
            self.dedup: Deduplicator = get_deduplicator(self.connection, dedup_store, dedup_prefix)
        except ValueError as exc:  # a bad prefix
            raise ConfigurationError(f"DedupQueue({name!r}): {exc}") from exc

    # -- jobs know their deduplicator ------------------------------------------------------

    def create_job(self, *args: Any, **kwargs: Any) -> Job:
        """RQ's ``create_job``; a DedupJob also learns this queue's deduplicator (its store)."""
        job = super().create_job(*args, **kwargs)
        if isinstance(job, DedupJob):
            job._taskdedup = self.dedup
        return job

    def fetch_job(self, job_id: str) -> Job | None:
        """RQ's ``fetch_job``; a DedupJob also learns this queue's deduplicator (its store)."""
        job = super().fetch_job(job_id)
        if isinstance(job, DedupJob):
            job._taskdedup = self.dedup
        return job

    # -- the gated entry points --------------------------------------------------------------

    def enqueue(self, f: Any, *args: Any, **kwargs: Any) -> Job | None:  # type: ignore[override]
        """``Queue.enqueue`` behind the gate; ``None`` for a dropped duplicate."""
        dedup, dedup_key = kwargs.pop("dedup", None), kwargs.pop("dedup_key", None)
        params = Queue.parse_args(f, *args, **kwargs)._asdict()
        return self._gated(params, dedup, dedup_key, None)

    def enqueue_call(  # type: ignore[override]
        self, func: Any, args: Any = None, kwargs: Any = None, *more: Any,
        dedup: PolicyLike = None, dedup_key: Any = None, **options: Any,
    ) -> Job | None:
        """``Queue.enqueue_call`` behind the gate; ``None`` for a dropped duplicate."""
        bound = _ENQUEUE_CALL_SIGNATURE.bind(self, func, args, kwargs, *more, **options)
        bound.apply_defaults()
        params = dict(bound.arguments)
        del params["self"]
        return self._gated(params, dedup, dedup_key, None)

    def enqueue_at(self, datetime: datetime, f: Any, *args: Any, **kwargs: Any) -> Job | None:
        """``Queue.enqueue_at`` behind the gate: the reservation lives ``ttl`` + the delay.

        ``enqueue_in`` goes through here too.
        """
        dedup, dedup_key = kwargs.pop("dedup", None), kwargs.pop("dedup_key", None)
        params = Queue.parse_args(f, *args, **kwargs)._asdict()
        return self._gated(params, dedup, dedup_key, datetime)

    def _gated(
        self, params: dict[str, Any], override: PolicyLike, dedup_key: Any, when: datetime | None
    ) -> Job | None:
        """Gate one call (RQ's parsed enqueue options in ``params``), then create and queue
        (or schedule, ``when``) its job as RQ's own enqueue methods do."""
        pipeline, unique = params.pop("pipeline", None), bool(params.pop("unique", False))
        at_front = bool(params.pop("at_front", False))
        job_id: str | None = params.get("job_id")
        if unique and not job_id:
            raise ValueError("unique=True requires an explicit job_id")
        func = params["func"]
        create = {k: v for k, v in params.items() if k in _CREATE_JOB_PARAMS}
        create["status"] = JobStatus.QUEUED if when is None else JobStatus.SCHEDULED

        def publish(job: Job) -> Job:
            if when is None:
                return self.enqueue_job(job, pipeline=pipeline, at_front=at_front, unique=unique)
            if at_front:
                job.enqueue_at_front = True
            return self.schedule_job(job, when, pipeline=pipeline, unique=unique)

        policy = self.dedup_policy if override is None else Policy.coerce(override)
        if policy is None or is_disabled():
            create["meta"] = {**(params.get("meta") or {}), META_KEY: {"off": True}}
            return publish(self.create_job(**create))
        if pipeline is not None:
            raise ValueError(
                "DedupQueue: pipeline= cannot be combined with the dedup gate (the reservation "
                "must be answered before the job is queued); enqueue without pipeline=, or "
                "pass dedup=False"
            )

        name, bind_to = _task_of(func)
        args, kwargs = params.get("args") or (), params.get("kwargs") or {}
        identity = self.dedup.identity(name, policy, args, kwargs, func=bind_to,
                                       dedup_key=dedup_key)
        owner = job_id or str(uuid.uuid4())
        create["job_id"] = owner
        create["meta"] = {**(params.get("meta") or {}),
                          META_KEY: _meta_entry(name, identity.key, policy)}
        job = self.create_job(**create)  # RQ validates its options before anything is stored
        if not policy.mode.gates_enqueue:
            return publish(job)

        if job_id is not None:
            status = self._job_status(job_id)
            if unique and status is not None:
                return publish(job)  # RQ raises DuplicateJobError; the lock is that job's
            if _alive(status):
                # The same job id re-enqueued while it is alive: a duplicate of itself.
                return self._on_duplicate(policy, name, identity.key, job_id, params)

        ttl_ms = self._reservation_ttl_ms(policy, when, params.get("ttl"))
        if not unique and self._fuses(job):
            return self._enqueue_fused(job, name, policy, identity, ttl_ms, when, at_front,
                                       params, publish)
        result = self.dedup.gate(name, policy, identity, owner, ttl_ms=ttl_ms)
        if result.verdict is Verdict.DUPLICATE and self._release_stale(name, identity, result):
            result = self.dedup.gate(name, policy, identity, owner, ttl_ms=ttl_ms)
        if result.verdict is Verdict.DUPLICATE:
            return self._on_duplicate(policy, name, identity.key, result.existing_id, params)
        if result.verdict is Verdict.REPLACED and result.existing_id:
            self._cancel_replaced(result.existing_id)
        try:
            return publish(job)
        except BaseException as exc:
            if result.verdict is not Verdict.UNGUARDED and not (
                isinstance(exc, DuplicateJobError) and self._job_alive(owner)
            ):
                self.dedup.release(name, identity.key, owner, reason="publish_failed")
            raise

    # -- one round trip: reserve inside RQ's own enqueue -------------------------------------

    def _fuses(self, job: Job) -> bool:
        """Whether this job's reservation can ride in the script that writes and queues it:
        the locks live in this queue's Redis, which is not a Cluster, and the job has no
        dependencies (RQ WATCHes those) nor a rate limit (promoted in its own round trips)."""
        store = self.dedup.store
        return (
            self._is_async
            and isinstance(store, RedisStore)
            and not isinstance(self.connection, RedisCluster)
            and getattr(store.client, "connection_pool", None)
            is getattr(self.connection, "connection_pool", False)
            and not job._dependency_ids
            and not job.has_rate_limit
        )

    def _enqueue_fused(
        self, job: Job, name: str, policy: Policy, identity: Identity, ttl_ms: int,
        when: datetime | None, at_front: bool, params: Mapping[str, Any],
        publish: Callable[[Job], Job],
    ) -> Job | None:
        """Reserve and enqueue in one Lua script (``enqueue.lua``), one round trip.

        RQ writes its enqueue (or schedule) commands into a pipeline that is never executed;
        the script runs them only if the reservation is taken. A duplicate's answer carries
        the original job's hash, so it costs no further round trip either. If the script
        fails, nothing of it is left (it is atomic), so nothing is released: on a lost reply
        the reservation and the job may both exist, and the caller's retry is answered with
        that job.
        """
        owner = job.id
        pipe = self.connection.pipeline()
        try:
            if when is None:
                self.enqueue_job(job, pipeline=pipe, at_front=at_front)
            else:
                if at_front:
                    job.enqueue_at_front = True
                self.schedule_job(job, when, pipeline=pipe)
            commands = [command for command, _options in pipe.command_stack]
        finally:
            pipe.reset()
        replace = policy.on_duplicate is OnDuplicate.REPLACE
        peek = self.job_class.redis_job_namespace_prefix
        for _attempt in range(2):
            started = time.perf_counter()
            try:
                lock, peeked = reserve_and_run(self.connection, identity.key, owner, ttl_ms,
                                               identity.check, replace, commands, peek)
            except StoreUnavailableError as exc:
                if may_have_run(exc):  # the queue's Redis is unreachable: as a plain enqueue
                    raise
                self.dedup.store_error(name, policy, identity.key, owner, exc, "enqueue")
                return publish(job)  # on_store_error="allow": enqueued without dedup
            result = self.dedup.verdict(name, identity, owner, lock,
                                        time.perf_counter() - started)
            if result.verdict is Verdict.REPLACED and result.existing_id:
                self._cancel_replaced(result.existing_id)
            if result.verdict is not Verdict.DUPLICATE:
                return job
            holder = _decode_hash(peeked)
            if not self._release_stale(name, identity, result, holder.get("status")):
                break
        return self._on_duplicate(policy, name, identity.key, result.existing_id, params,
                                  holder)

    # -- duplicates --------------------------------------------------------------------------

    def _on_duplicate(
        self, policy: Policy, name: str, key: str, existing_id: str | None,
        params: Mapping[str, Any], holder: Mapping[str, Any] | None = None,
    ) -> Job | None:
        carried = [option for option in _WORKFLOW_OPTIONS if params.get(option)]
        if existing_id is not None and not _is_job_id(existing_id) and not carried:
            raise DuplicateTaskError(
                key, existing_id,
                f"duplicate job {name}: {key} is held by {existing_id!r}, which is not an RQ "
                "job id (another client's lock, e.g. Celery's, on the same identity)",
            )
        # An explicit job_id re-enqueued while alive is a duplicate of itself: "replace" has
        # nothing to take the place of, so the job itself is returned.
        itself = existing_id == params.get("job_id")
        if resolve_duplicate(name, policy, key, existing_id, carried, unit="job",
                             replace_raises=not itself):
            assert existing_id is not None
            return self._original(existing_id, holder)
        return None

    def _original(self, job_id: str, holder: Mapping[str, Any] | None = None) -> Job:
        """The original job by id, from its hash when the gate's answer carried it (else
        fetched); an unfetched handle if its data already expired."""
        job = self.job_class(job_id, connection=self.connection, serializer=self.serializer)
        try:
            if holder:
                job.restore(holder)
            else:
                job.refresh()  # type: ignore[no-untyped-call]
        except NoSuchJobError:
            job = self.job_class(job_id, connection=self.connection, serializer=self.serializer)
        if isinstance(job, DedupJob):
            job._taskdedup = self.dedup
        return job

    def _release_stale(
        self, name: str, identity: Identity, result: GateResult, status: Any = None
    ) -> bool:
        """Free a queued reservation whose job no longer exists (or already ended), so the
        caller may reserve again — only on the duplicate path. ``status``: the holder's job
        status when the gate's answer carried it (``None``: unknown, or no such job)."""
        existing = result.existing_id
        if result.state is not LockState.QUEUED or not existing:
            return False
        if not _is_job_id(existing):  # not an RQ job: not ours to judge stale
            return False
        if _alive(status) or self._job_alive(existing, wait=self.heal_grace):
            return False
        if self.dedup.release(name, identity.key, existing, reason="stale", only_queued=True):
            logger.info("taskdedup: released stale lock %s of vanished job %s", identity.key,
                        existing)
        return True

    def _cancel_replaced(self, job_id: str) -> None:
        """Cancel the queued original that a ``replace`` displaced (the claim fence covers a
        cancel that comes too late)."""
        try:
            job = Job.fetch(job_id, connection=self.connection, serializer=self.serializer)
            if job.get_status(refresh=False) in _NOT_STARTED:
                Job.cancel(job)  # RQ's cancel: the lock is already the new job's
        except (NoSuchJobError, InvalidJobOperation) as exc:
            logger.info("taskdedup: replaced job %s was not cancelled: %s", job_id, exc)

    def _job_status(self, job_id: str) -> str | None:
        raw = self.connection.hget(self.job_class.key_for(job_id), "status")
        return raw.decode() if isinstance(raw, bytes) else raw

    def _job_alive(self, job_id: str, wait: float = 0.0) -> bool:
        """Whether ``job_id`` exists and has not ended, polling up to ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while True:
            if _alive(self._job_status(job_id)):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    @staticmethod
    def _reservation_ttl_ms(policy: Policy, when: datetime | None, job_ttl: Any) -> int:
        """``ttl`` + the scheduling delay, capped by RQ's job ``ttl`` (+1 s) when shorter."""
        ttl_ms = policy.ttl_ms
        if when is not None:
            ttl_ms += int(_delay_seconds(when) * 1000)
        if isinstance(job_ttl, (int, float)) and not isinstance(job_ttl, bool) and job_ttl > 0:
            ttl_ms = min(ttl_ms, int(job_ttl * 1000) + 1000)
        return max(1, ttl_ms)

    # -- synchronous queues (is_async=False) -----------------------------------------------

    def run_job(self, job: Job) -> Job:
        """Run a job in this process (``is_async=False``) behind the execution guard."""
        guard = _guard_of(job)
        if guard is None:
            return super().run_job(job)
        dedup = self.dedup
        result = dedup.start(guard.name, guard.policy, guard.key, job.id)
        if result.verdict is Verdict.DUPLICATE:
            job._result = _skip_result(job, result)
            job.ended_at = now()
            result_ttl = job.get_result_ttl(default_ttl=DEFAULT_RESULT_TTL)
            with self.connection.pipeline() as pipe:
                job._handle_success(result_ttl=result_ttl, pipeline=pipe, worker_name="")
                job.cleanup(result_ttl, pipeline=pipe)
                pipe.execute()
            return job
        claimed = result.verdict is Verdict.ACCEPTED and guard.policy.mode.gates_execution
        try:
            job = super().run_job(job)
        except BaseException:
            if claimed:
                dedup.release(guard.name, guard.key, job.id, reason="failed")
            raise
        if claimed:
            dedup.finish(guard.name, guard.policy, guard.key, job.id, success=True)
        return job


# -- the worker -----------------------------------------------------------------------------


class DedupWorker(Worker):
    """An RQ worker that guards jobs carrying taskdedup meta: ``rq worker -w
    taskdedup.rq.DedupWorker``.

    Args:
        dedup_store: where locks live (a Store, a ``redis.Redis`` or a URL); default the
            ``TASKDEDUP_URL`` environment variable, else the worker's connection. It must be
            the store the queues use.

    In the work-horse, before the body: claim the lock. A duplicate is not run: the job
    FINISHES with ``skipped_info(job)`` set and a ``{"taskdedup": "skipped duplicate", ...}``
    result, without ``on_success`` callbacks or webhooks. If the store is down and the job's
    policy says ``on_store_error='raise'``, the job is put back (scheduled in
    :attr:`store_retry_delay` seconds when a scheduler serves the queue, else re-queued at the
    back after that delay) without running and without counting as a failure or a retry.
    """

    store_retry_delay: float = 5.0
    """Seconds before a job whose lock could not be claimed (store down) is tried again."""

    def __init__(self, *args: Any, dedup_store: Store | redis.Redis | str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dedup: Deduplicator = get_deduplicator(self.connection, dedup_store)
        self._dedup_pid = os.getpid()
        self._dedup_claims: dict[str, _Guard] = {}

    def perform_job(self, job: Job, queue: Queue, execution: Execution) -> bool:
        """Claim the lock (in the work-horse), then run the job as RQ does; skip duplicates."""
        try:
            return self._perform_guarded(job, queue, execution)
        finally:
            if os.getpid() != self._dedup_pid:  # a work-horse ends with os._exit: no atexit
                self._hand_stats_to_worker()

    # -- the horse's counters go to the worker process, not to Redis -----------------------

    def fork_work_horse(self, job: Job, queue: Queue) -> None:
        """RQ's fork, with a pipe over which the horse hands its counters back."""
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        self._stats_pipe: int | None = write_end
        try:
            super().fork_work_horse(job, queue)  # the horse never returns from here
        finally:
            os.close(write_end)
            self._stats_pipe = None
        self._stats_read: int | None = read_end

    def monitor_work_horse(self, job: Job, queue: Queue, execution: Execution) -> None:
        """RQ's monitoring; then the horse's counters join this process's (flushed with its
        own every few seconds: no stats round trip per job)."""
        try:
            super().monitor_work_horse(job, queue, execution)
        finally:
            self._take_stats_from_horse()

    def _hand_stats_to_worker(self) -> None:
        fd = getattr(self, "_stats_pipe", None)
        payload = stats.hand_over() if fd is not None else None
        try:
            if payload:
                os.write(fd, payload)  # type: ignore[arg-type]  # an empty pipe takes 32 KB
        except OSError:
            stats.take_over(payload)  # type: ignore[arg-type]  # back to this process's recorders
            payload = None
        finally:
            if fd is not None:
                os.close(fd)
        if payload is None:
            stats.flush_all()

    def _take_stats_from_horse(self) -> None:
        fd = getattr(self, "_stats_read", None)
        if fd is None:
            return
        self._stats_read = None
        chunks = []
        try:
            while True:  # non-blocking: whatever the horse wrote before it ended
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except BlockingIOError:  # a grandchild still holds the write end: no EOF, all read
            pass
        finally:
            os.close(fd)
        if chunks:
            stats.take_over(b"".join(chunks))

    def _perform_guarded(self, job: Job, queue: Queue, execution: Execution) -> bool:
        guard = _guard_of(job)
        if guard is None:
            return bool(super().perform_job(job, queue, execution))
        try:
            result = self.dedup.start(guard.name, guard.policy, guard.key, job.id)
        except StoreUnavailableError as exc:
            self._retry_later(job, queue, execution, guard, exc)
            return False
        if result.verdict is Verdict.DUPLICATE:
            self._skip(job, queue, execution, result)
            return True
        if result.verdict is Verdict.ACCEPTED and guard.policy.mode.gates_execution:
            self._dedup_claims[job.id] = guard
        try:
            return bool(super().perform_job(job, queue, execution))
        finally:
            if self._dedup_claims.pop(job.id, None) is not None:
                self.dedup.stop_heartbeat(guard.key, job.id)

    def handle_job_success(
        self, job: Job, queue: Queue, started_job_registry: StartedJobRegistry,
        execution: Execution,
    ) -> None:
        """Complete the lock (or keep it for a pending ``Repeat``), then record success."""
        guard = self._dedup_claims.pop(job.id, None)
        if guard is not None:
            if job.repeats_left:
                interval = job.repeat_intervals[0] if job.repeat_intervals else 0
                self._rereserve(guard, job, float(interval))
            else:
                self.dedup.finish(guard.name, guard.policy, guard.key, job.id, success=True)
        super().handle_job_success(job, queue, started_job_registry, execution)

    def handle_job_retry(
        self, job: Job, queue: Queue, retry: Retry, started_job_registry: StartedJobRegistry,
        execution: Execution,
    ) -> None:
        """A job returned ``Retry``: keep the lock for the retry, or release it at the last."""
        self._dedup_claims.pop(job.id, None)
        guard = _guard_of(job)
        if guard is not None:
            if job.number_of_retries and job.number_of_retries >= retry.max:
                self.dedup.release(guard.name, guard.key, job.id, reason="failed")
            else:
                interval = Retry.get_interval(job.number_of_retries or 0, retry.intervals)
                self._rereserve(guard, job, float(interval))
        super().handle_job_retry(job, queue, retry, started_job_registry, execution)

    def handle_job_failure(
        self, job: Job, queue: Queue, started_job_registry: StartedJobRegistry | None = None,
        exc_string: str = "", execution: Execution | None = None,
    ) -> None:
        """Release the lock on a final failure, re-reserve it for a ``Retry``; then RQ's.

        Also runs in the main process when the work-horse died (killed, out of memory, hard
        timeout): the key comes from the job's meta, the release is fenced by the job id.
        """
        self._dedup_claims.pop(job.id, None)
        guard = _guard_of(job)
        if guard is not None:
            stopped = self._stopped_job_id == job.id
            if job.should_retry and not stopped:
                self._rereserve(guard, job, float(job.get_retry_interval()))
            else:
                self.dedup.release(guard.name, guard.key, job.id,
                                   reason="stopped" if stopped else "failed")
        super().handle_job_failure(job, queue, started_job_registry=started_job_registry,
                                   exc_string=exc_string, execution=execution)

    # -- helpers ---------------------------------------------------------------------------

    def _rereserve(self, guard: _Guard, job: Job, interval: float) -> None:
        """Keep the lock owned by this job id, queued for ``ttl`` + ``interval``: the retry
        runs, and a third party's duplicate meanwhile is still suppressed."""
        dedup = self.dedup
        if guard.policy.mode is Mode.WHILE_EXECUTING:  # not executing meanwhile
            dedup.release(guard.name, guard.key, job.id, reason="retry")
            return
        dedup.stop_heartbeat(guard.key, job.id)
        ttl_ms = guard.policy.ttl_ms + int(interval * 1000)
        try:
            result = dedup.gate(guard.name, guard.policy, Identity(guard.key), job.id,
                                ttl_ms=ttl_ms)
        except StoreUnavailableError as exc:
            logger.warning("taskdedup: could not keep the lock of %s[%s] for its retry: %s",
                           guard.name, job.id, exc)
            return
        if result.verdict is Verdict.DUPLICATE:
            logger.info("taskdedup: %s[%s] will retry, but %s holds its identity now",
                        guard.name, job.id, result.existing_id)

    def _skip(self, job: Job, queue: Queue, execution: Execution, result: GateResult) -> None:
        """Finish a duplicate without running its body (not a failure; no callbacks)."""
        self.prepare_job_execution(job, remove_from_intermediate_queue=len(self.queues) == 1)
        job.started_at = now()
        self.handle_execution_ended(job, queue, job.success_callback_timeout)
        job._result = _skip_result(job, result)
        job._status = JobStatus.FINISHED
        self.handle_job_success(job=job, queue=queue,
                                started_job_registry=queue.started_job_registry,
                                execution=execution)

    def _retry_later(
        self, job: Job, queue: Queue, execution: Execution, guard: _Guard,
        exc: StoreUnavailableError,
    ) -> None:
        """Put the job back without running it: never run unguarded, never dropped."""
        delay = self.store_retry_delay
        scheduler = queue.scheduler_pid is not None
        logger.warning(
            "taskdedup: store unavailable before %s[%s]; %s in %ss (not run): %s",
            guard.name, job.id, "rescheduled" if scheduler else "re-queued", delay, exc,
        )
        if not scheduler:
            time.sleep(delay)
        with self.connection.pipeline() as pipe:
            self.cleanup_execution(job, pipeline=pipe, execution=execution)
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            if scheduler:
                queue.schedule_job(job, now() + timedelta(seconds=delay), pipeline=pipe)
            else:
                queue._enqueue_job(job, pipeline=pipe)  # as RQ's own Retry re-queues
            pipe.execute()
