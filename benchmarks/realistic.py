"""The headline publish comparison: a realistic Celery app.

One app with default configuration (only ``broker_url``; its Redis also holds the locks),
plain tasks and gated ones side by side, and — first of all — a plain task published, so
that the producer pool exists before any gated publish. celery-once and celery-singleton run
in the same app, in the same interleaved runs. This is how users run taskdedup, so this row,
not an app tuned for it, is what the publish bars are judged on.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from . import apps
from .harness import Row, interleaved, purge, rate
from .micro import Context
from .publish import RUN_ARG, count_round_trips

__all__ = ["SECTION", "publish_rows", "realistic_publish"]

SECTION = "celery publish (realistic app)"
PLAIN = "plain task"
GATED = "taskdedup DedupTask"
QUEUE = "celery"  # the default queue: nothing else in the benchmark uses it
_LOCKS = {
    PLAIN: (),
    GATED: ("taskdedup:bench.realistic.*",),
    "celery-once": ("qo_bench.realistic.*",),
    "celery-singleton": ("SINGLETONLOCK_*",),
}


def _argv(tag: str, n: int) -> list[tuple[Any, ...]]:
    return [(i, 5000, "EUR", f"ORD-{tag}-{i}", RUN_ARG) for i in range(n)]


def realistic_publish(ctx: Context) -> list[Row]:
    """Publish throughput (distinct arguments) of plain and gated tasks in one default app."""
    client = ctx.client
    tasks = {PLAIN: apps.realistic["plain"], GATED: apps.realistic["taskdedup"]}
    tasks.update({label: apps.realistic[label] for label in ("celery-once", "celery-singleton")
                  if label in apps.realistic})

    def reset(label: str) -> None:
        client.delete(QUEUE)
        purge(client, *_LOCKS[label])

    reset(PLAIN)
    tasks[PLAIN].apply_async(_argv("first", 1)[0])  # the app's first publish is a plain one
    return publish_rows(ctx, SECTION, tasks, reset, lambda: int(client.llen(QUEUE)))


def publish_rows(ctx: Context, section: str, tasks: dict[str, Any],
                 reset: Callable[[str], None], queued: Callable[[], int],
                 extra: dict[str, Any] | None = None) -> list[Row]:
    """The publish comparison of ``tasks`` (the first is the plain baseline): each warmed
    up (connections, scripts, declarations), interleaved runs of distinct calls, then their
    round trips counted; ``reset(label)`` empties the queue and that task's locks,
    ``queued()`` says how many messages the last run left (checked against the calls)."""
    n, k = ctx.sizes.publish, ctx.sizes.count_ops
    plain = next(iter(tasks))
    for label, task in tasks.items():
        reset(label)
        for args in _argv(f"warm-{uuid.uuid4().hex}", 20):
            task.apply_async(args)
    published: dict[str, int] = {}

    def variant(label: str, task: Any) -> Callable[[int], float]:
        def one(run: int) -> float:
            reset(label)
            argv = _argv(f"{run}-{uuid.uuid4().hex}", n)
            apply = task.apply_async

            def body(count: int) -> None:
                for args in argv:
                    apply(args)

            sample = rate(body, n)
            published[label] = queued()
            return sample

        return one

    samples, ratios = interleaved({label: variant(label, task) for label, task in tasks.items()},
                                  ctx.sizes.runs, baseline=plain)
    rows = []
    for label, task in tasks.items():
        reset(label)
        argv = _argv(f"count-{uuid.uuid4().hex}", k)
        rts, server, sent = count_round_trips(
            ctx, lambda i, t=task, a=argv: t.apply_async(a[i]), k)
        note = "" if published[label] == n else f"published {published[label]}, expected {n}"
        rows.append(Row(
            section, label, "publishes/s", samples[label],
            baseline=None if label == plain else plain, ratios=ratios.get(label),
            round_trips=rts, commands=server, note=note,
            extra={"client_commands": sent, "messages_published_last_run": published[label],
                   **(extra or {})},
        ))
        reset(label)
    return rows
