"""taskdedup's log records in an ``rq worker``'s own output.

The ``taskdedup`` logger has a ``NullHandler`` (a library does not choose where its logs go),
and ``rq worker`` configures handlers on ``rq.worker`` only, never on the root logger: our
WARNINGs would vanish from the one place an RQ operator looks. So :class:`DedupWorker`
installs :class:`ToWorkerLog` when it starts: while the application has configured no logging
of its own (no root handler, no handler on ``taskdedup``), records go to the handlers RQ set
up, at the level the worker was started with (``rq worker --logging_level DEBUG`` shows each
skipped duplicate). An application that configures logging gets ours through it, as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ..core import SKIPPED_LEAD
from ..events import logger

__all__ = ["ToWorkerLog", "log_to_worker", "skipped_job"]

WORKER_LOGGER = "rq.worker"


class ToWorkerLog(logging.Handler):
    """Hands ``taskdedup`` records to the handlers of RQ's ``rq.worker`` logger, unless the
    application configured logging itself (then propagation already delivers them)."""

    def emit(self, record: logging.LogRecord) -> None:
        if _configured_elsewhere():
            return
        handlers = list(logging.getLogger(WORKER_LOGGER).handlers)
        if not handlers and logging.lastResort is not None:  # a worker RQ did not bootstrap
            handlers = [logging.lastResort]
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def _configured_elsewhere() -> bool:
    return bool(logging.getLogger().handlers) or any(
        not isinstance(h, (logging.NullHandler, ToWorkerLog)) for h in logger.handlers
    )


def log_to_worker() -> None:
    """Send ``taskdedup`` records to the worker's output (once per process), at the worker's
    level when the application left ours unset."""
    if not any(isinstance(h, ToWorkerLog) for h in logger.handlers):
        logger.addHandler(ToWorkerLog())
    if logger.level == logging.NOTSET and not _configured_elsewhere():
        level = logging.getLogger(WORKER_LOGGER).getEffectiveLevel()
        logger.setLevel(level)


_RQ_SUCCESS = "Successfully completed"


class _SkippedLine(logging.Filter):
    """Turns RQ's ``Successfully completed ...`` INFO line for a skipped job into ``Skipped
    (not run) ...``."""

    def __init__(self) -> None:
        super().__init__()
        self.rewrote = False

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_RQ_SUCCESS):
            record.msg = "Skipped (not run)" + record.msg[len(_RQ_SUCCESS):]
            self.rewrote = True
        return True


@contextmanager
def skipped_job(log: logging.Logger, job: Any, value: Mapping[str, Any]) -> Iterator[None]:
    """While a skipped duplicate goes through RQ's success path: its description (what
    rq-dashboard's job lists and RQ's log line show) leads with ``[SKIPPED duplicate of <id>
    (<state>)]``, and RQ's INFO line says ``Skipped (not run)`` instead of ``Successfully
    completed`` (an RQ release without that line gets one INFO line of ours instead)."""
    job.description = f"[{SKIPPED_LEAD} {value[SKIPPED_LEAD]}] {job.description}"
    line = _SkippedLine()
    log.addFilter(line)
    try:
        yield
    finally:
        log.removeFilter(line)
    if not line.rewrote:
        log.info("Skipped (not run) %s job %s", job.description, job.id)
