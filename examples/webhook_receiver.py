"""A webhook receiver that turns a provider's retried deliveries into one task.

Payment providers retry a webhook until they get a 2xx, and a slow answer looks like a failure
to them: the same event arrives two, three, ten times, always with the same
``Idempotency-Key`` header. The receiver passes that header as ``dedup_key``, so every
delivery of one event maps to one RQ job: the first is enqueued, the retries get the original
job's id back (still 202, so the provider stops retrying), and a key reused with a different
body is a client bug answered with 422.

Run it:  python examples/webhook_receiver.py
It starts a throwaway Redis unless TASKDEDUP_URL is set, an RQ worker, this HTTP server on
127.0.0.1, then plays the provider: three deliveries of one event and a bad reuse of its key.
The test suite runs this file.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import redis

from taskdedup import IdempotencyKeyMismatch, Policy
from taskdedup.rq import DedupQueue

URL = os.environ.get("TASKDEDUP_URL") or "redis://127.0.0.1:6379/0"


def record_payment(event: dict[str, Any]) -> str:
    """The side effect: book the payment (here: append it to a Redis list)."""
    url = os.environ.get("TASKDEDUP_URL") or URL
    redis.Redis.from_url(url).rpush("payments:booked", json.dumps(event, sort_keys=True))
    return f"booked {event['id']}"


class WebhookHandler(BaseHTTPRequestHandler):
    """POST /webhooks/payments with an Idempotency-Key header and a JSON body."""

    queue: DedupQueue

    def do_POST(self) -> None:
        key = self.headers.get("Idempotency-Key")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path != "/webhooks/payments" or not key:
            return self._answer(400, {"error": "POST /webhooks/payments with Idempotency-Key"})
        try:
            event = json.loads(body)
            job = self.queue.enqueue(record_payment, event, dedup_key=key)
        except IdempotencyKeyMismatch:
            return self._answer(422, {"error": "Idempotency-Key reused with another body"})
        except (ValueError, TypeError) as exc:
            return self._answer(400, {"error": str(exc)})
        assert job is not None  # on_duplicate="return": a duplicate gives the original job
        self._answer(202, {"job": job.id})

    def _answer(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


def deliver(port: int, key: str, event: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """What the provider does: POST the event with its idempotency key."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/webhooks/payments", data=json.dumps(event).encode(),
        headers={"Idempotency-Key": key, "Content-Type": "application/json"}, method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def main() -> int:
    from taskdedup.testing import RedisServer, stop_worker, wait_for

    server = None
    if not os.environ.get("TASKDEDUP_URL"):
        server = RedisServer().start()
        # at exit, after taskdedup's last stats flush (atexit runs handlers last-in first-out)
        atexit.register(server.cleanup)
        os.environ["TASKDEDUP_URL"] = server.url
    url = os.environ["TASKDEDUP_URL"]
    connection = redis.Redis.from_url(url)
    connection.delete("payments:booked")

    import webhook_receiver  # RQ refuses functions defined in __main__

    here = Path(__file__).resolve().parent
    queue = DedupQueue("webhooks", connection=connection, dedup=Policy(ttl=24 * 3600))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), webhook_receiver.WebhookHandler)
    webhook_receiver.WebhookHandler.queue = queue
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    worker = subprocess.Popen(
        [sys.executable, "-m", "rq.cli", "worker", "--quiet", "--url", url,
         "-w", "taskdedup.rq.DedupWorker", "--job-class", "taskdedup.rq.DedupJob", "webhooks"],
        cwd=here, env={**os.environ, "PYTHONPATH": str(here)},
    )
    try:
        port = httpd.server_address[1]
        event_id = f"evt_{os.getpid()}"
        event = {"id": event_id, "type": "payment.succeeded", "amount": 5000}
        answers = [deliver(port, event_id, event) for _ in range(3)]  # provider retries
        for status, payload in answers:
            print(f"delivery -> {status} {payload}")
        bad = deliver(port, event_id, {**event, "amount": 1})  # same key, another body
        print(f"reused key with another body -> {bad[0]} {bad[1]}")
        booked = wait_for(lambda: connection.lrange("payments:booked", 0, -1), timeout=60)
        print(f"payments booked: {len(booked)}")
        jobs = {payload["job"] for _, payload in answers}
        ok = all(s == 202 for s, _ in answers) and len(jobs) == 1 and bad[0] == 422
        return 0 if ok and len(booked) == 1 else 1
    finally:
        httpd.shutdown()
        # a warm shutdown (RQ lets a running job finish); one that hangs prints its stacks
        stop_worker(worker)


if __name__ == "__main__":
    sys.exit(main())
