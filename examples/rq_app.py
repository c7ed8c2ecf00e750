"""The smallest complete RQ example: a welcome e-mail that must be sent once.

Run it:  python examples/rq_app.py
It starts a throwaway Redis (pip-installed valkey-server) unless TASKDEDUP_URL is set, a real
``rq worker`` (taskdedup's DedupWorker), enqueues the same e-mail five times (a double click
and webhook retries), and checks that it was sent exactly once. The test suite runs this file.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from pathlib import Path

import redis

from taskdedup import Policy
from taskdedup.rq import DedupQueue

URL = os.environ.get("TASKDEDUP_URL") or "redis://127.0.0.1:6379/0"


def send_welcome_email(user_id: int) -> str:
    """Send an e-mail. taskdedup makes sure each user_id gets it once."""
    url = os.environ.get("TASKDEDUP_URL") or URL
    redis.Redis.from_url(url).rpush(f"emails:{user_id}", "welcome")  # the side effect
    return f"welcome e-mail sent to user {user_id}"


def main() -> int:
    from taskdedup.testing import RedisServer, stop_worker, wait_for

    server = None
    if not os.environ.get("TASKDEDUP_URL"):
        server = RedisServer().start()
        # at exit, after taskdedup's last stats flush (atexit runs handlers last-in first-out)
        atexit.register(server.cleanup)
        os.environ["TASKDEDUP_URL"] = server.url
    url = os.environ["TASKDEDUP_URL"]

    # RQ refuses functions defined in __main__: enqueue this file's function by module name.
    import rq_app

    here = Path(__file__).resolve().parent
    connection = redis.Redis.from_url(url)
    # A fresh start, so the demo can run again at once: forget earlier runs' e-mails and locks.
    connection.delete("emails:42", *connection.scan_iter("taskdedup:rq_app.send_welcome_email:*"))
    worker = subprocess.Popen(
        [sys.executable, "-m", "rq.cli", "worker", "--quiet", "--url", url,
         "-w", "taskdedup.rq.DedupWorker", "--job-class", "taskdedup.rq.DedupJob", "emails"],
        cwd=here, env={**os.environ, "PYTHONPATH": str(here)},
    )
    try:
        queue = DedupQueue("emails", connection=connection, dedup=Policy(ttl=600))
        jobs = [queue.enqueue(rq_app.send_welcome_email, 42) for _ in range(5)]
        ids = sorted({job.id for job in jobs if job is not None})
        print(f"enqueued 5 e-mails, got job ids: {ids}")
        job = jobs[0]
        assert job is not None
        wait_for(lambda: job.get_status() == "finished", timeout=60, what="e-mail sent")
        print(job.return_value())
        emails = connection.lrange("emails:42", 0, -1)
        print(f"e-mails sent: {len(emails)}")
        return 0 if len(emails) == 1 and len(ids) == 1 else 1
    finally:
        # a warm shutdown (RQ lets a running job finish); one that hangs prints its stacks
        stop_worker(worker)
        connection.close()


if __name__ == "__main__":
    sys.exit(main())
