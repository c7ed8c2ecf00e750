"""OpenTelemetry for taskdedup's decisions (``pip install 'taskdedup[otel]'``).

:class:`TaskdedupInstrumentor` is an OpenTelemetry ``BaseInstrumentor``: ``instrument()``
adds a process-wide listener to taskdedup's events (every
:class:`~taskdedup.core.Deduplicator`, those made later too), ``uninstrument()`` removes it;
``opentelemetry-instrument`` finds it through the ``opentelemetry_instrumentor`` entry point.
For each decision it:

* adds a span event ``taskdedup.<decision>`` to the current span — with Celery's own
  instrumentation (``opentelemetry-instrumentation-celery``) the worker's ``run/<task>`` span,
  on the caller's side the span that called ``delay`` — with the attributes
  ``taskdedup.task``, ``taskdedup.decision``, ``taskdedup.task_id`` (this call's id),
  ``taskdedup.existing_id`` (the original's id, for a duplicate or a skip),
  ``taskdedup.detail`` and ``taskdedup.lock_key`` (``{prefix}:{task}:{digest}``: a digest,
  never an argument or the raw idempotency key);
* starts a short span of its own, ``taskdedup duplicate <task>``, for a call suppressed before
  publishing (nothing was sent, so Celery's producer span, which starts at
  ``before_task_publish``, never exists), and for any decision that finds no recording span
  when it is not routine (an RQ worker or a Celery worker without its instrumentation: a
  skip, a deferral, a lost lease, a store error is still seen);
* counts ``taskdedup.decisions`` by ``taskdedup.task`` and ``taskdedup.decision`` through the
  metrics API.

Decisions are the events (:class:`~taskdedup.events.Event`) by name, except a duplicate
folded into a running call's follow-up, which is ``coalesced`` (SPEC §13, §15).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final

from .core import STATE_WORDS
from .events import DedupEvent, Event, Events
from .stores.base import LockState

INSTALL_HINT: Final = "pip install 'taskdedup[otel]'"

try:
    from opentelemetry import metrics, trace
    from opentelemetry.instrumentation.instrumentor import (  # type: ignore[attr-defined]
        BaseInstrumentor,
    )
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        f"taskdedup.otel needs OpenTelemetry, which is not installed: {INSTALL_HINT}",
        name=exc.name,
    ) from exc

__all__ = ["COUNTER", "INSTALL_HINT", "OtelListener", "TaskdedupInstrumentor", "decision_of"]

COUNTER: Final = "taskdedup.decisions"
"""The counter's name (a Prometheus exporter shows it as ``taskdedup_decisions_total``)."""

_ROUTINE: Final = frozenset({Event.RESERVED, Event.CLAIMED, Event.COMPLETED})
"""Decisions that are the normal life of a call: span events only, never a span of their own."""

_STATES: Final = frozenset(state.value for state in STATE_WORDS)

_PUBLISHED: Final = frozenset({"replaced"})
"""Duplicate details whose call was published all the same (it replaced the queued one)."""

try:
    _VERSION = version("taskdedup")
except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
    _VERSION = "0"


def decision_of(event: DedupEvent) -> str:
    """The decision an event reports: its name, or ``coalesced`` for a coalesced duplicate."""
    if event.event is Event.DUPLICATE and event.detail == "coalesced":
        return "coalesced"
    return event.event.value


def _attributes(event: DedupEvent, decision: str) -> dict[str, str]:
    attributes = {"taskdedup.task": event.task, "taskdedup.decision": decision}
    if event.task_id is not None:
        attributes["taskdedup.task_id"] = event.task_id
    if event.existing_id is not None:
        attributes["taskdedup.existing_id"] = event.existing_id
    if event.detail is not None:
        detail = event.detail
        if event.event is Event.SKIPPED and detail in _STATES:  # the holder's state, in words
            detail = STATE_WORDS[LockState(detail)]
        attributes["taskdedup.detail"] = detail
    if event.key:
        attributes["taskdedup.lock_key"] = _safe_key(event.key)
    return attributes


def _safe_key(key: str) -> str:
    """The lock key (``{prefix}:{scope}:{task}:{digest}``, already a digest of the call); a
    key that does not end in a hex digest is digested again, so no raw value leaves."""
    last = key.rsplit(":", 1)[-1]
    if len(last) >= 16 and all(c in "0123456789abcdef" for c in last):
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class OtelListener:
    """A listener on taskdedup's events that writes span events, short spans and a counter.

    Args:
        tracer: an OpenTelemetry ``Tracer``.
        meter: an OpenTelemetry ``Meter``.
    """

    def __init__(self, tracer: Any, meter: Any) -> None:
        self.tracer = tracer
        self.counter = meter.create_counter(
            COUNTER, unit="{decision}",
            description="taskdedup decisions by task and decision (reserved, duplicate, "
                        "skipped, deferred, coalesced, released, lease_lost, store_error, ...).",
        )

    def __call__(self, event: DedupEvent) -> None:
        decision = decision_of(event)
        attributes = _attributes(event, decision)
        self.counter.add(1, {"taskdedup.task": event.task, "taskdedup.decision": decision})
        name = f"taskdedup.{decision}"
        suppressed = event.event is Event.DUPLICATE and event.detail not in _PUBLISHED
        current = trace.get_current_span()
        if current.is_recording():
            current.add_event(name, attributes)
            if not suppressed:
                return
        elif event.event in _ROUTINE:
            return
        with self.tracer.start_as_current_span(
            f"taskdedup {decision} {event.task}", kind=trace.SpanKind.INTERNAL,
            attributes=attributes,
        ) as span:
            span.add_event(name, attributes)


class TaskdedupInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Reports every taskdedup decision to OpenTelemetry (see the module's docstring).

    ``instrument(tracer_provider=..., meter_provider=...)`` takes the providers to use (the
    global ones by default); ``uninstrument()`` stops reporting. Like every
    ``BaseInstrumentor``, one instance per process and ``instrument()`` twice is harmless.
    """

    _listener: OtelListener | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()

    def _instrument(self, **kwargs: Any) -> None:
        tracer = trace.get_tracer(
            __name__, _VERSION, tracer_provider=kwargs.get("tracer_provider"),
        )
        meter = metrics.get_meter(
            __name__, _VERSION, meter_provider=kwargs.get("meter_provider"),
        )
        listener = OtelListener(tracer, meter)
        self._listener = listener
        Events.add_everywhere(listener)

    def _uninstrument(self, **kwargs: Any) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            Events.remove_everywhere(listener)
