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

from ..events import logger

__all__ = ["ToWorkerLog", "log_to_worker"]

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
