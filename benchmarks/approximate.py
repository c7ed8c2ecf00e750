"""Approximate windows (SPEC §12): memory per identity, false-positive rate at capacity, and
the gated publish with an approximate window vs the exact tier, in one run.

* **Memory**: one window of ``capacity`` identities (10,000,000 by default, ``error_rate``
  0.01, 4 slices, 16 partitions), every live slice (5) filled to its share — the moment just
  before a rotation, when the window holds most. The current slice key of each partition is
  created by the production script (``complete.lua`` through ``RedisStore.remember``, on
  the server's clock: the bitmap written whole at its size) and copied (``COPY``) to the
  older live indexes, then each is filled by a bulk Lua script that computes the same bit positions
  from SHA-1-made digests, as many per call as fit in a short script (no 10M task
  publishes). ``MEMORY USAGE`` of the slice keys / identities = bytes per identity.
* **False positives**: fresh random identities (seeded) checked by the production
  ``reserve.lua`` with the window (pipelined); a DUPLICATE is a false positive.
* **Publish**: a realistic Celery app (default configuration, the broker is the lock Redis:
  the reservation rides in the push), a plain task published first, then interleaved runs of
  a task gated by an exact window and one gated by the filled approximate window (its
  filters are the ones above, so a check reads half-set bitmaps, as at capacity). The ratio
  approximate/exact is taken within each run.

The seeds' table (``../shared/seeds/001``): Redis SET NX ~80 MB per 1M IDs, Redis Bloom ~2 MB
per 1M IDs.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery import Celery

from taskdedup import Approximate, Policy, RedisStore
from taskdedup import approximate as approx
from taskdedup.celery import DedupTask

from .harness import Row, interleaved, purge, rate
from .micro import Context

__all__ = ["SECTION", "approximate"]

SECTION = "approximate"
NAME = "bench.approx"
EXACT = "exact window (done lock)"
APPROX = "approximate window (Bloom)"
PLAIN = "plain task"
ERROR_RATE = 0.01
TTL = 86400.0
QUEUE = "bench-approx"

# Fill KEYS (the partitions of one slice, partition order) with ARGV[2] identities made as
# digests sha1hex(ARGV[1] .. ':' .. j) for j in ARGV[3] .. ARGV[3] + ARGV[2] - 1, at the
# positions taskdedup.Approximate.positions gives (partition from the first 8 hex digits,
# enhanced double hashing of the next 24; math.fmod is exact below 2^53); ARGV[4] m,
# ARGV[5] k. Adds each key's share to its tail counter. Returns the count per key.
_FILL = """
local seed, count, first = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local m, k, parts = tonumber(ARGV[4]), tonumber(ARGV[5]), #KEYS
local added = {}
for p = 1, parts do added[p] = 0 end
for j = first, first + count - 1 do
  local d = redis.sha1hex(seed .. ':' .. j)
  local p = math.fmod(tonumber(string.sub(d, 1, 8), 16), parts) + 1
  local h1 = tonumber(string.sub(d, 9, 20), 16)
  local h2 = tonumber(string.sub(d, 21, 32), 16)
  local key = KEYS[p]
  for i = 0, k - 1 do
    redis.call('SETBIT', key, math.fmod(h1 + i * h2 + (i * i * i - i) / 6, m), 1)
  end
  added[p] = added[p] + 1
end
for p = 1, parts do
  redis.call('BITFIELD', KEYS[p], 'OVERFLOW', 'SAT', 'INCRBY', 'u32', m, added[p])
end
return added
"""

# The positions the fill script computes for one digest ARGV[1] (checked against Python's).
_POSITIONS = """
local d, m, k, parts = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local h1 = tonumber(string.sub(d, 9, 20), 16)
local h2 = tonumber(string.sub(d, 21, 32), 16)
local out = {math.fmod(tonumber(string.sub(d, 1, 8), 16), parts)}
for i = 0, k - 1 do
  out[#out + 1] = math.fmod(h1 + i * h2 + (i * i * i - i) / 6, m)
end
return out
"""


def _digest_of_partition(rng: random.Random, window: Approximate, partition: int) -> str:
    while True:
        digest = f"{rng.getrandbits(128):032x}"
        if window.positions(digest)[0] == partition:
            return digest


def fill_window(ctx: Context, window: Approximate) -> dict[str, Any]:
    """Create every live slice key of ``NAME`` on the server's clock (the current one with the
    production script, the older ones copied from it) and fill each to its share; the slice
    keys and what it took."""
    client = ctx.client
    store = RedisStore(client)
    rng = random.Random(1313)
    live = window.slices + 1
    started = time.perf_counter()
    current: list[str] = []
    index = 0
    for partition in range(window.partitions):
        digest = _digest_of_partition(rng, window, partition)
        key = approx.lock_key("taskdedup", None, NAME, digest, window)
        probe = approx.probe(key, window, int(TTL * 1000))
        assert probe is not None
        store.claim(key, "fill", 60_000)
        remembered = store.remember(key, "fill", probe)  # the server's current slice
        assert remembered.created
        index = remembered.slice_index
        current.append(f"{probe.slice_prefix}{index}")
    keys: list[list[str]] = []
    for back in range(window.slices, 0, -1):  # the older live slices, oldest first
        row = [f"{key.rpartition(':')[0]}:{index - back}" for key in current]
        for source, target in zip(current, row, strict=True):
            client.copy(source, target)
        keys.append(row)
    keys.append(current)
    # the Lua positions are Python's
    for _ in range(20):
        digest = f"{rng.getrandbits(128):032x}"
        partition, positions = window.positions(digest)
        lua = client.eval(_POSITIONS, 0, digest, window.bits, window.hashes, window.partitions)
        assert [int(x) for x in lua] == [partition, *positions], "fill positions differ"
    # each slice's share: the production identity of each key, then the bulk fill
    share = window.capacity // live - window.partitions
    fill = client.register_script(_FILL)
    chunk = 100_000
    for number, row in enumerate(keys):
        done = 0
        while done < share:
            count = min(chunk, share - done)
            fill(keys=row, args=[f"s{number}", count, done, window.bits, window.hashes])
            done += count
    identities = live * (share + window.partitions)
    return {"keys": [k for row in keys for k in row], "identities": identities,
            "fill_seconds": time.perf_counter() - started}


def memory_and_fpr(ctx: Context, capacity: int, checks: int) -> tuple[list[Row], dict[str, Any]]:
    client = ctx.client
    window = Approximate(capacity=capacity, error_rate=ERROR_RATE)
    purge(client, f"taskdedup:bloom:{NAME}:{{*", f"taskdedup:{NAME}:*")
    filled = fill_window(ctx, window)
    keys, identities = filled["keys"], filled["identities"]
    used = sum(int(client.memory_usage(key, samples=0) or 0) for key in keys)
    strlen = sum(int(client.strlen(key)) for key in keys)
    per_identity = used / identities
    # false positives: fresh identities through the production reserve script
    store = RedisStore(client)
    rng = random.Random(2626)
    policy = Policy(ttl=TTL, window=window)
    script = store._reserve
    store.reserve("taskdedup:bench.approx.load", "x", 1000)  # the script is loaded
    duplicates = 0
    batch = 5000
    ttl_ms = policy.ttl_ms
    for start in range(0, checks, batch):
        pipe = client.pipeline(transaction=False)
        for _ in range(min(batch, checks - start)):
            key = approx.lock_key("taskdedup", None, NAME, f"{rng.getrandbits(128):032x}",
                                  window)
            probe = approx.probe(key, window, ttl_ms)
            assert probe is not None
            first, slices = probe.span(int(time.time() * 1000))
            pipe.evalsha(script.sha, 1 + len(slices), key, *slices, "probe", 1000, "", "0",
                         probe.argument(first))
        duplicates += sum(1 for reply in pipe.execute() if int(reply[0]) == 2)
    measured = duplicates / checks
    purge(client, f"taskdedup:{NAME}:*")
    figures = {
        "capacity": capacity, "identities": identities, "error_rate": ERROR_RATE,
        "configured_fpr": ERROR_RATE, "measured_fpr": measured, "checks": checks,
        "bytes_per_identity": per_identity, "memory_usage_bytes": used,
        "bitmap_bytes": strlen, "keys": len(keys), "slices": window.slices,
        "partitions": window.partitions, "bits_per_key": window.bits,
        "hashes": window.hashes, "fill_seconds": round(filled["fill_seconds"], 1),
        "seeds": {"redis_set_nx_bytes_per_id": 80.0, "redis_bloom_bytes_per_id": 2.0},
    }
    rows = [
        Row(SECTION, f"memory per identity at {identities:,} identities (error_rate 0.01)",
            "B/identity", [per_identity], extra=dict(figures)),
        Row(SECTION, f"false-positive rate at capacity ({checks:,} fresh identities)",
            "rate", [measured], extra={"configured_fpr": ERROR_RATE, "measured_fpr": measured}),
    ]
    ctx.log(f"  {per_identity:.3f} B/identity over {len(keys)} keys ({used:,} B), measured "
            f"false-positive rate {measured:.4%} (configured {ERROR_RATE:.0%}), fill "
            f"{filled['fill_seconds']:.0f}s")
    return rows, figures


def publish_ratio(ctx: Context, capacity: int) -> list[Row]:
    """Gated publish throughput, approximate window vs exact window, one default app."""
    client, n = ctx.client, ctx.sizes.publish
    app = Celery("bench-approx", broker=ctx.url, set_as_current=False)
    app.conf.update(task_default_queue=QUEUE, task_ignore_result=True, taskdedup_stats=False)

    def body(user_id: int, amount_cents: int, currency: str, order_id: str, run: str) -> None:
        pass

    plain = app.task(name="bench.approx.plain", shared=False)(body)
    exact = app.task(name="bench.approx.exact", base=DedupTask, shared=False,
                     dedup=Policy(ttl=TTL))(body)
    windowed = app.task(name=NAME, base=DedupTask, shared=False, dedup=Policy(
        ttl=TTL, window=Approximate(capacity=capacity, error_rate=ERROR_RATE)))(body)
    tasks = {PLAIN: plain, EXACT: exact, APPROX: windowed}
    locks = {PLAIN: (), EXACT: ("taskdedup:bench.approx.exact:*",),
             APPROX: (f"taskdedup:{NAME}:*",)}

    def reset(label: str) -> None:
        client.delete(QUEUE)
        purge(client, *locks[label])

    def argv(tag: str, count: int) -> list[tuple[Any, ...]]:
        return [(i, 5000, "EUR", f"ORD-{tag}-{i}", "r") for i in range(count)]

    plain.apply_async(argv("first", 1)[0])  # the app's first publish is a plain one
    for label, task in tasks.items():
        reset(label)
        for args in argv(f"warm-{uuid.uuid4().hex}", 20):
            task.apply_async(args)

    published: dict[str, int] = {}

    def variant(label: str, task: Any) -> Callable[[int], float]:
        def one(run: int) -> float:
            reset(label)
            calls = argv(f"{run}-{uuid.uuid4().hex}", n)
            apply = task.apply_async

            def publish(count: int) -> None:
                for args in calls:
                    apply(args)

            sample = rate(publish, n)
            published[label] = published.get(label, 0) + int(client.llen(QUEUE))
            return sample

        return one

    runs = max(ctx.sizes.runs, 3)
    samples, _ = interleaved({label: variant(label, task) for label, task in tasks.items()},
                             runs, baseline=PLAIN)
    for label in tasks:
        reset(label)
    ratios = [a / e for a, e in zip(samples[APPROX], samples[EXACT], strict=True)]
    return [
        Row(SECTION, PLAIN + " (publish)", "calls/s", samples[PLAIN]),
        Row(SECTION, EXACT + " (gated publish)", "calls/s", samples[EXACT], baseline=PLAIN,
            ratios=[e / p for e, p in zip(samples[EXACT], samples[PLAIN], strict=True)]),
        Row(SECTION, APPROX + " (gated publish)", "calls/s", samples[APPROX], baseline=EXACT,
            ratios=ratios, note=f"{published.get(APPROX, 0):,} of {runs * n:,} published "
            "(the rest: false positives of the full window)",
            extra={"published": published.get(APPROX, 0), "calls": runs * n}),
    ]


def approximate(ctx: Context) -> tuple[list[Row], dict[str, Any]]:
    """The section's rows and its figures (for the JSON's ``approximate`` entry)."""
    capacity = ctx.sizes.approx_capacity
    rows, figures = memory_and_fpr(ctx, capacity, ctx.sizes.approx_checks)
    publish = publish_ratio(ctx, capacity)
    figures["publish_ratio_vs_exact"] = publish[-1].ratio
    purge(ctx.client, f"taskdedup:bloom:{NAME}:{{*")
    return rows + publish, figures
