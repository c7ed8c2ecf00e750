"""The app's configuration, read once per app: the lock store, the publish path, the fetch.

Store: ``app.conf.taskdedup_store`` (a Store or a ready redis client), else
``app.conf.taskdedup_url``, else ``TASKDEDUP_URL``, else the broker URL when it is Redis.
Publish path (:func:`fuses`): the reservation inside the broker's push
(:class:`~taskdedup.celery.transport.RedisTransport`, one round trip) or in a round trip of
its own; decided once per app and logged. Fetch (:func:`reliable_fetch`): with
``taskdedup_reliable_fetch``, a worker consumes through taskdedup's transport
(:mod:`taskdedup.celery.fetch`); decided once per app and logged.
"""

from __future__ import annotations

import os
import ssl
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import redis
from celery import Celery

from .. import stats
from ..core import DEFAULT_PREFIX, Deduplicator
from ..events import logger
from ..exceptions import ConfigurationError
from ..pids import ForkSafeLock, pid
from ..stores.base import Store
from ..stores.owners import compact_setting
from ..stores.redis import RedisStore
from . import _compat
from .fetch import DEFAULT_LEASE, DEFAULT_POLL
from .producers import producer_pool
from .transport import SENTINEL_TRANSPORT, TRANSPORT, RedisTransport, SentinelTransport

__all__ = ["fused_producer", "fuses", "get_deduplicator", "own_producer", "own_store",
           "reliable_fetch", "say_fetch_path", "say_publish_path", "use_reliable_fetch"]


def get_deduplicator(app: Celery) -> Deduplicator:
    """The app's :class:`~taskdedup.core.Deduplicator`, built once from its configuration.

    Store: ``app.conf.taskdedup_store`` (a Store or a ready redis client), else
    ``app.conf.taskdedup_url``, else ``TASKDEDUP_URL``, else the broker URL when it is Redis.
    Key prefix: ``app.conf.taskdedup_prefix``, else ``TASKDEDUP_PREFIX``, else ``taskdedup``.
    """
    dedup: Deduplicator | None = app.__dict__.get("_taskdedup")
    if dedup is not None:
        return dedup
    # Built under a lock: the threads of a threads pool ask at once on their first tasks, and
    # two deduplicators in one process would not know each other's claims sent ahead
    # (taskdedup.celery.ahead), heartbeats or counters.
    with _BUILD_LOCK:
        dedup = app.__dict__.get("_taskdedup")
        if dedup is None:
            prefix = app.conf.get("taskdedup_prefix") or os.environ.get("TASKDEDUP_PREFIX")
            prefix = prefix or DEFAULT_PREFIX
            dedup = Deduplicator(_store_for(app), prefix=prefix)
            if app.conf.get("taskdedup_stats", True):  # counters flushed off the hot path
                interval = app.conf.get("taskdedup_stats_interval") or stats.DEFAULT_INTERVAL
                stats.attach(dedup, interval=float(interval))
            app.__dict__["_taskdedup"] = dedup
    return dedup


_BUILD_LOCK = ForkSafeLock()


def own_store(app: Celery) -> bool:
    """Whether the app names a lock store of its own (not the broker's Redis)."""
    conf = app.conf
    return conf.get("taskdedup_store") is not None or bool(
        conf.get("taskdedup_url") or os.environ.get("TASKDEDUP_URL")
    )


def fuses(app: Celery) -> bool:
    """Whether this app's gated publishes reserve inside the broker's push (decided once).

    Yes when the locks live in the broker's Redis and kombu's Redis channel still has what the
    fused push needs (:func:`taskdedup.celery._compat.fused_push_missing`): with
    ``broker_transport = "taskdedup.celery:RedisTransport"``, or — unless
    ``taskdedup_fused_publish`` is False — with no transport configured and one
    ``redis://``/``rediss://`` broker URL (no separate write broker). In that second case the
    app's own connections keep kombu's transport (``broker_transport`` is not touched) and the
    gated publishes go through a producer pool of their own on :class:`RedisTransport` to the
    same broker, so what was published first does not matter. Decided when the first
    ``DedupTask`` is bound to the app (``Task.on_bound``) or publishes, and logged once at INFO.
    """
    cached: bool | None = app.__dict__.get("_taskdedup_fuses")
    if cached is None:
        cached, why = _choose(app)
        app.__dict__["_taskdedup_fuses"] = cached
        app.__dict__["_taskdedup_fuses_why"] = why
        # a kombu without what the fused push needs: a fallback the user did not choose
        app.__dict__["_taskdedup_fuses_missing"] = (
            None if cached else _compat.fused_push_missing(RedisTransport.Channel))
        say_publish_path(app)
    return cached


FUSED_TEXT = ("each deduplicated call is checked for duplicates in the same Redis call that "
              "queues it: no extra round trip")
APART_TEXT = ("each deduplicated call is checked for duplicates in a Redis call of its own "
              "before it is queued: one extra round trip")


def say_publish_path(app: Celery) -> None:
    """Log the publish path chosen for ``app``: what it means for the user in one plain
    sentence at INFO (and, when kombu lacks what the fused push needs, that it fell back and
    why), how and why at DEBUG; nothing when none was chosen yet.

    Said when the choice is made, and again by a worker once its logging is set up (the
    choice is made when tasks are bound, before Celery configures a worker's logging)."""
    why = app.__dict__.get("_taskdedup_fuses_why")
    if why is not None:
        fused = app.__dict__.get("_taskdedup_fuses")
        missing = app.__dict__.get("_taskdedup_fuses_missing")
        fallback = f" ({missing}: taskdedup uses kombu's own publish)" if missing else ""
        logger.info("taskdedup: Celery app %r: %s%s", app.main,
                    FUSED_TEXT if fused else APART_TEXT, fallback)
        logger.debug("taskdedup: Celery app %r publish path: %s", app.main, why)


def _choose(app: Celery) -> tuple[bool, str]:
    conf = app.conf
    transport = conf.broker_transport
    url = conf.broker_url
    own = "each gated publish reserves in a round trip of its own, then kombu publishes it"
    if own_store(app):
        return False, f"the locks have a store of their own (taskdedup_url/taskdedup_store): {own}"
    missing = _compat.fused_push_missing(RedisTransport.Channel)
    if transport is RedisTransport or transport == TRANSPORT:
        if missing:
            return False, f"broker_transport is {TRANSPORT}, but {missing}: {own}"
        if _bare_rediss(app):
            # kombu infers TLS from a bare rediss:// only for its own 'rediss' transport: keep
            # TLS here too, with kombu's default for that URL, and say so.
            conf.broker_use_ssl = {"ssl_cert_reqs": ssl.CERT_NONE}
            logger.warning(
                "taskdedup: broker_transport is %s and the broker URL is rediss:// without ssl "
                "options: broker_use_ssl set to kombu's default for rediss:// (TLS without "
                "certificate checks); set broker_use_ssl yourself to check them", TRANSPORT)
        return True, "gated publishes reserve inside the broker's push (one round trip)"
    if transport is not None:
        return False, f"broker_transport is {transport!r}: {own}"
    if not conf.get("taskdedup_fused_publish", True):
        return False, f"taskdedup_fused_publish is False: {own}"
    if not (isinstance(url, str) and url.split("://", 1)[0] in ("redis", "rediss")
            and ";" not in url and conf.broker_write_url in (None, url)):
        return False, f"the broker is not one redis:// URL that also holds the locks: {own}"
    if missing:
        return False, f"{missing}: {own}"
    return True, (f"gated publishes reserve inside the broker's push (one round trip), through "
                  f"producers of their own on {TRANSPORT} (other tasks keep kombu's transport; "
                  "taskdedup_fused_publish=False turns this off)")


def reliable_fetch(app: Celery) -> bool:
    """Whether this app's workers consume through the reliable fetch (decided once, logged).

    Yes when ``taskdedup_reliable_fetch`` is true (``CELERY_TASKDEDUP_RELIABLE_FETCH`` from
    Django settings), the broker a worker reads from is one ``redis://``, ``rediss://`` or
    ``sentinel://`` URL with kombu's transport or taskdedup's (no other ``broker_transport``),
    and kombu's Redis channel still has what the fetch relies on
    (:func:`taskdedup.celery._compat.reliable_fetch_missing`). Otherwise, with the setting on,
    the worker keeps kombu's fetch and a WARNING says the fetch is not reliable, and why.
    """
    cached: bool | None = app.__dict__.get("_taskdedup_reliable")
    if cached is None:
        cached, why = _choose_fetch(app)
        app.__dict__["_taskdedup_reliable"] = cached
        app.__dict__["_taskdedup_reliable_why"] = why
        say_fetch_path(app)
    return cached


def say_fetch_path(app: Celery) -> None:
    """Log the fetch chosen for ``app``: INFO when reliable, WARNING when the setting asked for
    it and it cannot be (nothing when the setting is off or nothing was chosen yet)."""
    why = app.__dict__.get("_taskdedup_reliable_why")
    if why is None:
        return
    if app.__dict__.get("_taskdedup_reliable"):
        logger.info("taskdedup: Celery app %r: %s", app.main, why)
    elif why:
        logger.warning("taskdedup: Celery app %r: the fetch is not reliable (a worker killed "
                       "between kombu's BRPOP and its unacked write loses the message): %s",
                       app.main, why)


def _choose_fetch(app: Celery) -> tuple[bool, str]:
    conf = app.conf
    if not conf.get("taskdedup_reliable_fetch"):
        return False, ""
    transport = conf.broker_transport
    url = conf.broker_read_url or conf.broker_url
    scheme = url.split("://", 1)[0].lower() if isinstance(url, str) else ""
    ours = _fetch_transport(scheme)
    own = "the worker keeps kombu's fetch"
    if transport is not None and transport not in (RedisTransport, TRANSPORT, SentinelTransport,
                                                   SENTINEL_TRANSPORT, *_KOMBU_NAMES):
        return False, f"broker_transport is {transport!r}, not taskdedup's: {own}"
    if ours is None:
        return False, f"the broker is not Redis ({scheme or 'no URL'}://): {own}"
    missing = _compat.reliable_fetch_missing(ours.Channel)
    if missing:
        return False, f"{missing}: {own}"
    options = conf.broker_transport_options or {}
    if options.get("ack_emulation") is False:
        return False, f"broker_transport_options['ack_emulation'] is False (no acks): {own}"
    lease = float(conf.get("taskdedup_fetch_lease") or DEFAULT_LEASE)
    return True, (f"the worker consumes through taskdedup's reliable fetch (a message moves "
                  f"into a processing list of the worker's in one step; lease {lease:g}s)")


def _fetch_transport(scheme: str) -> type[RedisTransport] | type[SentinelTransport] | None:
    if scheme in ("redis", "rediss"):
        return RedisTransport
    if scheme == "sentinel":
        return SentinelTransport
    return None


_TRANSPORT_NAMES = {RedisTransport: TRANSPORT, SentinelTransport: SENTINEL_TRANSPORT}
_KOMBU_NAMES = ("redis", "rediss", "sentinel")
"""kombu's own names for its Redis transports: replaced by taskdedup's like no name at all."""


def use_reliable_fetch(app: Celery, worker: str | None = None) -> bool:
    """Make this worker process consume through the reliable fetch, when :func:`reliable_fetch`
    says so: ``broker_transport`` becomes taskdedup's transport (kombu's, with the fused push
    and the fetch: every other command is kombu's own) and ``broker_transport_options`` gain
    the fetch's options (``taskdedup_fetch_lease``, ``taskdedup_fetch_poll``, the prefix, the
    worker's name). Called when the worker starts, before it connects; the app's configuration
    is not changed anywhere else."""
    if not reliable_fetch(app):
        return False
    conf = app.conf
    url = conf.broker_read_url or conf.broker_url
    transport = _fetch_transport(str(url).split("://", 1)[0].lower())
    if conf.broker_transport is None or conf.broker_transport in _KOMBU_NAMES:
        rediss = _bare_rediss(app)
        conf.broker_transport = _TRANSPORT_NAMES[transport]  # type: ignore[index]
        if rediss:  # what kombu infers from a bare rediss:// for its own transport name
            conf.broker_use_ssl = {"ssl_cert_reqs": ssl.CERT_NONE}
        # the publish path was chosen for kombu's transport: choose again on taskdedup's
        app.__dict__.pop("_taskdedup_fuses", None)
        app.__dict__.pop("_taskdedup_fuses_why", None)
        app.__dict__.pop("_taskdedup_route", None)
    prefix = conf.get("taskdedup_prefix") or os.environ.get("TASKDEDUP_PREFIX") or DEFAULT_PREFIX
    conf.broker_transport_options = {
        **(conf.broker_transport_options or {}),
        "taskdedup_reliable_fetch": True,
        "taskdedup_fetch_lease": float(conf.get("taskdedup_fetch_lease") or DEFAULT_LEASE),
        "taskdedup_fetch_poll": float(conf.get("taskdedup_fetch_poll") or DEFAULT_POLL),
        "taskdedup_prefix": prefix,
        "taskdedup_worker": worker,
    }
    return True


def _bare_rediss(app: Celery) -> bool:
    url = app.conf.broker_url
    return (isinstance(url, str) and url.startswith("rediss://") and "ssl_" not in url
            and not app.conf.broker_use_ssl)


def fused_producer(app: Celery, producer: Any = None) -> AbstractContextManager[Any]:
    """A producer whose channel runs the fused push, for one gated publish.

    ``producer`` when it is on :class:`RedisTransport` (or, in an app whose
    ``broker_transport`` is ours, whatever producer the caller gave); else one of taskdedup's
    own producers (:func:`own_producer`), on :class:`RedisTransport` to the app's broker.
    """
    if producer is not None and isinstance(_compat.transport_of(producer), RedisTransport):
        return nullcontext(producer)
    ours, timeout = _route(app)
    if ours:
        if producer is not None:
            return app.producer_or_acquire(producer)  # type: ignore[no-any-return]
        return _acquire(app, "_taskdedup_app_producers", _app_connection, timeout)
    return _acquire(app, "_taskdedup_producers", _fused_connection, timeout)


def own_producer(app: Celery, producer: Any = None) -> AbstractContextManager[Any]:
    """``producer`` when given, else one of taskdedup's producers over the app's own pool of
    broker connections (``app.pool``, no connection more): kombu's, but a queue is declared
    once per connection (:class:`.producers.DeclaredProducer`); made again after a fork."""
    if producer is not None:
        return nullcontext(producer)
    return _acquire(app, "_taskdedup_app_producers", _app_connection, _route(app)[1])


def _route(app: Celery) -> tuple[bool, float | None]:
    """Whether the app's ``broker_transport`` is ours, and its pool acquire timeout: read
    once per app (a settings lookup costs microseconds per publish)."""
    route: tuple[bool, float | None] | None = app.__dict__.get("_taskdedup_route")
    if route is None:
        transport = app.conf.broker_transport
        route = app.__dict__["_taskdedup_route"] = (
            transport is RedisTransport or transport == TRANSPORT,
            app.conf.get("broker_pool_acquire_timeout"))  # a setting of Celery 5.7 only
    return route


def _app_connection(app: Celery) -> Any:
    """The app's broker connection, as the app's own pool (``app.pool``) is keyed."""
    return app.connection_for_write()


def _fused_connection(app: Celery) -> Any:
    """The app's broker connection on :class:`RedisTransport`, with TLS as kombu decides it
    for this URL with its own transport (a bare rediss:// gets kombu's default there, and
    would get none with a transport named otherwise)."""
    tls = app.connection_for_write().ssl or None
    return app.connection_for_write(transport=RedisTransport, ssl=tls)


def _acquire(app: Celery, slot: str, connection: Any, timeout: float | None
             ) -> AbstractContextManager[Any]:
    """A producer of the app's pool kept in ``slot`` (made for this process from
    ``connection(app)``, over kombu's shared pool of its connections); ``timeout``: the
    app's pool acquire timeout (:func:`_route`)."""
    held: tuple[int, Any] | None = app.__dict__.get(slot)
    current = pid()  # os.getpid() is a system call: this one is refreshed at each fork
    if held is None or held[0] != current:
        held = app.__dict__[slot] = (current, producer_pool(connection(app), app.pool.limit))
    return held[1].acquire(block=True, timeout=timeout)  # type: ignore[no-any-return]


KOMBU_VISIBILITY_TIMEOUT = 3600.0
"""kombu's default ``visibility_timeout`` (seconds) for its Redis and SQS transports."""
_RESTORING_SCHEMES = ("redis", "rediss", "sentinel", "valkey", "valkeys", "sqs")


def visibility_timeout(app: Celery) -> float | None:
    """Seconds after which ``app``'s broker hands an unacked message out again (kombu's
    Redis and SQS transports: ``broker_transport_options['visibility_timeout']``), or None
    for a broker that redelivers only when its holder is gone: RabbitMQ (when a consumer's
    connection closes), Redis with ``taskdedup_reliable_fetch`` (when a worker's lease
    lapses; workers not yet upgraded still restore by time). Read once per app."""
    cached: tuple[float | None] | None = app.__dict__.get("_taskdedup_visibility")
    if cached is None:
        url = app.conf.broker_url
        scheme = url.split("://", 1)[0].lower() if isinstance(url, str) else ""
        seconds: float | None = None
        transport = app.conf.broker_transport
        reliable = app.conf.get("taskdedup_reliable_fetch") and _fetch_transport(scheme)
        if not reliable and (scheme in _RESTORING_SCHEMES or transport is RedisTransport
                             or transport == TRANSPORT):
            options = app.conf.broker_transport_options or {}
            seconds = float(options.get("visibility_timeout") or KOMBU_VISIBILITY_TIMEOUT)
        cached = app.__dict__["_taskdedup_visibility"] = (seconds,)
    return cached[0]


def _store_for(app: Celery) -> Store:
    conf = app.conf
    ready = conf.get("taskdedup_store")
    if ready is not None:
        if isinstance(ready, Store):
            return ready
        if isinstance(ready, redis.Redis):
            return RedisStore(ready, compact_owners=_compact(conf))
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
    return RedisStore.from_url(str(url), compact_owners=_compact(conf))


def _compact(conf: Any) -> bool:
    """``taskdedup_compact_owners``, else ``TASKDEDUP_COMPACT_OWNERS`` (off by default)."""
    return compact_setting(conf.get("taskdedup_compact_owners"))
