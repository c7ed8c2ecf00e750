"""What the lock server says about itself that decides whether deduplication holds.

Read with ``INFO`` (no CONFIG permission needed). The one fact that breaks deduplication
silently is eviction: every lock has a TTL, so under a ``maxmemory`` limit any policy but
``noeviction`` (``allkeys-*`` and ``volatile-*`` alike) may delete a held lock, and the next
duplicate is accepted as if it were new. :func:`warn_once` checks a server once per process
and logs a WARNING naming the policy and the fix; ``taskdedup doctor`` reports it with the
other checks.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

__all__ = ["EVICTION_FIX", "ServerFacts", "eviction_problem", "read_facts", "warn_once"]

logger = logging.getLogger("taskdedup")

EVICTION_FIX = (
    "set maxmemory-policy noeviction on this server (CONFIG SET maxmemory-policy noeviction, "
    "and in its config file), or keep the locks in a Redis of their own that never evicts"
)

_checked: set[str] = set()
_checked_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class ServerFacts:
    """The server's name and version, its memory limit and eviction policy, Cluster mode."""

    name: str            # "redis" or "valkey"
    version: str         # e.g. "7.0.15", or Valkey's own version "9.1.0"
    maxmemory: int       # bytes; 0 = no limit
    policy: str          # maxmemory-policy, e.g. "noeviction", "allkeys-lru"
    cluster: bool

    @property
    def version_tuple(self) -> tuple[int, ...]:
        parts = []
        for part in self.version.split("."):
            digits = "".join(ch for ch in part if ch.isdigit())
            parts.append(int(digits or 0))
        return tuple(parts)


def read_facts(client: Any) -> ServerFacts:
    """One ``INFO`` (the default sections: server, memory, cluster) of ``client``'s server.

    Raises:
        redis.RedisError: the server could not be asked (down, or ``INFO`` not permitted).
    """
    info = client.info()
    if info and all(isinstance(value, dict) for value in info.values()):
        info = next(iter(info.values()))  # a Cluster client answers per node: take one
    name = str(info.get("server_name") or "redis").lower()
    version = str(info.get("valkey_version") if name == "valkey" else info.get("redis_version"))
    return ServerFacts(
        name=name,
        version=version,
        maxmemory=int(info.get("maxmemory") or 0),
        policy=str(info.get("maxmemory_policy") or "noeviction"),
        cluster=bool(int(info.get("cluster_enabled") or 0)),
    )


def eviction_problem(facts: ServerFacts) -> str | None:
    """Why this server may evict locks, or None (``noeviction``, or no memory limit)."""
    if facts.policy == "noeviction" or facts.maxmemory == 0:
        return None
    return (f"maxmemory-policy is {facts.policy} with maxmemory {facts.maxmemory} bytes: under "
            "memory pressure the server deletes locks (every lock has a TTL), and duplicates "
            "then run")


def warn_once(client: Any, where: str) -> None:
    """Check the server behind ``client`` once per process (``where`` names it) and log a
    WARNING if it may evict locks. Never raises: a server that cannot be asked is left to
    the call that follows, which reports it."""
    with _checked_lock:
        if where in _checked:
            return
        _checked.add(where)
    try:
        facts = read_facts(client)
    except (RedisError, ValueError, TypeError) as exc:
        logger.debug("taskdedup: could not read INFO of %s (eviction not checked): %s",
                     where, exc)
        return
    problem = eviction_problem(facts)
    if problem:
        logger.warning("taskdedup: the lock server %s may evict locks: %s. Fix: %s.", where,
                       problem, EVICTION_FIX)
