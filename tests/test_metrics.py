"""taskdedup.metrics: the Prometheus listener, on a fresh CollectorRegistry per test."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from taskdedup import DedupEvent, Deduplicator, Event, MemoryStore, Policy
from taskdedup.metrics import INSTALL_HINT, PrometheusListener, attach


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _attached() -> tuple[CollectorRegistry, Deduplicator, Policy, Any]:
    """A deduplicator exporting to a registry of its own, and one identity of app.charge."""
    registry = CollectorRegistry()
    dedup = Deduplicator(MemoryStore())
    attach(dedup, registry)
    policy = Policy()
    return registry, dedup, policy, dedup.identity("app.charge", policy, (42,))


def test_listener_counts_events_by_task_and_event() -> None:
    registry, dedup, policy, identity = _attached()
    dedup.gate("app.charge", policy, identity, "id-1")
    dedup.gate("app.charge", policy, identity, "id-2")
    dedup.gate("app.charge", policy, identity, "id-3")
    dedup.start("app.charge", policy, identity.key, "id-1")
    dedup.finish("app.charge", policy, identity.key, "id-1", success=True)

    def count(event: str) -> float:
        return sample(registry, "taskdedup_events_total", task="app.charge", event=event)

    assert count("reserved") == 1
    assert count("duplicate") == 2
    assert count("claimed") == 1
    assert count("completed") == 1
    assert count("released") == 0


def test_a_retry_reserving_again_is_not_counted_as_a_new_enqueue() -> None:
    """The retry of an accepted call re-reserves its lock (``reserved`` with detail
    ``retry``): ``reserved`` counts new enqueues only, as ``taskdedup stats`` does."""
    registry, dedup, policy, identity = _attached()
    dedup.gate("app.charge", policy, identity, "id-1")
    dedup.start("app.charge", policy, identity.key, "id-1")
    dedup.gate("app.charge", policy, identity, "id-1", again="retry")
    dedup.gate("app.charge", policy, identity, "id-1", again="limit")

    def count(event: str) -> float:
        return sample(registry, "taskdedup_events_total", task="app.charge", event=event)

    assert count("reserved") == 1
    assert count("reserved_retry") == 1
    assert count("reserved_limit") == 1


def test_listener_observes_gate_latency_per_task() -> None:
    registry = CollectorRegistry()
    listener = PrometheusListener(registry)
    listener(DedupEvent(Event.RESERVED, "app.a", "k", seconds=0.003))
    listener(DedupEvent(Event.DUPLICATE, "app.a", "k", seconds=0.0004))
    listener(DedupEvent(Event.CLAIMED, "app.a", "k"))  # no latency: not observed

    assert sample(registry, "taskdedup_gate_seconds_count", task="app.a") == 2
    assert sample(registry, "taskdedup_gate_seconds_sum", task="app.a") == pytest.approx(0.0034)
    assert sample(registry, "taskdedup_gate_seconds_bucket", task="app.a", le="0.0005") == 1
    assert sample(registry, "taskdedup_gate_seconds_bucket", task="app.a", le="0.005") == 2


def test_labels_are_task_and_event_only() -> None:
    registry = CollectorRegistry()
    listener = PrometheusListener(registry)
    listener(DedupEvent(Event.RESERVED, "app.a", "taskdedup:app.a:" + "0" * 32, "id-1",
                        seconds=0.001))
    listener(DedupEvent(Event.DEFERRED, "app.a", "taskdedup:app.a:" + "0" * 32, "id-2",
                        detail="busy"))  # a second call's answer (SPEC §15)
    label_names = {
        metric.name: {name for s in metric.samples for name in s.labels if name != "le"}
        for metric in registry.collect()
        if metric.name.startswith("taskdedup_")
    }
    assert label_names == {"taskdedup_events": {"task", "event"},
                           "taskdedup_gate_seconds": {"task"},
                           "taskdedup_second_calls": {"task", "answer"}}


def test_listeners_on_one_registry_share_their_metrics() -> None:
    registry = CollectorRegistry()
    first, second = PrometheusListener(registry), PrometheusListener(registry)  # no ValueError
    first(DedupEvent(Event.SKIPPED, "app.a", "k"))
    second(DedupEvent(Event.SKIPPED, "app.a", "k"))
    assert sample(registry, "taskdedup_events_total", task="app.a", event="skipped") == 2


def test_attach_is_idempotent() -> None:
    registry = CollectorRegistry()
    dedup = Deduplicator(MemoryStore())
    assert attach(dedup, registry) is attach(dedup, registry)
    dedup.events.emit(DedupEvent(Event.RESERVED, "app.a", "k"))
    assert sample(registry, "taskdedup_events_total", task="app.a", event="reserved") == 1


def test_missing_prometheus_client_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # makes the import fail
    monkeypatch.delitem(sys.modules, "taskdedup.metrics")
    fresh = importlib.import_module("taskdedup.metrics")  # imports lazily: this still works
    with pytest.raises(ImportError) as info:
        fresh.PrometheusListener()
    assert "pip install 'taskdedup[prometheus]'" in str(info.value)
    assert INSTALL_HINT == "pip install 'taskdedup[prometheus]'"
