"""``DedupTask``: the enqueue gate (``apply_async``) and the worker's claim (``before_start``).

The caller computes the identity, reserves it and puts the lock key in the message headers,
so the worker never recomputes it. On a Redis broker that holds the locks the reservation
rides in the push (:mod:`taskdedup.celery.transport`: one round trip per publish); with the
locks elsewhere it is a round trip of its own, which :func:`taskdedup.celery.batch`
pipelines for many calls. On the worker, ``before_start`` claims the lock and skips the body
of a duplicate with :class:`DuplicateExecution` (an ``Ignore``); the signal handlers of
:mod:`taskdedup.celery.signals` complete or release it.
"""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any

from celery import Celery, Task
from celery.exceptions import Ignore, Retry

from .. import running
from ..core import Identity, Verdict, resolve_duplicate
from ..events import logger
from ..exceptions import ConfigurationError, StoreUnavailableError
from ..policy import OnDuplicate, Policy, is_disabled
from ..running import Running
from ..stores.redis import may_have_run
from . import _compat, claims, eager
from ._message import HEADER, SKIPPED, STATE_ATTR, carried_key, is_off, request_header
from .batch import BATCH, Deferred
from .config import fused_producer, fuses, get_deduplicator
from .transport import FUSED, Fused, RedisTransport

__all__ = ["DedupTask", "DuplicateExecution", "NO_RESERVE"]

NO_RESERVE = "_taskdedup_no_reserve"
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

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        """Decide the app's publish path (and log it) as soon as the app is configured; the
        first gated publish decides otherwise (the order of publishes does not matter either
        way: the one-round-trip publish has producers of its own)."""
        super().on_bound(app)
        if cls._dedup_policy is not None and app.configured:
            fuses(app)

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
        no_reserve = options.pop(NO_RESERVE, False)

        def publish(
            task_id: str | None, headers: dict[str, Any] | None, producer: Any = producer
        ) -> Any:
            if headers is not None:
                options["headers"] = headers
            handle = super(DedupTask, self).apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
            eager.remember(handle)  # task_always_eager: what a duplicate of it will get
            return handle

        policy = self._call_policy(override)
        if policy is None or is_disabled():
            headers = dict(options.get("headers") or {})
            headers[HEADER] = {"task": self.name, "off": 1}
            return publish(task_id, headers)

        headers = dict(options.get("headers") or {})
        carried = carried_key(headers.get(HEADER), self.name)
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

        # A fresh call (not a retry or a republish of that message) that reuses an explicit
        # task_id whose lock that id holds is a duplicate of itself, as RQ's job_id is.
        fresh = carried is None and not (task_id and task_id == self.request.id)
        task_id = task_id or str(uuid.uuid4())
        ttl_ms = _reservation_ttl_ms(policy, options)
        is_eager = self.app.conf.task_always_eager
        pending = BATCH.get()
        if fuses(self.app) and not is_eager and self._dedup_duplicate_rate < _CHECK_FIRST_ABOVE:
            with fused_producer(self.app, producer) as acquired:
                def publish_on(task_id: str | None, headers: dict[str, Any] | None) -> Any:
                    return publish(task_id, headers, acquired)

                if isinstance(_compat.transport_of(acquired), RedisTransport):
                    handle = self._publish_fused(policy, identity, task_id, ttl_ms, publish_on,
                                                 headers, link, link_error, options, fresh)
                    if pending is not None:  # already one round trip: published, recorded
                        pending.results.append(handle)
                    return handle
            # A producer not on RedisTransport (fused_producer never gives one): never push
            # without the gate, reserve in a round trip of its own below.
        if pending is not None and not is_eager:
            return pending.defer(Deferred(self, policy, identity, task_id, ttl_ms, publish,
                                          headers, link, link_error, options, fresh))
        return self._gate_and_publish(policy, identity, task_id, ttl_ms,
                                      lambda task_id: publish(task_id, headers),
                                      link, link_error, options, fresh)

    def _gate_and_publish(
        self, policy: Policy, identity: Identity, task_id: str, ttl_ms: int,
        publish: Callable[[str], Any], link: Any, link_error: Any, options: Mapping[str, Any],
        fresh: bool = False,
    ) -> Any:
        """Reserve (one round trip), then publish what the gate let through; a failed
        publish releases the reservation before the error reaches the caller."""
        dedup = get_deduplicator(self.app)
        result = dedup.gate(self.name, policy, identity, task_id, ttl_ms=ttl_ms, fresh=fresh)
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
        link: Any, link_error: Any, options: Mapping[str, Any], fresh: bool = False,
    ) -> Any:
        """Publish with the reservation inside the broker's push (:class:`RedisTransport`)."""
        fused = Fused(identity.key, task_id, ttl_ms, identity.check,
                      policy.on_duplicate is OnDuplicate.REPLACE, fresh=fresh)
        token = FUSED.set(fused)
        started = time.perf_counter()
        failure: StoreUnavailableError | None = None
        try:
            handle = publish(task_id, headers)
        except StoreUnavailableError as exc:
            failure = exc
        finally:
            FUSED.reset(token)
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
        if fused.result is None:
            # The message went through no push of this transport (kombu routed it nowhere, or
            # to a channel that is not ours): it is published, so no error now — it carries
            # its lock key, and the worker's claim still fences the execution.
            logger.warning("taskdedup: %s[%s] was published without its reservation (the "
                           "broker's push did not run the gate)", self.name, task_id)
            return handle
        result = dedup.verdict(self.name, identity, task_id, fused.result,
                               time.perf_counter() - started)
        self._note_outcome(result.verdict is Verdict.DUPLICATE)
        if result.verdict is Verdict.DUPLICATE:
            _compat.forget_pending(self, task_id)  # it was never sent
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
            if self.app.conf.task_always_eager:
                return eager.handle(str(existing_id))
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
        raw = request_header(request)
        if policy is None or is_disabled() or is_off(raw, self.name):
            return
        dedup = get_deduplicator(self.app)
        key = carried_key(raw, self.name)
        if key is None:  # sent by name, or from a client without taskdedup
            key = dedup.identity(self.name, policy, args, kwargs, func=self._func()).key
        try:
            result = dedup.start(self.name, policy, key, task_id)
        except StoreUnavailableError as exc:
            raise self._retry_later(exc) from exc
        if result.verdict is Verdict.DUPLICATE:
            setattr(request, STATE_ATTR, SKIPPED)
            raise DuplicateExecution(
                f"duplicate of {result.existing_id} ({result.state.value if result.state else '?'})"
            )
        if result.verdict is Verdict.ACCEPTED and policy.mode.gates_execution:
            setattr(request, STATE_ATTR, key)
            claims.record(task_id, self.name, key)
        running.enter(Running(self.name, task_id, key, policy.ttl))  # left in task_postrun

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
        sig.apply_async(**{NO_RESERVE: True})
        return Retry(exc=exc, when=_STORE_RETRY_COUNTDOWN, sig=sig)


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
