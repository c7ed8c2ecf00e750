"""Which :class:`~taskdedup.core.Deduplicator` an RQ queue, job or worker uses: one per store
and prefix, shared per process so their counters add up."""

from __future__ import annotations

import os
import weakref
from typing import Any

import redis

from .. import stats
from ..core import DEFAULT_PREFIX, Deduplicator
from ..exceptions import ConfigurationError
from ..pids import ForkSafeLock
from ..stores.base import Store
from ..stores.owners import compact_setting
from ..stores.redis import RedisStore

__all__ = ["get_deduplicator"]

_by_client: weakref.WeakKeyDictionary[Any, dict[str, Deduplicator]] = weakref.WeakKeyDictionary()
_by_url: dict[tuple[str, str], Deduplicator] = {}
_BUILD_LOCK = ForkSafeLock()


def get_deduplicator(
    connection: redis.Redis, store: Store | redis.Redis | str | None = None,
    prefix: str | None = None,
) -> Deduplicator:
    """The :class:`~taskdedup.core.Deduplicator` for an RQ connection.

    Store: ``store`` (a Store, a ready ``redis.Redis`` client or a URL), else the
    ``TASKDEDUP_URL`` environment variable, else ``connection`` itself (RQ's own Redis).
    Prefix: ``prefix``, else ``TASKDEDUP_PREFIX``, else ``taskdedup`` (the worker and the CLI
    read the same variables).
    Deduplicators on a URL or a connection are shared per process, so their counters add up.
    """
    prefix = prefix or os.environ.get("TASKDEDUP_PREFIX") or DEFAULT_PREFIX
    if isinstance(store, Store):
        return _new_deduplicator(store, prefix)
    if store is not None and not isinstance(store, (redis.Redis, str)):
        raise ConfigurationError(
            f"dedup_store must be a taskdedup Store, a redis.Redis client or a redis:// URL, "
            f"got {type(store).__name__}"
        )
    url = store if isinstance(store, str) else None
    if store is None:
        url = os.environ.get("TASKDEDUP_URL") or None
    client = store if isinstance(store, redis.Redis) else connection
    shared = _by_url.get((url, prefix)) if url is not None else (
        _by_client.get(client) or {}).get(prefix)
    if shared is not None:
        return shared
    with _BUILD_LOCK:  # one per store and prefix, even when threads ask at once
        if url is not None:
            dedup = _by_url.get((url, prefix))
            if dedup is None:
                dedup = _by_url[(url, prefix)] = _new_deduplicator(
                    RedisStore.from_url(url, compact_owners=compact_setting()), prefix)
            return dedup
        per_prefix = _by_client.setdefault(client, {})
        dedup = per_prefix.get(prefix)
        if dedup is None:
            dedup = per_prefix[prefix] = _new_deduplicator(
                RedisStore(client, compact_owners=compact_setting()), prefix)
        return dedup


def _new_deduplicator(store: Store, prefix: str) -> Deduplicator:
    """A Deduplicator whose counters are flushed to Redis off the hot path (taskdedup stats)."""
    dedup = Deduplicator(store, prefix=prefix)
    stats.attach(dedup)
    return dedup
