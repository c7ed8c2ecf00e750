"""Celery integration: ``DedupTask`` (the enqueue gate) and signal handlers (the worker guard).

Usage::

    @app.task(base=DedupTask, dedup=Policy(ttl=600))
    def charge(user_id, amount): ...

The caller computes the identity, reserves it and puts the lock key in the message headers,
so the worker never recomputes it. On a ``redis://`` broker that holds the locks the
reservation rides in the push (:class:`RedisTransport`, chosen automatically: one round trip
per publish); with the locks elsewhere it is a round trip of its own, which :func:`batch`
pipelines for many calls. On the worker, ``before_start`` claims
the lock (and skips the body of a duplicate with :class:`DuplicateExecution`, an ``Ignore``),
and Celery's signals complete or release it: ``task_success``, ``task_failure`` (also sent by
the main process for a lost worker or a hard time limit), ``task_retry``, ``task_revoked``
and ``task_postrun`` (for ``Ignore``/``Reject``).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

import redis
from celery import Celery, Task, signals
from celery.exceptions import Ignore, Retry
from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps as json_dumps

from . import stats
from .core import DEFAULT_PREFIX, Deduplicator, GateCall, Identity, Verdict, resolve_duplicate
from .events import logger
from .exceptions import ConfigurationError, DuplicateTaskError, StoreUnavailableError
from .policy import Mode, OnDuplicate, Policy, is_disabled
from .stores.base import LockResult, Outcome, Store
from .stores.redis import RedisStore, may_have_run, reserve_and_run

__all__ = ["HEADER", "Batch", "DedupTask", "DuplicateExecution", "batch", "get_deduplicator"]

HEADER = "taskdedup"
"""Message header carrying ``{"task": name, "key": lock key}`` or ``{"task": name, "off": 1}``."""

_NO_RESERVE = "_taskdedup_no_reserve"
_STATE_ATTR = "_taskdedup"  # on the request: the claimed lock key, or _SKIPPED
_SKIPPED = "skipped"
_CALLBACK_OPTIONS = ("link", "link_error", "chain", "chord", "group_id")
_STORE_RETRY_COUNTDOWN = 5.0
# RedisTransport: check first (a separate reserve) while more than half of the recent calls
# of a task were duplicates; the average weighs the last ~10 calls.
_CHECK_FIRST_ABOVE = 0.5
_RATE_WEIGHT = 0.1
_CALL_FIELDS = frozenset({"on_duplicate", "on_store_error"})
_POLICY_FIELDS = ("mode", "ttl", "lease", "include", "exclude", "key", "scope")


class DuplicateExecution(Ignore):  # type: ignore[misc]
    """Raised in ``before_start`` to skip a duplicate's body: Celery marks it IGNORED.

    It is not a failure: no error result is stored, no errbacks run, the message is acked.
    """


class DedupTask(Task):  # type: ignore[misc]
    """Celery task base class that deduplicates calls per :class:`taskdedup.Policy`.

    Declare with ``@app.task(base=DedupTask, dedup=Policy(...))``; without ``dedup`` the
    default ``Policy()`` applies, ``dedup=False`` turns it off for the task. Per call,
    ``apply_async`` also takes ``dedup=False`` (bypass gate and guard), ``dedup={...}``
    changing only ``on_duplicate``/``on_store_error``, and ``dedup_key="..."`` (an explicit
    idempotency key).
    """

    dedup: Policy | Mapping[str, Any] | bool | None = None
    _dedup_policy: Policy | None = Policy()
    _dedup_duplicate_rate: float = 0.0
    _dedup_func: Callable[..., Any] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "dedup" in cls.__dict__:  # else inherited as it is (dedup=False included)
            raw = cls.__dict__["dedup"]
            cls._dedup_policy = Policy() if raw is None else Policy.coerce(raw)
        run = cls.__dict__.get("run")
        func = getattr(run, "__func__", run)
        if cls._dedup_policy is not None and callable(func):
            _check_names(cls, func, cls._dedup_policy)

    # -- enqueue gate ---------------------------------------------------------------------

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        override = options.pop("dedup", None)
        dedup_key = options.pop("dedup_key", None)
        no_reserve = options.pop(_NO_RESERVE, False)

        def publish(
            task_id: str | None, headers: dict[str, Any] | None, producer: Any = producer
        ) -> Any:
            if headers is not None:
                options["headers"] = headers
            return super(DedupTask, self).apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )

        policy = self._call_policy(override)
        if policy is None or is_disabled():
            headers = dict(options.get("headers") or {})
            headers[HEADER] = {"task": self.name, "off": 1}
            return publish(task_id, headers)

        headers = dict(options.get("headers") or {})
        carried = _carried_key(headers.get(HEADER), self.name)
        dedup = get_deduplicator(self.app)
        if carried is not None:  # a retry or a republish: same identity, same id
            identity = Identity(carried)
        else:
            identity = dedup.identity(
                self.name, policy, args or (), kwargs, func=self._func(), dedup_key=dedup_key
            )
        headers[HEADER] = {"task": self.name, "key": identity.key}
        if not policy.mode.gates_enqueue or no_reserve:
            return publish(task_id, headers)

        task_id = task_id or str(uuid.uuid4())
        ttl_ms = _reservation_ttl_ms(policy, options)
        eager = self.app.conf.task_always_eager
        pending = _BATCH.get()
        if _fuses(self.app) and not eager and self._dedup_duplicate_rate < _CHECK_FIRST_ABOVE:
            with self.app.producer_or_acquire(producer) as acquired:
                def publish_on(task_id: str | None, headers: dict[str, Any] | None) -> Any:
                    return publish(task_id, headers, acquired)

                connection = getattr(acquired, "connection", None)
                if isinstance(getattr(connection, "transport", None), RedisTransport):
                    handle = self._publish_fused(policy, identity, task_id, ttl_ms, publish_on,
                                                 headers, link, link_error, options)
                    if pending is not None:  # already one round trip: published, recorded
                        pending.results.append(handle)
                    return handle
                # A connection made before the transport was chosen (a producer pool created
                # by an earlier plain publish): the gate is its own round trip.
                if pending is None:
                    return self._gate_and_publish(
                        policy, identity, task_id, ttl_ms,
                        lambda task_id: publish(task_id, headers, acquired),
                        link, link_error, options,
                    )
        if pending is not None and not eager:
            return pending.defer(_Deferred(self, policy, identity, task_id, ttl_ms, publish,
                                           headers, link, link_error, options))
        return self._gate_and_publish(policy, identity, task_id, ttl_ms,
                                      lambda task_id: publish(task_id, headers),
                                      link, link_error, options)

    def _gate_and_publish(
        self, policy: Policy, identity: Identity, task_id: str, ttl_ms: int,
        publish: Callable[[str], Any], link: Any, link_error: Any, options: Mapping[str, Any],
    ) -> Any:
        """Reserve (one round trip), then publish what the gate let through; a failed
        publish releases the reservation before the error reaches the caller."""
        dedup = get_deduplicator(self.app)
        result = dedup.gate(self.name, policy, identity, task_id, ttl_ms=ttl_ms)
        self._note_outcome(result.verdict is Verdict.DUPLICATE)
        if result.verdict is Verdict.DUPLICATE:
            return self._on_duplicate(policy, identity.key, result.existing_id, link, link_error,
                                      options)
        if result.verdict is Verdict.REPLACED and result.existing_id:
            self._revoke(result.existing_id)
        try:
            return publish(task_id)
        except BaseException:
            if result.verdict is not Verdict.UNGUARDED:
                dedup.release(self.name, identity.key, task_id, reason="publish_failed")
            raise

    def _publish_fused(
        self, policy: Policy, identity: Identity, task_id: str, ttl_ms: int,
        publish: Callable[[str | None, dict[str, Any] | None], Any], headers: dict[str, Any],
        link: Any, link_error: Any, options: Mapping[str, Any],
    ) -> Any:
        """Publish with the reservation inside the broker's push (:class:`RedisTransport`)."""
        fused = _Fused(identity.key, task_id, ttl_ms, identity.check,
                       policy.on_duplicate is OnDuplicate.REPLACE)
        token = _FUSED.set(fused)
        started = time.perf_counter()
        failure: StoreUnavailableError | None = None
        try:
            handle = publish(task_id, headers)
        except StoreUnavailableError as exc:
            failure = exc
        finally:
            _FUSED.reset(token)
        dedup = get_deduplicator(self.app)
        if failure is not None:
            # The connection broke: the broker is this Redis, so the publish failed as a plain
            # one would, and the script may have run (the caller's retry is answered with that
            # message). An error Redis answered (a user without script permission) ran
            # nothing: on_store_error decides, and "allow" publishes with kombu's own push.
            if may_have_run(failure):
                raise failure
            dedup.store_error(self.name, policy, identity.key, task_id, failure, "enqueue")
            return publish(task_id, headers)
        if fused.result is None:  # cannot happen on RedisTransport: say so rather than guess
            raise ConfigurationError(
                f"{self.name}: taskdedup.celery:RedisTransport did not see task {task_id}, "
                "which was published without its reservation"
            )
        result = dedup.verdict(self.name, identity, task_id, fused.result,
                               time.perf_counter() - started)
        self._note_outcome(result.verdict is Verdict.DUPLICATE)
        if result.verdict is Verdict.DUPLICATE:
            _forget_pending(self, task_id)  # it was never sent
            return self._on_duplicate(policy, identity.key, result.existing_id, link,
                                      link_error, options)
        if result.verdict is Verdict.REPLACED and result.existing_id:
            self._revoke(result.existing_id)
        return handle

    def _note_outcome(self, duplicate: bool) -> None:
        """Track this task's recent duplicate rate (an exponential moving average).

        With ``RedisTransport`` a call costs a whole message build before the script can say
        it is a duplicate; when most recent calls were duplicates (webhook retries), checking
        first (one EVALSHA, then the publish only for the accepted ones) is cheaper. The rate
        is only a choice between two correct paths, so racing updates do no harm.
        """
        rate = self._dedup_duplicate_rate * (1 - _RATE_WEIGHT)
        self._dedup_duplicate_rate = rate + _RATE_WEIGHT if duplicate else rate

    def _call_policy(self, override: Any) -> Policy | None:
        """The task's policy, with a per-call ``dedup=`` applied.

        Per call, ``dedup=False`` bypasses everything; a Policy or dict may change only what
        the caller decides (``on_duplicate``, ``on_store_error``): mode, windows and identity
        belong to the declaration, because the worker applies them too.
        """
        declared = self._dedup_policy
        if override is None or override is True:
            return declared
        if override is False:
            return None
        if isinstance(override, Mapping) and declared is not None:
            if set(override) <= _CALL_FIELDS:
                current = {f.name: getattr(declared, f.name) for f in fields(Policy)}
                return Policy(**{**current, **override})
        elif isinstance(override, Policy) and declared is not None:
            if all(getattr(override, f) == getattr(declared, f) for f in _POLICY_FIELDS):
                return override
        raise ConfigurationError(
            f"{self.name}: a per-call dedup= may only change on_duplicate and on_store_error "
            "(or be False to bypass); mode, ttl, lease and the identity options are applied "
            "by the worker too, so declare them on the task"
        )

    def _on_duplicate(
        self, policy: Policy, key: str, existing_id: str | None, link: Any, link_error: Any,
        options: Mapping[str, Any],
    ) -> Any:
        carried = [name for name in _CALLBACK_OPTIONS if options.get(name)]
        carried += [n for n, v in (("link", link), ("link_error", link_error)) if v]
        if resolve_duplicate(self.name, policy, key, existing_id, carried):
            return self.AsyncResult(existing_id)
        return None

    def _revoke(self, task_id: str) -> None:
        if self.app.conf.task_always_eager:
            return
        try:
            self.app.control.revoke(task_id)
        except Exception as exc:  # the claim fence skips it anyway
            logger.warning("taskdedup: could not revoke replaced task %s: %s", task_id, exc)

    def _func(self) -> Callable[..., Any]:
        func = self.__dict__.get("_dedup_func")
        if func is None:
            func = self.run
            self.__dict__["_dedup_func"] = func
        return func  # type: ignore[no-any-return]

    # -- worker guard ---------------------------------------------------------------------

    def before_start(self, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Claim the running lock; skip the body of a duplicate."""
        super().before_start(task_id, args, kwargs)
        request = self.request
        policy = self._dedup_policy
        raw = _request_header(request)
        if policy is None or is_disabled() or _is_off(raw, self.name):
            return
        dedup = get_deduplicator(self.app)
        key = _carried_key(raw, self.name)
        if key is None:  # sent by name, or from a client without taskdedup
            key = dedup.identity(self.name, policy, args, kwargs, func=self._func()).key
        try:
            result = dedup.start(self.name, policy, key, task_id)
        except StoreUnavailableError as exc:
            raise self._retry_later(exc) from exc
        if result.verdict is Verdict.DUPLICATE:
            setattr(request, _STATE_ATTR, _SKIPPED)
            raise DuplicateExecution(
                f"duplicate of {result.existing_id} ({result.state.value if result.state else '?'})"
            )
        if result.verdict is Verdict.ACCEPTED and policy.mode.gates_execution:
            setattr(request, _STATE_ATTR, key)

    def _retry_later(self, exc: StoreUnavailableError) -> Retry:
        """Republish this very message for later: never run unguarded, never dropped.

        Unlike ``self.retry`` it does not count against ``max_retries`` and does not touch
        the reservation (Redis is down).
        """
        request = self.request
        if request.is_eager:
            raise exc
        logger.warning(
            "taskdedup: store unavailable before %s[%s]; retrying in %ss: %s",
            self.name, request.id, _STORE_RETRY_COUNTDOWN, exc,
        )
        sig = self.signature_from_request(request, countdown=_STORE_RETRY_COUNTDOWN)
        sig.apply_async(**{_NO_RESERVE: True})
        return Retry(exc=exc, when=_STORE_RETRY_COUNTDOWN, sig=sig)


# -- many calls, their reservations in one pipeline ----------------------------------------


@dataclass
class _Deferred:
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
        self._pending: list[tuple[_Deferred, Any]] = []
        self.results: list[Any] = []
        self.errors: list[BaseException] = []

    def defer(self, call: _Deferred) -> Any:
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
                GateCall(c.task.name, c.policy, c.identity, c.task_id, c.ttl_ms)
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

    def _finish(self, call: _Deferred, handle: Any, answer: Any) -> Any:
        task = call.task
        if isinstance(answer, BaseException):
            self.errors.append(answer)
            return None
        if answer.verdict is Verdict.DUPLICATE:
            try:
                original = task._on_duplicate(call.policy, call.identity.key, answer.existing_id,
                                              call.link, call.link_error, call.options)
            except DuplicateTaskError as exc:
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


_BATCH: ContextVar[Batch | None] = ContextVar("taskdedup_batch", default=None)


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
    current = _BATCH.get()
    if current is not None:
        yield current
        return
    pending = Batch()
    token = _BATCH.set(pending)
    try:
        yield pending
    except BaseException:
        pending._pending.clear()
        raise
    finally:
        _BATCH.reset(token)
    pending.flush()


# -- one round trip: reserve inside the broker's push --------------------------------------


@dataclass
class _Fused:
    """A reservation for the next ``_put`` of message ``owner``, and the store's answer."""

    key: str
    owner: str
    ttl_ms: int
    check: str
    replace: bool
    result: LockResult | None = None


_FUSED: ContextVar[_Fused | None] = ContextVar("taskdedup_fused", default=None)


class _Channel(kombu_redis.Channel):
    """kombu's Redis channel, whose push also reserves the identity, in one Lua script."""

    _taskdedup_client: redis.Redis | None = None

    def _publisher(self) -> redis.Redis:
        """One client over the channel's pool for the fused pushes.

        kombu builds a new ``redis.Redis`` for every push (``conn_or_acquire``), which costs
        more than the round trip on a fast server; a client over a pool is thread-safe, so one
        per channel does, made again if the channel replaced its pool (after a reconnect).
        """
        client = self._taskdedup_client
        pool = self.pool
        if client is None or client.connection_pool is not pool:
            client = self._taskdedup_client = redis.Redis(connection_pool=pool)
        return client

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        fused = _FUSED.get()
        headers = message.get("headers") or {}
        if fused is None or headers.get("id") != fused.owner:
            super()._put(queue, message, **kwargs)  # type: ignore[no-untyped-call]
            return
        kwargs.pop("_publish_batch", None)  # this message cannot wait for a batch
        priority = self._get_message_priority(message, reverse=False)  # type: ignore[no-untyped-call]
        # kombu's client prefixes the keys of the commands it knows; inside a script it cannot.
        list_key = self.global_keyprefix + self._q_for_pri(queue, priority)  # type: ignore[no-untyped-call]
        fused.result, _ = reserve_and_run(
            self._publisher(), fused.key, fused.owner, fused.ttl_ms, fused.check,
            fused.replace, [("LPUSH", list_key, json_dumps(message))],  # type: ignore[no-untyped-call]
        )
        if self._expires and queue in self._expires and fused.result.outcome in _PUSHED:
            with self.conn_or_acquire() as client:
                for step in self.priority_steps:
                    name = self._q_for_pri(queue, step)  # type: ignore[no-untyped-call]
                    client.pexpire(name, self._expires[queue])


class RedisTransport(kombu_redis.Transport):
    """kombu's Redis transport with the gate fused into the publish (SPEC §10).

    A gated ``apply_async`` reserves and pushes in one Lua script, one round trip, atomically
    (no reservation without its message, no message without its reservation). Used when the
    locks live in the broker's Redis (no ``taskdedup_url``/``taskdedup_store`` that points
    elsewhere); chosen automatically for a plain ``redis://`` broker (see :func:`_fuses`), or
    set ``app.conf.broker_transport = "taskdedup.celery:RedisTransport"`` yourself (e.g. with
    ``rediss://``). Messages without a reservation go through kombu's own ``_put``.
    """

    Channel = _Channel


_PUSHED = (Outcome.ACQUIRED, Outcome.REPLACED)
TRANSPORT = "taskdedup.celery:RedisTransport"
"""``broker_transport`` of :class:`RedisTransport`."""


def _fuses(app: Celery) -> bool:
    """Whether this app's gated publishes reserve inside the broker's push.

    Yes with ``RedisTransport`` and the locks in the broker's Redis. Chosen automatically, on
    the first gated publish, for an app whose broker is one ``redis://`` URL, with no transport,
    no separate write broker and no lock store of its own configured — unless
    ``taskdedup_fused_publish`` is False. A connection made before that (a producer pool of an
    earlier plain publish) keeps kombu's transport; :meth:`DedupTask.apply_async` checks.
    """
    cached: bool | None = app.__dict__.get("_taskdedup_fuses")
    if cached is None:
        conf = app.conf
        own_store = conf.get("taskdedup_store") is not None or bool(
            conf.get("taskdedup_url") or os.environ.get("TASKDEDUP_URL")
        )
        transport = conf.broker_transport
        ours = transport is RedisTransport or transport == TRANSPORT
        url = conf.broker_url
        if (transport is None and not own_store and conf.get("taskdedup_fused_publish", True)
                and isinstance(url, str) and url.startswith("redis://") and ";" not in url
                and conf.broker_write_url in (None, url)):
            conf.broker_transport = TRANSPORT
            ours = True
        cached = app.__dict__["_taskdedup_fuses"] = bool(ours and not own_store)
    return cached


# -- signal handlers (worker side) ---------------------------------------------------------


def _dedup_task(sender: Any) -> DedupTask | None:
    return sender if isinstance(sender, DedupTask) and sender._dedup_policy is not None else None


def _on_success(sender: Any = None, **_: Any) -> None:
    task = _dedup_task(sender)
    if task is None:
        return
    request = task.request
    key = getattr(request, _STATE_ATTR, None)
    if key and key != _SKIPPED:
        get_deduplicator(task.app).finish(
            task.name, task._dedup_policy, key, request.id, success=True  # type: ignore[arg-type]
        )


def _on_failure(
    sender: Any = None, task_id: str | None = None, args: Any = None, kwargs: Any = None, **_: Any
) -> None:
    task = _dedup_task(sender)
    if task is None or task_id is None:
        return
    key = _key_for(task, task_id, args, kwargs)
    if key:
        get_deduplicator(task.app).release(task.name, key, task_id, reason="failed")


def _on_retry(sender: Any = None, request: Any = None, **_: Any) -> None:
    task = _dedup_task(sender)
    if task is None or request is None:
        return
    key = getattr(request, _STATE_ATTR, None)
    if not key or key == _SKIPPED:
        return
    dedup = get_deduplicator(task.app)
    if task._dedup_policy.mode is Mode.WHILE_EXECUTING:  # type: ignore[union-attr]
        dedup.release(task.name, key, request.id, reason="retry")  # not executing meanwhile
    else:  # the retry's publish re-reserved it for the countdown; just stop renewing
        dedup.stop_heartbeat(key, request.id)


def _on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    task = _dedup_task(sender)
    if task is None or request is None:
        return
    raw = (getattr(request, "request_dict", None) or {}).get(HEADER)
    key = _carried_key(raw, task.name) or getattr(request, _STATE_ATTR, None)
    if key is None and not _is_off(raw, task.name):
        key = _recompute(task, request.args, request.kwargs)
    if key and key != _SKIPPED:
        get_deduplicator(task.app).release(task.name, key, request.id, reason="revoked")


def _on_postrun(sender: Any = None, task_id: str | None = None, state: str | None = None,
                **_: Any) -> None:
    if state not in ("IGNORED", "REJECTED"):
        return
    task = _dedup_task(sender)
    if task is None or task_id is None:
        return
    key = getattr(task.request, _STATE_ATTR, None)
    if key and key != _SKIPPED:
        get_deduplicator(task.app).release(task.name, key, task_id, reason=state.lower())


def _key_for(task: DedupTask, task_id: str, args: Any, kwargs: Any) -> str | None:
    """The lock key of ``task_id``, in the pool process or in the worker's main process."""
    request = task.request
    if request is not None and request.id == task_id:
        key = getattr(request, _STATE_ATTR, None)
        if key is not None:
            return None if key == _SKIPPED else str(key)
        raw = _request_header(request)
        if _is_off(raw, task.name):
            return None
        carried = _carried_key(raw, task.name)
        if carried is not None:
            return carried
    # Main process after a lost worker or a hard time limit, without the request: recompute.
    # (An explicit dedup_key cannot be recomputed; that lock frees itself within ``lease``.)
    return _recompute(task, args, kwargs)


def _recompute(task: DedupTask, args: Any, kwargs: Any) -> str | None:
    policy = task._dedup_policy
    if policy is None or args is None:
        return None
    try:
        return get_deduplicator(task.app).identity(
            task.name, policy, args, kwargs, func=task._func()
        ).key
    except Exception:
        return None


signals.task_success.connect(_on_success, weak=False)
signals.task_failure.connect(_on_failure, weak=False)
signals.task_retry.connect(_on_retry, weak=False)
signals.task_revoked.connect(_on_revoked, weak=False)
signals.task_postrun.connect(_on_postrun, weak=False)
# Pool processes exit without atexit handlers: flush the last counts explicitly.
signals.worker_process_shutdown.connect(lambda **_: stats.flush_all(), weak=False)


# -- helpers -------------------------------------------------------------------------------


def _forget_pending(task: DedupTask, task_id: str) -> None:
    """Undo what Celery's publish set up for a result that will never come (a result
    backend that subscribes per task id, e.g. Redis pub/sub)."""
    consumer = getattr(task.backend, "result_consumer", None)
    cancel = getattr(consumer, "cancel_for", None)
    if cancel is not None:
        try:
            cancel(task_id)
        except Exception:  # best effort: it only frees a subscription
            logger.debug("taskdedup: could not cancel the result subscription of %s", task_id)


def _request_header(request: Any) -> Any:
    headers = getattr(request, "headers", None)
    if headers and HEADER in headers:
        return headers[HEADER]
    return getattr(request, HEADER, None)


def _carried_key(raw: Any, task_name: str) -> str | None:
    if isinstance(raw, Mapping) and raw.get("task") == task_name and raw.get("key"):
        return str(raw["key"])
    return None


def _is_off(raw: Any, task_name: str) -> bool:
    return isinstance(raw, Mapping) and raw.get("task") == task_name and bool(raw.get("off"))


def _reservation_ttl_ms(policy: Policy, options: Mapping[str, Any]) -> int:
    """``ttl`` plus the countdown/ETA delay, capped by ``expires`` (ETA-aware TTL)."""
    countdown, eta, expires = options.get("countdown"), options.get("eta"), options.get("expires")
    if not (countdown or eta or expires):
        return policy.ttl_ms  # the common call: no clock arithmetic
    now = datetime.now(UTC)
    delay = 0.0
    if countdown:
        delay = float(countdown)
    elif isinstance(eta, datetime):
        delay = (_aware(eta) - now).total_seconds()
    elif isinstance(eta, str):
        delay = (_aware(datetime.fromisoformat(eta)) - now).total_seconds()
    ttl_ms = policy.ttl_ms + max(0, int(delay * 1000))
    expires_in: float | None = None
    if isinstance(expires, (int, float)):
        expires_in = float(expires)
    elif isinstance(expires, str):  # a retry carries the original's expiry as ISO 8601
        expires = datetime.fromisoformat(expires)
    if isinstance(expires, datetime):
        expires_in = (_aware(expires) - now).total_seconds()
    if expires_in is not None:  # expired messages are discarded by the worker
        ttl_ms = min(ttl_ms, max(0, int(expires_in * 1000)) + 1000)
    return max(1, ttl_ms)


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _check_names(cls: type, func: Callable[..., Any], policy: Policy) -> None:
    import inspect

    names = policy.include or policy.exclude
    if not names:
        return
    params = inspect.signature(func).parameters
    unknown = sorted(n for n in names if n not in params)
    if unknown:
        which = "include" if policy.include else "exclude"
        raise ConfigurationError(
            f"{cls.__name__}: Policy.{which} names {', '.join(map(repr, unknown))}, which "
            f"are not parameters of the task (it takes {', '.join(params) or 'none'})"
        )


def get_deduplicator(app: Celery) -> Deduplicator:
    """The app's :class:`~taskdedup.core.Deduplicator`, built once from its configuration.

    Store: ``app.conf.taskdedup_store`` (a Store or a ready redis client), else
    ``app.conf.taskdedup_url``, else ``TASKDEDUP_URL``, else the broker URL when it is Redis.
    Key prefix: ``app.conf.taskdedup_prefix``, else ``TASKDEDUP_PREFIX``, else ``taskdedup``.
    """
    dedup: Deduplicator | None = app.__dict__.get("_taskdedup")
    if dedup is None:
        prefix = app.conf.get("taskdedup_prefix") or os.environ.get("TASKDEDUP_PREFIX")
        prefix = prefix or DEFAULT_PREFIX
        dedup = Deduplicator(_store_for(app), prefix=prefix)
        if app.conf.get("taskdedup_stats", True):  # counters flushed to Redis off the hot path
            interval = app.conf.get("taskdedup_stats_interval") or stats.DEFAULT_INTERVAL
            stats.attach(dedup, interval=float(interval))
        app.__dict__["_taskdedup"] = dedup
    return dedup


def _store_for(app: Celery) -> Store:
    conf = app.conf
    ready = conf.get("taskdedup_store")
    if ready is not None:
        if isinstance(ready, Store):
            return ready
        if isinstance(ready, redis.Redis):
            return RedisStore(ready)
        raise ConfigurationError(
            f"app.conf.taskdedup_store must be a taskdedup Store or a redis.Redis client, "
            f"got {type(ready).__name__}"
        )
    url = conf.get("taskdedup_url") or os.environ.get("TASKDEDUP_URL")
    if not url:
        broker = conf.broker_url if isinstance(conf.broker_url, str) else ""
        if broker.split("://", 1)[0] in ("redis", "rediss", "valkey", "valkeys"):
            url = broker.split(";", 1)[0]
    if not url:
        raise ConfigurationError(
            "taskdedup needs a Redis server for its locks: set app.conf.taskdedup_url "
            "(or the TASKDEDUP_URL environment variable) to a redis:// URL; the broker "
            f"({(conf.broker_url or 'unset').split('://', 1)[0]}://) is not Redis"
        )
    return RedisStore.from_url(str(url))
