"""taskdedup: stop duplicate work in Celery and RQ task queues, with state in Redis.

Every task call gets a deterministic identity (task name + canonical arguments, SHA-256);
a Redis lock per identity moves through reserve → claim → complete/release, one Lua call per
step, fenced by the task id. Integrations: :mod:`taskdedup.celery`, :mod:`taskdedup.rq`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .approximate import Approximate
from .core import Deduplicator
from .events import DedupEvent, Event
from .exceptions import (
    BusyTimeoutError,
    ConfigurationError,
    DuplicateTaskError,
    IdempotencyKeyMismatch,
    StoreUnavailableError,
    TaskDedupError,
)
from .identity import FINGERPRINT_VERSION, fingerprint, register_canonical
from .limits import Concurrency, OnLimit, Rate, RateLimitedError
from .policy import (
    Debounce,
    Mode,
    OnBusy,
    OnDuplicate,
    OnStoreError,
    Policy,
    disable,
    disabled,
    enable,
    is_disabled,
)
from .stores import MemoryStore, RedisStore, Store

try:
    __version__ = version("taskdedup")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    # Identity
    "fingerprint",
    "register_canonical",
    "FINGERPRINT_VERSION",
    # Policy
    "Policy",
    "Mode",
    "OnBusy",
    "OnDuplicate",
    "OnStoreError",
    "Approximate",
    "Debounce",
    "disable",
    "disabled",
    "enable",
    "is_disabled",
    # Limits (SPEC §16)
    "Concurrency",
    "Rate",
    "OnLimit",
    # Engine and stores
    "Deduplicator",
    "Store",
    "RedisStore",
    "MemoryStore",
    # Events
    "Event",
    "DedupEvent",
    # Errors
    "TaskDedupError",
    "DuplicateTaskError",
    "StoreUnavailableError",
    "IdempotencyKeyMismatch",
    "BusyTimeoutError",
    "RateLimitedError",
    "ConfigurationError",
    "__version__",
]
