"""Micro benchmarks: the Redis floor, ``fingerprint`` and bulk reservation.

* floor — what one round trip costs from redis-py with hiredis on this machine: a raw
  ``EVALSHA`` of taskdedup's reserve script and a ``SET NX PX``, plus reserve and LPUSH of
  the Celery message in two round trips vs in ONE script (the shipped ``enqueue.lua``);
* fingerprint — calls/s for a typical 5-argument task bound with ``func=``;
* bulk — ``RedisStore.reserve_many`` of N identities (pipelined, one client core).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import redis

from taskdedup import fingerprint
from taskdedup.stores.redis import SCRIPTS, RedisStore

from .harness import Row, Sizes, interleaved, median, rate

__all__ = ["Context", "bulk", "fingerprints", "floor"]


@dataclass
class Context:
    """What every section gets: the server, a client on it, the sizes, a logger."""

    url: str
    client: redis.Redis
    sizes: Sizes
    log: Callable[[str], None]
    message: bytes = b""  # a real Celery message body, captured by the publish section


def _digest() -> str:
    return os.urandom(16).hex()


def floor(ctx: Context) -> list[Row]:
    """Raw round trips: EVALSHA reserve vs SET NX PX; LPUSH vs reserve+LPUSH (1 or 2 RTs)."""
    client, n = ctx.client, ctx.sizes.floor_ops
    reserve = client.register_script(SCRIPTS["reserve"])
    combined = client.register_script(SCRIPTS["enqueue"])  # what a gated publish runs
    message = ctx.message or b"x" * 1000
    queue = "bench-floor-queue"
    owner = str(uuid.uuid4())
    reserve(keys=["bench-floor:warm"], args=[owner, 60_000, ""])
    combined(keys=["bench-floor:warm2"], args=[owner, 60_000, "", "0", "", "", 3, "LPUSH", queue,
                                              message])
    prefix = "bench-floor:"

    def keys(run: int, tag: str) -> list[str]:
        return [f"{prefix}{tag}:{run}:{i}:{_digest()}" for i in range(n)]

    def evalsha(run: int) -> float:
        ks = keys(run, "e")
        sha = reserve.sha

        def body(count: int) -> None:
            execute = client.execute_command
            for key in ks:
                execute("EVALSHA", sha, 1, key, owner, 600_000, "")

        return rate(body, n)

    def setnx(run: int) -> float:
        ks = keys(run, "s")

        def body(count: int) -> None:
            set_ = client.set
            for key in ks:
                set_(key, owner, nx=True, px=600_000)

        return rate(body, n)

    def lpush(run: int) -> float:
        client.delete(queue)

        def body(count: int) -> None:
            push = client.lpush
            for _ in range(count):
                push(queue, message)

        return rate(body, n)

    def two_round_trips(run: int) -> float:
        ks = keys(run, "t")
        sha = reserve.sha
        client.delete(queue)

        def body(count: int) -> None:
            execute, push = client.execute_command, client.lpush
            for key in ks:
                execute("EVALSHA", sha, 1, key, owner, 600_000, "")
                push(queue, message)

        return rate(body, n)

    def one_script(run: int) -> float:
        ks = keys(run, "o")
        sha = combined.sha
        client.delete(queue)

        def body(count: int) -> None:
            execute = client.execute_command
            for key in ks:
                execute("EVALSHA", sha, 1, key, owner, 600_000, "", "0", "", "", 3, "LPUSH", queue,
                        message)

        return rate(body, n)

    samples, _ = interleaved(
        {"set_nx_px": setnx, "evalsha_reserve": evalsha, "lpush": lpush,
         "reserve_then_lpush": two_round_trips, "reserve_lpush_one_script": one_script},
        ctx.sizes.runs, baseline=None,
    )
    client.delete(queue)
    _purge_prefix(client, prefix)

    def ratio(name: str, base: str) -> list[float]:
        return [a / b for a, b in zip(samples[name], samples[base], strict=True)]

    size = f"{len(message)} B message"
    return [
        Row("floor", "SET NX PX (redis-py + hiredis)", "ops/s", samples["set_nx_px"],
            round_trips=1),
        Row("floor", "EVALSHA reserve.lua", "ops/s", samples["evalsha_reserve"],
            baseline="SET NX PX (redis-py + hiredis)",
            ratios=ratio("evalsha_reserve", "set_nx_px"), round_trips=1),
        Row("floor", f"LPUSH ({size}: Celery's publish)", "ops/s", samples["lpush"],
            round_trips=1),
        Row("floor", "EVALSHA reserve, then LPUSH (2 RTs)", "ops/s",
            samples["reserve_then_lpush"], baseline=f"LPUSH ({size}: Celery's publish)",
            ratios=ratio("reserve_then_lpush", "lpush"), round_trips=2,
            note="the gate in its own round trip, at the Redis level"),
        Row("floor", "EVALSHA enqueue.lua: reserve + LPUSH (1 RT)", "ops/s",
            samples["reserve_lpush_one_script"], baseline=f"LPUSH ({size}: Celery's publish)",
            ratios=ratio("reserve_lpush_one_script", "lpush"), round_trips=1,
            note="the default one-round-trip publish, at the Redis level"),
    ]


def _purge_prefix(client: redis.Redis, prefix: str) -> None:
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}*", count=2000):
        batch.append(key)
        if len(batch) >= 2000:
            client.unlink(*batch)
            batch.clear()
    if batch:
        client.unlink(*batch)


# -- fingerprint ---------------------------------------------------------------------------------


def charge(user_id: int, amount_cents: int, currency: str, order_id: str,
           channel: str = "web") -> None:
    """A typical task signature: five arguments, one with a default."""


def charge_rich(user_id: int, amount: Decimal, when: datetime, order: dict[str, Any],
                tags: list[str]) -> None:
    """A richer one: Decimal, aware datetime, a small dict and a list."""


def fingerprints(ctx: Context) -> list[Row]:
    """``fingerprint`` calls/s: 5 scalar arguments bound with ``func=`` (the bar), and a
    richer 5-argument call for information."""
    n = ctx.sizes.fingerprint
    when = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    scalar_args = [(42 + i, 5000, "EUR", f"ORD-{i}", "web") for i in range(n)]
    rich_args = [
        (42 + i, Decimal("50.00"), when, {"sku": "A-1", "qty": 2, "gift": False}, ["vip", "eu"])
        for i in range(n)
    ]

    def scalar(run: int) -> float:
        def body(count: int) -> None:
            for args in scalar_args:
                fingerprint("tasks.charge", args, None, func=charge)

        return rate(body, n)

    def rich(run: int) -> float:
        def body(count: int) -> None:
            for args in rich_args:
                fingerprint("tasks.charge_rich", args, None, func=charge_rich)

        return rate(body, n)

    fingerprint("tasks.charge", scalar_args[0], None, func=charge)  # build the binder once
    fingerprint("tasks.charge_rich", rich_args[0], None, func=charge_rich)
    samples, _ = interleaved({"scalar": scalar, "rich": rich}, ctx.sizes.runs, baseline=None)
    return [
        Row("identity", "fingerprint, 5 args (int, int, str, str, str), func=", "calls/s",
            samples["scalar"], note="one core, pure Python"),
        Row("identity", "fingerprint, 5 args (int, Decimal, datetime, dict, list), func=",
            "calls/s", samples["rich"], note="for information"),
    ]


# -- bulk ----------------------------------------------------------------------------------------


def bulk(ctx: Context) -> list[Row]:
    """``RedisStore.reserve_many`` of N fresh identities per run (one client core)."""
    client, n = ctx.client, ctx.sizes.bulk
    store = RedisStore(client)
    walls: list[float] = []
    cpus: list[float] = []
    server_us: list[float] = []
    prefix = "bench-bulk:taskdedup:tasks.charge:"
    store.reserve_many([(f"{prefix}warm", str(uuid.uuid4()), 60_000, "")])
    for _ in range(ctx.sizes.runs):
        blob = os.urandom(16 * n).hex()
        keys = [f"{prefix}{blob[i:i + 32]}" for i in range(0, 32 * n, 32)]
        items = [(key, str(uuid.uuid4()), 600_000, "") for key in keys]
        before = client.info("commandstats").get("cmdstat_evalsha", {})
        started, cpu = time.perf_counter(), time.process_time()
        results = store.reserve_many(items)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        after = client.info("commandstats").get("cmdstat_evalsha", {})
        if len(results) != n:
            raise RuntimeError(f"reserve_many returned {len(results)} results for {n} items")
        walls.append(n / wall)
        cpus.append(n / cpu if cpu > 0 else float("inf"))
        calls = int(after.get("calls", 0)) - int(before.get("calls", 0))
        if calls:
            server_us.append((int(after["usec"]) - int(before.get("usec", 0))) / calls)
        for start in range(0, n, 10_000):
            client.unlink(*keys[start:start + 10_000])
    return [
        Row("bulk", f"RedisStore.reserve_many ({n:,} identities)", "identities/s", walls,
            note=(f"client CPU alone: {median(cpus):,.0f}/s; server time in reserve.lua: "
                  f"{median(server_us):.1f} us/call"),
            extra={"per_client_cpu_s": cpus, "server_us_per_reserve": server_us}),
    ]
