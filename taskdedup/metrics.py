"""Prometheus export of taskdedup's events (``pip install 'taskdedup[prometheus]'``).

:class:`PrometheusListener` is a listener on :attr:`Deduplicator.events
<taskdedup.core.Deduplicator.events>` that exports:

* ``taskdedup_events_total{task, event}`` — a counter per event (``reserved``, ``duplicate``,
  ``claimed``, ``skipped``, ``completed``, ``released``, ``lease_lost``, ``store_error``);
  an accepted call's own id reserving again for its retry, its ``Repeat`` or a limit's
  put-off counts as ``reserved_retry`` / ``reserved_repeat`` / ``reserved_limit``, so
  ``reserved`` counts new enqueues only (as ``taskdedup stats`` does);
* ``taskdedup_gate_seconds{task}`` — a histogram of the enqueue gate's store call;
* ``taskdedup_second_calls_total{task, answer}`` — the second call's answers (SPEC §15):
  ``wait`` (an execution put off because another id ran its identity), ``coalesced`` (a call
  folded into a running identity's follow-up), ``superseded`` (a debounced call a later one
  of its burst replaced).

and, for approximate windows (SPEC §12), :func:`attach_windows` registers a collector that
reads the live slices at scrape time (never on the hot path): per task
``taskdedup_window_fill_ratio``, ``taskdedup_window_false_positive_rate`` (estimated),
``taskdedup_window_identities`` (remembered) and ``taskdedup_window_slices_dropped``;
for per-key limits (SPEC §16), :func:`attach_limits` reads per task, at scrape time,
``taskdedup_limit_slots_in_use`` and ``taskdedup_limit_waiting`` (calls put off now); the
calls put off and dropped are ``taskdedup_events_total{event="limited"|"dropped"}``.

Labels are the task name and the event only, never an argument, a key or a task id, so the
cardinality stays at (tasks x events). ``prometheus_client`` is imported when a listener is
built, not when taskdedup is imported. Serving the metrics (``start_http_server``, and the
multiprocess mode a prefork Celery worker needs) is left to the application, as usual.

Example::

    from taskdedup.celery import get_deduplicator
    from taskdedup.metrics import attach

    attach(get_deduplicator(app))
"""

from __future__ import annotations

import importlib
import threading
import weakref
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final

from .events import DedupEvent, Event

if TYPE_CHECKING:
    from .core import Deduplicator

__all__ = [
    "GATE_BUCKETS", "INSTALL_HINT", "LimitCollector", "PrometheusListener", "WindowCollector",
    "attach", "attach_limits", "attach_windows",
]

INSTALL_HINT: Final = "pip install 'taskdedup[prometheus]'"

_AGAIN: Final = frozenset(("retry", "repeat", "limit"))
"""``reserved`` details of an accepted call's own id reserving again (as
:data:`taskdedup.stats.AGAIN`): counted as ``reserved_<detail>``, not as ``reserved``."""

GATE_BUCKETS: Final = (
    0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
"""Histogram buckets (seconds) for the gate: one Redis round trip, usually sub-millisecond."""

# registry → (counter, histogram): one set of metric objects per registry, so two
# Deduplicators (two apps) in one process do not register the same names twice.
_METRICS: weakref.WeakKeyDictionary[Any, tuple[Any, Any, Any]] = weakref.WeakKeyDictionary()
# (event, detail) → the second call's answer it counts (SPEC §15)
_SECOND_CALLS: Final = {
    (Event.DEFERRED, "busy"): "wait",
    (Event.DUPLICATE, "coalesced"): "coalesced",
    (Event.SKIPPED, "superseded"): "superseded",
}
_METRICS_LOCK = threading.Lock()
_ATTACHED: weakref.WeakKeyDictionary[Any, PrometheusListener] = weakref.WeakKeyDictionary()


def _prometheus() -> ModuleType:
    try:
        return importlib.import_module("prometheus_client")
    except ImportError as exc:
        raise ImportError(
            f"taskdedup.metrics needs prometheus_client, which is not installed: {INSTALL_HINT}",
            name="prometheus_client",
        ) from exc


class PrometheusListener:
    """Counts events and observes gate latency in Prometheus metrics.

    Args:
        registry: the ``CollectorRegistry`` to register in (default: prometheus_client's
            global ``REGISTRY``). Listeners on the same registry share their metrics.

    Raises:
        ImportError: ``prometheus_client`` is not installed (the message says what to run).
    """

    def __init__(self, registry: Any = None) -> None:
        prometheus = _prometheus()
        if registry is None:
            registry = prometheus.REGISTRY
        self.registry = registry
        with _METRICS_LOCK:
            metrics = _METRICS.get(registry)
            if metrics is None:
                metrics = (
                    prometheus.Counter(
                        "taskdedup_events",
                        "taskdedup events by task and event (reserved, duplicate, claimed, "
                        "skipped, completed, released, lease_lost, store_error).",
                        ("task", "event"),
                        registry=registry,
                    ),
                    prometheus.Histogram(
                        "taskdedup_gate_seconds",
                        "Time the enqueue gate's store call took, by task.",
                        ("task",),
                        registry=registry,
                        buckets=GATE_BUCKETS,
                    ),
                    prometheus.Counter(
                        "taskdedup_second_calls",
                        "The second call's answers by task (wait, coalesced, superseded).",
                        ("task", "answer"),
                        registry=registry,
                    ),
                )
                _METRICS[registry] = metrics
        self.events_total, self.gate_seconds, self.second_calls = metrics
        # Label lookups take a lock in prometheus_client; the children are cached here.
        self._counters: dict[tuple[str, str], Any] = {}
        self._histograms: dict[str, Any] = {}

    def __call__(self, event: DedupEvent) -> None:
        name = event.event.value
        if event.event is Event.RESERVED and event.detail in _AGAIN:  # not a new enqueue
            name = f"reserved_{event.detail}"
        counter = self._counters.get((event.task, name))
        if counter is None:
            counter = self._counters[(event.task, name)] = self.events_total.labels(
                event.task, name
            )
        counter.inc()
        answer = _SECOND_CALLS.get((event.event, event.detail or ""))
        if answer is not None:
            self.second_calls.labels(event.task, answer).inc()
        if event.seconds is not None:
            histogram = self._histograms.get(event.task)
            if histogram is None:
                histogram = self._histograms[event.task] = self.gate_seconds.labels(event.task)
            histogram.observe(event.seconds)


def attach(dedup: Deduplicator, registry: Any = None) -> PrometheusListener:
    """Export ``dedup``'s events to Prometheus; returns the listener (the same one if called
    again for this Deduplicator).

    Raises:
        ImportError: ``prometheus_client`` is not installed (the message says what to run).
    """
    listener = _ATTACHED.get(dedup)
    if listener is None:
        listener = PrometheusListener(registry)
        dedup.events.add(listener)
        _ATTACHED[dedup] = listener
    return listener


class _ScrapeCollector:
    """A Prometheus collector that reads Redis when scraped (never on the hot path). A scrape
    that cannot reach Redis yields nothing (and is logged at WARNING) rather than failing the
    whole scrape. Subclasses say what they read and which families it makes."""

    what = ""  # for the warning: "could not read <what>"

    def __init__(self, client: Any, prefix: str = "taskdedup") -> None:
        self.client = client
        self.prefix = prefix

    def read(self) -> Any:
        raise NotImplementedError

    def families(self, core: Any, found: Any) -> list[Any]:
        raise NotImplementedError

    def collect(self) -> Any:
        from .events import logger

        core = importlib.import_module("prometheus_client.core")
        try:
            found = self.read()
        except Exception as exc:
            logger.warning("taskdedup: could not read %s: %s", self.what, exc)
            return
        yield from self.families(core, found)


def _register(collector: _ScrapeCollector, registry: Any) -> None:
    prometheus = _prometheus()
    (prometheus.REGISTRY if registry is None else registry).register(collector)


class WindowCollector(_ScrapeCollector):
    """A Prometheus collector of the approximate windows' quality signals, read from Redis
    when scraped (:func:`taskdedup.stats.read_windows`: SCAN and one read script per slice
    key, pipelined), so nothing is added to the hot path. A scrape that cannot reach Redis
    yields nothing (and is logged at WARNING) rather than failing the whole scrape.

    Args:
        client: a ``redis.Redis`` (or ``RedisCluster``) client on the lock store.
        prefix: the key prefix (``taskdedup`` unless configured).
    """

    what = "the approximate windows"

    def read(self) -> Any:
        from .stats import read_windows

        return read_windows(self.client, self.prefix)

    def families(self, core: Any, found: Any) -> list[Any]:
        families = {
            "fill": core.GaugeMetricFamily(
                "taskdedup_window_fill_ratio",
                "Mean share of set bits in the live slices of a task's approximate window.",
                labels=["task"]),
            "fpr": core.GaugeMetricFamily(
                "taskdedup_window_false_positive_rate",
                "Estimated chance that a new call is taken for a duplicate, from the fill.",
                labels=["task"]),
            "identities": core.GaugeMetricFamily(
                "taskdedup_window_identities",
                "Identities the live slices of a task's approximate window remember.",
                labels=["task"]),
            "dropped": core.GaugeMetricFamily(
                "taskdedup_window_slices_dropped",
                "Slice periods rotated out of a task's approximate window (expired).",
                labels=["task"]),
        }
        for name, window in found.items():
            families["fill"].add_metric([name], window.fill)
            families["fpr"].add_metric([name], window.false_positive_rate)
            families["identities"].add_metric([name], window.identities)
            families["dropped"].add_metric([name], window.slices_dropped)
        return list(families.values())


def attach_windows(client: Any, prefix: str = "taskdedup", registry: Any = None) -> WindowCollector:
    """Export the approximate windows' quality signals of ``client``'s Redis to Prometheus.

    Raises:
        ImportError: ``prometheus_client`` is not installed (the message says what to run).
    """
    collector = WindowCollector(client, prefix)
    _register(collector, registry)
    return collector


class LimitCollector(_ScrapeCollector):
    """A Prometheus collector of per-key limits (SPEC §16), read from Redis when scraped
    (:func:`taskdedup.limits.read_limits`): per task, never per key value, the slots in use
    and the calls waiting now. A scrape that cannot reach Redis yields nothing (WARNING)."""

    what = "the limits"

    def read(self) -> Any:
        from .limits import read_limits

        return read_limits(self.client, self.prefix)

    def families(self, core: Any, found: Any) -> list[Any]:
        slots = core.GaugeMetricFamily(
            "taskdedup_limit_slots_in_use",
            "Concurrency slots held now by running bodies of a task (all its key values).",
            labels=["task"])
        waiting = core.GaugeMetricFamily(
            "taskdedup_limit_waiting",
            "Calls of a task put off by a limit now, waiting for a slot or a window.",
            labels=["task"])
        for name, figures in found.items():
            slots.add_metric([name], figures.slots_in_use)
            waiting.add_metric([name], figures.waiting)
        return [slots, waiting]


def attach_limits(client: Any, prefix: str = "taskdedup", registry: Any = None) -> LimitCollector:
    """Export the per-key limits of ``client``'s Redis to Prometheus (slots in use, calls
    waiting, per task).

    Raises:
        ImportError: ``prometheus_client`` is not installed (the message says what to run).
    """
    collector = LimitCollector(client, prefix)
    _register(collector, registry)
    return collector
