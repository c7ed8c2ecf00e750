"""taskdedup.otel with the OpenTelemetry SDK's in-memory exporters (InMemorySpanExporter,
InMemoryMetricReader): span events on the current span, a short span of its own for a call
suppressed before publishing, a counter by task and decision, uninstrument(), the entry point;
beside opentelemetry-instrumentation-celery in this process (the producer) and in a real Celery
worker subprocess (whose spans a span processor writes to Redis for the test to read), and on
RQ. OpenTelemetry is in the ``test`` dependency group; without it this module is skipped,
except on CI, where that is an error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

_MISSING = [name for name in ("opentelemetry.sdk", "opentelemetry.instrumentation.celery")
            if importlib.util.find_spec(name.split(".")[0]) is None
            or importlib.util.find_spec(name) is None]
if _MISSING:
    _WHY = (f"not installed: {', '.join(_MISSING)} (the 'test' dependency group: pip install "
            "opentelemetry-sdk opentelemetry-instrumentation-celery)")
    if os.environ.get("CI"):  # as for a missing Redis binary: on CI an error, not a skip
        pytest.fail(_WHY, pytrace=False)
    pytest.skip(_WHY, allow_module_level=True)

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

from taskdedup import Deduplicator, MemoryStore, Policy  # noqa: E402
from taskdedup.events import Events  # noqa: E402
from taskdedup.otel import COUNTER, TaskdedupInstrumentor  # noqa: E402
from taskdedup.testing import wait_for  # noqa: E402
from tests.workers import CeleryWorker  # noqa: E402

SECRET = "alice@example.com"  # an argument value that must never reach telemetry


class Otel:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.tracer = self.tracer_provider.get_tracer("tests")

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def counts(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == COUNTER:
                        for point in metric.data.data_points:
                            attrs = dict(point.attributes)
                            out[(str(attrs["taskdedup.task"]),
                                 str(attrs["taskdedup.decision"]))] = int(point.value)
        return out


@pytest.fixture
def otel() -> Iterator[Otel]:
    o = Otel()
    TaskdedupInstrumentor().instrument(tracer_provider=o.tracer_provider,
                                       meter_provider=o.meter_provider)
    try:
        yield o
    finally:
        TaskdedupInstrumentor().uninstrument()


def events_of(span: ReadableSpan) -> list[tuple[str, dict[str, Any]]]:
    return [(e.name, dict(e.attributes or {})) for e in span.events]


def no_secret(otel: Otel) -> None:
    for span in otel.finished():
        assert SECRET not in json.dumps(span.to_json())


def test_each_decision_is_an_event_on_the_current_span_and_counted(otel: Otel) -> None:
    dedup, policy = Deduplicator(MemoryStore()), Policy(mode="until_executed", ttl=60)
    identity = dedup.identity("app.send", policy, (SECRET,))
    with otel.tracer.start_as_current_span("request") as request:
        dedup.gate("app.send", policy, identity, "id-1", fresh=True)
        dedup.gate("app.send", policy, identity, "id-2", fresh=True)
        dedup.start("app.send", policy, identity.key, "id-3")  # another id: skipped
        dedup.release("app.send", identity.key, "id-1", reason="failed")
    spans = {s.name: s for s in otel.finished()}
    assert set(spans) == {"request", "taskdedup duplicate app.send"}
    seen = events_of(spans["request"])
    assert [name for name, _ in seen] == [
        "taskdedup.reserved", "taskdedup.duplicate", "taskdedup.skipped", "taskdedup.released"
    ]
    duplicate = seen[1][1]
    assert duplicate["taskdedup.task"] == "app.send"
    assert duplicate["taskdedup.decision"] == "duplicate"
    assert duplicate["taskdedup.existing_id"] == "id-1"  # the original's id
    assert duplicate["taskdedup.task_id"] == "id-2"
    assert duplicate["taskdedup.lock_key"] == identity.key  # prefix, task and a digest
    assert seen[2][1]["taskdedup.existing_id"] == "id-1"
    assert seen[3][1]["taskdedup.detail"] == "failed"
    # the suppressed call's own short span, a child of the caller's
    own = spans["taskdedup duplicate app.send"]
    assert own.parent is not None and own.parent.span_id == request.get_span_context().span_id
    assert [name for name, _ in events_of(own)] == ["taskdedup.duplicate"]
    no_secret(otel)
    assert otel.counts() == {
        ("app.send", "reserved"): 1, ("app.send", "duplicate"): 1,
        ("app.send", "skipped"): 1, ("app.send", "released"): 1,
    }


def test_without_a_current_span_only_what_is_not_routine_gets_a_span(otel: Otel) -> None:
    dedup, policy = Deduplicator(MemoryStore()), Policy(mode="until_expired", ttl=60)
    identity = dedup.identity("app.send", policy, (SECRET,))
    dedup.gate("app.send", policy, identity, "id-1", fresh=True)  # routine: counted only
    dedup.start("app.send", policy, identity.key, "id-1")
    dedup.finish("app.send", policy, identity.key, "id-1", success=True)
    assert otel.finished() == []
    dedup.start("app.send", policy, identity.key, "id-9")  # done by id-1: skipped
    (span,) = otel.finished()
    assert span.name == "taskdedup skipped app.send" and span.parent is None
    assert events_of(span)[0][1]["taskdedup.existing_id"] == "id-1"
    assert otel.counts()[("app.send", "completed")] == 1


def test_an_idempotency_key_never_leaves_raw(otel: Otel) -> None:
    dedup, policy = Deduplicator(MemoryStore()), Policy(ttl=60)
    identity = dedup.identity("app.pay", policy, (), {}, dedup_key=SECRET)
    with otel.tracer.start_as_current_span("request"):
        dedup.gate("app.pay", policy, identity, "id-1", fresh=True)
        dedup.gate("app.pay", policy, identity, "id-2", fresh=True)
    assert len(otel.finished()) == 2
    no_secret(otel)


def test_uninstrument_stops_reporting_and_instrument_is_idempotent(otel: Otel) -> None:
    TaskdedupInstrumentor().instrument()  # again: BaseInstrumentor ignores it
    assert len(Events._everywhere) == 1
    TaskdedupInstrumentor().uninstrument()
    assert Events._everywhere == ()
    dedup, policy = Deduplicator(MemoryStore()), Policy(ttl=60)
    identity = dedup.identity("app.send", policy, (1,))
    with otel.tracer.start_as_current_span("request"):
        dedup.gate("app.send", policy, identity, "id-1", fresh=True)
        dedup.gate("app.send", policy, identity, "id-2", fresh=True)
    (request,) = otel.finished()
    assert request.events == () or list(request.events) == []
    assert otel.counts() == {}


def test_opentelemetry_instrument_finds_it_through_its_entry_point(tmp_path: Path) -> None:
    from importlib.metadata import entry_points

    (ep,) = entry_points(group="opentelemetry_instrumentor", name="taskdedup")
    assert ep.load() is TaskdedupInstrumentor
    # the real command, as a deployment runs it: our listener is in place before the app runs
    command = Path(sys.executable).with_name("opentelemetry-instrument")
    if not command.exists():
        pytest.skip(f"no {command.name} beside {sys.executable}")
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
           "OTEL_LOGS_EXPORTER": "none"}
    done = subprocess.run(
        [str(command), sys.executable, "-c",
         "from taskdedup.events import Events; print([type(x).__name__ for x in "
         "Events._everywhere])"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['OtelListener']", (done.stdout, done.stderr[-2000:])


# -- beside opentelemetry-instrumentation-celery ---------------------------------------------


class ObserveWorker(CeleryWorker):
    app_module = "tests.observe_app"


@pytest.fixture(scope="module")
def spans_key() -> str:
    return f"otel-spans:{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def worker(redis_url: str, spans_key: str) -> Iterator[ObserveWorker]:
    queue = f"otel-{uuid.uuid4().hex[:8]}"
    w = ObserveWorker(redis_url, queue=queue, concurrency=1,
                      env={"TASKDEDUP_TEST_OTEL_LIST": spans_key}).start()
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture
def celery_otel(otel: Otel, redis_url: str, worker: ObserveWorker) -> Iterator[Any]:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    from tests import observe_app

    observe_app.configure(redis_url, worker.queue)
    CeleryInstrumentor().instrument(tracer_provider=otel.tracer_provider)
    try:
        yield observe_app
    finally:
        CeleryInstrumentor().uninstrument()


def worker_spans(rc: redis.Redis, key: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in rc.lrange(key, 0, -1)]


def test_beside_celery_instrumentation_producer_and_worker(
    otel: Otel, celery_otel: Any, redis_url: str, spans_key: str
) -> None:
    rc = redis.Redis.from_url(redis_url)
    app, task = celery_otel.app, celery_otel.send_welcome_email
    label = uuid.uuid4().hex[:12]
    with otel.tracer.start_as_current_span("signup"):
        first = task.delay(7, label)
        again = task.delay(7, label)  # suppressed at enqueue: nothing is published
    assert again.id == first.id
    assert first.get(timeout=30) == "sent to 7"
    # sent by name: not gated at enqueue, skipped by the worker's claim
    with otel.tracer.start_as_current_span("replay"):
        skipped = app.send_task(task.name, (7, label), queue=app.conf.task_default_queue)
    assert skipped.get(timeout=30)["SKIPPED"] == f"duplicate of {first.id} (done)"

    # the producer side, in this process
    spans = otel.finished()
    names = [s.name for s in spans]
    assert names.count(f"apply_async/{task.name}") == 2  # the first delay and the send_task
    assert names.count(f"taskdedup duplicate {task.name}") == 1  # the suppressed second delay
    signup = next(s for s in spans if s.name == "signup")
    assert [n for n, _ in events_of(signup)] == ["taskdedup.reserved", "taskdedup.duplicate"]
    assert events_of(signup)[1][1]["taskdedup.existing_id"] == first.id

    # the worker side: its run/ spans carry the claim and the skip
    def task_id(span: dict[str, Any]) -> str | None:
        attributes = span["attributes"]
        return attributes.get("celery.task_id") or attributes.get("messaging.message.id")

    def runs() -> list[dict[str, Any]]:
        return [s for s in worker_spans(rc, spans_key) if s["name"] == f"run/{task.name}"
                and task_id(s) in (first.id, skipped.id)]

    found = wait_for(lambda: len(runs()) == 2 and runs(), timeout=30, what="worker spans")
    by_id = {task_id(s): s for s in found}
    ran, skip = by_id[first.id], by_id[skipped.id]
    assert [e["name"] for e in ran["events"]] == ["taskdedup.claimed", "taskdedup.completed"]
    (event,) = skip["events"]
    assert event["name"] == "taskdedup.skipped"
    assert event["attributes"]["taskdedup.existing_id"] == first.id
    assert event["attributes"]["taskdedup.task"] == task.name
    # the worker's span continues the producer's trace (Celery's instrumentation propagates it)
    replay = next(s for s in spans if s.name == "replay")
    assert skip["trace_id"] == replay.context.trace_id
    assert event["attributes"]["taskdedup.detail"] == "done"  # the original's state
    assert label not in json.dumps(skip) and label not in json.dumps(ran)  # no argument value
    assert all(label not in json.dumps(s.to_json()) for s in spans
               if not s.name.startswith("apply_async/"))  # Celery's own span names its args


def test_rq_a_duplicate_enqueue_and_a_skipped_job(otel: Otel, redis_url: str) -> None:
    from taskdedup.rq import DedupQueue
    from tests import rq_jobs

    rc = redis.Redis.from_url(redis_url)
    name, label = "tests.rq_jobs.record", uuid.uuid4().hex[:12]
    idle = DedupQueue(f"otel-rq-{label}", connection=rc, dedup=Policy(ttl=60))
    with otel.tracer.start_as_current_span("webhook"):
        one = idle.enqueue(rq_jobs.record, label)
        two = idle.enqueue(rq_jobs.record, label)  # suppressed: nothing enqueued
    assert one is not None and two is not None and two.id == one.id
    assert [s.name for s in otel.finished()] == [f"taskdedup duplicate {name}", "webhook"]
    # a synchronous queue runs the job here, with no span around it: the skip gets its own
    policy = Policy(mode="while_executing")
    sync = DedupQueue(f"otel-rq-sync-{label}", connection=rc, is_async=False, dedup=policy)
    key = sync.dedup.identity(name, policy, (label + "s",), {}, func=rq_jobs.record).key
    rc.set(key, "R||someone-else", px=30_000)  # another worker runs this identity now
    try:
        job = sync.enqueue(rq_jobs.record, label + "s")
    finally:
        rc.delete(key)
    assert job is not None and job.get_status() == "finished"
    (span,) = [s for s in otel.finished() if s.name == f"taskdedup skipped {name}"]
    assert events_of(span)[0][1]["taskdedup.existing_id"] == "someone-else"
    assert otel.counts()[(name, "skipped")] == 1
    assert otel.counts()[(name, "duplicate")] == 1
    no_secret(otel)
