"""The reliable fetch's processing lists in Redis (SPEC §17): their keys, and what operators read.

A worker consuming through taskdedup's reliable fetch (:mod:`taskdedup.celery.fetch`) is one
*owner*: one consuming channel of one process. Its keys, in the broker's Redis, under the
taskdedup prefix::

    {prefix}:fetch:owners                     hash   owner -> its entry (JSON: worker, host,
                                                     pid, lease_ms, since)
    {prefix}:fetch:{owner}:lease              string the owner's lease (PX), renewed by its
                                                     fetches and its heartbeat
    {prefix}:fetch:{owner}:sources            set    every source list it fetched from
    {prefix}:fetch:{owner}:list:{source}      list   the messages it holds from ``source``
                                                     (kombu's queue list, priority list
                                                     included, with kombu's key prefix)

An owner whose lease lapsed is an *orphan*: a live worker puts its messages back at the head of
their sources. This module knows nothing of Celery or kombu: ``taskdedup doctor`` and the
dashboard read through :func:`holders`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import redis

from .locks import key_text

__all__ = [
    "Holder",
    "holders",
    "lease_key",
    "list_key",
    "owners_key",
    "sources_key",
]


def owners_key(prefix: str) -> str:
    """The registry of owners: a hash, owner -> its entry (JSON)."""
    return f"{prefix}:fetch:owners"


def lease_key(prefix: str, owner: str) -> str:
    """The owner's lease: present (with a PX) while the owner lives."""
    return f"{prefix}:fetch:{owner}:lease"


def sources_key(prefix: str, owner: str) -> str:
    """The set of source lists the owner fetched from (each has a processing list)."""
    return f"{prefix}:fetch:{owner}:sources"


def list_key(prefix: str, owner: str, source: str) -> str:
    """The owner's processing list for messages taken from ``source``."""
    return f"{prefix}:fetch:{owner}:list:{source}"


@dataclass(frozen=True)
class Holder:
    """One owner of processing lists, as Redis has it now.

    ``ttl_ms`` is its lease's PTTL: ``-2`` when the lease is gone (an orphan: a live worker
    puts its messages back within one heartbeat), ``-1`` for a lease without expiry (not
    written by taskdedup). ``lists`` maps each source list to the number of messages held
    from it.
    """

    owner: str
    worker: str
    host: str
    pid: int | None
    lease_ms: int | None
    ttl_ms: int
    lists: dict[str, int] = field(default_factory=dict)

    @property
    def orphan(self) -> bool:
        """The lease lapsed: its holder died (or stopped answering for a whole lease)."""
        return self.ttl_ms == -2

    @property
    def held(self) -> int:
        """Messages held, over every source."""
        return sum(self.lists.values())


def holders(client: redis.Redis, prefix: str) -> list[Holder]:
    """Every owner in the registry, its lease and the size of each processing list, in two
    pipelined round trips after the registry's read. An entry taskdedup did not write (not
    JSON, not an object) is shown with what can be read of it."""
    entries = client.hgetall(owners_key(prefix))
    owners = sorted(key_text(owner) for owner in entries)
    if not owners:
        return []
    pipe = client.pipeline(transaction=False)
    for owner in owners:
        pipe.pttl(lease_key(prefix, owner).encode("utf-8", "surrogateescape"))
        pipe.smembers(sources_key(prefix, owner).encode("utf-8", "surrogateescape"))
    replies = pipe.execute(raise_on_error=False)
    sources: dict[str, list[str]] = {}
    ttls: dict[str, int] = {}
    for index, owner in enumerate(owners):
        ttl, members = replies[2 * index], replies[2 * index + 1]
        ttls[owner] = ttl if isinstance(ttl, int) else -2
        sources[owner] = sorted(key_text(m) for m in members) if isinstance(members, set) else []
    pipe = client.pipeline(transaction=False)
    for owner in owners:
        for source in sources[owner]:
            pipe.llen(list_key(prefix, owner, source).encode("utf-8", "surrogateescape"))
    lengths = iter(pipe.execute(raise_on_error=False))
    found = []
    raw = {key_text(owner): value for owner, value in entries.items()}
    for owner in owners:
        lists = {}
        for source in sources[owner]:
            length = next(lengths)
            lists[source] = length if isinstance(length, int) else 0
        entry = _entry(raw[owner])
        pid = entry.get("pid")
        lease = entry.get("lease_ms")
        found.append(Holder(
            owner=owner, worker=str(entry.get("worker") or ""), host=str(entry.get("host") or ""),
            pid=pid if isinstance(pid, int) else None,
            lease_ms=lease if isinstance(lease, int) else None,
            ttl_ms=ttls[owner], lists=lists,
        ))
    return found


def _entry(value: Any) -> dict[str, Any]:
    try:
        entry = json.loads(value)
    except (TypeError, ValueError):
        return {}
    return entry if isinstance(entry, dict) else {}
