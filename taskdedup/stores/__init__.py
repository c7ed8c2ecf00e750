"""Where locks live: the :class:`Store` protocol and its two implementations.

:class:`RedisStore` keeps one key per task identity in Redis or Valkey and moves it with
one Lua call per transition; :class:`MemoryStore` does the same in process, with an
injectable clock, for tests. Both pass one contract suite (``tests/test_store_contract.py``).
"""

from __future__ import annotations

from .base import LockInfo, LockResult, LockState, Outcome, Store
from .memory import MemoryStore
from .redis import RedisStore

__all__ = ["LockInfo", "LockResult", "LockState", "MemoryStore", "Outcome", "RedisStore", "Store"]
