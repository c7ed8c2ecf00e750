"""Measuring tools shared by every section: interleaved timing, medians, pair-by-pair ratios,
and Redis round-trip counting (client side and server side).

Why interleaved: the machine is small and shared, so its speed drifts during a run. Each
"run" measures every variant of a comparison once, in a rotated order, and the ratio to the
baseline is taken within that run; the reported ratio is the median of those per-run ratios.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.connection import AbstractConnection

__all__ = [
    "RoundTripCounter",
    "Row",
    "Sizes",
    "command_calls",
    "command_delta",
    "interleaved",
    "median",
    "purge",
    "rate",
]


@dataclass(frozen=True)
class Sizes:
    """How much work each section does (``--quick`` shrinks everything)."""

    runs: int = 5                 # interleaved runs of the cheap comparisons
    floor_ops: int = 3000         # raw EVALSHA / SET NX PX per run
    publish: int = 700            # Celery apply_async per variant per run
    enqueue: int = 600            # RQ enqueue per variant per run
    count_ops: int = 100          # calls per round-trip counting segment
    celery_tasks: int = 2000      # tasks per end-to-end Celery run (600 was ±0.15 run to run)
    celery_runs: int = 5
    rq_fork_jobs: int = 200       # jobs per end-to-end RQ Worker (fork per job) run
    rq_simple_jobs: int = 500     # jobs per end-to-end RQ SimpleWorker run
    rq_runs: int = 5
    bulk: int = 50_000            # identities per reserve_many run (5 pipeline chunks)
    memory_keys: int = 1_000_000  # keys per memory layout
    fingerprint: int = 20_000     # fingerprint() calls per run
    profile_calls: int = 1000     # plain and gated enqueues under cProfile
    warmup: bool = True           # untimed warm-up batches before the worker runs
    approx_capacity: int = 10_000_000  # identities in the approximate window (memory, FPR)
    approx_checks: int = 100_000  # fresh identities checked for false positives

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            runs=1, floor_ops=50, publish=30, enqueue=20, count_ops=5, celery_tasks=20,
            celery_runs=1, rq_fork_jobs=4, rq_simple_jobs=10, rq_runs=1, bulk=500,
            memory_keys=2000, fingerprint=500, profile_calls=20, warmup=False,
            approx_capacity=20_000, approx_checks=20_000,
        )


@dataclass
class Row:
    """One measured figure: its per-run samples and, for a comparison, per-run ratios."""

    section: str
    name: str
    unit: str
    samples: list[float]
    baseline: str | None = None
    ratios: list[float] | None = None
    round_trips: float | None = None
    commands: dict[str, float] | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def value(self) -> float:
        return median(self.samples)

    @property
    def ratio(self) -> float | None:
        return median(self.ratios) if self.ratios else None

    def as_json(self) -> dict[str, Any]:
        return {
            "section": self.section,
            "name": self.name,
            "unit": self.unit,
            "median": self.value,
            "samples": self.samples,
            "baseline": self.baseline,
            "ratio_median": self.ratio,
            "ratios": self.ratios,
            "round_trips": self.round_trips,
            "commands": self.commands,
            "note": self.note,
            **({"extra": self.extra} if self.extra else {}),
        }


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def rate(body: Callable[[int], Any], n: int) -> float:
    """Operations per second of ``body(n)``, which performs ``n`` operations."""
    gc.collect()
    started = time.perf_counter()
    body(n)
    return n / (time.perf_counter() - started)


def interleaved(
    variants: Mapping[str, Callable[[int], float]],
    runs: int,
    baseline: str | None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Run every variant once per run, rotating the order each run.

    Each callable gets the run index and returns one sample (ops/s). Returns the samples
    per variant and, when ``baseline`` is given, the per-run ratio of each other variant to
    the baseline's sample *of the same run*.
    """
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for run in range(runs):
        shift = run % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(variants[name](run))
    ratios: dict[str, list[float]] = {}
    if baseline is not None:
        base = samples[baseline]
        for name in names:
            if name != baseline:
                ratios[name] = [s / b for s, b in zip(samples[name], base, strict=True)]
    return samples, ratios


# -- counting round trips --------------------------------------------------------------------


class RoundTripCounter:
    """Counts what redis-py clients of *this thread* send, as a context manager.

    A round trip is one ``send_packed_command`` (a single command, or a whole pipeline,
    MULTI/EXEC included). Command names are recorded from ``send_command`` and from the
    pipelines' ``pack_commands``. Only the thread that entered the counter is counted, so
    background threads (taskdedup's stats flusher, heartbeats) never leak into a count.
    The patch is on redis-py's ``AbstractConnection`` class, so kombu's connections are
    counted too.

    Example::

        with RoundTripCounter() as counter:
            task.apply_async((1, 2))
        counter.round_trips, counter.commands   # 2, Counter({"EVALSHA": 1, "LPUSH": 1})
    """

    def __init__(self) -> None:
        self.round_trips = 0
        self.commands: Counter[str] = Counter()
        self.shas: list[str] = []
        self._thread = threading.get_ident()
        self._saved: dict[str, Any] = {}
        self._named = False  # the next packed send was recorded by name already

    def __enter__(self) -> RoundTripCounter:
        cls = AbstractConnection
        self._saved = {
            name: cls.__dict__[name]
            for name in ("send_packed_command", "send_command", "pack_commands")
        }
        send_packed, send, pack_many = (
            self._saved["send_packed_command"], self._saved["send_command"],
            self._saved["pack_commands"],
        )
        counter = self

        def send_packed_command(conn: Any, command: Any, check_health: bool = True) -> Any:
            if threading.get_ident() == counter._thread:
                counter.round_trips += 1
                if counter._named:
                    counter._named = False
                else:  # packed by its caller (taskdedup's raw sends): read the names
                    for args in _unpack(command):
                        counter._record(args)
                    counter._named = False
            return send_packed(conn, command, check_health)

        def send_command(conn: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == counter._thread:
                counter._record(args)
            return send(conn, *args, **kwargs)

        def pack_commands(conn: Any, commands: Any) -> Any:
            commands = list(commands)
            if threading.get_ident() == counter._thread:
                for command in commands:
                    counter._record(command)
            return pack_many(conn, commands)

        cls.send_packed_command = send_packed_command  # type: ignore[method-assign]
        cls.send_command = send_command  # type: ignore[method-assign]
        cls.pack_commands = pack_commands  # type: ignore[method-assign]
        return self

    def _record(self, args: Sequence[Any]) -> None:
        if not args:
            return
        name = _text(args[0]).upper()
        if name in ("EVALSHA", "EVAL") and len(args) > 1:
            self.shas.append(_text(args[1]) if name == "EVALSHA" else "<source>")
        self.commands[name] += 1
        self._named = True

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(AbstractConnection, name, original)


def _unpack(packed: Any) -> list[list[bytes]]:
    """The first two items of each command in a packed RESP buffer (its name and, for
    EVALSHA, the script's sha): what a caller that packs its own commands sent."""
    chunks = [packed] if isinstance(packed, (bytes, bytearray, memoryview, str)) else packed
    data = b"".join(c.encode() if isinstance(c, str) else bytes(c) for c in chunks)
    commands: list[list[bytes]] = []
    pos = 0
    while pos < len(data) and data[pos:pos + 1] == b"*":
        end = data.index(b"\r\n", pos)
        count, pos = int(data[pos + 1:end]), end + 2
        items: list[bytes] = []
        for _ in range(count):
            end = data.index(b"\r\n", pos)
            size, pos = int(data[pos + 1:end]), end + 2
            if len(items) < 2:
                items.append(data[pos:pos + size])
            pos += size + 2
        commands.append(items)
    return commands


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- server side -------------------------------------------------------------------------------


def command_calls(client: redis.Redis) -> Counter[str]:
    """``INFO commandstats`` as ``{command: calls}`` (server-wide)."""
    stats = client.info("commandstats")
    return Counter(
        {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}
    )


def command_delta(before: Counter[str], after: Counter[str], per: int) -> dict[str, float]:
    """Calls per operation between two ``command_calls`` snapshots, without the ``info`` calls
    that took them. Commands run from Lua (GET/SET/PTTL inside a script) are counted by the
    server too: only ``evalsha``/``eval`` are round trips among those."""
    delta = after - before
    delta.pop("info", None)
    return {name: round(count / per, 3) for name, count in sorted(delta.items())}


@contextmanager
def server_commands(client: redis.Redis, per: int) -> Iterator[dict[str, float]]:
    """Fill the yielded dict with the server's command calls per operation in the block."""
    result: dict[str, float] = {}
    before = command_calls(client)
    yield result
    result.update(command_delta(before, command_calls(client), per))


def purge(client: redis.Redis, *patterns: str) -> int:
    """UNLINK every key matching ``patterns`` (SCAN, never KEYS); the number removed."""
    removed = 0
    for pattern in patterns:
        batch: list[bytes] = []
        for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                removed += int(client.unlink(*batch))
                batch.clear()
        if batch:
            removed += int(client.unlink(*batch))
    return removed
