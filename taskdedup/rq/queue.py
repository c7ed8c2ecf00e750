"""``DedupQueue``: RQ's enqueue methods behind the gate; one round trip where the locks live
in the queue's own Redis (the reservation rides in the script that writes and queues the job).
"""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Final

import redis
from redis.client import Pipeline
from redis.cluster import RedisCluster
from rq.defaults import DEFAULT_RESULT_TTL
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.timeouts import BaseDeathPenalty, UnixSignalDeathPenalty
from rq.utils import now

from .. import flow, running
from ..core import (
    Deduplicator,
    GateResult,
    Identity,
    Verdict,
    resolve_duplicate,
    window_probe,
)
from ..events import logger
from ..exceptions import ConfigurationError, DuplicateTaskError, StoreUnavailableError
from ..limits import Limit, coerce_limits
from ..policy import MAX_DURATION_MS, OnDuplicate, Policy, PolicyLike, is_disabled
from ..running import Running
from ..stores.base import LockState, Outcome, Store
from ..stores.redis import RedisStore, may_have_run, reserve_and_run
from . import _compat, many
from . import limits as job_limits
from .call import alive, decode_hash, delay_seconds, task_of
from .config import get_deduplicator
from .job import DedupJob
from .meta import META_KEY, Guard, meta_entry, skip_result, trusted_guard

__all__ = ["DedupQueue"]

_WORKFLOW_OPTIONS: Final = ("depends_on", "on_success", "on_failure", "on_stopped")
_CREATE_JOB_PARAMS: Final = frozenset(inspect.signature(Queue.create_job).parameters) - {"self"}
_ENQUEUE_CALL_SIGNATURE: Final = inspect.signature(Queue.enqueue_call)
_CREATE_JOB_SIGNATURE: Final = inspect.signature(Queue.create_job)
_NOT_FUSED: Final = _compat.FusedSupport("", "")  # locks elsewhere: no reason worth a log line
_CLAIM_ATTR: Final = "_taskdedup_claim"
"""A synchronous job's claim, from ``run_sync`` to ``run_job`` (RQ calls one from the other)."""


class DedupQueue(Queue):
    """An RQ queue whose ``enqueue``, ``enqueue_call``, ``enqueue_at``, ``enqueue_in`` and
    ``enqueue_many`` are gated per :class:`taskdedup.Policy`.

    Args:
        dedup: the queue's default policy (a Policy or a dict of its fields); ``None`` means
            ``Policy()``, ``False`` turns gating off unless a call passes ``dedup=``.
        dedup_store: where locks live (a Store, a ``redis.Redis`` or a URL); default the
            ``TASKDEDUP_URL`` environment variable, else the queue's own connection.
        dedup_prefix: the first component of lock keys (default ``taskdedup``).
        limits: ``[taskdedup.Concurrency(...), taskdedup.Rate(...)]`` for every job of this
            queue (SPEC §16), enforced by ``DedupWorker`` (run it ``--with-scheduler``).

    The other arguments are RQ's. Per call, the enqueue methods also take ``dedup=``
    (a Policy, a dict, or ``False`` to bypass both the gate and the worker guard) and
    ``dedup_key=`` (an explicit idempotency key); both are removed before RQ sees the call.

    Raises:
        ConfigurationError: ``dedup`` or ``dedup_store`` is invalid.
    """

    job_class: type[Job] = DedupJob
    dedup_limits: tuple[Limit, ...] = ()
    """The queue's ``limits=`` (SPEC §16), carried by every job it creates."""
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
        limits: Sequence[Limit] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            name, connection=connection, default_timeout=default_timeout, is_async=is_async,
            job_class=job_class, serializer=serializer, death_penalty_class=death_penalty_class,
            **kwargs,
        )
        if self.job_class is Job:  # passed on by a framework (django-rq's default JOB_CLASS)
            self.job_class = DedupJob  # keep what releases the lock on cancel and delete
        self.dedup_policy: Policy | None = Policy() if dedup is None else Policy.coerce(dedup)
        try:
            self.dedup: Deduplicator = get_deduplicator(self.connection, dedup_store, dedup_prefix)
        except ValueError as exc:  # a bad prefix
            raise ConfigurationError(f"DedupQueue({name!r}): {exc}") from exc
        self.dedup_limits = coerce_limits(limits, f"DedupQueue({name!r})")
        self._fused = self._check_fused()  # its probe job is made by create_job

    def _check_fused(self) -> _compat.FusedSupport | None:
        """Whether a reservation can ride in the script that writes and queues (or schedules)
        the job (None: not known yet, the server did not answer; checked again at the next
        enqueue)."""
        if not self._shares_the_store():
            return _NOT_FUSED
        try:
            return _compat.fused_support(self)
        except _compat.Unchecked:
            return None

    def _shares_the_store(self) -> bool:
        """Whether the locks live in this queue's Redis (same connection pool), which is not
        a Cluster, and jobs are queued for workers: then a reservation can ride in the
        script that writes and queues the job."""
        store = self.dedup.store
        return (
            _compat.is_async(self)
            and isinstance(store, RedisStore)
            and not isinstance(self.connection, RedisCluster)
            and getattr(store.client, "connection_pool", None)
            is getattr(self.connection, "connection_pool", False)
        )

    # -- jobs know their deduplicator ------------------------------------------------------

    def create_job(self, *args: Any, **kwargs: Any) -> Job:
        """RQ's ``create_job``; a DedupJob also learns this queue's deduplicator (its store),
        and a call under the queue's ``limits=`` carries them in its meta (:mod:`.limits`)."""
        if self.dedup_limits and not is_disabled():
            bound = _CREATE_JOB_SIGNATURE.bind(self, *args, **kwargs)
            call = bound.arguments
            name = task_of(call["func"])[0]
            lease = (self.dedup_policy or Policy()).lease
            call["meta"] = {**(call.get("meta") or {}), job_limits.META_KEY: job_limits.meta_entry(
                self.dedup, name, self.dedup_limits, lease, call.get("args") or (),
                call.get("kwargs") or {})}
            args, kwargs = bound.args[1:], bound.kwargs
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
        params = _compat.parse_enqueue_args(f, *args, **kwargs)
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
        params = _compat.parse_enqueue_args(f, *args, **kwargs)
        return self._gated(params, dedup, dedup_key, datetime)

    def enqueue_many(  # type: ignore[override]
        self, job_datas: Iterable[Any], pipeline: Pipeline | None = None,
        group_id: str | None = None,
    ) -> list[Job | None]:
        """``Queue.enqueue_many`` behind the gate: the calls' reservations in one round trip,
        then RQ's own ``enqueue_many`` of the accepted ones (:mod:`.many`).

        One answer per call, in call order: its job; for a duplicate, the original's job
        (another call of the same batch included) or ``None`` (``on_duplicate="drop"``). All
        or nothing: a refused call raises and nothing of the batch is enqueued. Calls made
        with :meth:`prepare_data` may carry ``dedup=`` and ``dedup_key=``.
        """
        return many.enqueue_many(self, job_datas, pipeline, group_id, super().enqueue_many)

    prepare_data = staticmethod(many.prepare_data)
    """RQ's ``Queue.prepare_data``; also takes ``dedup=`` and ``dedup_key=`` per call."""

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

        def publish(job: Job, pipe: Pipeline | None = pipeline) -> Job:
            """RQ's own enqueue (or schedule) of ``job`` (``unique`` only where RQ has it)."""
            extra = {"unique": True} if unique else {}
            if when is None:
                return self.enqueue_job(job, pipeline=pipe, at_front=at_front, **extra)
            if at_front:
                job.enqueue_at_front = True
            return self.schedule_job(job, when, pipeline=pipe, **extra)

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

        name, bind_to = task_of(func)
        args, kwargs = params.get("args") or (), params.get("kwargs") or {}
        identity = self.dedup.identity(name, policy, args, kwargs, func=bind_to,
                                       dedup_key=dedup_key)
        owner = job_id or str(uuid.uuid4())
        create["job_id"] = owner
        create["meta"] = {**(params.get("meta") or {}),
                          META_KEY: meta_entry(name, identity.key, policy, identity.check)}
        job = self.create_job(**create)  # RQ validates its options before anything is stored
        flows = _compat.is_async(self) and not unique  # a synchronous queue runs it now
        if policy.debounce is not None and flows:  # its countdown replaces `when`
            return self._enqueue_debounced(job, name, policy, identity, at_front)
        if (policy.on_duplicate is OnDuplicate.COALESCE and job_id is None and flows
                and when is None and not any(params.get(o) for o in _WORKFLOW_OPTIONS)):
            commands = self._captured(job, publish, when) if self._fuses(job, when) else None
            if commands is not None:  # one round trip unless the call becomes a follow-up
                ttl_ms = self._reservation_ttl_ms(policy, when, params.get("ttl"))
                return self._enqueue_fused(
                    job, name, policy, identity, ttl_ms, commands, params, publish,
                    follow_up=(create, at_front))
            return self._enqueue_coalesced(job, name, policy, identity, params, create,
                                           publish, at_front)
        if not policy.mode.gates_enqueue:
            return publish(job)

        ttl_ms = self._reservation_ttl_ms(policy, when, params.get("ttl"))
        commands = (self._captured(job, publish, when)
                    if not unique and self._fuses(job, when) else None)
        if commands is not None:  # an explicit job id's status is read inside the script
            return self._enqueue_fused(job, name, policy, identity, ttl_ms, commands, params,
                                       publish, guard=job_id is not None)
        if job_id is not None:
            status = self._job_status(job_id)
            if unique and status is not None:
                return publish(job)  # RQ raises DuplicateJobError; the lock is that job's
            if alive(status):
                # The same job id re-enqueued while it is alive: a duplicate of itself.
                return self._on_duplicate(policy, name, identity.key, job_id, params)

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
                isinstance(exc, _compat.DuplicateJobError) and self._job_alive(owner)
            ):
                self.dedup.release(name, identity.key, owner, reason="publish_failed")
            raise

    # -- coalesce and debounce (SPEC §15, taskdedup.flow) -----------------------------------

    def _enqueue_debounced(
        self, job: Job, name: str, policy: Policy, identity: Identity, at_front: bool
    ) -> Job:
        """``debounce=``: every call is enqueued, scheduled ``wait`` on (or what is left of
        ``max_wait``) with the generation the publish's Lua call gave it (a second round
        trip: RQ's own schedule); the worker runs only the burst's last call."""
        generation, delay = flow.debounce(self.dedup, name, policy, identity.key)
        _flow_meta(job, flow.GENERATION, generation)
        try:
            if delay <= 0:
                return self.enqueue_job(job, at_front=at_front)
            if at_front:
                job.enqueue_at_front = True
            # RQ's scheduled registry keeps whole seconds (truncated): round up, never early
            when = now() + timedelta(seconds=delay)
            if when.microsecond:
                when = when.replace(microsecond=0) + timedelta(seconds=1)
            return self.schedule_job(job, when)
        except BaseException:  # take the generation back before the error reaches the caller
            flow.undo(self.dedup, name, flow.debounce_key(self.dedup, identity.key), generation)
            raise

    def _follow_up(
        self, name: str, key: str, follow: str, generation: int, job: Job,
        create: Mapping[str, Any], at_front: bool,
    ) -> Job:
        """Write this call as the follow-up job ``follow`` (its data with this call's
        arguments, its meta with the follow-up's generation) and queue its id."""
        owner = job.id
        if follow != owner:
            job = self.create_job(**{**create, "job_id": follow})
        _flow_meta(job, flow.FOLLOW_UP, generation)
        try:
            return self.enqueue_job(job, at_front=at_front)
        except BaseException:  # take the generation back before the error reaches the caller
            flow.undo(self.dedup, name, flow.follow_up_key(self.dedup, key), generation,
                      created=follow == owner)
            raise

    def _enqueue_coalesced(
        self, job: Job, name: str, policy: Policy, identity: Identity,
        params: Mapping[str, Any], create: dict[str, Any], publish: Callable[[Job], Job],
        at_front: bool,
    ) -> Job | None:
        """``on_duplicate="coalesce"``: the gate in one Lua call; a queued original's job, or
        this call written as the identity's follow-up (its job id kept across the calls it
        gathers: the job's data is written again with the latest arguments and its id queued
        again; a copy that finds the follow-up claimed ends without a new outcome)."""
        owner = job.id
        ttl_ms = self._reservation_ttl_ms(policy, None, params.get("ttl"))
        answer = flow.coalesce(self.dedup, name, policy, identity, owner, ttl_ms)
        if answer.verdict is Verdict.COALESCED:
            return self._follow_up(name, identity.key, answer.existing_id or owner,
                                   answer.generation, job, create, at_front)
        if answer.verdict is Verdict.DUPLICATE:
            return self._on_duplicate(policy, name, identity.key, answer.existing_id, params)
        try:
            return publish(job)
        except BaseException:
            if answer.verdict is not Verdict.UNGUARDED:
                self.dedup.release(name, identity.key, owner, reason="publish_failed")
            raise

    # -- one round trip: reserve inside RQ's own enqueue -------------------------------------

    def _fuses(self, job: Job, when: datetime | None = None) -> bool:
        """Whether this job's reservation can ride in the script that writes and queues (or
        schedules) it: that path passed the queue's check, and the job has no dependencies
        (RQ WATCHes those) nor a rate limit (promoted in its own round trips)."""
        if self._fused is None:
            self._fused = self._check_fused()
        fused = self._fused
        return (
            fused is not None
            and (fused.enqueue if when is None else fused.schedule) is None
            and not _compat.has_dependencies(job)
            and not _compat.has_rate_limit(job)
        )

    def _captured(
        self, job: Job, publish: Callable[[Job, Pipeline | None], Job], when: datetime | None
    ) -> list[Any] | None:
        """RQ's own enqueue (or schedule) commands for ``job``, captured without sending
        anything; None (and the public path) if they cannot ride in the script."""
        try:
            return _compat.capture_enqueue(self.connection, lambda pipe: publish(job, pipe),
                                           job.id, "enqueue" if when is None else "schedule")
        except _compat.CaptureRefused as exc:
            _compat.say_public_path(str(exc))
            return None

    def _enqueue_fused(
        self, job: Job, name: str, policy: Policy, identity: Identity, ttl_ms: int,
        commands: list[Any], params: Mapping[str, Any], publish: Callable[[Job], Job],
        follow_up: tuple[Mapping[str, Any], bool] | None = None, guard: bool = False,
    ) -> Job | None:
        """Reserve and enqueue in one Lua script (``enqueue.lua``), one round trip.

        ``guard`` (an explicit job id): the script first reads that job's status, and a job
        of this id that exists and has not ended makes the call a duplicate of itself (its
        hash in the answer), as the non-fused path's status read does in a round trip of
        its own.

        ``commands`` are RQ's own enqueue (or schedule) writes, captured in a pipeline that was
        never executed; the script runs them only if the reservation is taken. A duplicate's
        answer carries the original job's hash, so it costs no further round trip either. If
        the script fails, nothing of it is left (it is atomic), so nothing is released: on a
        lost reply the reservation and the job may both exist, and the caller's retry is
        answered with that job.
        """
        owner = job.id
        replace = policy.on_duplicate is OnDuplicate.REPLACE
        peek = self.job_class.redis_job_namespace_prefix
        record = None if follow_up is None else flow.follow_up_key(self.dedup, identity.key)
        for _attempt in range(2):
            started = time.perf_counter()
            try:
                lock, peeked = reserve_and_run(self.connection, identity.key, owner, ttl_ms,
                                               identity.check, replace, commands, peek,
                                               window=window_probe(policy, identity.key),
                                               follow_up=record, guard=guard,
                                               compact_owners=getattr(
                                                   self.dedup.store, "compact_owners", False))
            except StoreUnavailableError as exc:
                if may_have_run(exc):  # the queue's Redis is unreachable: as a plain enqueue
                    raise
                self.dedup.store_error(name, policy, identity.key, owner, exc, "enqueue")
                return publish(job)  # on_store_error="allow": enqueued without dedup
            if lock.outcome is Outcome.ALIVE:
                # The same job id re-enqueued while it is alive: a duplicate of itself.
                return self._on_duplicate(policy, name, identity.key, owner, params,
                                          decode_hash(peeked))
            if lock.outcome is Outcome.COALESCED and follow_up is not None and peeked:
                follow, generation = lock.owner or owner, int(peeked[0])
                flow.coalesced(self.dedup, name, identity.key, owner, follow, generation,
                               time.perf_counter() - started)
                return self._follow_up(name, identity.key, follow, generation, job,
                                       *follow_up)
            result = self.dedup.verdict(name, identity, owner, lock,
                                        time.perf_counter() - started)
            if result.verdict is Verdict.REPLACED and result.existing_id:
                self._cancel_replaced(result.existing_id)
            if result.verdict is not Verdict.DUPLICATE:
                return job
            holder = decode_hash(peeked)
            if not self._release_stale(name, identity, result, holder.get("status")):
                break
        return self._on_duplicate(policy, name, identity.key, result.existing_id, params,
                                  holder)

    # -- duplicates --------------------------------------------------------------------------

    def _on_duplicate(
        self, policy: Policy, name: str, key: str, existing_id: str | None,
        params: Mapping[str, Any], holder: Mapping[str, Any] | None = None,
    ) -> Job | None:
        if self._answers_duplicate(policy, name, key, existing_id, params):
            assert existing_id is not None
            return self._original(existing_id, holder)
        return None

    def _answers_duplicate(
        self, policy: Policy, name: str, key: str, existing_id: str | None,
        params: Mapping[str, Any],
    ) -> bool:
        """``on_duplicate`` for a duplicate call (RQ's enqueue options in ``params``): True to
        answer with the original's job, False to drop it; DuplicateTaskError to refuse."""
        carried = [option for option in _WORKFLOW_OPTIONS if params.get(option)]
        if existing_id is not None and not _compat.is_job_id(existing_id) and not carried:
            raise DuplicateTaskError(
                key, existing_id,
                f"duplicate job {name}: {key} is held by {existing_id!r}, which is not an RQ "
                "job id (another client's lock, e.g. Celery's, on the same identity)",
            )
        # An explicit job_id re-enqueued while alive is a duplicate of itself: "replace" has
        # nothing to take the place of, so the job itself is returned.
        itself = existing_id == params.get("job_id")
        return resolve_duplicate(name, policy, key, existing_id, carried, unit="job",
                                 replace_raises=not itself)

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
        if not _compat.is_job_id(existing):  # not an RQ job: not ours to judge stale
            return False
        if alive(status) or self._job_alive(existing, wait=self.heal_grace):
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
            if job.get_status(refresh=False) in _compat.NOT_STARTED:
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
            if alive(self._job_status(job_id)):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    @staticmethod
    def _reservation_ttl_ms(policy: Policy, when: datetime | None, job_ttl: Any) -> int:
        """``ttl`` + the scheduling delay, capped by RQ's job ``ttl`` (+1 s) when shorter."""
        ttl_ms = policy.ttl_ms
        if when is not None:
            ttl_ms += int(delay_seconds(when) * 1000)
        if isinstance(job_ttl, (int, float)) and not isinstance(job_ttl, bool) and job_ttl > 0:
            ttl_ms = min(ttl_ms, int(job_ttl * 1000) + 1000)
        return max(1, min(ttl_ms, MAX_DURATION_MS))

    # -- synchronous queues (is_async=False) -----------------------------------------------

    def run_sync(self, job: Job) -> Job:
        """Run a job in this process (``is_async=False``) behind the execution guard.

        The claim comes first: a copy of this very job id while it runs (a nested or
        concurrent run of the same id) or after its own success ends here without a new
        outcome — no result, no callbacks — and the job is left as that run leaves it.
        """
        try:
            guard = trusted_guard(job, self.dedup)
        except TypeError as exc:  # arguments without identity: failed by run_job, not run
            setattr(job, _CLAIM_ATTR, (None, exc))
            return super().run_sync(job)
        if guard is None:
            return super().run_sync(job)
        claim: GateResult | StoreUnavailableError
        try:
            claim = self.dedup.start(guard.name, guard.policy, guard.key, job.id,
                                     check=guard.check)
        except StoreUnavailableError as exc:  # the job fails with it (run_job raises it)
            claim = exc
        if isinstance(claim, GateResult) and claim.verdict is Verdict.FINISHED:
            job.set_status(JobStatus.FINISHED)  # as its own run left it
            return job
        if isinstance(claim, GateResult) and claim.verdict is Verdict.DEFERRED:
            logger.info("taskdedup: %s[%s] is running now: this synchronous copy of it is "
                        "not run (the running one gives the job its outcome)", guard.name,
                        job.id)
            return job
        setattr(job, _CLAIM_ATTR, (guard, claim))
        return super().run_sync(job)

    def run_job(self, job: Job) -> Job:
        """The body of a synchronous job (called by ``run_sync``) after its claim: skipped as
        a duplicate, or run under its own identity (:mod:`taskdedup.running`; the enclosing
        job's is restored after it) and its lock completed or released."""
        pending: tuple[Guard | None, GateResult | Exception] | None = getattr(
            job, _CLAIM_ATTR, None)
        if pending is None:  # not guarded: no identity, never the enclosing job's
            token = running.enter(None)
            try:
                return super().run_job(job)
            finally:
                running.leave(token)
        delattr(job, _CLAIM_ATTR)
        guard, claim = pending
        if isinstance(claim, Exception):
            raise claim
        assert guard is not None
        dedup = self.dedup
        if claim.verdict is Verdict.DUPLICATE:
            _compat.mark_finished(job, skip_result(job, claim))
            job.ended_at = now()
            result_ttl = job.get_result_ttl(default_ttl=DEFAULT_RESULT_TTL)
            with self.connection.pipeline() as pipe:
                _compat.save_success(job, result_ttl, pipe)
                job.cleanup(result_ttl, pipeline=pipe)
                pipe.execute()
            return job
        claimed = claim.verdict is Verdict.ACCEPTED and guard.policy.mode.gates_execution
        token = running.enter(Running(guard.name, job.id, guard.key, guard.policy.ttl,
                                      redelivery=None))
        try:
            job = super().run_job(job)
        except BaseException:
            if claimed:
                dedup.release(guard.name, guard.key, job.id, reason="failed")
            raise
        finally:
            running.leave(token)
        if claimed:
            dedup.finish(guard.name, guard.policy, guard.key, job.id, success=True)
        return job


def _flow_meta(job: Job, field: str, generation: int) -> None:
    """Put ``generation`` in ``field`` of the job's taskdedup meta (0: the store was down
    and on_store_error='allow': no generation, the call runs as it is)."""
    if generation:
        job.meta[META_KEY] = {**job.meta[META_KEY], field: generation}
