"""The Celery app of tests/test_otel.py and tests/test_flower_rq_dashboard.py, imported by the
test process and by the worker subprocess (``celery -A tests.observe_app worker``).

With ``TASKDEDUP_TEST_OTEL_LIST`` set, each pool process instruments itself as a real
deployment does (``worker_process_init``): Celery's own instrumentation
(``opentelemetry-instrumentation-celery``) and taskdedup's, with a span processor that writes
every finished span as JSON to that Redis list, where the test reads the worker's side.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery, signals

from taskdedup import Policy
from taskdedup.celery import DedupTask
from tests.effects import effect, r

URL = os.environ.get("TASKDEDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("observe", broker=URL, backend=URL)
app.conf.update(
    taskdedup_url=URL,
    task_default_queue=os.environ.get("TASKDEDUP_TEST_QUEUE", "observe"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    result_expires=600,
)


def configure(url: str, queue: str) -> None:
    """Point the test process's app at the test server and the worker's queue."""
    os.environ["TASKDEDUP_TEST_REDIS_URL"] = url
    app.conf.update(broker_url=url, result_backend=url, taskdedup_url=url,
                    task_default_queue=queue)
    for name in [n for n in app.__dict__ if n.startswith("_taskdedup")]:
        app.__dict__.pop(name, None)
    app._pool = None
    app.amqp._producer_pool = None
    app._local.__dict__.pop("backend", None)


@app.task(base=DedupTask, dedup=Policy(mode="until_expired", ttl=120))
def send_welcome_email(user_id: int, label: str) -> str:
    effect(label, user_id)
    return f"sent to {user_id}"


def _span_json(span: Any) -> str:
    parent = span.parent.span_id if span.parent is not None else None
    return json.dumps({
        "name": span.name, "trace_id": span.context.trace_id,
        "span_id": span.context.span_id, "parent_id": parent,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "attributes": dict(e.attributes or {})}
                   for e in span.events],
    })


@signals.worker_process_init.connect
def _instrument(**_: Any) -> None:
    key = os.environ.get("TASKDEDUP_TEST_OTEL_LIST")
    if not key:
        return
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        SimpleSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    from taskdedup.otel import TaskdedupInstrumentor

    class ToRedis(SpanExporter):
        """Each finished span as JSON on a Redis list (the worker's side, for the test)."""

        def export(self, spans: Any) -> SpanExportResult:
            r().rpush(key, *[_span_json(span) for span in spans])
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ToRedis()))
    trace.set_tracer_provider(provider)
    CeleryInstrumentor().instrument()
    TaskdedupInstrumentor().instrument()
