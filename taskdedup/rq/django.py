"""``DjangoDedupQueue``: :class:`~taskdedup.rq.DedupQueue` for django-rq, keeping its
``COMMIT_MODE``.

django-rq's own queue class (``DjangoRQ``) defers an enqueue made inside a database
transaction until the transaction commits (``COMMIT_MODE = "on_db_commit"``, its default), so
a job never runs before the rows it reads exist, and never runs at all when the transaction
rolls back. ``RQ["QUEUE_CLASS"] = "taskdedup.rq.DedupQueue"`` would lose that silently: use
``"taskdedup.rq.django.DjangoDedupQueue"``. The whole gated call is deferred — the
reservation too — so a rolled-back transaction leaves no lock behind, and duplicates made
inside one transaction are gated against each other when it commits. A deferred call
returns ``None``, as django-rq's does; an error of the deferred call (``on_duplicate="raise"``,
the store down) is raised where Django runs the commit callbacks, after the commit, as for
any ``on_commit`` callback. ``"request_finished"`` and ``"auto"`` behave as in django-rq.
Needs Django and django-rq 4.0+ (imported here, not by :mod:`taskdedup.rq`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django_rq import thread_queue
from django_rq.settings import QUEUES

from ..exceptions import ConfigurationError

try:
    from django_rq.queues import VALID_COMMIT_MODES, get_commit_mode, get_result_ttl
except ImportError as exc:  # django-rq < 4.0: AUTOCOMMIT, no COMMIT_MODE
    raise ConfigurationError(
        "taskdedup.rq.django needs django-rq 4.0 or later (its COMMIT_MODE); with an older "
        "django-rq use RQ['QUEUE_CLASS'] = 'taskdedup.rq.DedupQueue' and enqueue from "
        "transaction.on_commit"
    ) from exc
from ..policy import PolicyLike
from .queue import DedupQueue

__all__ = ["DjangoDedupQueue"]


class DjangoDedupQueue(DedupQueue):
    """A DedupQueue that enqueues when django-rq's ``COMMIT_MODE`` says (see the module).

    Takes django-rq's ``commit_mode`` (and its deprecated ``autocommit``) besides
    DedupQueue's arguments; ``get_queue()`` passes them.

    Raises:
        ConfigurationError: ``commit_mode`` is not one of django-rq's.
    """

    def __init__(self, *args: Any, commit_mode: str | None = None,
                 autocommit: bool | None = None, **kwargs: Any) -> None:
        if commit_mode is None:
            commit_mode = get_commit_mode() if autocommit is None else (
                "auto" if autocommit else "request_finished")
        if commit_mode not in VALID_COMMIT_MODES:
            raise ConfigurationError(
                f"DjangoDedupQueue: commit_mode must be one of {VALID_COMMIT_MODES}, "
                f"not {commit_mode!r}"
            )
        self.commit_mode: str = commit_mode
        super().__init__(*args, **kwargs)

    def _gated(
        self, params: dict[str, Any], override: PolicyLike, dedup_key: Any, when: datetime | None
    ) -> Any:
        if when is not None or self.commit_mode == "auto":  # django-rq defers enqueue only
            return self.original_enqueue_call(params, override, dedup_key, when)
        if self.commit_mode == "on_db_commit":
            if not connection.in_atomic_block:
                return self.original_enqueue_call(params, override, dedup_key, when)
            transaction.on_commit(
                lambda: self.original_enqueue_call(params, override, dedup_key, when)
            )
            return None
        # typed for DjangoRQ; it only calls original_enqueue_call(*args) at request end
        thread_queue.add(self, (params, override, dedup_key, when), {})  # type: ignore[arg-type]
        return None

    def original_enqueue_call(
        self, params: dict[str, Any], override: PolicyLike, dedup_key: Any, when: datetime | None
    ) -> Any:
        """The gated call, now (django-rq's ``thread_queue.commit`` calls it by this name at
        the end of a request); the queue's ``DEFAULT_RESULT_TTL`` applies as in django-rq."""
        if params.get("result_ttl") is None and self.name in QUEUES:
            result_ttl = get_result_ttl(self.name)
            if result_ttl is not None:
                params["result_ttl"] = result_ttl
        return super()._gated(params, override, dedup_key, when)
