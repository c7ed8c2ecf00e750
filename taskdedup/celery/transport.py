"""taskdedup's kombu Redis transport: the one-round-trip publish, and the reliable fetch.

Publishing: a gated ``apply_async`` sets :data:`FUSED` for its message; the channel's ``_put``
(a queue) or ``_put_fanout`` (a broadcast) then runs the reservation and kombu's own push in one
Lua script (``enqueue.lua``): no reservation without its message, no message without its
reservation, a duplicate pushes nothing. Every other message goes through kombu's own code.

Consuming: with the transport option ``taskdedup_reliable_fetch``, the channel consumes through
per-worker processing lists (:mod:`taskdedup.celery.fetch`); else kombu's own fetch.

:class:`SentinelTransport` is the same over kombu's Sentinel transport (``sentinel://``). What
this relies on in kombu lives in :mod:`taskdedup.celery._compat`.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import redis
from kombu.utils.json import dumps as _kombu_dumps

from ..approximate import probe_for
from ..exceptions import StoreUnavailableError
from ..stores.base import LockResult, Outcome
from ..stores.redis import may_have_run, reserve_and_run
from . import _compat
from .fetch import OPTIONS as FETCH_OPTIONS
from .fetch import ReliableFetch

__all__ = ["FUSED", "SENTINEL_TRANSPORT", "TRANSPORT", "Fused", "RedisTransport",
           "SentinelTransport"]

TRANSPORT = "taskdedup.celery:RedisTransport"
"""``broker_transport`` of :class:`RedisTransport`."""
SENTINEL_TRANSPORT = "taskdedup.celery.transport:SentinelTransport"
"""``broker_transport`` of :class:`SentinelTransport`."""

@dataclass
class Fused:
    """A reservation for the pushes of message ``owner``, and the store's answer.

    ``unsure`` names the pushes (their queue or topic) whose script may have run although it
    failed (a lost reply): kombu resends a publish after a connection error (Celery's
    ``task_publish_retry``), and that resent script must not push a second copy. A message
    routed to two queues is two pushes of one publish, each made once.
    """

    key: str
    owner: str
    ttl_ms: int
    check: str
    replace: bool
    fresh: bool = False
    """Not a retry or a republish of ``owner``'s message: its own lock is a duplicate."""
    result: LockResult | None = None
    unsure: set[str] = field(default_factory=set)
    follow_up: str | None = None
    """``on_duplicate="coalesce"``: the follow-up record's key (SPEC §15); a COALESCED answer
    pushes nothing and leaves the follow-up's generation in :attr:`generation`."""
    generation: int = 0
    compact: bool = False
    """The lock store writes compact owners (:attr:`RedisStore.compact_owners`)."""

    def run(self, client: redis.Redis, commands: list[tuple[Any, ...]]) -> None:
        """Reserve and, if the gate lets the message through, run ``commands``: one script.

        A broken connection is raised as redis-py's own error, so kombu retries it as it
        retries its own push; the resent script recognises this owner's queued lock and pushes
        nothing again.
        """
        target = str(commands[0][1])
        try:
            self.result, extra = reserve_and_run(client, self.key, self.owner, self.ttl_ms,
                                                 self.check, self.replace, commands,
                                                 resent=target in self.unsure,
                                                 fresh=self.fresh, window=probe_for(self.key),
                                                 follow_up=self.follow_up,
                                                 compact_owners=self.compact)
        except StoreUnavailableError as exc:
            cause = exc.__cause__
            if may_have_run(exc) and isinstance(cause, redis.RedisError):
                self.unsure.add(target)
                raise cause from None
            raise
        self.unsure.discard(target)
        if self.result.outcome is Outcome.COALESCED and extra:
            self.generation = int(extra[0])
        if self.result.outcome in (Outcome.ACQUIRED, Outcome.REPLACED):
            # The lock is this publish's own now: its push to another queue (one publish
            # routed to two queues) is the same message, not a fresh call.
            self.fresh = False


def json_dumps(message: Any) -> str:
    """kombu's own JSON encoding of a message (what its ``_put`` pushes)."""
    return str(_kombu_dumps(message))  # type: ignore[no-untyped-call]


FUSED: ContextVar[Fused | None] = ContextVar("taskdedup_fused", default=None)


class FusedPush(_compat.Channel):
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

    def _fused_for(self, message: dict[str, Any]) -> Fused | None:
        fused = FUSED.get()
        if fused is None or _compat.message_id(message) != fused.owner:
            return None
        return fused

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        fused = self._fused_for(message)
        if fused is None:
            super()._put(queue, message, **kwargs)  # type: ignore[no-untyped-call]
            return
        _compat.flush_publish_batch(kwargs)
        commands: list[tuple[Any, ...]] = [
            ("LPUSH", _compat.queue_list_key(self, queue, message), json_dumps(message))]
        expiry = _compat.queue_expiry_ms(self, queue)
        if expiry is not None:  # kombu 5.7's x-expires: refreshed by every push, as kombu does
            commands += [("PEXPIRE", key, expiry)
                         for key in _compat.priority_queue_keys(self, queue)]
        fused.run(self._publisher(), commands)

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str,
                    **kwargs: Any) -> None:
        """A broadcast: gated inside the script like a queued message."""
        fused = self._fused_for(message)
        if fused is None:
            super()._put_fanout(exchange, message, routing_key, **kwargs)  # type: ignore[no-untyped-call]
            return
        _compat.flush_publish_batch(kwargs)
        payload = json_dumps(message)
        fused.run(self._publisher(), [
            ("PUBLISH", topic, payload)
            for topic in _compat.publish_topic_keys(self, exchange, routing_key)])


class _Channel(FusedPush, ReliableFetch):
    """The fused push and the reliable fetch on kombu's Redis channel."""

    from_transport_options: tuple[str, ...] = (
        _compat.Channel.from_transport_options + FETCH_OPTIONS)  # type: ignore[assignment]


class _SentinelChannel(FusedPush, ReliableFetch, _compat.SentinelChannel):
    """The same on kombu's Sentinel channel."""

    from_transport_options: tuple[str, ...] = (
        _compat.SentinelChannel.from_transport_options + FETCH_OPTIONS)  # type: ignore[assignment]


class RedisTransport(_compat.Transport):
    """kombu's Redis transport with the gate fused into the publish.

    A gated ``apply_async`` reserves and pushes in one Lua script, one round trip, atomically
    (no reservation without its message, no message without its reservation). Used when the
    locks live in the broker's Redis; chosen when a ``DedupTask`` is bound to an app whose
    broker is one ``redis://`` or ``rediss://`` URL (see
    :func:`taskdedup.celery.config.fuses`), or set
    ``app.conf.broker_transport = "taskdedup.celery:RedisTransport"`` yourself. Messages
    without a reservation go through kombu's own code.

    TLS comes from ``broker_use_ssl`` or the URL's ``ssl_*`` options: kombu infers it from a
    bare ``rediss://`` only for its own ``rediss`` transport (taskdedup's own producers copy
    that inference, see :func:`taskdedup.celery.config.fused_producer`).
    """

    Channel = _Channel


class SentinelTransport(_compat.SentinelTransport):
    """kombu's Sentinel transport (``sentinel://``) with taskdedup's channel: used by a worker
    with the reliable fetch on a Sentinel broker."""

    Channel = _SentinelChannel
