"""Everything that differs between RQ releases (2.6 to 3.x) or touches a private detail of RQ
or redis-py, in one place, each with the check that it still holds.

Feature detection only (no version strings):

- RQ 3.0 passes an ``Execution`` to ``perform_job``, ``handle_job_*``, ``monitor_work_horse``
  and ``cleanup_execution``; RQ 2.x does not (the worker keeps ``self.execution``), except
  ``handle_job_retry`` in later 2.x releases. Each method is asked separately.
- RQ 3.0 adds ``JobStatus.READY_TO_ENQUEUE`` / ``RATE_LIMITED`` and ``Job.has_rate_limit``;
  RQ 2.8 adds ``unique=True`` with ``DuplicateJobError`` and ``JOB_ID_PATTERN``; RQ 2.9
  names the fields of ``Queue.parse_args``.
- The one-round-trip enqueue runs RQ's own enqueue into a pipeline that is never executed and
  hands its commands to ``enqueue.lua``. That rests on redis-py's ``Pipeline.command_stack``
  and on RQ writing its enqueue as plain writes into the pipeline it is given (no WATCH, no
  read whose answer it needs, no script of its own, nothing sent around the pipeline).
  :func:`capture_enqueue` checks the commands on every call, in a pipeline that cannot reach
  the server; :func:`fused_support` runs RQ's enqueue and schedule once per job class, when a
  queue is declared, against a client that refuses anything sent outside the pipeline. Where
  that fails (RQ 2.x schedules its registry entry outside the pipeline), the path is reported
  in one INFO line and reserves in its own round trip, then enqueues with RQ's own code.
- RQ 3.0 stops its pub/sub thread after its UNSUBSCRIBE; redis-py 8.2's ``stop()`` waits for
  that thread without a limit, and a thread that read the reply first waits 60 s in its next
  ``get_message``: :func:`quiet_pubsub_thread` clears the thread's run flag first (redis-py's
  private ``_running``, an Event in 8.1 and 8.2), else bounds ``stop()`` (public).
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

import redis
import rq.exceptions
import rq.job
from redis.client import Pipeline
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.worker import Worker

from ..events import logger

if TYPE_CHECKING:
    from rq.executions import Execution

__all__ = [
    "DEAD_STATUSES", "NOT_STARTED", "CaptureRefused", "DuplicateJobError", "FusedSupport",
    "Unchecked", "capture_enqueue", "cleanup_execution", "execution_args", "execution_kwargs",
    "fused_support", "has_dependencies", "has_rate_limit", "is_async", "is_job_id",
    "mark_finished", "missing_worker_hooks", "parse_enqueue_args", "quiet_pubsub_thread",
    "requeue", "save_success", "say_public_path", "stopped_job_id",
]


# -- names that only some releases have --------------------------------------------------------


class _NoDuplicateJobError(Exception):
    """Stands for ``rq.exceptions.DuplicateJobError`` on RQ releases without ``unique=True``
    (before 2.8): never raised."""


DuplicateJobError: Final[type[Exception]] = getattr(
    rq.exceptions, "DuplicateJobError", _NoDuplicateJobError
)

_JOB_ID_PATTERN: Final[re.Pattern[str]] = getattr(
    rq.job, "JOB_ID_PATTERN", re.compile(r"[A-Za-z0-9_-]+")
)


def _statuses(*names: str) -> frozenset[JobStatus]:
    """The members of ``JobStatus`` with these names that this RQ release has."""
    return frozenset(getattr(JobStatus, name) for name in names if hasattr(JobStatus, name))


DEAD_STATUSES: Final = _statuses("FINISHED", "FAILED", "STOPPED", "CANCELED")
"""Statuses of a job that has ended."""
NOT_STARTED: Final = _statuses(
    "CREATED", "QUEUED", "SCHEDULED", "DEFERRED", "READY_TO_ENQUEUE", "RATE_LIMITED"
)
"""Statuses of a job that has not started (RQ 3.0 adds the last two)."""


def quiet_pubsub_thread(thread: Any) -> None:
    """Tell RQ's pub/sub thread (redis-py's ``PubSubWorkerThread``) to stop before RQ's
    ``unsubscribe`` sends UNSUBSCRIBE, so the reply that wakes it also ends it.

    RQ 3.0 unsubscribes, then calls ``stop()``, then joins for 1 s. A thread that read the
    reply before ``stop()`` waits in its next ``get_message(timeout=60)``; redis-py 8.2's
    ``stop()`` joins it without a limit, so the worker took 60 s to exit. Without the flag
    (another redis-py), ``stop()`` is bounded instead: RQ's own 1 s join, as before 8.2.
    """
    running = getattr(thread, "_running", None)
    if isinstance(running, threading.Event):
        running.clear()
        return
    stop = getattr(thread, "stop", None)
    if stop is not None and "timeout" in inspect.signature(stop).parameters:
        thread.stop = functools.partial(stop, timeout=0)


def is_job_id(value: str) -> bool:
    """Whether ``value`` can be an RQ job id (as RQ 2.8+ validates them)."""
    return bool(_JOB_ID_PATTERN.fullmatch(value))


def has_rate_limit(job: Job) -> bool:
    """Whether ``job`` is rate limited (RQ 3.0's ``rate_limit=``; no such thing before)."""
    return bool(getattr(job, "has_rate_limit", False))


def has_dependencies(job: Job) -> bool:
    """Whether ``job`` depends on other jobs (RQ WATCHes those when it enqueues it)."""
    return bool(job._dependency_ids)


def is_async(queue: Queue) -> bool:
    """Whether ``queue`` hands jobs to workers (``is_async=True``) or runs them at once."""
    return bool(queue._is_async)


# -- RQ's parsed enqueue options ---------------------------------------------------------------


_OPTIONS: Final = (
    "func", "timeout", "description", "result_ttl", "ttl", "failure_ttl", "depends_on",
    "job_id", "at_front", "meta", "retry", "repeat", "on_success", "on_failure", "on_stopped",
    "pipeline",
)
_PLAIN_PARSED_ARGS: Final = {
    18: (*_OPTIONS, "args", "kwargs"),  # RQ 2.6, 2.7
    19: (*_OPTIONS, "unique", "args", "kwargs"),  # RQ 2.8
}
"""The order of ``Queue.parse_args``' plain tuple, by its length (RQ 2.9 names the fields)."""


def parse_enqueue_args(f: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """RQ's own parsing of ``enqueue(f, *args, **kwargs)``: its options by name."""
    parsed = Queue.parse_args(f, *args, **kwargs)
    if hasattr(parsed, "_asdict"):
        return dict(parsed._asdict())
    names = _PLAIN_PARSED_ARGS.get(len(parsed))
    if names is None:  # an RQ whose tuple this module cannot read: nothing was enqueued
        raise TypeError(
            f"taskdedup cannot read this RQ release's Queue.parse_args ({len(parsed)} fields)"
        )
    return dict(zip(names, parsed, strict=True))


# -- job internals the worker and the synchronous queue set ------------------------------------


def mark_finished(job: Job, result: Any) -> None:
    """Give ``job`` a return value and the FINISHED status in memory (RQ's own perform_job
    sets the same two attributes before ``handle_job_success`` saves them)."""
    job._result = result
    job._status = JobStatus.FINISHED


def save_success(job: Job, result_ttl: int, pipeline: Pipeline) -> None:
    """RQ's own bookkeeping of a finished job (status, result, registries) on ``pipeline``."""
    job._handle_success(result_ttl=result_ttl, pipeline=pipeline, worker_name="")


def requeue(queue: Queue, job: Job, pipeline: Pipeline) -> None:
    """Queue ``job`` again as RQ's own ``Retry`` does (no dependency checks), or by the public
    ``enqueue_job`` on an RQ without ``_enqueue_job``."""
    enqueue = getattr(queue, "_enqueue_job", None) or queue.enqueue_job
    enqueue(job, pipeline=pipeline)


def stopped_job_id(worker: Worker) -> str | None:
    """The id of the job this worker was told to stop (``rq`` ``send_stop_job_command``)."""
    value = getattr(worker, "_stopped_job_id", None)
    return value if isinstance(value, str) else None


# -- worker methods: RQ 3.0 passes the Execution, RQ 2.x does not ------------------------------


def _takes_execution(method: Callable[..., Any]) -> bool:
    return "execution" in inspect.signature(method).parameters


_PASSES_EXECUTION: Final = frozenset(
    name for name in ("perform_job", "handle_job_success", "handle_job_retry",
                      "handle_job_failure", "monitor_work_horse", "cleanup_execution")
    if _takes_execution(getattr(Worker, name))
)


_WORKER_HOOKS: Final = {
    "perform_job": ["job", "queue"], "handle_job_success": ["job", "queue"],
    "handle_job_failure": ["job", "queue"], "handle_job_retry": ["job", "queue"],
    "handle_execution_ended": ["job", "queue"], "fork_work_horse": ["job", "queue"],
    "monitor_work_horse": ["job", "queue"], "prepare_job_execution": ["job"],
    "cleanup_execution": ["job"],
}


def missing_worker_hooks() -> list[str]:
    """RQ ``Worker`` methods the guard overrides or calls that this release lacks, or whose
    leading parameters differ: a worker whose hooks RQ never calls would run jobs unguarded,
    so it refuses to start instead."""
    missing = []
    for name, leading in _WORKER_HOOKS.items():
        method = getattr(Worker, name, None)
        params = list(inspect.signature(method).parameters)[1:] if callable(method) else []
        if params[:len(leading)] != leading:
            missing.append(name)
    return missing


def execution_args(method: str, execution: Execution | None) -> tuple[Any, ...]:
    """The trailing ``execution`` argument of RQ's ``Worker.<method>``: ``(execution,)`` where
    this release takes one, else ``()``."""
    return (execution,) if method in _PASSES_EXECUTION else ()


def execution_kwargs(method: str, execution: Execution | None) -> dict[str, Any]:
    """``{"execution": execution}`` where RQ's ``Worker.<method>`` takes one, else ``{}``."""
    return {"execution": execution} if method in _PASSES_EXECUTION else {}


def cleanup_execution(
    worker: Worker, job: Job, pipeline: Pipeline, execution: Execution | None
) -> None:
    """RQ's ``cleanup_execution`` with or without the ``execution`` argument."""
    worker.cleanup_execution(
        job, pipeline=pipeline, **execution_kwargs("cleanup_execution", execution)
    )


# -- the one-round-trip enqueue: RQ's commands, captured -----------------------------------------


PLAIN_WRITES: Final = frozenset({
    "SADD", "SREM", "HSET", "HMSET", "HSETNX", "HDEL", "HINCRBY", "SET", "SETEX", "PSETEX", "DEL",
    "UNLINK", "EXPIRE", "PEXPIRE", "EXPIREAT", "PEXPIREAT", "PERSIST", "RPUSH", "LPUSH", "LREM",
    "ZADD", "ZREM",
})
"""Commands that may run inside ``enqueue.lua``: writes whose answer RQ does not read (it
never reads a pipeline's answers when it enqueues into a caller's pipeline)."""


_QUEUEING: Final = frozenset({"RPUSH", "LPUSH", "ZADD"})
_PROBE_READS: Final = frozenset({"INFO"})
"""What RQ may ask the server directly while it enqueues (its version, cached after once)."""


class _Immediate(Exception):
    """RQ tried to send a command at once instead of queueing it in the pipeline."""


class _CapturePipeline(Pipeline):
    """A pipeline that only collects commands: sending one at once (what redis-py does after a
    WATCH) or executing is refused, so nothing of a capture can reach the server."""

    def immediate_execute_command(self, *args: Any, **options: Any) -> Any:
        raise _Immediate(f"sends {args[0] if args else '?'} at once")

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        raise _Immediate("executes a pipeline of its own")


class _ProbeClient(redis.Redis):
    """The server as RQ sees it during the check: the reads it needs (``INFO``) are answered,
    a command sent outside the pipeline it was given is refused, never performed."""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        name = str(args[0]).upper() if args else "?"
        if name in _PROBE_READS:
            return super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
        raise _Immediate(f"sends {name} outside the pipeline it is given")

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        return _CapturePipeline(self.connection_pool, self.response_callbacks, transaction,
                                shard_hint)


class CaptureRefused(Exception):
    """RQ's enqueue cannot ride in the script; the message says why (for the INFO line)."""


def capture_enqueue(
    connection: redis.Redis, write: Callable[[Pipeline], Any], job_id: str,
    what: str = "enqueue",
) -> list[Sequence[Any]]:
    """The commands ``write`` (RQ's enqueue or schedule of job ``job_id`` into a pipeline)
    queues, checked to be plain writes that ``enqueue.lua`` can run and to queue or schedule
    the job (RPUSH/LPUSH/ZADD of its id). Nothing of it is sent to the server through the
    pipeline; that RQ sends nothing around it is what :func:`fused_support` checks.

    Raises:
        CaptureRefused: redis-py or RQ changed in a way the script cannot follow (the caller
            enqueues by the public path instead).
    """
    pipe = _CapturePipeline(connection.connection_pool, connection.response_callbacks, True,
                            None)
    try:
        try:
            write(pipe)
        except _Immediate as exc:
            raise CaptureRefused(f"RQ's {what} {exc}") from None
        stack = getattr(pipe, "command_stack", None)
        if not isinstance(stack, list):
            raise CaptureRefused("redis-py's Pipeline has no command_stack list")
        if getattr(pipe, "watching", False):  # MULTI alone is fine: the script is atomic
            raise CaptureRefused(f"RQ's {what} WATCHes keys (it reads before it writes)")
        commands: list[Sequence[Any]] = []
        for entry in stack:
            command = entry[0] if isinstance(entry, tuple) and entry else None
            name = command[0] if isinstance(command, tuple) and command else None
            if not isinstance(command, tuple) or not isinstance(name, str) \
                    or name.upper() not in PLAIN_WRITES:
                raise CaptureRefused(
                    f"RQ's {what} queues {name or entry!r}, not a plain write a script can run"
                )
            commands.append(command)
        if not any(str(command[0]).upper() in _QUEUEING and str(command[-1]) == job_id
                   for command in commands):
            raise CaptureRefused(f"RQ's {what} does not queue the job id in its pipeline")
        return commands
    finally:
        pipe.reset()


@dataclass(frozen=True, slots=True)
class FusedSupport:
    """Why RQ's ``enqueue_job`` / ``schedule_job`` cannot ride in ``enqueue.lua`` (None: it
    can)."""

    enqueue: str | None
    schedule: str | None


_PROBE_FUNC: Final = "taskdedup.rq._compat.fused_support"
_checked: dict[type[Job], FusedSupport] = {}
_said: set[str] = set()


class Unchecked(Exception):
    """The check could not run: RQ's enqueue asks the server (its version), which did not
    answer (Redis down when the queue was declared). Ask again later."""


def _probe(job_class: type[Job], connection: redis.Redis) -> FusedSupport:
    """RQ's own enqueue and schedule of a probe job, against a server that refuses anything
    sent outside the pipeline (and performs none of it).

    Raises:
        Unchecked: RQ's enqueue needed the server (its version) and could not reach it.
    """
    client = _ProbeClient(connection_pool=connection.connection_pool)
    queue = Queue("taskdedup-probe", connection=client, job_class=job_class)

    def problem(what: str, write: Callable[[Queue, Job, Pipeline], Any]) -> str | None:
        job = queue.create_job(_PROBE_FUNC, job_id="taskdedup-probe")
        try:
            capture_enqueue(client, lambda pipe: write(queue, job, pipe), job.id, what)
        except CaptureRefused as exc:
            return str(exc)
        except redis.RedisError as exc:
            raise Unchecked(str(exc)) from exc
        except Exception as exc:  # any other surprise: the public path, and say what it was
            return f"capturing RQ's {what} failed: {type(exc).__name__}: {exc}"
        return None

    return FusedSupport(
        enqueue=problem("enqueue", lambda q, job, pipe: q.enqueue_job(job, pipeline=pipe)),
        schedule=problem("schedule (enqueue_at, enqueue_in)", lambda q, job, pipe: (
            q.schedule_job(job, datetime.now(UTC), pipeline=pipe))),
    )


def fused_support(queue: Queue) -> FusedSupport:
    """Whether this queue's enqueue and schedule can reserve inside RQ's own commands.

    Checked once per job class and process, when the first such queue is declared: RQ's
    enqueue and schedule of a probe job must queue only plain writes into the pipeline they
    are given (a capture: nothing reaches the server) and send nothing around it. The first
    time a reason is found, one INFO line says it; that path then reserves in its own round
    trip and enqueues with RQ's code.

    Raises:
        Unchecked: the server did not answer; nothing is cached, the next call checks again.
    """
    job_class = queue.job_class
    if job_class not in _checked:
        _checked[job_class] = _probe(job_class, queue.connection)
    support = _checked[job_class]
    for problem in (support.enqueue, support.schedule):
        if problem is not None:
            say_public_path(problem)
    return support


def say_public_path(problem: str) -> None:
    """Log, once per reason and process, why enqueues take the public path."""
    if problem not in _said:
        _said.add(problem)
        logger.info(
            "taskdedup: DedupQueue reserves in its own round trip, then enqueues with RQ's own "
            "code (2 round trips instead of 1): %s", problem,
        )
