"""``taskdedup doctor``: check that a lock server can hold taskdedup's guarantees.

Each check answers with a :class:`Finding`: the server's version (Redis 6.2+, Valkey 7.2+),
its eviction policy (anything but ``noeviction`` under a memory limit deletes locks), whether
the user may run scripts (EVAL, EVALSHA), Cluster mode, whether the user reaches keys under
the prefix (an ACL ``~{prefix}:*``), and whether it may run the bitmap commands approximate
windows use (a problem only where windows are in use under the prefix), and whether it may run
the other commands of the least-privilege rule (the stats flush, the operators' tools, the
server's clock). One finding is information, never a problem: how a worker's claim and
completion reach the server (one ``SET IFEQ`` each on Valkey 8.1+, else a script each).
Nothing is left behind: the probe keys are deleted at once. Two checks read what workers
left: the copies they met, and the reliable fetch's processing lists (which workers use it,
and messages held by a worker whose lease lapsed).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from redis.exceptions import NoPermissionError, RedisError, ResponseError

from .events import Event
from .exceptions import StoreUnavailableError
from .locks import glob_escape, scan_keys, shown
from .processing import holders
from .stats import stats_key
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
    unused: bool = False
    """Something is missing that nothing uses yet: not a problem (``ok``) until it is."""

    @property
    def status(self) -> str:
        """``ok``, ``PROBLEM``, or ``not in use`` (missing, but nothing needs it yet)."""
        if not self.ok:
            return "PROBLEM"
        return "not in use" if self.unused else "ok"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


def diagnose(client: Any, prefix: str) -> list[Finding]:
    """Run every check against ``client``'s server, for locks under ``prefix``.

    Raises:
        redis.ConnectionError / redis.TimeoutError: the server cannot be reached at all.
    """
    client.ping()
    return [*_server_checks(client), _script_check(client), _swap_check(client, prefix),
            _prefix_check(client, prefix),
            _commands_check(client, prefix), _window_check(client, prefix),
            _copies_check(client, prefix), _fetch_check(client, prefix)]


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


def _swap_check(client: Any, prefix: str) -> Finding:
    """How a worker's two steps reach this server (``stores/cas.py``): information only."""
    if RedisStore(client).swaps(prefix):
        return Finding("worker steps", True, "a claim and a completion are one SET IFEQ each "
                       "(the server compares and sets: no script)")
    return Finding("worker steps", True, "a claim and a completion run a script each (SET "
                   "IFEQ, one command each instead, needs Valkey 8.1 or later)")


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


# What each command of the ACL rule (docs/how-to/operating.md) is for, beyond the scripts,
# the probe lock and the windows' bitmap commands probed by the other checks.
_COMMAND_USES = {
    "get": "reading a lock", "set": "writing a lock", "del": "releasing a lock",
    "pttl": "a lock's TTL", "pexpire": "the heartbeat", "time": "approximate windows' clock",
    "hincrby": "the stats flush", "hgetall": "stats and the dashboard", "scan": "list/clear/stats",
    "type": "inspect", "multi": "inspect and the dashboard", "exec": "inspect and the dashboard",
}


def _commands_check(client: Any, prefix: str) -> Finding:
    """Each command of the least-privilege rule that the other checks do not reach, run by
    name on a probe key under the prefix (a script's commands are checked against the ACL
    like any other, so running them directly tells which one a script would be refused)."""
    key = f"{prefix}:doctor:{uuid.uuid4().hex}"
    probes = {
        "set": ("SET", key, "probe", "PX", 10_000), "get": ("GET", key),
        "pttl": ("PTTL", key), "pexpire": ("PEXPIRE", key, 10_000), "type": ("TYPE", key),
        "del": ("DEL", key), "time": ("TIME",),
        "hincrby": ("HINCRBY", key, "probe", 1), "hgetall": ("HGETALL", key),
        "scan": ("SCAN", 0, "MATCH", glob_escape(key), "COUNT", 10),
    }
    denied, failed = _probe(client, key, probes)
    other = [f"{name}: {reply}" for name, reply in failed]
    try:
        atomic = client.pipeline(transaction=True)
        atomic.get(key)
        atomic.execute()
    except NoPermissionError:
        denied += ["multi", "exec"]
    except RedisError as exc:
        if "NOPERM" in str(exc) or "permission" in str(exc).lower():
            denied += ["multi", "exec"]
        else:
            other.append(f"multi/exec: {exc}")
    if denied:
        uses = sorted({_COMMAND_USES[name] for name in denied})
        return Finding("commands", False,
                       f"this user may not run {', '.join(denied)} ({'; '.join(uses)} fail)",
                       f"allow {' '.join('+' + n for n in denied)} to the taskdedup user (the "
                       "rule in docs/how-to/operating.md)")
    if other:
        return Finding("commands", False, f"a probe under {prefix}:* failed: {other[0]}")
    return Finding("commands", True, "the stats flush, the operators' tools and the server's "
                   "clock are permitted (" + " ".join(sorted(probes)) + " multi exec)")


def _probe(
    client: Any, key: str, probes: dict[str, tuple[Any, ...]]
) -> tuple[list[str], list[tuple[str, RedisError]]]:
    """Run each probe (one pipeline, then ``key`` deleted): the names the user may not run,
    and the other errors by name."""
    pipe = client.pipeline(transaction=False)
    for command in probes.values():
        pipe.execute_command(*command)
    pipe.delete(key)
    replies = dict(zip(probes, pipe.execute(raise_on_error=False), strict=False))
    denied = [name for name, reply in replies.items() if isinstance(reply, NoPermissionError)]
    failed = [(name, reply) for name, reply in replies.items()
              if isinstance(reply, RedisError) and not isinstance(reply, NoPermissionError)]
    return denied, failed


def _window_check(client: Any, prefix: str) -> Finding:
    """What an approximate window needs beyond a lock's commands: its scripts read and write
    the slice bitmaps (a script's commands are checked against the user's ACL like any
    other), ``taskdedup stats`` and the metrics read their fill. Each is probed by name."""
    key = f"{prefix}:bloom:doctor:{uuid.uuid4().hex}"
    expires_ms = int(time.time() * 1000) + 10_000
    probes = {
        "setbit": ("SETBIT", key, 7, 1), "getbit": ("GETBIT", key, 7),
        "bitfield": ("BITFIELD", key, "GET", "u8", 0), "exists": ("EXISTS", key),
        "pexpireat": ("PEXPIREAT", key, expires_ms), "time": ("TIME",),
        "bitcount": ("BITCOUNT", key),
        "strlen": ("STRLEN", key),
    }
    denied, failed = _probe(client, key, probes)
    other = [reply for _, reply in failed]
    if not denied and not other:
        return Finding("windows", True, "approximate windows' bitmap commands are permitted")
    problem = (f"this user may not run {', '.join(denied)}" if denied
               else f"a probe bitmap under {prefix}:bloom:* failed: {other[0]}")
    fix = f"allow {' '.join('+' + n for n in denied)} to the taskdedup user" if denied else ""
    if _windows_in_use(client, prefix):
        return Finding("windows", False, f"{problem}: approximate windows under {prefix}:* "
                       "fail (their calls follow on_store_error)", fix)
    return Finding("windows", True, f"{problem}; no approximate window is in use under "
                   f"{prefix}:* (needed only if you add one)", fix, unused=True)


def _copies_check(client: Any, prefix: str) -> Finding:
    """Whether workers have met copies of one message (the ``deferred`` counts they flush):
    kombu's Redis transport hands out a copy of a held ETA/countdown message every
    ``visibility_timeout``, so a countdown beyond it is at work (SPEC §5). taskdedup runs one
    copy, but each costs a delivery, and a copy that waits more than a lease for a worker
    process after the first finished runs again in ``until_executed`` mode."""
    counts: dict[str, int] = {}
    stats_prefix = stats_key(prefix, "")
    try:
        keys = list(scan_keys(client, glob_escape(stats_prefix) + "*"))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hget(key, Event.DEFERRED.value)
        for key, value in zip(keys, pipe.execute(raise_on_error=False), strict=True):
            try:
                counts[key[len(stats_prefix):]] = int(value)
            except (TypeError, ValueError):  # absent, or an odd field someone else wrote
                continue
    except (RedisError, UnicodeError) as exc:
        return Finding("copies", True, f"cannot read the workers' counts ({exc})")
    copied = {task: n for task, n in counts.items() if n > 0}
    if not copied:
        return Finding("copies", True, "no worker has met a copy of a message it was running")
    worst = sorted(copied.items(), key=lambda item: -item[1])[:5]
    return Finding(
        "copies", False,
        "workers put off copies of messages that were running: "
        + ", ".join(f"{task} ({n})" for task, n in worst)
        + " — a countdown/ETA beyond the broker's visibility_timeout (kombu hands out a copy "
        "every visibility_timeout while a worker holds the message)",
        "raise broker_transport_options['visibility_timeout'] above your longest countdown "
        "(taskdedup runs one copy; the others cost deliveries)")


def _fetch_check(client: Any, prefix: str) -> Finding:
    """Which workers consume through the reliable fetch (SPEC §17), how much each holds, and
    whether messages wait in the processing lists of a worker whose lease lapsed (a live worker
    with the reliable fetch puts them back within a third of its lease: a lasting orphan means
    none runs). The lists live in the broker's Redis: point ``--url`` at the broker."""
    try:
        found = holders(client, prefix)
    except (RedisError, UnicodeError) as exc:
        return Finding("fetch", True, f"cannot read the reliable fetch's registry ({exc})")
    if not found:
        return Finding("fetch", True, f"no worker uses the reliable fetch under {prefix}:fetch "
                       "(taskdedup_reliable_fetch; its lists live in the broker's Redis)")
    live = [h for h in found if not h.orphan]
    orphans = [h for h in found if h.orphan and h.held]

    def who(h: Any) -> str:
        return f"{shown(h.worker or h.owner)} (pid {h.pid}, {h.held} held)"

    detail = (f"{len(live)} worker(s) use the reliable fetch: "
              + (", ".join(who(h) for h in live[:5]) or "none alive")
              + (f" and {len(live) - 5} more" if len(live) > 5 else ""))
    if not orphans:
        return Finding("fetch", True, detail)
    waiting = sum(h.held for h in orphans)
    return Finding(
        "fetch", False,
        f"{detail}; {waiting} message(s) wait in the processing lists of "
        + ", ".join(who(h) for h in orphans[:5]) + ", whose lease lapsed",
        "start a worker with taskdedup_reliable_fetch on these queues: it puts them back at "
        "the head of their queues within a third of its lease")


def _windows_in_use(client: Any, prefix: str) -> bool:
    """Whether a slice bitmap exists under ``prefix`` (SCAN, stopping at the first)."""
    try:
        for _ in client.scan_iter(match=f"{glob_escape(prefix)}:bloom:*", count=1000):
            return True
    except RedisError:
        return True  # cannot tell: report the problem
    return False
