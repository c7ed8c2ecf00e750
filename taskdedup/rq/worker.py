"""``DedupWorker``: claims the lock before the body runs (in the worker, just before it forks
the work-horse; in the process that runs the body otherwise), and completes, releases or
re-reserves it from RQ's own success, failure and retry handlers."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import redis
from rq.job import Job, JobStatus, Retry
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.utils import now
from rq.worker import Worker

from .. import flow, running, stats
from ..core import Deduplicator, GateResult, Identity, StartResult, Verdict, copy_wait
from ..events import logger
from ..exceptions import (
    BusyTimeoutError,
    ConfigurationError,
    StoreUnavailableError,
    TaskDedupError,
)
from ..forklease import ChildLease
from ..policy import MAX_DURATION_MS, Mode, OnDuplicate
from ..running import Running
from ..stores.base import Store
from ..stores.redis import refused
from . import _compat
from . import limits as job_limits
from .config import get_deduplicator
from .logs import log_to_worker, skipped_job
from .meta import META_KEY, Guard, skip_result, trusted_guard

if TYPE_CHECKING:
    from rq.executions import Execution

__all__ = ["DedupWorker"]


@dataclass(slots=True)
class _Ahead:
    """A job's claim made by the worker before it forked the work-horse (see
    :meth:`DedupWorker.fork_work_horse`): the horse acts on ``result`` instead of claiming."""

    job_id: str
    guard: Guard
    result: StartResult
    lease: ChildLease | None  # the running lock the worker renews for the horse


@contextlib.contextmanager
def _frozen_for_fork() -> Iterator[None]:
    """Freeze the garbage collector's objects for a fork, and thaw them in this process.

    The work-horse's collections then leave the objects it inherits alone: a collection
    that reached them would write to every page they are on, each a copy-on-write fault
    (the guard's allocations made the horse's collections reach them: ~1 ms a job, #25).
    This is the fork pattern of :func:`gc.freeze`'s documentation. The young generations
    are collected first, so what thaws into the oldest one is counted as a collection's
    survivors are (the worker's own garbage is collected as before), and the horse starts
    with none of the worker's young objects to scan. A process that froze objects itself
    (``gc.get_freeze_count() > 0``) or turned collection off is left as it is."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.collect(1)
    gc.freeze()
    try:
        yield  # the horse leaves by os._exit, its objects still frozen
    finally:
        gc.unfreeze()


class DedupWorker(Worker):
    """An RQ worker that guards jobs carrying taskdedup meta: ``rq worker -w
    taskdedup.rq.DedupWorker``.

    Args:
        dedup_store: where locks live (a Store, a ``redis.Redis`` or a URL); default the
            ``TASKDEDUP_URL`` environment variable, else the worker's connection. It must be
            the store the queues use.

    Before the body: claim the lock (in this process, just before it forks the work-horse;
    its heartbeat thread renews the lease while the horse runs, see
    :mod:`taskdedup.forklease`). A duplicate is not run: the job
    FINISHES with ``skipped_info(job)`` set and a ``{"taskdedup": "skipped duplicate", ...}``
    result, without ``on_success`` callbacks or webhooks. A copy of this very job id while it
    runs elsewhere (its lock ``running`` by this id, lease live) is put back for later, a
    quarter of the lease on (at least 1 s), neither run nor failed nor counted as a retry; a
    copy after this id's own success ends without a new outcome (the job stays as its first
    run left it). If the store is down and the job's policy says ``on_store_error='raise'``,
    the job is put back (scheduled in :attr:`store_retry_delay` seconds when a scheduler
    serves the queue, else re-queued at the back after that delay) without running and
    without counting as a failure or a retry; a claim Redis refuses for what it is (NOPERM:
    the ACL user lacks a command or the key pattern) fails the job with an error that points
    at ``taskdedup doctor``.

    The lock key in the job's meta is used only when it is one this worker's deduplicator
    could have made for the job's function (:func:`~taskdedup.rq.meta.trusted_guard`); else
    the identity is recomputed from the job's arguments, with a WARNING.

    RQ 3.x passes an ``Execution`` to the methods below and RQ 2.x does not; they take it
    optionally and hand it on only where RQ expects it.
    """

    store_retry_delay: float = 5.0
    """Seconds before a job whose lock could not be claimed (store down) is tried again."""

    def __init__(self, *args: Any, dedup_store: Store | redis.Redis | str | None = None,
                 **kwargs: Any) -> None:
        missing = _compat.missing_worker_hooks()
        if missing:
            raise ConfigurationError(
                f"DedupWorker cannot guard jobs on this RQ release: rq.worker.Worker lacks "
                f"{', '.join(missing)} as taskdedup knows them; install an RQ release taskdedup "
                "supports (docs/reference/versions.md)"
            )
        super().__init__(*args, **kwargs)
        self.dedup: Deduplicator = get_deduplicator(self.connection, dedup_store)
        self.dedup.check_store()  # here, not in every forked work-horse (one INFO per job)
        self._dedup_pid = os.getpid()
        self._dedup_claims: dict[str, Guard] = {}
        self._dedup_unclaimed: set[str] = set()  # failed before a claim: no lock to touch
        self._dedup_released: set[str] = set()  # released as its function raised
        self._dedup_ahead: _Ahead | None = None  # claimed before the fork, for the horse
        self._dedup_forks = _forks_its_horse(type(self))

    def bootstrap(self, *args: Any, **kwargs: Any) -> None:
        """RQ's start-up (it sets up the worker's log handlers); then our records join that
        output when the application configured no logging of its own (:mod:`.logs`)."""
        super().bootstrap(*args, **kwargs)
        log_to_worker()

    def unsubscribe(self) -> None:
        """RQ's, with its pub/sub thread told to stop first: a worker on redis-py 8.2 could
        take 60 s to exit otherwise (:func:`~taskdedup.rq._compat.quiet_pubsub_thread`)."""
        thread = getattr(self, "pubsub_thread", None)
        if thread is not None:
            _compat.quiet_pubsub_thread(thread)
        super().unsubscribe()  # type: ignore[no-untyped-call]

    def perform_job(self, job: Job, queue: Queue, execution: Execution | None = None) -> bool:
        """Claim the lock (in the work-horse), then run the job as RQ does; skip duplicates."""
        try:
            return self._perform_guarded(job, queue, execution)
        finally:
            if os.getpid() != self._dedup_pid:  # a work-horse ends with os._exit: no atexit
                self._hand_stats_to_worker()

    # -- the horse's counters go to the worker process, not to Redis -----------------------

    def fork_work_horse(self, job: Job, queue: Queue) -> None:
        """The job's claim (:meth:`_claim_before_fork`), then RQ's fork, with a pipe over
        which the horse hands its counters back, and this process's objects frozen for the
        fork (:func:`_frozen_for_fork`)."""
        self._dedup_ahead = self._claim_before_fork(job) if self._dedup_forks else None
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        self._stats_pipe: int | None = write_end
        try:
            with _frozen_for_fork():
                super().fork_work_horse(job, queue)  # the horse never returns from here
        except BaseException:
            self._end_ahead()
            raise
        finally:
            os.close(write_end)
            self._stats_pipe = None
        self._stats_read: int | None = read_end

    def _claim_before_fork(self, job: Job) -> _Ahead | None:
        """Claim ``job``'s lock here, before the fork, for the horse to act on: this process's
        objects are warm, and its heartbeat thread (running anyway) renews the lease while
        the horse runs (:class:`~taskdedup.forklease.ChildLease`), so a horse starts no
        thread of its own. None (the horse claims, as on any worker) for a job without a
        lock or whose claim compares a generation (debounce, coalesce), and when the claim
        here fails (the horse claims again and acts on what it gets)."""
        try:
            guard = trusted_guard(job, self.dedup)
        except TypeError:  # no identity: the horse fails the job, as before
            return None
        if guard is None or not guard.policy.mode.gates_execution \
                or _flow_generation(job, guard)[0] is not None:
            return None
        try:  # first, so that nothing can fail between the claim and the hand-over
            child = ChildLease(self.dedup, guard.name, guard.key, job.id, guard.policy.lease_ms)
        except OSError:  # no shared memory to be had: the horse claims as it always did
            return None
        try:
            result = self.dedup.start(guard.name, guard.policy, guard.key, job.id,
                                      check=guard.check)
        except StoreUnavailableError:
            child.discard()
            return None  # the horse claims again, and puts the job back or fails it
        except Exception:  # never in the way of the job: the horse claims as it always did
            child.discard()
            logger.exception("taskdedup: claiming %s[%s] before the fork failed",
                             guard.name, job.id)
            return None
        lease: ChildLease | None = child
        if result.verdict is not Verdict.ACCEPTED or not child.keep():
            child.discard()
            lease = None  # no lock taken (a duplicate, a copy, ...): nothing to renew
        return _Ahead(job.id, guard, result, lease)

    def _end_ahead(self) -> None:
        """The horse has ended (or was never forked): stop renewing the lease kept for it."""
        ahead, self._dedup_ahead = self._dedup_ahead, None
        if ahead is not None and ahead.lease is not None:
            ahead.lease.end()

    def monitor_work_horse(
        self, job: Job, queue: Queue, execution: Execution | None = None
    ) -> None:
        """RQ's monitoring; then the horse's counters join this process's (flushed with its
        own every few seconds: no stats round trip per job)."""
        try:
            super().monitor_work_horse(
                job, queue, *_compat.execution_args("monitor_work_horse", execution)
            )
        finally:
            self._end_ahead()
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
            stats.flush_before_exit()

    def _stats_threads_later(self) -> None:
        """After the claim in a work-horse: a horse that runs a body under a heartbeat starts
        its stats threads (and flushes) from that heartbeat's thread once the first flush
        would have been due, so a long job's counts reach Redis as before; it spares a
        thread start per job (most jobs end first, their counts handed to the worker).
        Without a heartbeat (the worker claimed before the fork and renews the lease) they
        are released now: none was wanted yet, so a thread starts only if the body records
        something, and :meth:`_settle_as_it_returns` holds them again after the body."""
        heartbeat = self.dedup.heartbeat()
        if len(heartbeat):
            heartbeat.call_later(stats.held_interval(),
                                 functools.partial(stats.release_threads, flush=True))
        else:
            stats.release_threads()

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

    # -- the guard -------------------------------------------------------------------------

    def _perform_guarded(self, job: Job, queue: Queue, execution: Execution | None) -> bool:
        run = _compat.execution_args("perform_job", execution)
        horse = os.getpid() != self._dedup_pid
        ahead = self._dedup_ahead if horse else None
        if ahead is not None and ahead.job_id == job.id:
            guard: Guard | None = ahead.guard
        else:
            ahead = None
            try:
                guard = trusted_guard(job, self.dedup)
            except TypeError as exc:  # its arguments have no identity: never run unguarded
                return self._fail(job, queue, run, TaskDedupError(
                    f"taskdedup: job {job.id} carries no usable lock key and its arguments "
                    f"have no identity ({exc}); not run"))
        if guard is None:
            limited = job_limits.enter(self, job, queue, execution, run, None)
            if limited is not None:
                return limited
            try:
                return bool(super().perform_job(job, queue, *run))
            finally:
                job_limits.leave(self, job)
        generation, follow_up = _flow_generation(job, guard)
        if horse:  # no stats thread per work-horse: its counts go to the worker at its end
            stats.hold_threads()
        try:
            if ahead is not None:  # claimed by the worker before the fork
                result = ahead.result
                if ahead.lease is not None:
                    ahead.lease.adopt()
            elif generation is None:
                result = self.dedup.start(guard.name, guard.policy, guard.key, job.id,
                                          check=guard.check)
            else:  # debounce / coalesce: the claim compares the job's generation
                result = flow.claim(self.dedup, guard.name, guard.policy, guard.key, job.id,
                                    generation=generation, follow_up=follow_up)
        except StoreUnavailableError as exc:
            if horse:
                stats.release_threads()
            if refused(exc):  # the same answer every time: this job's error, not an outage
                return self._fail(job, queue, run, _refusal(guard, job, exc))
            self._retry_later(job, queue, execution, guard, exc)
            return False
        except BaseException:
            if horse:
                stats.release_threads()
            raise
        if horse:
            self._stats_threads_later()
        if result.verdict is Verdict.SUPERSEDED:
            if follow_up:  # the follow-up's newer write runs under this id: no new outcome
                self._end_copy(job, queue, execution)
            else:
                self._skip(job, queue, execution, result,
                           flow.superseded_value(generation or 0))
            return True
        if result.verdict is Verdict.DUPLICATE:
            self._skip(job, queue, execution, result)
            return True
        if result.verdict is Verdict.WAITING and follow_up:
            # put off as a copy is (only its id goes back): a newer call's data is kept
            delay = flow.busy_wait(guard.policy, 0.0)
            self._put_back(job, queue, execution, delay or copy_wait(guard.policy), save=False)
            return True
        if result.verdict is Verdict.DEFERRED:
            self._defer(job, queue, execution, guard)
            return True
        if result.verdict is Verdict.WAITING:
            return self._wait(job, queue, execution, run, guard, result.existing_id)
        if result.verdict is Verdict.FINISHED:
            self._end_finished(job, queue, execution)
            return True
        if result.verdict is Verdict.ACCEPTED and guard.policy.mode.gates_execution:
            self._dedup_claims[job.id] = guard
            self._settle_as_it_returns(job, guard)
        limited = job_limits.enter(self, job, queue, execution, run, guard)  # SPEC §16
        if limited is not None:
            return limited
        # the body (and taskdedup.sql.effects in it) sees the identity the job carried
        token = running.enter(Running(guard.name, job.id, guard.key, guard.policy.ttl,
                                      redelivery=None))  # RQ has no visibility timeout
        try:
            return bool(super().perform_job(job, queue, *run))
        finally:
            running.leave(token)
            job_limits.leave(self, job)
            if self._dedup_claims.pop(job.id, None) is not None:
                self.dedup.stop_heartbeat(guard.key, job.id)

    def handle_job_success(
        self, job: Job, queue: Queue, started_job_registry: StartedJobRegistry,
        execution: Execution | None = None,
    ) -> None:
        """Complete the lock (or keep it for a pending ``Repeat``), then record success."""
        guard = self._dedup_claims.pop(job.id, None)
        if guard is not None:
            if job.repeats_left:
                interval = job.repeat_intervals[0] if job.repeat_intervals else 0
                self._rereserve(guard, job, float(interval), again="repeat")
            else:
                self.dedup.finish(guard.name, guard.policy, guard.key, job.id, success=True)
        super().handle_job_success(
            job, queue, started_job_registry,
            *_compat.execution_args("handle_job_success", execution),
        )

    def handle_job_retry(
        self, job: Job, queue: Queue, retry: Retry, started_job_registry: StartedJobRegistry,
        execution: Execution | None = None,
    ) -> None:
        """A job returned ``Retry``: keep the lock for the retry, or release it at the last."""
        self._dedup_claims.pop(job.id, None)
        guard = self._lock_of(job)
        if guard is not None:
            if job.number_of_retries and job.number_of_retries >= retry.max:
                self.dedup.release(guard.name, guard.key, job.id, reason="failed")
            else:
                interval = Retry.get_interval(job.number_of_retries or 0, retry.intervals)
                self._rereserve(guard, job, float(interval))
        super().handle_job_retry(
            job, queue, retry, started_job_registry,
            *_compat.execution_args("handle_job_retry", execution),
        )

    def handle_job_failure(
        self, job: Job, queue: Queue, started_job_registry: StartedJobRegistry | None = None,
        exc_string: str = "", execution: Execution | None = None,
    ) -> None:
        """Release the lock on a final failure, re-reserve it for a ``Retry``; then RQ's.

        Also runs in the main process when the work-horse died (killed, out of memory, hard
        timeout): the key comes from the job's meta, the release is fenced by the job id.
        """
        self._dedup_claims.pop(job.id, None)
        guard = None if self._discard_released(job.id) else self._lock_of(job)
        if guard is not None:
            stopped = _compat.stopped_job_id(self) == job.id
            if job.should_retry and not stopped:
                self._rereserve(guard, job, float(job.get_retry_interval()))
            else:
                self.dedup.release(guard.name, guard.key, job.id,
                                   reason="stopped" if stopped else "failed")
        super().handle_job_failure(
            job, queue, started_job_registry=started_job_registry, exc_string=exc_string,
            **_compat.execution_kwargs("handle_job_failure", execution),
        )

    # -- helpers ---------------------------------------------------------------------------

    def _discard_released(self, job_id: str) -> bool:
        """Whether the job's lock was released as its function raised (and forget it)."""
        released = job_id in self._dedup_released
        self._dedup_released.discard(job_id)
        return released

    def _lock_of(self, job: Job) -> Guard | None:
        """The trusted guard of a job whose lock a failure or retry handler releases or
        re-reserves; None without one, or when the job failed before any claim."""
        if job.id in self._dedup_unclaimed:
            self._dedup_unclaimed.discard(job.id)
            return None
        try:
            return trusted_guard(job, self.dedup)
        except TypeError:  # no identity: its claim was refused, nothing to release
            return None

    def _fail(
        self, job: Job, queue: Queue, run: tuple[Any, ...], error: BaseException
    ) -> bool:
        """Fail ``job`` with ``error`` without running its body, by RQ's own failure path
        (FAILED, its failure callback, its own ``Retry`` if it has one), no lock touched."""
        def refuse(*_args: Any, **_kwargs: Any) -> Any:
            raise error

        job.perform = refuse  # type: ignore[method-assign]  # this job object only
        self._dedup_unclaimed.add(job.id)
        try:
            return bool(super().perform_job(job, queue, *run))
        finally:
            self._dedup_unclaimed.discard(job.id)

    def _put_back(
        self, job: Job, queue: Queue, execution: Execution | None, delay: float, save: bool
    ) -> bool:
        """Give the job back to its queue ``delay`` seconds on: through RQ's scheduler when
        one serves the queue, else re-queued at the back after waiting here. ``save``: write
        the job as scheduled/queued (RQ's own schedule); without it only its id goes back,
        so a copy never overwrites the hash of the run that owns it. True: scheduled."""
        scheduler = queue.scheduler_pid is not None
        if not scheduler:
            time.sleep(delay)
        with self.connection.pipeline() as pipe:
            _compat.cleanup_execution(self, job, pipe, execution)
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            when = now() + timedelta(seconds=delay)
            if scheduler and save:
                queue.schedule_job(job, when, pipeline=pipe)
                # RQ 2.6's schedule_job leaves the job's status as it was (queued):
                # operators and callers see "scheduled", as RQ's enqueue_at shows it
                job.set_status(JobStatus.SCHEDULED, pipeline=pipe)
            elif scheduler:
                queue.scheduled_job_registry.schedule(job, when, pipeline=pipe)
            elif save:
                _compat.requeue(queue, job, pipe)  # as RQ's own Retry re-queues
            else:
                queue.push_job_id(job.id, pipeline=pipe)
            pipe.execute()
        return scheduler

    def _defer(self, job: Job, queue: Queue, execution: Execution | None, guard: Guard) -> None:
        """Another copy of this very job id runs now: give this one back for later (a quarter
        of the lease on, at least 1 s), leaving the running copy's job hash alone. Not run,
        not failed, not a retry; once the running copy has ended it finishes (success) or
        runs (its lock was released)."""
        delay = copy_wait(guard.policy)
        how = "rescheduled" if queue.scheduler_pid is not None else "re-queued"
        logger.info("taskdedup: %s[%s] %s in %ss (another copy of it is running)",
                    guard.name, job.id, how, delay)
        self._put_back(job, queue, execution, delay, save=False)

    def _wait(
        self, job: Job, queue: Queue, execution: Execution | None, run: tuple[Any, ...],
        guard: Guard, holder: str | None,
    ) -> bool:
        """``on_busy="wait"`` (SPEC §15): another job runs this identity now. Put this one
        back for later as a copy is (:meth:`_put_back`: scheduled, same id, not a retry),
        with when its wait started in its meta (:data:`taskdedup.flow.WAITING_SINCE`); once
        it has waited ``busy_timeout``, fail it with :class:`BusyTimeoutError`, not run."""
        meta = job.meta if isinstance(job.meta, dict) else {}
        since = flow.waiting_since(meta.get(flow.WAITING_SINCE))
        started = time.time()
        waited = 0.0 if since is None else max(0.0, started - since)
        delay = flow.busy_wait(guard.policy, waited)
        if delay is None:
            return self._fail(job, queue, run, BusyTimeoutError(guard.key, holder, waited))
        if since is None:
            job.meta[flow.WAITING_SINCE] = started  # saved with the job by _put_back
        how = "rescheduled" if queue.scheduler_pid is not None else "re-queued"
        logger.debug("taskdedup: %s[%s] %s in %.1fs: its identity is running by %s",
                     guard.name, job.id, how, delay, holder)
        self._put_back(job, queue, execution, delay, save=True)
        return True

    def _end_copy(self, job: Job, queue: Queue, execution: Execution | None) -> None:
        """End this pass of a job id whose newer write runs (or ran) under the same id (a
        coalesced follow-up's earlier message): nothing of the job is touched."""
        with self.connection.pipeline() as pipe:
            _compat.cleanup_execution(self, job, pipe, execution)
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            pipe.execute()

    def _end_finished(self, job: Job, queue: Queue, execution: Execution | None) -> None:
        """This very job id already succeeded: end this copy without a new outcome (no
        result, no callbacks, no webhooks, no dependents). The job is left as its first run
        left it: FINISHED (put back if re-queueing the copy changed it), its result kept."""
        with self.connection.pipeline() as pipe:
            _compat.cleanup_execution(self, job, pipe, execution)
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            job.set_status(JobStatus.FINISHED, pipeline=pipe)
            pipe.execute()

    def _settle_as_it_returns(self, job: Job, guard: Guard) -> None:
        """Complete the lock as the job's function returns, or release it as it raises with
        no retry left, before RQ runs the job's success or failure callback: a callback
        that enqueues the same call again finds the identity free. A returned ``Retry``, a
        pending ``Repeat`` or a failure that will retry keep the lock for
        ``handle_job_retry`` / ``handle_job_success`` / ``handle_job_failure`` as before."""
        perform = job.perform
        horse = os.getpid() != self._dedup_pid

        def perform_then_settle() -> Any:
            try:
                value = perform()
            except Exception:
                if horse:  # what is counted from here on goes to the worker at the end
                    stats.hold_threads()
                if not job.should_retry and self._dedup_claims.pop(job.id, None) is not None:
                    self._dedup_released.add(job.id)
                    self.dedup.release(guard.name, guard.key, job.id, reason="failed")
                raise
            if horse:
                stats.hold_threads()
            if not isinstance(value, Retry) and not job.repeats_left and \
                    self._dedup_claims.pop(job.id, None) is not None:
                self.dedup.finish(guard.name, guard.policy, guard.key, job.id, success=True)
            return value

        job.perform = perform_then_settle  # type: ignore[method-assign]  # this job object only

    def _rereserve(self, guard: Guard, job: Job, interval: float, again: str = "retry") -> None:
        """Keep the lock owned by this job id, queued for ``ttl`` + ``interval``: the retry
        runs, and a third party's duplicate meanwhile is still suppressed (counted as
        ``again``, not as an accepted enqueue)."""
        dedup = self.dedup
        if guard.policy.mode is Mode.WHILE_EXECUTING:  # not executing meanwhile
            dedup.release(guard.name, guard.key, job.id, reason="retry")
            return
        dedup.stop_heartbeat(guard.key, job.id)
        ttl_ms = min(guard.policy.ttl_ms + int(interval * 1000), MAX_DURATION_MS)
        try:
            result = dedup.gate(guard.name, guard.policy, Identity(guard.key), job.id,
                                ttl_ms=ttl_ms, again=again)
        except StoreUnavailableError as exc:
            logger.warning("taskdedup: could not keep the lock of %s[%s] for its retry: %s",
                           guard.name, job.id, exc)
            return
        if result.verdict is Verdict.DUPLICATE:
            logger.info("taskdedup: %s[%s] will retry, but %s holds its identity now",
                        guard.name, job.id, result.existing_id)

    def _skip(
        self, job: Job, queue: Queue, execution: Execution | None, result: GateResult,
        value: dict[str, Any] | None = None,
    ) -> None:
        """Finish a duplicate (or, with ``value``, a superseded debounced call) without
        running its body (not a failure; no callbacks)."""
        self.prepare_job_execution(job, remove_from_intermediate_queue=len(self.queues) == 1)
        job.started_at = now()
        self.handle_execution_ended(job, queue, job.success_callback_timeout)
        if value is None:
            value = skip_result(job, result)
        _compat.mark_finished(job, value)
        with skipped_job(self.log, job, value):  # says so where operators look
            self.handle_job_success(job=job, queue=queue,
                                    started_job_registry=queue.started_job_registry,
                                    execution=execution)

    def _retry_later(
        self, job: Job, queue: Queue, execution: Execution | None, guard: Guard,
        exc: StoreUnavailableError,
    ) -> None:
        """Put the job back without running it: never run unguarded, never dropped."""
        delay = self.store_retry_delay
        logger.warning(
            "taskdedup: store unavailable before %s[%s]; %s in %ss (not run): %s",
            guard.name, job.id,
            "rescheduled" if queue.scheduler_pid is not None else "re-queued", delay, exc,
        )
        self._put_back(job, queue, execution, delay, save=True)


def _forks_its_horse(cls: type[DedupWorker]) -> bool:
    """Whether ``cls``'s work-horse is a fork of the worker (RQ's ``Worker.fork_work_horse``),
    which inherits a claim made before it; not a process started afresh (``SpawnWorker``
    composed after ``DedupWorker``), which claims for itself."""
    mro = cls.__mro__
    for klass in mro[mro.index(DedupWorker) + 1:]:
        if "fork_work_horse" in vars(klass):
            return klass is Worker
    return False


def _refusal(guard: Guard, job: Job, exc: StoreUnavailableError) -> ConfigurationError:
    """The error a job fails with when Redis refuses its claim for what it is (NOPERM)."""
    error = ConfigurationError(
        f"taskdedup: Redis refused the claim of {guard.name}[{job.id}] on {guard.key} "
        f"({exc.__cause__}); this is a configuration error, not an outage, so the job fails "
        "instead of waiting for the store: run `taskdedup doctor` with the worker's "
        "TASKDEDUP_URL (and TASKDEDUP_PREFIX) to see what the Redis user lacks (a command, "
        "or the lock keys' pattern ~<prefix>:*)"
    )
    error.__cause__ = exc
    return error


def _flow_generation(job: Job, guard: Guard) -> tuple[int | None, bool]:
    """The generation a debounced job or a coalesced follow-up carries in its meta (None:
    neither, or a field its policy does not use), and whether it is a follow-up."""
    raw = job.meta.get(META_KEY) if isinstance(job.meta, dict) else None
    if guard.policy.debounce is not None:
        return flow.generation_of(raw, flow.GENERATION), False
    if guard.policy.on_duplicate is OnDuplicate.COALESCE:
        generation = flow.generation_of(raw, flow.FOLLOW_UP)
        return generation, generation is not None
    return None, False
