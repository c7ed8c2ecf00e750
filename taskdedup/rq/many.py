"""``DedupQueue.enqueue_many``: every call of the batch gated in one round trip
(:meth:`~taskdedup.core.Deduplicator.gate_many`), then RQ's own ``enqueue_many`` of the
accepted ones; and ``DedupQueue.prepare_data``, which also takes ``dedup=`` and ``dedup_key=``.

A batch is enqueued all or nothing: a call refused (``on_duplicate="raise"``, a duplicate that
carries callbacks or ``depends_on``, a reused idempotency key with other arguments, the store
down under ``on_store_error="raise"``) takes back the batch's reservations and raises before
any job is written.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.client import Pipeline
from rq.job import Job
from rq.queue import EnqueueData, Queue

from ..core import GateCall, GateResult, Identity, Verdict
from ..policy import Policy, PolicyLike, is_disabled
from ..stores.base import LockState
from . import _compat
from .call import alive, task_of
from .meta import META_KEY, meta_entry

if TYPE_CHECKING:
    from .queue import DedupQueue

__all__ = ["DedupEnqueueData", "enqueue_many", "prepare_data"]


class DedupEnqueueData(EnqueueData):  # RQ's NamedTuple, with two attributes more
    """RQ's ``EnqueueData`` with this call's ``dedup`` and ``dedup_key`` (a plain ``Queue``
    ignores them)."""

    dedup: PolicyLike = None
    dedup_key: Any = None


def prepare_data(
    *args: Any, dedup: PolicyLike = None, dedup_key: Any = None, **kwargs: Any
) -> Any:
    """RQ's ``Queue.prepare_data``; ``dedup=`` and ``dedup_key=`` as ``enqueue`` takes them."""
    data = Queue.prepare_data(*args, **kwargs)
    if dedup is None and dedup_key is None:
        return data
    marked = DedupEnqueueData(*data)
    marked.dedup, marked.dedup_key = dedup, dedup_key
    return marked


@dataclass
class _Call:
    """One call of the batch and what became of it."""

    data: Any  # EnqueueData, its job_id and meta set when gated
    name: str = ""
    policy: Policy | None = None
    identity: Identity | None = None
    answer: GateResult | Exception | None = None
    publish: bool = True
    given_id: bool = False  # the caller chose the job id
    original: int | None = None  # answered with this other call of the batch's job
    holder: Any = None  # a duplicate's original job's hash (not of this batch), when read
    dropped: bool = False  # a duplicate answered with None (on_duplicate="drop")
    job: Job | None = None


def enqueue_many(
    queue: DedupQueue, job_datas: Iterable[Any], pipeline: Pipeline | None,
    group_id: str | None, rq_enqueue_many: Callable[..., list[Job]],
) -> list[Job | None]:
    """Gate ``job_datas`` in one round trip, then enqueue the accepted ones with RQ's own
    ``enqueue_many`` (``rq_enqueue_many``). One answer per call, in call order: its job, the
    original's job for a duplicate (``on_duplicate="return"``; another call of this batch
    included), ``None`` for a dropped duplicate."""
    calls = [_prepare(queue, data) for data in job_datas]
    gated = [c for c in calls if c.policy is not None]
    if gated and pipeline is not None:
        raise ValueError(
            "DedupQueue.enqueue_many: pipeline= cannot be combined with the dedup gate (the "
            "reservations must be answered before the jobs are queued); call it without "
            "pipeline=, or prepare the calls with dedup=False"
        )
    _check_ids(calls)
    owners = {c.data.job_id: i for i, c in enumerate(calls) if c.policy is not None}
    _answer_alive_ids(queue, calls)
    _gate(queue, calls)
    _heal_stale(queue, calls, owners)
    errors = _resolve(queue, calls, owners)
    if errors:
        _take_back(queue, calls)
        first = errors[0]
        if len(errors) > 1:
            first.add_note(f"DedupQueue.enqueue_many: {len(errors) - 1} more call(s) of this "
                           "batch were refused too; nothing of it was enqueued")
        raise first
    datas = [c.data for c in calls if c.publish]
    try:
        jobs = rq_enqueue_many(datas, pipeline=pipeline, group_id=group_id) if datas else []
    except BaseException:
        _take_back(queue, calls)
        raise
    by_id = {job.id: job for job in jobs}
    for c in calls:
        if c.publish:
            c.job = by_id.get(c.data.job_id)
    for c in calls:
        answer = c.answer
        if isinstance(answer, GateResult) and answer.verdict is Verdict.REPLACED \
                and answer.existing_id and answer.existing_id not in owners:
            queue._cancel_replaced(answer.existing_id)
    return [_result(queue, calls, i) for i in range(len(calls))]


def _prepare(queue: DedupQueue, data: Any) -> _Call:
    """The call of one ``EnqueueData``: its identity and the job meta ``enqueue`` sets (a
    ``TypeError`` for arguments without identity, before anything is reserved)."""
    override, dedup_key = getattr(data, "dedup", None), getattr(data, "dedup_key", None)
    policy = queue.dedup_policy if override is None else Policy.coerce(override)
    meta = dict(data.meta or {})
    given_id = data.job_id is not None
    job_id = data.job_id if given_id else str(uuid.uuid4())  # to find its job afterwards
    if policy is None or is_disabled():
        meta[META_KEY] = {"off": True}
        return _Call(data._replace(job_id=job_id, meta=meta), given_id=given_id)
    name, bind_to = task_of(data.func)
    identity = queue.dedup.identity(name, policy, data.args or (), data.kwargs or {},
                                    func=bind_to, dedup_key=dedup_key)
    meta[META_KEY] = meta_entry(name, identity.key, policy, identity.check)
    call = _Call(data._replace(job_id=job_id, meta=meta), name, policy, identity,
                 given_id=given_id)
    if not policy.mode.gates_enqueue:  # while_executing: guarded at the worker only
        call.answer = GateResult(Verdict.ACCEPTED)
    return call


def _check_ids(calls: list[_Call]) -> None:
    """Two calls with one job id would be one job (RQ 3.0 refuses them; 2.x keeps one)."""
    seen: set[str] = set()
    for c in calls:
        job_id = c.data.job_id
        if c.given_id:
            if job_id in seen:
                raise ValueError(f"Job ID '{job_id}' appears more than once in enqueue_many()")
            seen.add(job_id)


def _answer_alive_ids(queue: DedupQueue, calls: list[_Call]) -> None:
    """A call whose explicit job id names a job that is alive is a duplicate of itself (as
    ``enqueue``), read for all of them in one round trip."""
    given = [c for c in calls if c.given_id and c.policy is not None and c.answer is None]
    if not given:
        return
    with queue.connection.pipeline(transaction=False) as pipe:
        for c in given:
            pipe.hget(queue.job_class.key_for(c.data.job_id), "status")
        statuses = pipe.execute()
    for c, raw in zip(given, statuses, strict=True):
        status = raw.decode() if isinstance(raw, bytes) else raw
        if alive(status):
            c.answer = GateResult(Verdict.DUPLICATE, c.data.job_id, LockState.QUEUED)


def _gate(queue: DedupQueue, calls: list[_Call]) -> None:
    """Reserve every gated call still unanswered: one ``gate_many`` (one round trip)."""
    pending = [c for c in calls if c.policy is not None and c.answer is None]
    if not pending:
        return
    gate_calls = []
    for c in pending:
        assert c.policy is not None and c.identity is not None
        ttl_ms = queue._reservation_ttl_ms(c.policy, None, c.data.ttl)
        gate_calls.append(GateCall(c.name, c.policy, c.identity, c.data.job_id, ttl_ms))
    for c, answer in zip(pending, queue.dedup.gate_many(gate_calls), strict=True):
        c.answer = answer


def _heal_stale(queue: DedupQueue, calls: list[_Call], owners: dict[str, int]) -> None:
    """Duplicates of jobs outside the batch: their jobs read in one round trip (the original's
    handle); a queued reservation whose job is gone is released and the call gated again."""
    outside = [c for c in calls if isinstance(c.answer, GateResult)
               and c.answer.verdict is Verdict.DUPLICATE and c.answer.existing_id
               and c.answer.existing_id not in owners
               and c.answer.existing_id != c.data.job_id
               and _compat.is_job_id(c.answer.existing_id)]
    if not outside:
        return
    with queue.connection.pipeline(transaction=False) as pipe:
        for c in outside:
            assert isinstance(c.answer, GateResult) and c.answer.existing_id
            pipe.hgetall(queue.job_class.key_for(c.answer.existing_id))
        hashes = pipe.execute()
    for c, holder in zip(outside, hashes, strict=True):
        assert isinstance(c.answer, GateResult) and c.policy and c.identity
        raw = holder.get(b"status") if holder else None
        status = raw.decode() if isinstance(raw, bytes) else raw
        if holder and alive(status):
            c.holder = holder
        elif queue._release_stale(c.name, c.identity, c.answer, status):
            ttl_ms = queue._reservation_ttl_ms(c.policy, None, c.data.ttl)
            try:
                c.answer = queue.dedup.gate(c.name, c.policy, c.identity, c.data.job_id,
                                            ttl_ms=ttl_ms)
            except Exception as exc:  # IdempotencyKeyMismatch, StoreUnavailableError
                c.answer = exc


def _resolve(queue: DedupQueue, calls: list[_Call], owners: dict[str, int]) -> list[Exception]:
    """Apply ``on_duplicate`` to each duplicate, mark the calls ``replace`` displaced; the
    refusals, in call order."""
    errors: list[Exception] = []
    for index, c in enumerate(calls):
        answer = c.answer
        if answer is None:
            continue
        if isinstance(answer, Exception):
            errors.append(answer)
            c.publish = False
            continue
        if answer.verdict is Verdict.REPLACED and answer.existing_id in owners:
            displaced = calls[owners[answer.existing_id]]  # this call takes its place
            displaced.publish, displaced.original = False, index
        if answer.verdict is not Verdict.DUPLICATE:
            continue
        c.publish = False
        assert c.policy is not None and c.identity is not None
        params = c.data._asdict()
        existing = answer.existing_id
        try:
            keep = queue._answers_duplicate(c.policy, c.name, c.identity.key, existing, params)
        except Exception as exc:  # DuplicateTaskError
            errors.append(exc)
            continue
        if keep and existing in owners and existing != c.data.job_id:
            c.original = owners[existing]
        elif not keep:
            c.dropped = True
    return errors


def _take_back(queue: DedupQueue, calls: list[_Call]) -> None:
    """Release the reservations this batch took (nothing of it is enqueued)."""
    for c in calls:
        answer = c.answer
        if isinstance(answer, GateResult) and answer.verdict in (Verdict.ACCEPTED,
                                                                 Verdict.REPLACED) \
                and c.policy is not None and c.policy.mode.gates_enqueue:
            assert c.identity is not None
            queue.dedup.release(c.name, c.identity.key, c.data.job_id, reason="publish_failed")


def _result(queue: DedupQueue, calls: list[_Call], index: int) -> Job | None:
    """What the caller gets for call ``index``."""
    seen: set[int] = set()
    c = calls[index]
    while c.original is not None and index not in seen:  # another call of the batch
        seen.add(index)
        index = c.original
        c = calls[index]
    if c.publish:
        return c.job
    if c.dropped or not isinstance(c.answer, GateResult):
        return None
    existing = c.answer.existing_id
    if existing is None:
        return None
    return queue._original(existing, c.holder or None)
