"""The smallest complete Celery example: a payment task that must charge once.

Run it:  python examples/celery_app.py
It starts a throwaway Redis (pip-installed valkey-server) unless TASKDEDUP_URL is set, a real
Celery worker, sends the same charge five times (a double click and webhook retries), and
checks that the card was charged exactly once. The test suite runs this file.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from pathlib import Path

import redis
from celery import Celery

from taskdedup import Policy
from taskdedup.celery import DedupTask

URL = os.environ.get("TASKDEDUP_URL") or "redis://127.0.0.1:6379/0"
app = Celery("payments", broker=URL, backend=URL)
app.conf.update(taskdedup_url=URL, broker_connection_retry_on_startup=True)


@app.task(base=DedupTask, dedup=Policy(ttl=600), name="payments.charge")
def charge(order_id: str, amount_cents: int) -> str:
    """Charge a card. taskdedup makes sure each (order_id, amount) is charged once."""
    redis.Redis.from_url(URL).rpush(f"charges:{order_id}", amount_cents)  # the side effect
    return f"charged {amount_cents} for {order_id}"


def main() -> int:
    global URL
    from taskdedup.testing import RedisServer, wait_for

    server = None
    if not os.environ.get("TASKDEDUP_URL"):
        server = RedisServer().start()
        # at exit, after taskdedup's last stats flush (atexit runs handlers last-in first-out)
        atexit.register(server.cleanup)
        URL = os.environ["TASKDEDUP_URL"] = server.url
        app.conf.update(broker_url=URL, result_backend=URL, taskdedup_url=URL)

    here = Path(__file__).resolve().parent
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "--quiet", "-A", "celery_app", "worker", "-P", "prefork",
         "-c", "2", "-l", "WARNING", "--without-gossip", "--without-mingle"],
        cwd=here, env={**os.environ, "PYTHONPATH": str(here)},
    )
    try:
        results = [charge.delay("ORD-789", 5000) for _ in range(5)]
        print(f"sent 5 charges, got task ids: {sorted({r.id for r in results})}")
        print(results[0].get(timeout=60))
        charges = wait_for(
            lambda: redis.Redis.from_url(URL).lrange("charges:ORD-789", 0, -1), timeout=30
        )
        print(f"charges recorded: {len(charges)}")
        return 0 if len(charges) == 1 and len({r.id for r in results}) == 1 else 1
    finally:
        worker.terminate()
        worker.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
