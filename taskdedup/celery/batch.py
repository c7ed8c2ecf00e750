"""``batch()``: the reservations of many gated calls (a loop over ``delay``, a ``group``) in
one pipeline, then their publishes in call order."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core import Deduplicator, GateCall, Identity, Verdict
from ..policy import Policy
from .config import get_deduplicator

if TYPE_CHECKING:
    from .task import DedupTask

__all__ = ["BATCH", "Batch", "Deferred", "batch"]


@dataclass
class Deferred:
    """A gated call held back by :func:`batch` until the block ends."""

    task: DedupTask
    policy: Policy
    identity: Identity
    task_id: str
    ttl_ms: int
    publish: Callable[..., Any]
    headers: dict[str, Any]
    link: Any
    link_error: Any
    options: Mapping[str, Any]
    fresh: bool = False
    given: str | None = None


class Batch:
    """The calls of one :func:`batch` block; after it, their outcomes.

    Attributes:
        results: per gated call, in call order: the handle that was returned for it (its id
            turned into the original's for a duplicate), or None for a duplicate dropped
            (``on_duplicate="drop"``) or a call that failed.
        errors: what failed (``DuplicateTaskError`` for ``on_duplicate="raise"``,
            ``IdempotencyKeyMismatch``, ``StoreUnavailableError``, a publish error); the first
            is raised when the block ends, after every other call was published.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Deferred, Any]] = []
        self.results: list[Any] = []
        self.errors: list[BaseException] = []

    def defer(self, call: Deferred) -> Any:
        handle = call.task.AsyncResult(call.task_id)
        self._pending.append((call, handle))
        return handle

    def flush(self) -> None:
        """Reserve every pending call (one pipeline per store), then publish the accepted ones
        in call order, and apply ``on_duplicate`` to the others."""
        pending, self._pending = self._pending, []
        answers: list[Any] = [None] * len(pending)
        by_dedup: dict[int, tuple[Deduplicator, list[int]]] = {}
        for index, (call, _) in enumerate(pending):
            dedup = get_deduplicator(call.task.app)
            by_dedup.setdefault(id(dedup), (dedup, []))[1].append(index)
        for dedup, indexes in by_dedup.values():
            calls = [
                GateCall(c.task.name, c.policy, c.identity, c.task_id, c.ttl_ms, c.fresh)
                for c in (pending[i][0] for i in indexes)
            ]
            for index, answer in zip(indexes, dedup.gate_many(calls), strict=True):
                answers[index] = answer
        for (call, handle), answer in zip(pending, answers, strict=True):
            self.results.append(self._finish(call, handle, answer))
        if self.errors:
            first = self.errors[0]
            if len(self.errors) > 1:
                first.add_note(f"taskdedup.celery.batch: {len(self.errors) - 1} more call(s) "
                               "of this batch failed too (Batch.errors)")
            raise first

    def _finish(self, call: Deferred, handle: Any, answer: Any) -> Any:
        task = call.task
        if isinstance(answer, BaseException):
            self.errors.append(answer)
            return None
        if answer.verdict is Verdict.DUPLICATE:
            try:
                original = task._on_duplicate(
                    call.policy, call.identity.key, answer.existing_id, call.task_id, call.given,
                    lambda task_id, headers: call.publish(task_id, headers, None), call.headers,
                    call.link, call.link_error, call.options)
            except Exception as exc:  # DuplicateTaskError, or a marked duplicate's publish
                self.errors.append(exc)
                return None
            if original is None:
                return None
            handle.id = original.id
            return handle
        if answer.verdict is Verdict.REPLACED and answer.existing_id:
            task._revoke(answer.existing_id)
        try:
            # Celery acquires a producer per call: the one of the block (a group's) is gone.
            call.publish(call.task_id, call.headers, None)
        except Exception as exc:
            if answer.verdict is not Verdict.UNGUARDED:
                get_deduplicator(task.app).release(task.name, call.identity.key, call.task_id,
                                                   reason="publish_failed")
            self.errors.append(exc)
            return None
        return handle


BATCH: ContextVar[Batch | None] = ContextVar("taskdedup_batch", default=None)


@contextmanager
def batch() -> Iterator[Batch]:
    """Gate the ``DedupTask`` calls made in the block together: their reservations go to
    Redis in one pipeline when the block ends, then the accepted calls are published.

    For a loop over ``delay``/``apply_async`` and for ``group(...).apply_async()``, whose
    members are published one by one: N calls cost one reservation round trip instead of
    N. Inside the block each call returns its handle at once but publishes nothing; if the
    block raises, nothing of it is reserved or published. A duplicate's handle is turned
    into the original's (its ``id`` changes); what each call became is in
    :attr:`Batch.results`. Errors of single calls (``on_duplicate="raise"``, a mismatched
    idempotency key, the store down under ``on_store_error="raise"``) do not stop the others:
    the first is raised when the block ends. Nested blocks join the outermost. Calls under
    ``task_always_eager`` are not held back; calls through ``RedisTransport`` (already one
    round trip each, reservation included) are published at once and recorded in
    :attr:`Batch.results`.

    Example::

        with batch() as sent:
            for order in orders:
                charge.delay(order.id, order.amount)
        accepted = [r for r in sent.results if r is not None]
    """
    current = BATCH.get()
    if current is not None:
        yield current
        return
    pending = Batch()
    token = BATCH.set(pending)
    try:
        yield pending
    except BaseException:
        pending._pending.clear()
        raise
    finally:
        BATCH.reset(token)
    pending.flush()
