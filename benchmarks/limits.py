"""Per-key limits (SPEC §16): what a limit check costs per task, and Redis memory per key
value in use, in one run.

* **Per task**: the worker's guard of one execution, as a worker runs it (the claim, then the
  completion sent at once with its reply read later: ``Deduplicator.start`` /
  ``finish(later=True)``), without a limit, with a ``Concurrency`` (``limits.admit`` then
  ``limits.release``: the slot's acquire script, one more round trip waited for, and its
  release, sent at once like the completion) and with a ``Concurrency`` and a ``Rate`` (one
  more: the rate script). The variants run interleaved, and each one's throughput is divided
  by the no-limit variant's of the same run. Every call has its own key value (a tenant per
  call), as many tenants would, so no call is ever refused and nothing waits.
* **Memory**: ``keys`` key values each holding one slot and one start in a window
  (``MEMORY USAGE`` of the sets, summed, per key value), as while their bodies run.
"""

from __future__ import annotations

import uuid
from typing import Any

from taskdedup import Concurrency, Policy, Rate, RedisStore
from taskdedup import limits as lim
from taskdedup.core import Deduplicator

from .harness import Row, interleaved, purge, rate
from .micro import Context

__all__ = ["SECTION", "limits"]

SECTION = "limits"
PREFIX = "bench-limits"
NAME = "bench.limited"
PLAIN = "claim + complete, no limit"
CONCURRENCY = "claim + Concurrency + complete"
BOTH = "claim + Concurrency + Rate + complete"


def _tenant(tenant: str) -> str:
    return tenant


def limits(ctx: Context) -> list[Row]:
    client, sizes = ctx.client, ctx.sizes
    dedup = Deduplicator(RedisStore(client), prefix=PREFIX)
    policy = Policy(mode="while_executing", lease=60)
    declared: dict[str, tuple[Any, ...]] = {
        PLAIN: (),
        CONCURRENCY: lim.coerce_limits([Concurrency(2, key=_tenant)], NAME),
        BOTH: lim.coerce_limits([Concurrency(2, key=_tenant),
                                 Rate(100, per=60, key=_tenant)], NAME),
    }
    n = max(10, sizes.floor_ops // 3)

    def variant(which: str) -> Any:
        chosen = declared[which]

        def run(index: int) -> float:
            calls = [(str(uuid.uuid4()), uuid.uuid4().hex) for _ in range(n)]

            def body(count: int) -> None:
                for owner, tenant in calls:
                    key = dedup.identity(NAME, policy, (tenant,)).key
                    dedup.start(NAME, policy, key, owner)
                    if chosen:
                        admitted = lim.admit(dedup, NAME, chosen, (tenant,), {}, owner,
                                             policy.lease_ms)
                        lim.release(dedup, admitted.slots)
                    dedup.finish(NAME, policy, key, owner, success=True, later=True)

            return rate(body, n)

        return run

    for which in declared:  # warm: scripts cached, code paths imported
        variant(which)(0)
    samples, ratios = interleaved({name: variant(name) for name in declared}, sizes.runs, PLAIN)
    purge(client, f"{PREFIX}:*")
    rows = [Row(SECTION, name, "executions/s", samples[name], baseline=(
        None if name == PLAIN else PLAIN), ratios=ratios.get(name),
        note="one execution's guard on the worker: claim, limits, complete")
        for name in declared]

    keys = max(100, sizes.memory_keys // 10)
    both = declared[BOTH]
    held = [lim.admit(dedup, NAME, both, (f"tenant-{i}",), {}, f"{uuid.uuid4()}", 600_000)
            for i in range(keys)]
    used = 0
    sets = 0
    for key in client.scan_iter(match=f"{PREFIX}:limit:*", count=1000):
        used += int(client.memory_usage(key, samples=0) or 0)
        sets += 1
    for admitted in held:  # given back as bodies do (their heartbeats stop)
        lim.release(dedup, admitted.slots)
    purge(client, f"{PREFIX}:*")
    rows.append(Row(SECTION, "Redis memory per key value in use (one slot held, one start "
                    "in the window)", "bytes", [used / keys],
                    note=f"{keys} key values, {sets} sorted sets, MEMORY USAGE summed"))
    ctx.log(f"  limits: {rows[1].ratio or 0:.2f}x / {rows[2].ratio or 0:.2f}x of no limit, "
            f"{used / keys:.0f} bytes per key value")
    return rows
