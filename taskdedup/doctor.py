"""``taskdedup doctor``: check that a lock server can hold taskdedup's guarantees.

Each check answers with a :class:`Finding`: the server's version (Redis 6.2+, Valkey 7.2+),
its eviction policy (anything but ``noeviction`` under a memory limit deletes locks), whether
the user may run scripts (EVAL, EVALSHA), Cluster mode, and whether the user reaches keys
under the prefix (an ACL ``~{prefix}:*``). Nothing is left behind: the probe lock is
released at once.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from typing import Any

from redis.exceptions import NoPermissionError, RedisError, ResponseError

from .exceptions import StoreUnavailableError
from .stores.redis import RedisStore
from .stores.server import EVICTION_FIX, eviction_problem, read_facts

__all__ = ["Finding", "diagnose"]

_FLOORS = {"redis": (6, 2), "valkey": (7, 2)}
_PROBE_SCRIPT = "return 1"


@dataclass(frozen=True, slots=True)
class Finding:
    """One check: its name, whether it passed, what was found, and what to change."""

    check: str
    ok: bool
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def diagnose(client: Any, prefix: str) -> list[Finding]:
    """Run every check against ``client``'s server, for locks under ``prefix``.

    Raises:
        redis.ConnectionError / redis.TimeoutError: the server cannot be reached at all.
    """
    client.ping()
    return [*_server_checks(client), _script_check(client), _prefix_check(client, prefix)]


def _server_checks(client: Any) -> list[Finding]:
    try:
        facts = read_facts(client)
    except NoPermissionError as exc:
        return [Finding("server", False, f"INFO is not permitted to this user ({exc}): the "
                        "version and the eviction policy cannot be checked",
                        "allow +info to the taskdedup user")]
    floor = _FLOORS.get(facts.name, _FLOORS["redis"])
    version_ok = facts.version_tuple[:2] >= floor
    found = [Finding(
        "server", version_ok, f"{facts.name} {facts.version}",
        "" if version_ok else f"use {facts.name} {'.'.join(map(str, floor))} or later",
    )]
    problem = eviction_problem(facts)
    limit = f"maxmemory {facts.maxmemory} bytes" if facts.maxmemory else "no maxmemory limit"
    found.append(Finding(
        "eviction", problem is None,
        problem or f"maxmemory-policy {facts.policy}, {limit}: locks are never evicted",
        EVICTION_FIX if problem else "",
    ))
    found.append(Finding(
        "cluster", True,
        "Cluster mode: use a RedisCluster client; each lock is one key, so locks spread over "
        "slots (the one-round-trip publish and enqueue need a standalone broker)"
        if facts.cluster else "standalone (not Cluster)",
    ))
    return found


def _script_check(client: Any) -> Finding:
    try:
        client.eval(_PROBE_SCRIPT, 0)
        sha = client.script_load(_PROBE_SCRIPT) if _may_load(client) else None
        if sha is not None:
            client.evalsha(sha, 0)
    except NoPermissionError as exc:
        return Finding("scripts", False, f"this user may not run scripts: {exc}",
                       "allow +eval +evalsha (and +script|load for batch reservations)")
    except ResponseError as exc:
        return Finding("scripts", False, f"scripts fail: {exc}",
                       "taskdedup needs Lua scripting (EVAL/EVALSHA)")
    return Finding("scripts", True, "EVAL and EVALSHA are permitted")


def _may_load(client: Any) -> bool:
    """SCRIPT LOAD is only needed for batch reservations: a user without it still passes."""
    try:
        client.script_exists("0" * 40)
    except NoPermissionError:
        return False
    return True


def _prefix_check(client: Any, prefix: str) -> Finding:
    store = RedisStore(client)
    key, owner = f"{prefix}:doctor:{uuid.uuid4().hex}", f"doctor-{uuid.uuid4().hex}"
    try:
        store.reserve(key, owner, 10_000)
        store.release(key, owner)
    except StoreUnavailableError as exc:
        cause = exc.__cause__
        if isinstance(cause, NoPermissionError):
            return Finding("acl", False, f"this user cannot write keys under {prefix}:* ({cause})",
                           f"grant the taskdedup user ~{prefix}:* (its key pattern)")
        if isinstance(cause, RedisError):
            return Finding("acl", False, f"a probe lock under {prefix}:* failed: {cause}")
        raise
    return Finding("acl", True, f"a probe lock under {prefix}:* was taken and released")
