"""The state machine over a Store, independent of any task framework.

Integrations (``taskdedup.celery``, ``taskdedup.rq``) call a :class:`Deduplicator` at four
points: :meth:`~Deduplicator.gate` when a call is enqueued, :meth:`~Deduplicator.start` when a
worker is about to run the body, :meth:`~Deduplicator.finish` when it is over, and
:meth:`~Deduplicator.release` when a queued call is abandoned (publish failed, revoked).
Each of these is one store transition (one Redis round trip). Decisions about store errors
(``on_store_error``) are taken here so every integration behaves alike.
"""

from __future__ import annotations

import inspect
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from . import approximate
from .approximate import Probe
from .events import Counters, Event, Events, logger
from .exceptions import (
    ConfigurationError,
    DuplicateTaskError,
    IdempotencyKeyMismatch,
    StoreUnavailableError,
)
from .identity import fingerprint, fingerprint_value
from .pids import ForkSafeLock, pid
from .policy import Mode, OnBusy, OnDuplicate, OnStoreError, Policy
from .stores.base import SETTLE_AFTER, LockResult, LockState, Outcome, Store

__all__ = [
    "Deduplicator", "GateCall", "GateResult", "Heartbeat", "Identity", "SentGate", "StartResult",
    "Verdict",
    "check_hint", "copy_wait", "resolve_duplicate",
]

DEFAULT_PREFIX = "taskdedup"
MAX_KEY_LENGTH = 512
"""The longest lock key taken from a message (ours are well under 200 characters)."""
_DIGEST = re.compile(r"[0-9a-f]{32}")

_AGAIN: ContextVar[str | None] = ContextVar("taskdedup_again", default=None)


@contextmanager
def reserving_again(why: str) -> Iterator[None]:
    """The reservations made inside are an accepted call's own id reserving again (``why``:
    ``"retry"``), whatever path publishes it: their ``reserved`` events carry ``why`` as
    their detail, and the stats count them apart from the enqueues accepted."""
    token = _AGAIN.set(why)
    try:
        yield
    finally:
        _AGAIN.reset(token)


@dataclass(frozen=True, slots=True)
class Identity:
    """Where a call's lock lives. ``check`` is the argument digest kept for explicit keys."""

    key: str
    check: str = ""


_HEX = frozenset("0123456789abcdef")


def check_hint(value: object) -> str:
    """An argument check a message carries (a Celery header's, an RQ job's meta), if it is
    one (32 hex digits), else "": a hint for the worker's claim, dropped when malformed."""
    if isinstance(value, str) and len(value) == 32 and _HEX.issuperset(value):
        return value
    return ""


class Verdict(StrEnum):
    """What the gate or the worker guard decided."""

    ACCEPTED = "accepted"
    """Go ahead: the lock is held by this call."""
    DUPLICATE = "duplicate"
    """Another id holds the identity (``existing_id``); do not enqueue / do not run."""
    REPLACED = "replaced"
    """on_duplicate=replace displaced the queued ``existing_id``; go ahead and revoke it."""
    UNGUARDED = "unguarded"
    """The store was unavailable and on_store_error='allow': go ahead without dedup."""
    DEFERRED = "deferred"
    """Worker only: this very id runs now (another copy of its message, its lease live): do
    not run, do not fail, do not count a retry; try again later (SPEC §5)."""
    WAITING = "waiting"
    """Worker only: another id runs this identity now and the policy says
    ``on_busy="wait"``: put this execution off as :attr:`DEFERRED` (same republish, not a
    retry) until the other has finished (SPEC §15); ``existing_id`` is the holder."""
    FINISHED = "finished"
    """Worker only: this very id already succeeded (a redelivery after success): end without
    a new outcome, no result, no callbacks (SPEC §5)."""
    COALESCED = "coalesced"
    """Enqueue only, ``on_duplicate="coalesce"``: the call is (or joins) the follow-up of a
    running call, ``existing_id`` its id: publish under that id (SPEC §15, :mod:`.flow`)."""
    SUPERSEDED = "superseded"
    """Worker only: a later call replaced this message (a debounced burst's earlier call, or
    an older message of a coalesced follow-up): end without running (SPEC §15)."""


@dataclass(frozen=True, slots=True)
class GateResult:
    verdict: Verdict
    existing_id: str | None = None
    state: LockState | None = None


StartResult = GateResult


@dataclass(frozen=True, slots=True)
class GateCall:
    """One call for :meth:`Deduplicator.gate_many`."""

    name: str
    policy: Policy
    identity: Identity
    owner: str
    ttl_ms: int
    fresh: bool = False
    """A new call, not a retry or a republish of ``owner``'s message (see ``gate``)."""


class Deduplicator:
    """Computes identities and moves their locks through reserve → claim → complete/release.

    Args:
        store: where locks live (a :class:`~taskdedup.stores.RedisStore` in production).
        prefix: first component of every key (``{prefix}:{scope}:{task}:{digest}``).
    """

    def __init__(self, store: Store, *, prefix: str = DEFAULT_PREFIX) -> None:
        if not isinstance(prefix, str) or not prefix or ":" in prefix:
            raise ConfigurationError(
                f"key prefix must be a non-empty string without ':', got {prefix!r}"
            )
        self.store = store
        self.prefix = prefix
        self.events = Events()
        self.counters = Counters()
        self.events.add(self.counters)
        self._heartbeat: Heartbeat | None = None
        self._heartbeat_pid = 0
        # leases a parent renews for this forked child: (key, owner) -> (pid, settle)
        self._adopted: dict[tuple[str, str], tuple[int, Callable[[], None]]] = {}
        self._heartbeat_lock = ForkSafeLock()  # a forked child builds its own heartbeat
        self._store_checked = False
        # approximate windows: (task, slice index) already warned about in this process
        self._window_warned: set[tuple[str, int]] = set()

    # -- identity -------------------------------------------------------------------------

    def identity(
        self,
        name: str,
        policy: Policy,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        func: Callable[..., Any] | None = None,
        dedup_key: Any = None,
    ) -> Identity:
        """The lock key of one call; raises ``TypeError`` for arguments without identity."""
        scope = policy.scope
        check = ""
        if dedup_key is not None:
            digest = fingerprint_value(name, dedup_key, scope=scope)
            check = fingerprint(
                name, args, kwargs, func=func,
                include=policy.include, exclude=policy.exclude, scope=scope,
            )
        elif policy.key is not None:
            digest = fingerprint_value(name, policy.key(*args, **(kwargs or {})), scope=scope)
        else:
            digest = fingerprint(
                name, args, kwargs, func=func,
                include=policy.include, exclude=policy.exclude, scope=scope,
            )
        if policy.window is not None:
            key = approximate.lock_key(self.prefix, scope, name, digest, policy.window)
            approximate.register(key, policy.window, policy.ttl_ms)
            return Identity(key, check)
        return Identity(self.lock_key(name, digest, scope), check)

    def lock_key(self, name: str, digest: str, scope: str | None = None) -> str:
        if scope:
            return f"{self.prefix}:{scope}:{name}:{digest}"
        return f"{self.prefix}:{name}:{digest}"

    def trusted_key(self, name: str, policy: Policy, carried: Any) -> str | None:
        """``carried`` (a lock key read from a message header or a job's meta) when it is one
        this process could have made for task ``name`` under ``policy``: a ``str`` of at most
        :data:`MAX_KEY_LENGTH` characters, ``{prefix}:{scope}:{task}:`` and a digest (under
        an approximate window, the partition's hash tag and a digest). Else None: the caller
        recomputes the identity from the arguments (SPEC §8, input is not trusted), so a
        forged header can neither hijack another task's lock nor bypass this one's."""
        if type(carried) is not str or len(carried) > MAX_KEY_LENGTH:
            return None
        base = self.lock_key(name, "", policy.scope)
        if not carried.startswith(base):
            return None
        rest = carried[len(base):]
        if policy.window is None:
            return carried if _DIGEST.fullmatch(rest) else None
        digest = rest[-32:]
        if not _DIGEST.fullmatch(digest) or carried != approximate.lock_key(
            self.prefix, policy.scope, name, digest, policy.window
        ):
            return None
        return carried

    # -- enqueue --------------------------------------------------------------------------

    def gate(
        self,
        name: str,
        policy: Policy,
        identity: Identity,
        owner: str,
        *,
        ttl_ms: int | None = None,
        fresh: bool = False,
        again: str | None = None,
    ) -> GateResult:
        """Reserve ``identity`` for ``owner`` at enqueue (one round trip).

        ``fresh``: a new call, not a retry or a republish of ``owner``'s message; when it
        reuses an explicit id whose lock is held by that id, it is a duplicate of itself.
        ``again``: why an accepted call's own id reserves again (``"retry"``, ``"limit"``):
        its ``reserved`` event carries it as its detail, and the stats count it apart from
        the enqueues accepted.

        Raises:
            IdempotencyKeyMismatch: an explicit key is held with other arguments.
            StoreUnavailableError: Redis is down and ``on_store_error='raise'``.
        """
        ttl_ms = ttl_ms or policy.ttl_ms
        started = time.perf_counter()
        try:
            # fresh only when set: a store written before ``fresh`` still takes the call
            extra: dict[str, Any] = {"fresh": True} if fresh else {}
            probe = window_probe(policy, identity.key)
            if probe is not None:
                extra["window"] = probe
            if policy.on_duplicate is OnDuplicate.REPLACE:
                result = self.store.replace(identity.key, owner, ttl_ms, identity.check, **extra)
            else:
                result = self.store.reserve(identity.key, owner, ttl_ms, identity.check, **extra)
        except StoreUnavailableError as exc:
            if policy.on_store_error is OnStoreError.RAISE:
                self._forget_reservation(identity.key, owner)
            return self.store_error(name, policy, identity.key, owner, exc, "enqueue")
        return self.verdict(name, identity, owner, result, time.perf_counter() - started,
                            again=again)

    def gate_send(
        self,
        name: str,
        policy: Policy,
        identity: Identity,
        owner: str,
        *,
        ttl_ms: int,
        fresh: bool = False,
    ) -> SentGate | None:
        """:meth:`gate`, sent now and answered later: the reservation goes out without
        waiting for its reply, so the integration builds its message while Redis runs the
        script, and :meth:`SentGate.result` gives what :meth:`gate` would have given (same
        events, same ``on_store_error``, same errors). None when the store cannot send
        without reading (no ``send_reserve``, or one that declines) or the policy has an
        approximate window: then call :meth:`gate`."""
        send = getattr(self.store, "send_reserve", None)
        if send is None or policy.window is not None:
            return None
        replace = policy.on_duplicate is OnDuplicate.REPLACE
        started = time.perf_counter()
        sent = send(identity.key, owner, ttl_ms, identity.check, fresh=fresh, replace=replace)
        if sent is None:
            return None
        return SentGate(self, name, policy, identity, owner, sent, started)

    def gate_many(
        self, calls: Sequence[GateCall]
    ) -> list[GateResult | IdempotencyKeyMismatch | StoreUnavailableError]:
        """:meth:`gate` for many calls, their reservations in one pipeline round trip.

        Uses the store's ``reserve_many`` when it has one (RedisStore, MemoryStore), calls
        under an approximate window included (their probes ride along); calls whose policy
        says ``on_duplicate="replace"`` are gated one by one. Each call is
        reported as :meth:`gate` reports it, and answered in order: a GateResult, or the
        error :meth:`gate` would have raised for it, as a value, so the integration can
        still publish the others.
        """
        answers: list[GateResult | IdempotencyKeyMismatch | StoreUnavailableError | None]
        answers = [None] * len(calls)
        bulk: Callable[..., list[LockResult]] | None = getattr(self.store, "reserve_many", None)
        batched = [] if bulk is None else [
            i for i, call in enumerate(calls)
            if call.policy.on_duplicate is not OnDuplicate.REPLACE
        ]
        # One pipeline per kind of call (fresh or not: nearly always one kind).
        groups = [[i for i in batched if calls[i].fresh is fresh] for fresh in (False, True)]
        for fresh, group in zip((False, True), groups, strict=True):
            if group:
                self._gate_bulk(calls, group, answers, bulk, fresh)  # type: ignore[arg-type]
        for i, call in enumerate(calls):
            if answers[i] is None:
                try:
                    answers[i] = self.gate(call.name, call.policy, call.identity, call.owner,
                                           ttl_ms=call.ttl_ms, fresh=call.fresh)
                except (IdempotencyKeyMismatch, StoreUnavailableError) as error:
                    answers[i] = error
        return answers  # type: ignore[return-value]  # every slot is filled

    def _gate_bulk(
        self, calls: Sequence[GateCall], batched: list[int],
        answers: list[GateResult | IdempotencyKeyMismatch | StoreUnavailableError | None],
        bulk: Callable[..., list[LockResult]], fresh: bool,
    ) -> None:
        """The calls ``batched`` (indexes into ``calls``) in one ``reserve_many``."""
        if batched:
            extra: dict[str, Any] = {"fresh": True} if fresh else {}
            windows = [window_probe(calls[i].policy, calls[i].identity.key) for i in batched]
            if any(w is not None for w in windows):
                extra["windows"] = windows
            started = time.perf_counter()
            try:
                locks = bulk([(calls[i].identity.key, calls[i].owner, calls[i].ttl_ms,
                               calls[i].identity.check) for i in batched], **extra)
            except StoreUnavailableError as exc:
                self._forget_reservations(
                    [calls[i] for i in batched
                     if calls[i].policy.on_store_error is OnStoreError.RAISE]
                )
                for i in batched:
                    call = calls[i]
                    try:
                        answers[i] = self.store_error(call.name, call.policy, call.identity.key,
                                                      call.owner, exc, "enqueue")
                    except StoreUnavailableError as refused:
                        answers[i] = refused
            else:
                seconds = (time.perf_counter() - started) / len(batched)
                for i, lock in zip(batched, locks, strict=True):
                    call = calls[i]
                    try:
                        answers[i] = self.verdict(call.name, call.identity, call.owner, lock,
                                                  seconds)
                    except IdempotencyKeyMismatch as mismatch:
                        answers[i] = mismatch

    def _forget_reservations(self, calls: Sequence[GateCall]) -> None:
        """:meth:`_forget_reservation` for each call, stopping at the first that cannot
        reach the store (Redis is down: one timeout, not one per call)."""
        for call in calls:
            try:
                self.store.release(call.identity.key, call.owner, only_queued=True)
            except Exception:
                logger.debug("taskdedup: could not take back %d reservations", len(calls))
                return

    def verdict(
        self, name: str, identity: Identity, owner: str, result: LockResult,
        seconds: float | None = None, *, again: str | None = None,
    ) -> GateResult:
        """Turn the store's answer to a reservation into a verdict, and report it.

        :meth:`gate` calls it; an integration that reserved in its own round trip (the
        Celery transport reserving inside the publish) calls it with that answer.

        Raises:
            IdempotencyKeyMismatch: an explicit key is held with other arguments.
        """
        if not self._store_checked:
            self.check_store()
        outcome, key, existing = result.outcome, identity.key, result.owner
        if outcome is Outcome.ACQUIRED:
            self._emit(Event.RESERVED, name, key, owner, None, again or _AGAIN.get(), seconds)
            return GateResult(Verdict.ACCEPTED)
        if outcome is Outcome.REPLACED:
            self._emit(Event.DUPLICATE, name, key, owner, existing, "replaced", seconds)
            logger.debug("taskdedup: %s replaced queued task %s with %s", name, existing, owner)
            return GateResult(Verdict.REPLACED, existing, result.state)
        if outcome is Outcome.MISMATCH:
            self._emit(Event.DUPLICATE, name, key, owner, existing, "mismatch", seconds)
            raise IdempotencyKeyMismatch(key, existing)
        # existing None with DONE: an approximate window's filter remembers the identity
        detail = "window" if existing is None and result.state is LockState.DONE else None
        self._emit(Event.DUPLICATE, name, key, owner, existing, detail, seconds)
        if existing is None and result.state is None:
            self._foreign(name, key, owner, "enqueue")
        return GateResult(Verdict.DUPLICATE, existing, result.state)

    def _forget_reservation(self, key: str, owner: str) -> None:
        """After a failed reserve: if Redis ran it but the reply was lost, take it back.

        The caller is told nothing was enqueued, so a reservation for ``owner`` must not
        outlive the call and suppress the caller's retry. Best effort (Redis may be down).
        """
        try:
            self.store.release(key, owner, only_queued=True)
        except Exception:  # still unavailable: nothing was written, or it expires with ttl
            logger.debug("taskdedup: could not take back the reservation of %s", owner)

    # -- worker ---------------------------------------------------------------------------

    def send_start(self, policy: Policy, key: str, owner: str, *, check: str = ""
                   ) -> Any | None:
        """The claim of :meth:`start`, sent now and read by ``start(..., sent=...)``: an
        integration with a round trip of its own to make first (kombu's unacked record)
        sends the claim before it, so both wait on the server together. None when it cannot
        go ahead (a store without ``send_claim``, ``until_executing``, an approximate
        window): then ``start`` claims as usual. ``check``: as in :meth:`start`."""
        return self._ahead("send_claim", policy, key, owner, check)

    def carry_start(self, policy: Policy, key: str, owner: str, *, check: str = ""
                    ) -> Any | None:
        """The claim of :meth:`start`, for a transaction that an integration sends anyway to
        the store's server to carry (kombu's unacked record): no round trip of its own. The
        integration adds ``sent.command`` to it and passes that command's reply to
        ``sent.reply``; ``start(..., sent=sent)`` reads it, and claims as usual if none came.
        None as for :meth:`send_start`, or where the store has no ``carry_claim``."""
        return self._ahead("carry_claim", policy, key, owner, check)

    def _ahead(self, how: str, policy: Policy, key: str, owner: str, check: str) -> Any | None:
        """The claim of :meth:`start` made ahead by the store's ``how`` method, or None."""
        make = getattr(self.store, how, None)
        if make is None or policy.window is not None or policy.mode is Mode.UNTIL_EXECUTING:
            return None
        if not self._store_checked:
            self.check_store()
        return make(key, owner, policy.lease_ms, **self._claim_hint(policy, check))

    def _claim_hint(self, policy: Policy, check: str, reserved: bool = True
                    ) -> dict[str, Any]:
        """What a store that takes hints (RedisStore: the first command of its claim) is told
        of the lock the claim expects: none reserved (``while_executing``, or a message
        published without taskdedup), or the argument check the reservation holds (an
        explicit key's, carried by the message). A hint picks a command, never an outcome:
        a wrong one costs a round trip."""
        if not getattr(self.store, "claim_takes_reserved", False):
            return {}
        if not (reserved and policy.mode.gates_enqueue):
            return {"reserved": False}
        return {"check": check} if check else {}

    def start(self, name: str, policy: Policy, key: str, owner: str, *,
              sent: Any = None, check: str = "", reserved: bool = True) -> StartResult:
        """Guard a body about to run: claim the running lock and start its heartbeat.

        ``until_executing`` does not gate execution: its reservation is released here and
        the body always runs. ``sent``: this claim, sent ahead by :meth:`send_start`.
        ``check``: the argument check the message says its reservation holds (an explicit
        key's digest, "" for none); ``reserved``: False for a message published without
        taskdedup (sent by name: no reservation was made). Hints for the store's first
        command, never trusted for the outcome.

        Raises:
            StoreUnavailableError: Redis is down and ``on_store_error='raise'``; the
                integration must retry the task later, never run it unguarded.
        """
        if not self._store_checked:
            self.check_store()
        if policy.mode is Mode.UNTIL_EXECUTING:
            self.release(name, key, owner, reason="started")
            return StartResult(Verdict.ACCEPTED)
        try:
            probe = None if sent is not None else window_probe(policy, key)
            if sent is not None:
                result = sent.read()
            elif probe is not None:
                result = self.store.claim(key, owner, policy.lease_ms,  # type: ignore[call-arg]
                                          window=probe)
            else:
                result = self.store.claim(key, owner, policy.lease_ms,
                                          **self._claim_hint(policy, check, reserved))
        except StoreUnavailableError as exc:
            return self.store_error(name, policy, key, owner, exc, "start")
        if result.outcome is Outcome.ACQUIRED:
            self._emit(Event.CLAIMED, name, key, owner)
            self.heartbeat().add(name, key, owner, policy.lease_ms)
            return StartResult(Verdict.ACCEPTED)
        if result.owner == owner and result.state is LockState.RUNNING:
            self._emit(Event.DEFERRED, name, key, owner, owner, "copy")
            logger.info("taskdedup: %s[%s] is running in another copy of its message (a "
                        "broker redelivery while it runs): this copy waits", name, owner)
            return StartResult(Verdict.DEFERRED, owner, result.state)
        if (policy.on_busy is OnBusy.WAIT and result.state is LockState.RUNNING
                and result.owner != owner):
            self._emit(Event.DEFERRED, name, key, owner, result.owner, "busy")
            logger.debug("taskdedup: %s[%s] waits: identity %s is running by %s",
                         name, owner, key, result.owner)
            return StartResult(Verdict.WAITING, result.owner, result.state)
        state = result.state.value if result.state else "?"
        self._emit(Event.SKIPPED, name, key, owner, result.owner, state)
        if result.owner == owner:
            logger.info("taskdedup: %s[%s] already succeeded: this redelivered copy ends "
                        "without running again", name, owner)
            return StartResult(Verdict.FINISHED, owner, result.state)
        if result.state is None:
            self._foreign(name, key, owner, "start")
        else:
            logger.debug(
                "taskdedup: skipped %s[%s]: identity %s is %s by %s",
                name, owner, key, _STATE_WORDS.get(result.state, "held"), result.owner,
            )
        return StartResult(Verdict.DUPLICATE, result.owner, result.state)

    def _foreign(self, name: str, key: str, owner: str | None, where: str) -> None:
        """A lock key holds a value taskdedup did not write, and it blocked ``owner`` at
        ``where`` (enqueue or start): WARNING naming the key, counted (SPEC §8)."""
        self._emit(Event.FOREIGN, name, key, owner, detail=where)
        logger.warning(
            "taskdedup: %s[%s] was blocked at %s by %s, which holds a value taskdedup did not "
            "write (another program's key under the prefix?); look at it with `taskdedup "
            "inspect --key %s` and remove it with `taskdedup clear --key %s`",
            name, owner, where, key, key, key,
        )

    def finish(self, name: str, policy: Policy, key: str, owner: str, *, success: bool,
               later: bool = False, hold: bool = False) -> None:
        """The body is over: complete (success) or release (final failure).

        Store errors are logged, not raised: the lock then frees itself within ``lease``.
        ``later``: a worker's success whose completion need not hold up its next task — the
        completion is sent at once and its reply read later (a store with
        ``complete_later``, exact windows): ``completed`` is emitted when it is sent, and a
        lock found gone when the reply is read is reported then (``lease_lost``).
        ``hold`` (with ``later``): no copy of this call can follow it (acked before its body,
        no ETA, not redelivered), so the completion may ride, within milliseconds, in a
        transaction the worker sends anyway (``RedisStore.hold_here``).
        """
        self.stop_heartbeat(key, owner)
        if policy.mode is Mode.UNTIL_EXECUTING:
            return
        if not success:
            if self._release(name, key, owner, "failed") is Outcome.NOT_OWNER:
                self._emit(Event.LEASE_LOST, name, key, owner, detail="release")
            return
        probe = window_probe(policy, key)
        # until_expired keeps DONE for ttl; else the identity is free again, and a tombstone
        # tells this id's copies it ran
        ttl_ms, finished_ms = ((policy.ttl_ms, 0) if policy.mode is Mode.UNTIL_EXPIRED
                               else (0, policy.lease_ms))
        complete_later = getattr(self.store, "complete_later", None) if later else None
        if probe is None and complete_later is not None:
            def report(outcome: Outcome | StoreUnavailableError) -> None:
                if outcome is not Outcome.OK:  # ``completed`` was said at the send
                    self._completed(name, policy, key, owner, outcome)

            # ``hold`` only when asked: a store of its own may take no such argument
            if complete_later(key, owner, ttl_ms, report, finished_ms=finished_ms,
                              **({"hold": True} if hold else {})):
                # said now, inside the task's span and logs; a lock found gone when the reply
                # is read follows as lease_lost
                self._emit(Event.COMPLETED, name, key, owner)
                self.heartbeat().settle_soon(self.store)
                return
        try:
            if probe is not None:
                outcome: Outcome | StoreUnavailableError = self._remember(
                    name, key, owner, probe, policy.lease_ms)
            elif finished_ms:
                outcome = self.store.complete(key, owner, 0, finished_ms=finished_ms)
            else:  # the plain call, as stores written before finished_ms take it
                outcome = self.store.complete(key, owner, ttl_ms)
        except StoreUnavailableError as exc:
            outcome = exc
        self._completed(name, policy, key, owner, outcome)

    def _completed(self, name: str, policy: Policy, key: str, owner: str,
                   outcome: Outcome | StoreUnavailableError) -> None:
        """Report what a completion answered."""
        if isinstance(outcome, StoreUnavailableError):
            self._emit(Event.STORE_ERROR, name, key, owner, detail="complete")
            logger.warning("taskdedup: could not complete %s[%s]: %s", name, owner, outcome)
            return
        if outcome is Outcome.OK:
            self._emit(Event.COMPLETED, name, key, owner)
        else:
            self._emit(Event.LEASE_LOST, name, key, owner, detail="complete")
            logger.warning(
                "taskdedup: %s[%s] finished after its lock %s was gone (expired: lease %.1fs "
                "too short?, or evicted by the server: taskdedup doctor checks)",
                name, owner, key, policy.lease,
            )

    def _remember(
        self, name: str, key: str, owner: str, probe: Probe, finished_ms: int
    ) -> Outcome:
        """Complete under an approximate window: the identity goes into the current slice
        (one round trip); a slice passing its capacity share is reported once (WARNING)."""
        remembered = self.store.remember(  # type: ignore[attr-defined]
            key, owner, probe, finished_ms=finished_ms)
        window = probe.window
        if remembered.added > window.share:
            mark = (name, remembered.slice_index)
            if mark not in self._window_warned:
                self._window_warned.add(mark)
                if len(self._window_warned) > 1024:
                    self._window_warned = {mark}
                logger.warning(
                    "taskdedup: the approximate window of %s passed its capacity: a slice "
                    "holds more than %d identities per partition (capacity=%d over %d live "
                    "slices and %d partitions), so its false-positive rate is above "
                    "error_rate=%g; raise capacity", name, window.share, window.capacity,
                    window.slices + 1, window.partitions, window.error_rate,
                )
        outcome: Outcome = remembered.outcome
        return outcome

    def release(
        self, name: str, key: str, owner: str, *, reason: str, only_queued: bool = False
    ) -> bool:
        """Compare-and-delete ``key`` for ``owner``; True when it was ours. Never raises.

        ``only_queued`` leaves a lock that a worker has claimed (cancel of a queued job).
        """
        return self._release(name, key, owner, reason, only_queued) is Outcome.OK

    def _release(
        self, name: str, key: str, owner: str, reason: str, only_queued: bool = False
    ) -> Outcome | None:
        if not only_queued:
            self.stop_heartbeat(key, owner)
        try:
            if only_queued:
                outcome = self.store.release(key, owner, only_queued=True)
            else:  # the plain call, as stores written before only_queued take it
                outcome = self.store.release(key, owner)
        except StoreUnavailableError as exc:
            self._emit(Event.STORE_ERROR, name, key, owner, detail=f"release:{reason}")
            logger.warning("taskdedup: could not release %s[%s] (%s): %s", name, owner, reason, exc)
            return None
        if outcome is Outcome.OK:
            self._emit(Event.RELEASED, name, key, owner, detail=reason)
        return outcome

    # -- heartbeat ------------------------------------------------------------------------

    def heartbeat(self) -> Heartbeat:
        """This process's heartbeat thread (a new one after a fork)."""
        current = pid()
        if self._heartbeat is None or self._heartbeat_pid != current:
            with self._heartbeat_lock:
                if self._heartbeat is None or self._heartbeat_pid != current:
                    self._heartbeat = Heartbeat(self)
                    self._heartbeat_pid = current
        return self._heartbeat

    def stop_heartbeat(self, key: str, owner: str) -> None:
        """Stop renewing ``key``'s lease (the body is over: its lock is being completed,
        released or re-reserved); a lease the parent renews for this process is marked
        settled (:meth:`adopt`)."""
        if self._adopted:
            adopted = self._adopted.pop((key, owner), None)
            if adopted is not None and adopted[0] == pid():
                adopted[1]()
        if self._heartbeat is not None and self._heartbeat_pid == pid():
            self._heartbeat.remove(key, owner)

    def adopt(self, key: str, owner: str, settle: Callable[[], None]) -> None:
        """In a forked child whose parent claimed ``key`` and renews its lease
        (:class:`taskdedup.forklease.ChildLease`): call ``settle()`` when this process stops
        the lease's heartbeat, so the parent stops renewing it."""
        self._adopted[(key, owner)] = (pid(), settle)

    # -- helpers --------------------------------------------------------------------------

    def check_store(self) -> None:
        """Let the store check its server, once (a RedisStore warns when the server may evict
        locks; a store without ``check_server`` has nothing to check). Called on first use;
        a worker that forks per job calls it before forking, so no child asks again."""
        self._store_checked = True
        check = getattr(self.store, "check_server", None)
        if check is None:
            return
        if "prefix" in inspect.signature(check).parameters:  # RedisStore: its probe key's
            check(prefix=self.prefix)
        else:
            check()

    def store_error(
        self, name: str, policy: Policy, key: str, owner: str, exc: StoreUnavailableError,
        where: str,
    ) -> GateResult:
        """Report a store failure at ``where`` and apply ``on_store_error``: UNGUARDED for
        ``allow`` (logged at WARNING), else ``exc`` is raised. For integrations that reach
        the store in their own round trip (RQ's fused enqueue)."""
        self._emit(Event.STORE_ERROR, name, key, owner, detail=where)
        if policy.on_store_error is OnStoreError.ALLOW:
            logger.warning(
                "taskdedup: store unavailable at %s of %s[%s]; proceeding WITHOUT dedup "
                "(on_store_error='allow'): %s", where, name, owner, exc,
            )
            return GateResult(Verdict.UNGUARDED)
        raise exc

    def _emit(
        self, event: Event, name: str, key: str, owner: str | None,
        existing_id: str | None = None, detail: str | None = None, seconds: float | None = None,
    ) -> None:
        self.events.record(event, name, key, owner, existing_id, detail, seconds)


_STATE_WORDS = {LockState.QUEUED: "queued", LockState.RUNNING: "running", LockState.DONE: "done",
                LockState.FINISHED: "finished"}


COPY_WAIT_MIN = 1.0
"""Seconds: the shortest wait of a copy put off (SPEC §5)."""


def copy_wait(policy: Policy, redelivery: float | None = None) -> float:
    """How long a copy of a running message waits before it claims again: a quarter of the
    lease (at least :data:`COPY_WAIT_MIN`), so a dead original's lapse is noticed soon; and
    under half of ``redelivery`` (the broker's visibility timeout), so the broker does not
    copy the waiting message once more (at least 0.1 s)."""
    wait = max(COPY_WAIT_MIN, policy.lease / 4)
    if redelivery is not None:
        wait = max(0.1, min(wait, redelivery / 2))
    return wait


def window_probe(policy: Policy, key: str) -> Probe | None:
    """The approximate window's probe of lock ``key`` under ``policy``, or None (an exact
    window, or a key made without the window: e.g. a message sent before it was declared)."""
    if policy.window is None:
        return None
    return approximate.probe(key, policy.window, policy.ttl_ms)


STATE_WORDS: dict[LockState, str] = _STATE_WORDS
SKIPPED_MARK = "skipped duplicate"


SKIPPED_LEAD = "SKIPPED"
"""The first key of a skipped duplicate's result, so that its repr leads with the word where
operators scan truncated results (Flower's task list, rq-dashboard's job page, worker logs)."""


def skipped_value(existing_id: str | None, state: LockState | None) -> dict[str, Any]:
    """The result of an execution skipped as a duplicate (Celery and RQ alike, JSON-friendly):
    ``{"SKIPPED": "duplicate of <id> (<state>)", "taskdedup": "skipped duplicate",
    "existing_id": ..., "state": ...}`` (the first key is for the eye; read it with
    ``skipped_info``)."""
    word = STATE_WORDS.get(state) if state else None
    # For the eye, and safe to write anywhere (RQ writes it into the job's description): an
    # owner read from Redis that is not UTF-8 is shown escaped.
    shown = existing_id.encode("utf-8", "backslashreplace").decode() if existing_id else None
    of = f"duplicate of {shown}" if shown else "duplicate of an earlier call"
    return {SKIPPED_LEAD: f"{of} ({word})" if word else of, "taskdedup": SKIPPED_MARK,
            "existing_id": existing_id, "state": word}


def skipped_of(value: Any) -> dict[str, Any] | None:
    """``{"existing_id", "state"}`` when ``value`` is a skipped duplicate's result, else None."""
    if isinstance(value, Mapping) and value.get("taskdedup") == SKIPPED_MARK:
        return {"existing_id": value.get("existing_id"), "state": value.get("state")}
    return None


def resolve_duplicate(
    name: str, policy: Policy, key: str, existing_id: str | None, carried: Sequence[str] = (),
    *, unit: str = "task", replace_raises: bool = True,
) -> bool:
    """Apply ``on_duplicate`` to a call found to be a duplicate, the same way everywhere.

    Returns True to hand the caller the original's handle, False to drop the call (logged at
    DEBUG: it is counted). Raises :class:`DuplicateTaskError` for ``raise``; for ``replace``
    of an original that has started (``replace_raises``); for a holder that is not an id (a
    value taskdedup did not write); and whatever ``on_duplicate`` says, when the call carries
    a workflow (``carried``: callbacks, chain steps, dependents), which dropping would lose
    silently.
    """
    if carried:
        raise DuplicateTaskError(
            key, existing_id,
            f"duplicate {unit} {name}: {key} is held by {existing_id!r}, and this call carries "
            f"{', '.join(sorted(set(carried)))}, which would be lost if it were dropped; "
            f"nothing was sent. Enqueue the workflow once, or give the call a dedup_key / "
            "dedup=False.",
        )
    if existing_id is None and policy.window is not None and not carried:
        # The approximate window remembers the identity (a filter keeps no id): there is no
        # original's handle to return, so "return" and "drop" both give None.
        if policy.on_duplicate is OnDuplicate.RAISE or (
            policy.on_duplicate is OnDuplicate.REPLACE and replace_raises
        ):
            raise DuplicateTaskError(
                key, None,
                f"duplicate {unit} {name}: {key} succeeded within the window (remembered by "
                "the approximate window, which keeps no id; or a false positive at its "
                "error_rate)",
            )
        logger.debug("taskdedup: duplicate %s remembered by the approximate window", name)
        return False
    if existing_id is None:
        raise DuplicateTaskError(
            key, None,
            f"duplicate {unit} {name}: {key} holds a value taskdedup did not write; inspect "
            "or delete that key",
        )
    mode = policy.on_duplicate
    if mode is OnDuplicate.RAISE:
        raise DuplicateTaskError(key, existing_id)
    if mode is OnDuplicate.DROP:
        logger.debug("taskdedup: dropped duplicate %s (held by %s)", name, existing_id)
        return False
    if mode is OnDuplicate.REPLACE and replace_raises:
        raise DuplicateTaskError(
            key, existing_id,
            f"cannot replace {unit} {name} {existing_id!r}: it has already started or "
            f"finished (replace only takes the place of a queued {unit})",
        )
    return True


class SentGate:
    """A reservation :meth:`Deduplicator.gate_send` sent, answered by :meth:`result` (read
    once, then kept); :meth:`abandon` for a call given up before its publish."""

    __slots__ = ("_answer", "_dedup", "_identity", "_name", "_owner", "_policy", "_sent",
                 "_started")

    def __init__(self, dedup: Deduplicator, name: str, policy: Policy, identity: Identity,
                 owner: str, sent: Any, started: float) -> None:
        self._dedup = dedup
        self._name = name
        self._policy = policy
        self._identity = identity
        self._owner = owner
        self._sent = sent
        self._started = started
        self._answer: GateResult | BaseException | None = None

    @property
    def answered(self) -> bool:
        """Whether :meth:`result` was asked (its reply read, or its error raised)."""
        return self._answer is not None

    def result(self) -> GateResult:
        """What :meth:`Deduplicator.gate` would have answered; raises what it would have
        raised (once read, the same answer or error each time). ``seconds`` in the events is
        the time from the send to the reply read, the work done meanwhile included."""
        answer = self._answer
        if answer is None:
            answer = self._answer = self._read()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def _read(self) -> GateResult | BaseException:
        dedup, policy, key = self._dedup, self._policy, self._identity.key
        try:
            try:
                lock = self._sent.read()
            except StoreUnavailableError as exc:
                if policy.on_store_error is OnStoreError.RAISE:
                    dedup._forget_reservation(key, self._owner)
                return dedup.store_error(self._name, policy, key, self._owner, exc, "enqueue")
            return dedup.verdict(self._name, self._identity, self._owner, lock,
                                 time.perf_counter() - self._started)
        except (IdempotencyKeyMismatch, StoreUnavailableError) as error:
            return error

    def abandon(self) -> None:
        """The call was given up before its publish (an error on the way): read the answer
        and take back a reservation it made. Never raises; a reply that cannot be read
        closes its connection."""
        if self._answer is not None:
            return
        try:
            answer = self._answer = self._read()
        except BaseException:
            self._sent.discard()
            raise
        if isinstance(answer, GateResult) and answer.verdict in (Verdict.ACCEPTED,
                                                                 Verdict.REPLACED):
            try:
                self._dedup.release(self._name, self._identity.key, self._owner,
                                    reason="publish_failed")
            except Exception:  # Redis down meanwhile: it expires with its ttl
                logger.debug("taskdedup: could not take back the reservation of %s",
                             self._owner)


class Heartbeat:
    """Renews the running locks of this process every ``lease / 3`` from a daemon thread.

    A lock found no longer ours is reported as ``lease_lost`` and dropped from the set; the
    body keeps running (it cannot be stopped safely), and its completion will not touch
    the new owner's lock (fencing).
    """

    def __init__(self, dedup: Deduplicator) -> None:
        self._dedup = dedup
        self._cond = threading.Condition()
        self._due: dict[tuple[str, str], tuple[float, int, str]] = {}
        self._thread: threading.Thread | None = None
        self._wake_at = float("inf")  # when the thread wakes next on its own
        self._settle: dict[int, Any] = {}  # stores owing completion replies (settle_soon)
        self._settle_at = float("inf")
        self._calls: list[tuple[float, Callable[[], object]]] = []  # call_later
        # leases kept for a forked child (hand_over): renewed until it says it settled them
        self._until: dict[tuple[str, str], Callable[[], bool]] = {}

    def add(self, name: str, key: str, owner: str, lease_ms: int) -> None:
        due = time.monotonic() + lease_ms / 3000
        with self._cond:
            self._due[(key, owner)] = (due, lease_ms, name)
            self._start()
            if due < self._wake_at:  # else the thread's own wake-up covers it: no wake per task
                self._cond.notify()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="taskdedup-heartbeat", daemon=True
            )
            self._thread.start()

    def remove(self, key: str, owner: str) -> None:
        with self._cond:
            self._due.pop((key, owner), None)
            self._until.pop((key, owner), None)

    def hand_over(self, key: str, owner: str, settled: Callable[[], bool]) -> bool:
        """Keep renewing the lease of ``key`` for a child process this one forks to run the
        body (:class:`taskdedup.forklease.ChildLease`), until ``settled()`` says the child
        completed, released or re-reserved it: from then on its renewals stop, and a lock
        found gone is the child's to report, not a lost lease. False when this heartbeat
        renews no such lease (no lock was taken)."""
        with self._cond:
            if (key, owner) not in self._due:
                return False
            self._until[(key, owner)] = settled
            return True

    def settle_soon(self, store: Any) -> None:
        """Have ``store``'s unread completion replies read within ``SETTLE_AFTER`` if the
        worker's own next claim has not read them by then (``RedisStore.complete_later``)."""
        at = time.monotonic() + SETTLE_AFTER
        with self._cond:
            self._settle[id(store)] = store
            if self._settle_at <= at:
                return  # a wake-up is due already
            self._settle_at = at
            self._start()
            if at < self._wake_at:
                self._cond.notify()

    def call_later(self, delay: float, call: Callable[[], object]) -> None:
        """Have this heartbeat's thread call ``call()`` once, ``delay`` seconds on (an RQ
        work-horse's stats: :func:`taskdedup.stats.hold_threads`). Errors are logged."""
        at = time.monotonic() + delay
        with self._cond:
            self._calls.append((at, call))
            self._start()
            if at < self._wake_at:
                self._cond.notify()

    def __len__(self) -> int:
        return len(self._due)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                settle: list[Any] = []
                if self._settle_at <= now:
                    settle, self._settle = list(self._settle.values()), {}
                    self._settle_at = float("inf")
                calls = [call for at, call in self._calls if at <= now]
                if calls:
                    self._calls = [(at, call) for at, call in self._calls if at > now]
            for store in settle:
                self._read_replies(store)
            for call in calls:
                try:
                    call()
                except Exception:  # the thread must survive anything
                    logger.exception("taskdedup: a call on the heartbeat thread failed")
            with self._cond:
                now = time.monotonic()
                due = [(k, v) for k, v in self._due.items() if v[0] <= now]
                if self._until and due:  # a child settled its lease: no more renewals
                    settled = [k for k, _ in due if k in self._until and self._until[k]()]
                    for k in settled:
                        self._due.pop(k, None)
                        self._until.pop(k, None)
                    due = [(k, v) for k, v in due if k not in settled]
                if not due:
                    wait = min(min((v[0] for v in self._due.values()), default=now + 60),
                               self._settle_at,
                               min((at for at, _ in self._calls), default=now + 60)) - now
                    self._wake_at = now + max(0.005, wait)
                    self._cond.wait(timeout=max(0.005, wait))
                    self._wake_at = float("inf")
                    continue
                for k, (_, lease_ms, name) in due:
                    self._due[k] = (now + lease_ms / 3000, lease_ms, name)
            for (key, owner), (_, lease_ms, name) in due:
                self._beat(name, key, owner, lease_ms)

    def _read_replies(self, store: Any) -> None:
        """Read the completion replies ``store``'s threads have left unread for a while;
        look again later while some are owed."""
        try:
            owed = store.settle(SETTLE_AFTER / 2)
        except Exception:  # the thread must survive anything
            logger.exception("taskdedup: reading completion replies failed")
            return
        if owed:
            self.settle_soon(store)

    def _beat(self, name: str, key: str, owner: str, lease_ms: int) -> None:
        dedup = self._dedup
        try:
            outcome = dedup.store.heartbeat(key, owner, lease_ms)
        except StoreUnavailableError as exc:
            dedup._emit(Event.STORE_ERROR, name, key, owner, detail="heartbeat")
            logger.warning("taskdedup: heartbeat of %s[%s] failed: %s", name, owner, exc)
            return
        except Exception:  # the thread must survive anything
            logger.exception("taskdedup: heartbeat of %s[%s] failed", name, owner)
            return
        if outcome is not Outcome.OK:
            with self._cond:
                if (key, owner) not in self._due:
                    return  # finished meanwhile
                self._due.pop((key, owner), None)
                settled = self._until.pop((key, owner), None)
            if settled is not None and settled():
                return  # the child completed or released it meanwhile: its own to report
            dedup._emit(Event.LEASE_LOST, name, key, owner, detail="heartbeat")
            logger.warning(
                "taskdedup: %s[%s] lost its lock %s (expired before the heartbeat, or evicted "
                "by the server: taskdedup doctor checks)",
                name, owner, key,
            )
