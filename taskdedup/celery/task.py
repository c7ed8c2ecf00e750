"""``DedupTask``: the enqueue gate (``apply_async``) and the worker's claim (``before_start``).

The caller computes the identity, reserves it and puts the lock key in the message headers,
so the worker never recomputes it. On a Redis broker that holds the locks the reservation
rides in the push (:mod:`taskdedup.celery.transport`: one round trip per publish); with the
locks elsewhere it is a round trip of its own, sent before Celery builds the message and
read just before the broker publish (``_publish_overlapped``: the wait hides under Celery's
own work), and :func:`taskdedup.celery.batch` pipelines it for many calls. On the worker,
``before_start`` claims the lock and skips the body of a duplicate with
:class:`DuplicateExecution` (an ``Ignore``); the signal handlers of
:mod:`taskdedup.celery.signals` complete or release it.
"""

from __future__ import annotations

import inspect
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any

from celery import Celery, Task, states
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore, Retry, TaskPredicate
from celery.signals import after_task_publish, before_task_publish

from .. import flow, running
from ..core import (
    Identity,
    SentGate,
    Verdict,
    copy_wait,
    reserving_again,
    resolve_duplicate,
    skipped_of,
    skipped_value,
)
from ..events import logger
from ..exceptions import (
    BusyTimeoutError,
    ConfigurationError,
    DuplicateTaskError,
    StoreUnavailableError,
)
from ..limits import Limit, RateLimitedError, coerce_limits
from ..policy import MAX_DURATION_MS, OnDuplicate, Policy, is_disabled
from ..running import Running
from ..stores.base import LockState, Outcome
from ..stores.redis import may_have_run, refused
from . import _compat, claims, eager, handover, holders, stopping
from . import ahead as claimed_ahead
from . import limits as task_limits
from ._message import (
    AHEAD_ATTR,
    COMPLETED_ATTR,
    HEADER,
    RELEASED_ATTR,
    RUNNING_ATTR,
    SKIP_ATTR,
    SKIPPED,
    STATE_ATTR,
    TRACED_ATTR,
    carried_check,
    carried_key,
    is_off,
    mark,
    marked,
    request_header,
)
from .batch import BATCH, Deferred
from .config import fused_producer, fuses, get_deduplicator, own_producer, visibility_timeout
from .result import DedupResult
from .transport import FUSED, Fused, RedisTransport

__all__ = ["OUTBOX", "DedupTask", "DuplicateExecution", "NO_RESERVE", "skipped_info"]

NO_RESERVE = "_taskdedup_no_reserve"
OUTBOX = "_taskdedup_outbox"
"""``apply_async`` option of :mod:`taskdedup.celery.outbox`: a row published under its own id,
maybe again. Its gate is a fresh call's, and a lock its own id holds queued or running lets a
copy through without touching the lock (the worker's same-id copy rule runs it once: SPEC
§5); done or finished by its own id, nothing is sent. A retry's republish would turn a
running lock back to queued, and a copy could then run beside the original."""
_CALLBACK_OPTIONS = ("link", "link_error", "chain", "chord", "group_id")
_STORE_RETRY_COUNTDOWN = 5.0
# RedisTransport: check first (a separate reserve) while more than half of the recent calls
# of a task were duplicates; the average weighs the last ~10 calls.
_CHECK_FIRST_ABOVE = 0.5
_RATE_WEIGHT = 0.1
_CALL_FIELDS = frozenset({"on_duplicate", "on_store_error"})
_POLICY_FIELDS = ("mode", "ttl", "lease", "include", "exclude", "key", "scope", "window")


class DuplicateExecution(Ignore):  # type: ignore[misc]
    """No longer raised (0.1 skipped a duplicate's body with it, leaving no final state);
    kept so that imports of it keep working. A skipped duplicate now ends SUCCESS with
    :func:`skipped_info`, or, inside a workflow, FAILURE with ``DuplicateTaskError``."""


class DedupTask(Task):  # type: ignore[misc]
    """Celery task base class that deduplicates calls per :class:`taskdedup.Policy`.

    Declare with ``@app.task(base=DedupTask, dedup=Policy(...))``; without ``dedup`` the
    default ``Policy()`` applies, ``dedup=False`` turns it off for the task. Per call,
    ``apply_async`` also takes ``dedup=False`` (bypass gate and guard), ``dedup={...}``
    changing only ``on_duplicate``/``on_store_error``, and ``dedup_key="..."`` (an explicit
    idempotency key).
    """

    dedup: Policy | Mapping[str, Any] | bool | None = None
    Request = "taskdedup.celery.ahead:DedupRequest"
    """Celery's worker request, with the claim sent before the ack (:mod:`.ahead`); a
    subclass may name its own (a subclass of that one keeps the saving)."""
    # A duplicate that ends its workflow, and a call a limit dropped, are expected errors:
    # logged without a traceback.
    throws: tuple[type[BaseException], ...] = (DuplicateTaskError, RateLimitedError)
    _dedup_policy: Policy | None = Policy()
    _dedup_duplicate_rate: float = 0.0
    _dedup_func: Callable[..., Any] | None = None
    _dedup_track_started: bool = False
    limits: Any = None
    """``limits=[taskdedup.Concurrency(...), taskdedup.Rate(...)]`` (SPEC §16), with or
    without ``dedup=``: taken at the worker after the claim (:mod:`taskdedup.celery.limits`)."""
    _dedup_limits: tuple[Limit, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "dedup" in cls.__dict__:  # else inherited as it is (dedup=False included)
            raw = cls.__dict__["dedup"]
            cls._dedup_policy = Policy() if raw is None else Policy.coerce(raw)
        throws = tuple(cls.__dict__.get("throws") or ())
        expected = tuple(e for e in (DuplicateTaskError, RateLimitedError) if e not in throws)
        if expected:
            cls.throws = (*throws, *expected)
        run = cls.__dict__.get("run")
        func = getattr(run, "__func__", run)
        if cls._dedup_policy is not None and callable(func):
            _check_names(cls, func, cls._dedup_policy)
        if "limits" in cls.__dict__:
            cls._dedup_limits = coerce_limits(cls.__dict__["limits"], cls.__name__)

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        """Decide the app's publish path (and log it) as soon as the app is configured; the
        first gated publish decides otherwise (the order of publishes does not matter either
        way: the one-round-trip publish has producers of its own)."""
        super().on_bound(app)
        if cls._dedup_policy is not None:
            app.steps["consumer"].add(claimed_ahead.ClaimAhead)  # a set: once per app
            app.steps["consumer"].add(stopping.SweepWhileStopping)
        if cls._dedup_policy is not None and app.configured:
            fuses(app)
        if cls._dedup_policy is not None and cls.track_started:
            # Celery's tracer writes STARTED before before_start: a copy of a message that
            # already succeeded (or is running) would overwrite the id's SUCCESS. The claim
            # writes it instead, once it knows this execution runs (_track_started).
            cls.track_started = False
            cls._dedup_track_started = True

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
        outbox = bool(options.pop(OUTBOX, False))

        def publish(
            task_id: str | None, headers: dict[str, Any] | None, producer: Any = producer
        ) -> Any:
            if headers is not None:
                options["headers"] = headers
            if producer is None and not options.get("connection"):
                # one of taskdedup's producers over the app's pool, not one of Celery's: the
                # queue is declared once per connection (producers.DeclaredProducer)
                with own_producer(self.app) as chosen:
                    handle = super(DedupTask, self).apply_async(
                        args, kwargs, task_id, chosen, link, link_error, shadow, **options)
            else:
                handle = super(DedupTask, self).apply_async(
                    args, kwargs, task_id, producer, link, link_error, shadow, **options)
            if isinstance(handle, DedupResult) and headers is not None:
                ours = headers.get(HEADER)  # made below, with this task's key
                handle.lock_key = ours.get("key") if isinstance(ours, dict) else None
            eager.remember(handle)  # task_always_eager: what a duplicate of it will get
            return handle

        policy = self._call_policy(override)
        if policy is None or is_disabled():
            headers = dict(options.get("headers") or {})
            headers[HEADER] = {"task": self.name, "off": 1}
            return publish(task_id, headers)

        headers = dict(options.get("headers") or {})
        dedup = get_deduplicator(self.app)
        previous = headers.get(HEADER)
        carried = None if previous is None else dedup.trusted_key(
            self.name, policy, carried_key(previous, self.name))
        if carried is not None:  # a retry or a republish: same identity, same id
            identity = Identity(carried)
        else:
            identity = dedup.identity(
                self.name, policy, args or (), kwargs, func=self._func(), dedup_key=dedup_key
            )
        headers[HEADER] = {"task": self.name, "key": identity.key}
        if identity.check:  # an explicit key's: the worker's claim expects it
            headers[HEADER]["check"] = identity.check
        coalesce = False
        is_eager = self.app.conf.task_always_eager  # read once: a lookup costs microseconds
        if carried is not None and isinstance(previous, Mapping):  # a republish keeps them
            headers[HEADER].update({f: previous[f] for f in _FLOW_FIELDS if f in previous})
            if check := carried_check(previous, self.name):
                headers[HEADER]["check"] = check
        elif not (no_reserve or outbox or is_eager):
            if policy.debounce is not None:
                return self._publish_debounced(policy, identity, task_id, publish, headers,
                                               options)
            coalesce = (policy.on_duplicate is OnDuplicate.COALESCE and task_id is None
                        and not link and not link_error
                        and not any(options.get(name) for name in _CALLBACK_OPTIONS))
        if not policy.mode.gates_enqueue or no_reserve:
            return publish(task_id, headers)

        # A fresh call (not a retry or a republish of that message) that reuses an explicit
        # task_id whose lock that id holds is a duplicate of itself, as RQ's job_id is.
        fresh = outbox or (carried is None and not (task_id and task_id == self.request.id))
        given = task_id
        task_id = task_id or str(uuid.uuid4())
        ttl_ms = _reservation_ttl_ms(policy, options, self)
        pending = BATCH.get()
        if (fuses(self.app) and not is_eager and self._dedup_duplicate_rate < _CHECK_FIRST_ABOVE
                and not _announces_publishes(self.app)):
            with fused_producer(self.app, producer) as acquired:
                def publish_on(task_id: str | None, headers: dict[str, Any] | None) -> Any:
                    return publish(task_id, headers, acquired)

                if isinstance(_compat.transport_of(acquired), RedisTransport):
                    follow_up = (flow.follow_up_key(get_deduplicator(self.app), identity.key)
                                 if coalesce else None)
                    handle = self._publish_fused(policy, identity, task_id, ttl_ms, publish_on,
                                                 headers, link, link_error, options, fresh,
                                                 given, outbox, follow_up)
                    if pending is not None:  # already one round trip: published, recorded
                        pending.results.append(handle)
                    return handle
            # A producer not on RedisTransport (fused_producer never gives one): never push
            # without the gate, reserve in a round trip of its own below.
        if coalesce:  # its gate in a round trip of its own (flow.coalesce), then the push
            return self._publish_coalesced(policy, identity, given, publish, headers, options)
        if (pending is None and not is_eager and not outbox and not options.get("connection")
                and self._dedup_duplicate_rate < _CHECK_FIRST_ABOVE
                and not _announces_publishes(self.app) and _compat.gated_publish_missing() is None):
            # A message built for nothing costs more than the wait when most calls are
            # duplicates: then (as with the fused push) the gate goes first. With
            # connection=, Celery makes a producer of its own: the gate goes first too.
            sent = get_deduplicator(self.app).gate_send(
                self.name, policy, identity, task_id, ttl_ms=ttl_ms,
                fresh=fresh and given is not None)  # a new id: a lost reply is sent again
            if sent is not None:
                return self._publish_overlapped(policy, identity, task_id, sent, publish,
                                                headers, link, link_error, options, given,
                                                producer)
        if pending is not None and not is_eager and not outbox:
            return pending.defer(Deferred(self, policy, identity, task_id, ttl_ms, publish,
                                          headers, link, link_error, options, fresh, given))
        return self._gate_and_publish(policy, identity, task_id, ttl_ms, publish, headers,
                                      link, link_error, options, fresh, given, outbox)

    def _gate_and_publish(
        self, policy: Policy, identity: Identity, task_id: str, ttl_ms: int,
        publish: Callable[[str, dict[str, Any]], Any], headers: dict[str, Any], link: Any,
        link_error: Any, options: Mapping[str, Any], fresh: bool = False,
        given: str | None = None, outbox: bool = False,
    ) -> Any:
        """Reserve (one round trip), then publish what the gate let through; a failed
        publish releases the reservation before the error reaches the caller."""
        dedup = get_deduplicator(self.app)
        result = dedup.gate(self.name, policy, identity, task_id, ttl_ms=ttl_ms, fresh=fresh)
        self._note_outcome(result.verdict is Verdict.DUPLICATE)
        if outbox and _live_copy(result, task_id):
            return publish(task_id, headers)  # its own lock: a copy, the lock left as it is
        if result.verdict is Verdict.DUPLICATE:
            return self._on_duplicate(policy, identity.key, result.existing_id, task_id, given,
                                      publish, headers, link, link_error, options)
        if result.verdict is Verdict.REPLACED and result.existing_id:
            self._revoke(result.existing_id)
        try:
            return publish(task_id, headers)
        except BaseException:
            if result.verdict is not Verdict.UNGUARDED:
                dedup.release(self.name, identity.key, task_id, reason="publish_failed")
            raise

    def _publish_overlapped(
        self, policy: Policy, identity: Identity, task_id: str, sent: SentGate,
        publish: Callable[..., Any], headers: dict[str, Any],
        link: Any, link_error: Any, options: Mapping[str, Any], given: str | None,
        producer: Any,
    ) -> Any:
        """:meth:`_gate_and_publish` with the reservation's round trip under Celery's own
        work: the reservation was sent (``sent``), Celery builds the message, and the reply is
        read just before the broker publish (:class:`~taskdedup.celery._compat.GatedProducer`),
        which goes out only for a call the gate let through. Same outcomes as
        :meth:`_gate_and_publish`: a duplicate is not published (``_on_duplicate``), a
        replaced id is revoked before the publish, a failed publish releases the reservation
        before the error reaches the caller, a store error follows ``on_store_error``.
        Used only where nothing listens to Celery's publish signals (a duplicate goes through
        Celery's ``send_task`` without a message sent)."""

        def decide() -> bool:
            result = sent.result()
            self._note_outcome(result.verdict is Verdict.DUPLICATE)
            if result.verdict is Verdict.DUPLICATE:
                return False
            if result.verdict is Verdict.REPLACED and result.existing_id:
                self._revoke(result.existing_id)
            return True

        gated: _compat.GatedProducer | None = None
        try:
            with own_producer(self.app, producer) as acquired:
                gated = _compat.GatedProducer(acquired, decide)
                handle = publish(task_id, headers, gated)
        except BaseException:
            if gated is not None and gated.state == gated.PUBLISHING:
                if sent.result().verdict is not Verdict.UNGUARDED:
                    get_deduplicator(self.app).release(
                        self.name, identity.key, task_id, reason="publish_failed")
            elif not sent.answered:  # no producer, or Celery failed before its publish
                sent.abandon()
            raise
        result = sent.result()
        if gated.state == gated.PENDING:
            # Celery returned without publishing through the producer it was given: it may
            # have published another way; the message carries its lock key either way.
            logger.warning("taskdedup: %s[%s] was not published through taskdedup's producer "
                           "(its reservation is kept)", self.name, task_id)
            self._note_outcome(result.verdict is Verdict.DUPLICATE)
        if result.verdict is Verdict.DUPLICATE:
            _compat.forget_pending(self, task_id)  # it was never sent
            return self._on_duplicate(policy, identity.key, result.existing_id, task_id, given,
                                      publish, headers, link, link_error, options)
        return handle

    def _publish_fused(
        self, policy: Policy, identity: Identity, task_id: str, ttl_ms: int,
        publish: Callable[[str | None, dict[str, Any] | None], Any], headers: dict[str, Any],
        link: Any, link_error: Any, options: Mapping[str, Any], fresh: bool = False,
        given: str | None = None, outbox: bool = False, follow_up: str | None = None,
    ) -> Any:
        """Publish with the reservation inside the broker's push (:class:`RedisTransport`);
        with ``follow_up`` (coalesce), a call the script folds into the follow-up pushes
        nothing and is published again as the follow-up's message."""
        fused = Fused(identity.key, task_id, ttl_ms, identity.check,
                      policy.on_duplicate is OnDuplicate.REPLACE, fresh=fresh,
                      follow_up=follow_up, compact=getattr(
                          get_deduplicator(self.app).store, "compact_owners", False))
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
        if fused.result.outcome is Outcome.COALESCED:
            _compat.forget_pending(self, task_id)  # it was never sent
            self._note_outcome(True)
            follow = fused.result.owner or task_id
            flow.coalesced(dedup, self.name, identity.key, task_id, follow, fused.generation,
                           time.perf_counter() - started)
            return self._publish_follow_up(identity.key, task_id, follow, fused.generation,
                                           publish, headers)
        result = dedup.verdict(self.name, identity, task_id, fused.result,
                               time.perf_counter() - started)
        self._note_outcome(result.verdict is Verdict.DUPLICATE)
        if outbox and _live_copy(result, task_id):
            return publish(task_id, headers)  # its own lock: a copy, pushed without the gate
        if result.verdict is Verdict.DUPLICATE:
            _compat.forget_pending(self, task_id)  # it was never sent
            return self._on_duplicate(policy, identity.key, result.existing_id, task_id, given,
                                      publish, headers, link, link_error, options)
        if result.verdict is Verdict.REPLACED and result.existing_id:
            self._revoke(result.existing_id)
        return handle

    def _publish_debounced(
        self, policy: Policy, identity: Identity, task_id: str | None,
        publish: Callable[[str | None, dict[str, Any]], Any], headers: dict[str, Any],
        options: dict[str, Any],
    ) -> Any:
        """``debounce=`` (SPEC §15): every call is published, with the generation the
        publish's Lua call gave it and its countdown (replacing any ``countdown``/``eta``);
        the worker runs only the burst's last (:func:`taskdedup.flow.claim`)."""
        dedup = get_deduplicator(self.app)
        generation, delay = flow.debounce(dedup, self.name, policy, identity.key)
        if generation:
            headers[HEADER] = {**headers[HEADER], flow.GENERATION: generation}
        options.pop("eta", None)
        options["countdown"] = delay
        try:
            return publish(task_id, headers)
        except BaseException:
            flow.undo(dedup, self.name, flow.debounce_key(dedup, identity.key), generation)
            raise

    def _publish_coalesced(
        self, policy: Policy, identity: Identity, task_id: str | None,
        publish: Callable[[str | None, dict[str, Any]], Any], headers: dict[str, Any],
        options: Mapping[str, Any],
    ) -> Any:
        """``on_duplicate="coalesce"`` (SPEC §15): the gate in one Lua call; a duplicate of a
        queued call gets the original's handle, one of a running call is published as (or
        republished as the newest message of) the identity's one follow-up, under its id,
        with this call's arguments and the follow-up's generation."""
        dedup = get_deduplicator(self.app)
        owner = task_id or str(uuid.uuid4())
        ttl_ms = _reservation_ttl_ms(policy, options, self)
        answer = flow.coalesce(dedup, self.name, policy, identity, owner, ttl_ms, fresh=True)
        self._note_outcome(answer.verdict is Verdict.DUPLICATE)
        if answer.verdict is Verdict.COALESCED:
            return self._publish_follow_up(identity.key, owner, answer.existing_id or owner,
                                           answer.generation, publish, headers)
        if answer.verdict is Verdict.DUPLICATE:
            return self._on_duplicate(policy, identity.key, answer.existing_id, owner, task_id,
                                      publish, headers, None, None, options)
        try:
            return publish(owner, headers)
        except BaseException:
            if answer.verdict is not Verdict.UNGUARDED:
                dedup.release(self.name, identity.key, owner, reason="publish_failed")
            raise

    def _publish_follow_up(
        self, key: str, owner: str, follow: str, generation: int,
        publish: Callable[[str | None, dict[str, Any]], Any], headers: dict[str, Any],
    ) -> Any:
        """Publish this call (``owner``) as the newest message of follow-up ``follow`` (its
        id, this call's arguments, the follow-up's ``generation``): kombu's own push. A
        failed publish takes the generation back before the error reaches the caller."""
        try:
            return publish(follow, {**headers, HEADER: {**headers[HEADER],
                                                        flow.FOLLOW_UP: generation}})
        except BaseException:
            dedup = get_deduplicator(self.app)
            flow.undo(dedup, self.name, flow.follow_up_key(dedup, key), generation,
                      created=follow == owner)
            raise

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
        policy: Policy | None = None
        if isinstance(override, Mapping) and declared is not None:
            if set(override) <= _CALL_FIELDS:
                current = {f.name: getattr(declared, f.name) for f in fields(Policy)}
                policy = Policy(**{**current, **override})
        elif isinstance(override, Policy) and declared is not None:
            if all(getattr(override, f) == getattr(declared, f) for f in _POLICY_FIELDS):
                policy = override
        if policy is not None and declared is not None and (
                (policy.on_duplicate is OnDuplicate.COALESCE)
                != (declared.on_duplicate is OnDuplicate.COALESCE)
                or policy.debounce != declared.debounce):
            raise ConfigurationError(
                f"{self.name}: on_duplicate='coalesce' and debounce= are applied by the worker "
                "too (it claims a follow-up or a debounced call by its generation): declare "
                "them on the task, not per call")
        if policy is not None:
            return policy
        raise ConfigurationError(
            f"{self.name}: a per-call dedup= may only change on_duplicate and on_store_error "
            "(or be False to bypass); mode, ttl, lease and the identity options are applied "
            "by the worker too, so declare them on the task"
        )

    def _on_duplicate(
        self, policy: Policy, key: str, existing_id: str | None, task_id: str,
        given: str | None, publish: Callable[[str, dict[str, Any]], Any],
        headers: dict[str, Any], link: Any, link_error: Any, options: Mapping[str, Any],
    ) -> Any:
        """What a duplicate call returns: the original's handle (or None, or an error) per
        ``on_duplicate`` — or, for a duplicate that continues a workflow, its own handle: it
        is published *marked*, and the worker ends it without running the body."""
        carried = [name for name in _CALLBACK_OPTIONS if options.get(name)]
        carried += [n for n, v in (("link", link), ("link_error", link_error)) if v]
        workflow = self._continues(existing_id, task_id, given, options, bool(carried))
        if workflow is not None:
            logger.debug("taskdedup: %s[%s] is a duplicate of %s and %s: published marked, its "
                         "worker ends it without running the body", self.name, task_id,
                         existing_id, "continues a workflow" if workflow else "is a retry")
            return publish(task_id, {**headers, HEADER: mark(headers[HEADER], existing_id,
                                                             workflow)})
        if resolve_duplicate(self.name, policy, key, existing_id, carried):
            if self.app.conf.task_always_eager:
                return eager.handle(str(existing_id))
            original = self.AsyncResult(existing_id)
            original.lock_key = key  # revoke() frees the identity of the call it stands for
            return original
        return None

    def _continues(
        self, existing_id: str | None, task_id: str, given: str | None,
        options: Mapping[str, Any], carried: bool,
    ) -> bool | None:
        """Whether a duplicate must be published anyway (marked), and whether it then ends
        its workflow in an error (True) or as a skipped duplicate (False); None: not.

        - A group or chord member: a group is published all or nothing, and nothing is
          half-sent; the member's error (naming the original) becomes the group's or chord's.
        - In a worker, Celery publishing a chain's next step, a ``link`` callback or a chord
          body after the parent ran, or code publishing with an id of its own: raising there
          would turn the task that already ran into a FAILURE and release its lock, and
          returning the original's handle would leave that id without a state forever.
        - A task's own retry (``self.retry``) whose identity another id holds meanwhile: it
          ends as a skipped duplicate of that id, never swallowed without a state.

        ``existing_id`` is None when no id is known (an approximate window remembers the
        identity, not who ran it). Never for an explicit ``task_id`` that is its own original (a
        duplicate of itself),
        and never for a caller outside a worker: there a call with callbacks raises and a
        plain call gets the original's handle, per ``on_duplicate``.
        """
        if existing_id is not None and existing_id == task_id:
            return None
        if options.get("group_id") or options.get("chord"):
            return True
        if self.app.current_worker_task is None:
            return None
        if carried:
            return True
        if given is not None and given == self.request.id:
            return False
        if given is not None or "parent_id" in options:
            return True
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

    def AsyncResult(self, task_id: Any, **kwargs: Any) -> DedupResult:
        """Celery's handle, whose ``revoke()`` also frees a queued call's identity at once
        (:class:`~taskdedup.celery.result.DedupResult`)."""
        handle = DedupResult(task_id, backend=self.backend, task_name=self.name,
                             app=self._get_app(), **kwargs)
        handle.lock_task = self.name
        return handle

    # -- worker guard ---------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body, or return the result of a skipped duplicate (``before_start``).

        Called by the worker's tracer right after ``before_start`` (which marks the request),
        or directly in-process (``task(...)``, e.g. from another task's body): a direct call
        runs with an identity of its own, never its caller's, restored when it returns."""
        request = self.request
        if request.__dict__.pop(TRACED_ATTR, False):
            skipped = getattr(request, SKIP_ATTR, None)
            if skipped is not None:
                return skipped
            try:
                value = super().__call__(*args, **kwargs)
            except TaskPredicate:  # Retry, Ignore, Reject: their own signals decide
                raise
            except Exception:  # a FAILURE: released before Celery stores it, calls errbacks
                self._release_failed(request)
                raise
            self._complete(request)
            return value
        token = running.enter(self._direct_identity(args, kwargs))
        try:
            return super().__call__(*args, **kwargs)
        finally:
            running.leave(token)

    def _complete(self, request: Any) -> None:
        """The body returned: complete its lock now, before Celery publishes its callbacks
        and stores its result, so whoever sees the outcome (``.get()`` returns, a chain's next
        step is published) finds the identity released and its own call runs. The reply is
        awaited when the outcome is seen that way (a result stored, callbacks, eager);
        otherwise it is read later (:meth:`taskdedup.core.Deduplicator.finish`). The
        ``task_success`` handler then completes nothing twice; a failure after this (a result
        that cannot be stored) still releases the lock by its id."""
        key = request.__dict__.get(STATE_ATTR)
        policy = self._dedup_policy
        if not key or key == SKIPPED or policy is None:
            return
        setattr(request, COMPLETED_ATTR, True)
        later = not (request.is_eager or self._outcome_seen(request))
        get_deduplicator(self.app).finish(self.name, policy, str(key), request.id,
                                          success=True, later=later,
                                          hold=later and self._no_copy(request))
        holders.clear(request.id)  # a loss from here on is not this lock's

    def _release_failed(self, request: Any) -> None:
        """The body raised (not a retry, ``Ignore`` or ``Reject``): Celery records a FAILURE
        next — stores it, calls the errbacks, sends ``task_failure`` — so release the lock now
        and wait for it: an errback or a caller that sees the failure and calls again finds
        the identity free. ``task_failure`` then releases nothing twice."""
        key = request.__dict__.get(STATE_ATTR)
        if not key or key == SKIPPED or self._dedup_policy is None:
            return
        setattr(request, RELEASED_ATTR, True)
        get_deduplicator(self.app).release(self.name, str(key), request.id, reason="failed")
        holders.clear(request.id)

    def _no_copy(self, request: Any) -> bool:
        """Whether no copy of this message can follow it, so its completion may wait
        milliseconds for a transaction the worker sends anyway (``Deduplicator.finish``'s
        ``hold``): its claim rode ahead moments before the body (no ETA, no wait in the
        prefetch buffer, in which kombu could restore it), it was acked before the body,
        and it is not itself a restored copy."""
        if not request.__dict__.get(AHEAD_ATTR) or self.acks_late:
            return False
        info = request.delivery_info
        return not (isinstance(info, Mapping) and info.get("redelivered"))

    def _outcome_seen(self, request: Any) -> bool:
        """Whether this execution's outcome reaches anyone once the body returns: a result
        stored in a backend, or callbacks (``link``, a chain, a chord) published."""
        if request.callbacks or request.chain or request.chord:
            return True
        if self.ignore_result or request.__dict__.get("ignore_result"):
            return False
        return not isinstance(self.backend, DisabledBackend)

    def _direct_identity(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Running | None:
        """The running identity of a direct in-process call: its own key (None when dedup is
        off or its arguments have no identity), under its caller's redelivery delay."""
        policy = self._dedup_policy
        if policy is None or is_disabled():
            return None
        try:
            key = get_deduplicator(self.app).identity(
                self.name, policy, args, kwargs, func=self._func()).key
        except TypeError:
            return None
        outer = running.current()
        return Running(self.name, str(uuid.uuid4()), key, policy.ttl,
                       redelivery=outer.redelivery if outer is not None else None)

    def before_start(self, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Claim the running lock (:meth:`_claim_start`), then take the task's limits: a
        skipped duplicate takes no slot (SPEC §16)."""
        self._claim_start(task_id, args, kwargs, self.request)
        if self._dedup_limits:
            task_limits.enter(self, task_id, args, kwargs)

    def _claim_start(self, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any],
                     request: Any) -> None:
        """Claim the running lock; skip the body of a duplicate; put off a concurrent copy of
        this very message; end a redelivery of a call that already succeeded. ``request``:
        ``self.request``, read once (each read looks up Celery's request stack)."""
        ahead = [claimed_ahead.take(task_id)]  # the claim sent before the ack, if any
        handed = handover.pop_field(request)  # or the one a prefork main process made
        try:
            self._claim_body(task_id, args, kwargs, request, ahead, handed)
        finally:
            if ahead[0] is not None:  # sent ahead, not read: never a lock without its body
                claimed_ahead.abandon(task_id, ahead[0])

    def _claim_body(self, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any],
                    request: Any, ahead: list[tuple[str, Any, Any, int] | None],
                    handed: Any = None) -> None:
        """:meth:`_claim_start`'s work; ``ahead[0]``, the claim sent ahead, is emptied when
        this claim reads it; ``handed``: the offer of a claim the worker's main process made
        (:mod:`.handover`), taken here if it is still offered for this call's lock (one not
        taken is given back by the main process when the request ends)."""
        super().before_start(task_id, args, kwargs)
        setattr(request, TRACED_ATTR, True)  # the tracer's call, not a direct one
        policy = self._dedup_policy
        if policy is None:
            return
        dedup = get_deduplicator(self.app)
        early = ahead[0]
        if early is not None and early[0] == self.name and early[2] is dedup:
            # sent ahead from this very message's header, read as this task's moments ago
            # (claimed_ahead.send_ahead: not off, not a marked duplicate, its key one this
            # task makes, no debounce or coalesce): the claim to read, nothing to parse again
            ahead[0] = None
            key, sent, generation, follow_up = early[1].key, early[1], None, False
            check, reserved = "", True  # the check is the sent claim's already
            setattr(request, AHEAD_ATTR, True)
        else:
            raw = request_header(request)
            if is_disabled() or is_off(raw, self.name):
                return
            key = self._carried(dedup, policy, raw, task_id)
            check = carried_check(raw, self.name) if key is not None else ""
            duplicate = marked(raw, self.name)
            if duplicate is not None:  # found at enqueue, published anyway (workflow, retry)
                logger.debug("taskdedup: skipped %s[%s]: a duplicate of %s found when it was "
                             "published", self.name, task_id, duplicate[0])
                self._skip(request, key, duplicate[0], None, workflow=duplicate[1])
                return
            reserved = key is not None
            if key is None:  # sent by name, or from a client without taskdedup: no reservation
                key = dedup.identity(self.name, policy, args, kwargs, func=self._func()).key
            generation, follow_up = _flow_generation(policy, raw, self.name)
            sent = None
        if early is not None and sent is None:
            ahead[0] = None
            if generation is None and early[1].key == key and early[2] is dedup:
                sent = early[1]
                setattr(request, AHEAD_ATTR, True)
            else:  # sent for another lock or by a deduplicator the app has replaced since:
                # read (and given back) before this claim, which would otherwise find the lock
                # it took and take it for a copy of this very call running elsewhere
                claimed_ahead.abandon(task_id, early)
        if handed is not None and sent is None and generation is None:
            adopt = getattr(dedup.store, "handed_claim", None)
            if adopt is not None and handover.take(handed, task_id, key):
                sent = adopt(key, task_id, check)
        try:
            if generation is None:
                result = dedup.start(self.name, policy, key, task_id, sent=sent, check=check,
                                     reserved=reserved)
            else:  # debounce / coalesce: the claim compares the message's generation
                result = flow.claim(dedup, self.name, policy, key, task_id,
                                    generation=generation, follow_up=follow_up)
        except StoreUnavailableError as exc:
            if refused(exc):
                raise ConfigurationError(
                    f"taskdedup: Redis refused the claim of {self.name}[{task_id}] on {key!r}: "
                    f"{exc.__cause__}; the lock store's user lacks a permission or the value "
                    "is out of range: run `taskdedup doctor` (retrying would fail the same "
                    "way)") from exc
            raise self._retry_later(exc) from exc
        verdict = result.verdict
        if verdict is Verdict.SUPERSEDED:
            setattr(request, STATE_ATTR, SKIPPED)
            if follow_up:  # a newer message of this very id runs: it gives the outcome
                raise Ignore()
            setattr(request, SKIP_ATTR, flow.superseded_value(generation or 0))
            return
        if verdict is Verdict.DEFERRED:
            setattr(request, STATE_ATTR, SKIPPED)
            raise self._defer(policy)
        if verdict is Verdict.WAITING:
            setattr(request, STATE_ATTR, SKIPPED)
            raise self._wait(policy, key, result.existing_id)
        if verdict is Verdict.FINISHED:
            setattr(request, STATE_ATTR, SKIPPED)
            raise Ignore()  # acked: no result, no event, no callbacks, nothing propagated
        if verdict is Verdict.DUPLICATE:
            self._skip(request, key, result.existing_id, result.state, workflow=False)
            return
        if verdict is Verdict.ACCEPTED and policy.mode.gates_execution:
            setattr(request, STATE_ATTR, key)
            claims.record(task_id, self.name, key)
        if self._dedup_limits:  # before STARTED is written: a call put off never started
            task_limits.enter(self, task_id, args, kwargs)
        if self._dedup_track_started and not request.is_eager:
            self._track_started(request)
        # left in task_postrun, which restores the identity of an enclosing execution
        token = running.enter_later(self._running, task_id, key, policy)
        setattr(request, RUNNING_ATTR, token)

    def _track_started(self, request: Any) -> None:
        """STARTED in the result backend, as Celery's ``task_track_started`` writes it, but
        only for an execution that runs (see ``on_bound``)."""
        if self.ignore_result or request.__dict__.get("ignore_result"):
            return
        self.backend.store_result(
            request.id, {"pid": os.getpid(), "hostname": request.hostname}, states.STARTED,
            request=request)

    def _carried(
        self, dedup: Any, policy: Policy, raw: Any, task_id: str
    ) -> str | None:
        """The lock key the message carries, when it is one this task could have made
        (SPEC §8: a forged or malformed header key is ignored, and the identity recomputed)."""
        carried = raw.get("key") if isinstance(raw, Mapping) and raw.get(
            "task") == self.name else None
        if carried is None:
            return None
        key: str | None = dedup.trusted_key(self.name, policy, carried)
        if key is None:
            logger.warning(
                "taskdedup: %s[%s] carries a lock key in its %r header that this task would "
                "not make (%s of %d characters): ignored, the identity is recomputed from the "
                "arguments", self.name, task_id, HEADER, type(carried).__name__,
                len(carried) if isinstance(carried, str) else 0,
            )
        return key

    def _running(self, task_id: str, key: str, policy: Policy) -> Running:
        """The identity of this task's execution ``task_id`` (:func:`taskdedup.running.current`
        makes it when asked)."""
        return Running(self.name, task_id, key, policy.ttl, redelivery=self._redelivery(policy))

    def _redelivery(self, policy: Policy) -> float | None:
        """How long the broker may take to hand this message out again if its worker dies:
        the visibility timeout plus the lease (None: only when the connection closes)."""
        timeout = visibility_timeout(self.app)
        return None if timeout is None else timeout + policy.lease

    def _wait(self, policy: Policy, key: str, holder: str | None) -> BaseException:
        """``on_busy="wait"`` (SPEC §15): another id runs this identity now; put this call
        off with the copies' republish (:meth:`_defer`), carrying when its wait started
        (:data:`taskdedup.flow.WAITING_SINCE`), or end it with :class:`BusyTimeoutError`
        once it has waited ``busy_timeout``."""
        request = self.request
        if request.is_eager:
            raise ConfigurationError(
                f"{self.name}[{request.id}] runs eagerly while {holder!r} runs its identity "
                "and on_busy='wait': an eager call cannot wait; call it when the other ends")
        headers = request.headers if isinstance(request.headers, Mapping) else {}
        since = flow.waiting_since(headers.get(flow.WAITING_SINCE, getattr(
            request, flow.WAITING_SINCE, None)))
        now = time.time()
        waited = 0.0 if since is None else max(0.0, now - since)
        delay = flow.busy_wait(policy, waited, visibility_timeout(self.app))
        if delay is None:
            return BusyTimeoutError(key, holder, waited)
        logger.debug("taskdedup: %s[%s] waits %.1fs more for %s (running by %s)",
                     self.name, request.id, delay, key, holder)
        put_off: BaseException = self._defer(
            policy, delay, {flow.WAITING_SINCE: now if since is None else since})
        return put_off

    def _defer(
        self, policy: Policy, delay: float | None = None,
        headers: Mapping[str, Any] | None = None,
    ) -> Ignore:
        """Put off this copy of a message whose other copy runs now (SPEC §5): republish the
        very message (same id, same retries: not a retry) for a little later, and end this
        one without an outcome. The delay stays under the visibility timeout (so the broker
        does not copy the republished message again) and under the lease (so a dead
        original's lapse is noticed soon). A waiting call (:meth:`_wait`, a limit's put-off)
        comes with its own ``delay`` and ``headers``; its republished message is the call's
        only one, so a republish that fails (after kombu's own retries) is raised, and the
        call ends FAILURE with the broker's error instead of being acked away unseen."""
        request = self.request
        if request.is_eager:
            raise ConfigurationError(
                f"{self.name}[{request.id}] runs eagerly while another execution of the same "
                "id holds its lock: give each eager call its own id")
        if delay is None:
            delay = copy_wait(policy, visibility_timeout(self.app))
        extra: dict[str, Any] = {}
        if headers:
            current = request.headers if isinstance(request.headers, Mapping) else {}
            extra["headers"] = {**current, **headers}
        try:
            self.signature_from_request(request, countdown=delay, **extra).apply_async(
                **{NO_RESERVE: True})
        except Exception as exc:
            if headers:  # a waiting call: nothing else would ever run it
                logger.warning("taskdedup: could not put off %s[%s] (%s): it ends with that "
                               "error, not run", self.name, request.id, exc)
                raise
            logger.warning("taskdedup: could not put off the copy of %s[%s] (%s): it is "
                           "dropped; the running copy holds its own message",
                           self.name, request.id, exc)
        else:
            logger.debug("taskdedup: %s[%s] runs in another copy: this one is put off %.1fs",
                         self.name, request.id, delay)
        return Ignore()

    def _skip(
        self, request: Any, key: str | None, existing_id: str | None, state: LockState | None,
        workflow: bool,
    ) -> None:
        """End a duplicate without its body, in a state Celery users see (result backend,
        events, Flower): FAILURE with ``DuplicateTaskError`` naming the original when it
        belongs to a workflow (callbacks, chain, group, chord: that error is what the
        workflow's result and errbacks get, nothing waits forever), else SUCCESS with
        ``{"taskdedup": "skipped duplicate", "existing_id": ..., "state": ...}``."""
        setattr(request, STATE_ATTR, SKIPPED)
        if workflow or request.callbacks or request.chain or request.chord or request.group:
            original = (f"task {existing_id!r}, which holds {key}" if existing_id else
                        f"{key}, which ran already (its id is not kept)")
            raise DuplicateTaskError(
                key or "?", existing_id,
                f"{self.name}[{request.id}] did not run: it is a duplicate of {original}; the "
                "workflow it belongs to (its callbacks, chain, group or chord) ends with this "
                "error",
            )
        setattr(request, SKIP_ATTR, skipped_value(existing_id, state))

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``Task.retry``; its republish's reservation (this id's own lock, kept for
        the countdown) is counted as a retry, not as an accepted enqueue."""
        with reserving_again("retry"):
            return super().retry(*args, **kwargs)

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


def skipped_info(result: Any) -> dict[str, Any] | None:
    """``{"existing_id", "state"}`` when a task was skipped as a duplicate, else None.

    ``result`` is an ``AsyncResult`` (or ``EagerResult``) or the value a task returned. A
    skipped duplicate ends SUCCESS (its body did not run: ``existing_id`` held the identity,
    ``state`` ``queued``, ``running`` or ``done``), as a skipped RQ job ends FINISHED.
    """
    if hasattr(result, "successful") and hasattr(result, "result"):
        if not result.successful():
            return None
        result = result.result
    return skipped_of(result)


_FLOW_FIELDS = (flow.GENERATION, flow.FOLLOW_UP)


def _flow_generation(policy: Policy, raw: Any, name: str) -> tuple[int | None, bool]:
    """The generation a debounced call or a coalesced follow-up's message carries (None:
    neither, or a field this task's policy does not use), and whether it is a follow-up."""
    if not isinstance(raw, Mapping) or raw.get("task") != name:
        return None, False
    if policy.debounce is not None:
        return flow.generation_of(raw, flow.GENERATION), False
    if policy.on_duplicate is OnDuplicate.COALESCE:
        generation = flow.generation_of(raw, flow.FOLLOW_UP)
        return generation, generation is not None
    return None, False


def _live_copy(result: Any, task_id: str) -> bool:
    """Whether a gate's answer is this very id's own lock, queued or running (see
    :data:`OUTBOX`)."""
    return (result.verdict is Verdict.DUPLICATE and result.existing_id == task_id
            and result.state in (LockState.QUEUED, LockState.RUNNING))


def _announces_publishes(app: Celery) -> bool:
    """Whether something watches each publish (``before/after_task_publish`` receivers, the
    ``task-sent`` event Flower shows): then gate first, so a duplicate is never announced as
    sent. The fused push decides inside the publish, after ``before_task_publish`` fired.
    Receivers are looked at per call (a list); the setting is read once per app (a lookup in
    Celery's settings costs microseconds)."""
    if before_task_publish.receivers or after_task_publish.receivers:
        return True
    sent: bool | None = app.__dict__.get("_taskdedup_sent_event")
    if sent is None:
        sent = app.__dict__["_taskdedup_sent_event"] = bool(app.conf.task_send_sent_event)
    return sent


def _reservation_ttl_ms(
    policy: Policy, options: Mapping[str, Any], task: DedupTask | None = None
) -> int:
    """``ttl`` plus the countdown/ETA delay, capped by ``expires`` (ETA-aware TTL); a delay
    beyond the broker's visibility timeout is reported once per task (``task``)."""
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
    if task is not None:
        _warn_beyond_visibility(task, delay)
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
    return max(1, min(ttl_ms, MAX_DURATION_MS))  # a countdown of centuries: Redis's limit


_WARNED_DELAYS: set[str] = set()


def _warn_beyond_visibility(task: DedupTask, delay: float) -> None:
    """Once per task and process: a countdown/ETA beyond the broker's visibility timeout
    makes kombu restore a copy of the held message every visibility timeout until it is due
    (SPEC §5). taskdedup runs one of them, but each copy still costs a delivery."""
    timeout = visibility_timeout(task.app)
    if timeout is None or delay <= timeout or task.name in _WARNED_DELAYS:
        return
    _WARNED_DELAYS.add(task.name)
    logger.warning(
        "taskdedup: %s was sent with a countdown/ETA of %.0fs, beyond the broker's "
        "visibility_timeout of %.0fs: kombu will hand a copy of the message out again every "
        "%.0fs until it is due. taskdedup runs only one of them (the others are put off and "
        "end without running), but consider raising broker_transport_options"
        "['visibility_timeout'] above your longest countdown", task.name, delay, timeout,
        timeout,
    )


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
