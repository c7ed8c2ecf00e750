"""``python -m benchmarks ab OLD NEW``: one worker path, two code trees, side by side.

For a change to the worker's side, whose effect is smaller than this machine's run-to-run
spread: each tree (a checkout, e.g. ``git worktree add /tmp/old HEAD~1``) gets its own Celery
worker of the realistic app on its own queue, and every round publishes a plain batch and a
gated batch to each, trees in alternating order, the other trees' workers stopped meanwhile;
the ratio gated/plain is taken per tree within each round. Besides the ratios it reports, per
task, the worker's CPU (the worker process and its pool children, from ``/proc``), the
server's CPU and the server's commands (in all, then each), which move less with the
machine's load than throughput does. Linux only (``/proc``).

    python -m benchmarks ab /tmp/old . --pool solo --rounds 4 --tasks 2000
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from . import apps, jobs
from .harness import command_calls, command_delta

__all__ = ["main"]

STAGE = "bench-ab-stage"


def _cpu(pid: int) -> float:
    """User + system CPU seconds of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its children (a prefork pool)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return _cpu(pid) + sum(_cpu(int(child)) for child in children)


class _Worker:
    """A Celery worker of ``benchmarks.apps:realistic_app`` run from ``tree``."""

    def __init__(self, tree: Path, index: int, url: str, pool: str) -> None:
        self.tree, self.queue = tree, f"bench-ab-{index}"
        self.log = Path(f"/tmp/bench-ab-worker-{index}-{os.getpid()}.log")
        env = {**os.environ, jobs.ENV_URL: url, "PYTHONPATH": str(tree)}
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "benchmarks.apps:realistic_app",
                 "worker", "-P", pool, "-c", "2" if pool == "prefork" else "1", "-Q",
                 self.queue, "-n", f"ab{index}-{os.getpid()}@%h", "--without-gossip",
                 "--without-mingle", "--without-heartbeat", "-l", "WARNING"],
                cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)

    def send_signal(self, signum: int) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signum)

    def stop(self) -> None:
        self.send_signal(signal.SIGCONT)
        self.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


@contextmanager
def _alone(workers: list[_Worker], worker: _Worker) -> Iterator[None]:
    """The other trees' workers stopped (SIGSTOP) while ``worker`` runs a batch: their idle
    polls (a BRPOP a second, kombu's restore) would count as this batch's commands and CPU."""
    others = [other for other in workers if other is not worker]
    for other in others:
        other.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for other in others:
            other.send_signal(signal.SIGCONT)


def _batch(client: redis.Redis, server_pid: int, worker: _Worker, task: Any, total: int,
           timeout: float = 600) -> dict[str, Any]:
    key = f"bench:celery:{uuid.uuid4().hex}"
    run = f"{key}|{total}"
    client.delete(STAGE)
    for i in range(total):
        task.apply_async((i, 5000, "EUR", f"ORD-{key}-{i}", run), queue=STAGE)
    before, worker_cpu, server_cpu = command_calls(client), _tree_cpu(worker.process.pid), \
        _cpu(server_pid)
    client.rename(STAGE, worker.queue)
    deadline = time.monotonic() + timeout
    while not client.exists(f"{key}:t1"):
        if worker.process.poll() is not None:
            raise RuntimeError(f"the worker of {worker.tree} exited: see {worker.log}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {key} of {worker.tree} not done in {timeout} s")
        time.sleep(0.02)
    after = command_calls(client)
    cpu = ((_tree_cpu(worker.process.pid) - worker_cpu) / total * 1e6,
           (_cpu(server_pid) - server_cpu) / total * 1e6)
    t0, t1 = (float(client.get(f"{key}:{end}") or 0) for end in ("t0", "t1"))
    client.delete(f"{key}:done", f"{key}:t0", f"{key}:t1")
    commands = command_delta(before, after, total)
    commands.pop("exists", None)  # this function's own polling
    return {"rate": (total - 1) / (t1 - t0), "worker_us": cpu[0], "server_us": cpu[1],
            "commands": sum(commands.values()), "each": commands}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs=2, type=Path, help="the two code trees: OLD NEW")
    parser.add_argument("--pool", default="solo", choices=["solo", "prefork", "threads"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--url", help="a running server (default: start valkey-server)")
    args = parser.parse_args(argv)
    trees = [tree.resolve() for tree in args.trees]
    from taskdedup.testing import RedisServer

    server = None if args.url else RedisServer().start()
    url = args.url or server.url  # type: ignore[union-attr]
    apps.configure(url)
    client = redis.Redis.from_url(url)
    server_pid = int(client.info("server")["process_id"])
    workers = [_Worker(tree, i, url, args.pool) for i, tree in enumerate(trees)]
    plain, gated = apps.realistic["plain"], apps.realistic["taskdedup"]
    results: dict[tuple[int, str], list[dict[str, Any]]] = {}
    try:
        for worker in workers:  # start-up, scripts, first fork: untimed
            for task in (plain, gated):
                _batch(client, server_pid, worker, task, 20)
        for round_ in range(args.rounds):
            order = list(enumerate(workers))
            for i, worker in order if round_ % 2 == 0 else order[::-1]:
                for label, task in (("plain", plain), ("gated", gated)):
                    with _alone(workers, worker):
                        batch = _batch(client, server_pid, worker, task, args.tasks)
                    results.setdefault((i, label), []).append(batch)
                ratio = results[i, "gated"][-1]["rate"] / results[i, "plain"][-1]["rate"]
                print(f"round {round_} {trees[i]}: gated/plain {ratio:.3f}", flush=True)
    finally:
        for worker in workers:
            worker.stop()
        if server is not None:
            server.cleanup()
    for i, tree in enumerate(trees):
        ratios = [g["rate"] / p["rate"]
                  for g, p in zip(results[i, "gated"], results[i, "plain"], strict=True)]

        def median(label: str, field: str, i: int = i) -> float:
            return statistics.median(r[field] for r in results[i, label])

        print(f"{tree}: gated/plain {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}-{max(ratios):.3f}]; per task, plain → gated: worker CPU "
              f"{median('plain', 'worker_us'):.0f} → {median('gated', 'worker_us'):.0f} µs, "
              f"server CPU {median('plain', 'server_us'):.0f} → "
              f"{median('gated', 'server_us'):.0f} µs, server commands "
              f"{median('plain', 'commands'):.1f} → {median('gated', 'commands'):.1f}")
        for label in ("plain", "gated"):
            runs = results[i, label]
            names = sorted({name for r in runs for name in r["each"]})
            each = ", ".join(
                f"{name} {statistics.median(r['each'].get(name, 0.0) for r in runs):.2f}"
                for name in names)
            print(f"  {label} commands per task: {each}")
    return 0
