"""The redis-py shims (``taskdedup/stores/_compat.py``): the raw exchange of ``reserve_many``
works on every supported redis-py, and without the internals it needs the store falls back to
a pipeline, says so once, and gives the same answers."""

from __future__ import annotations

import logging
import warnings

import pytest
import redis

from taskdedup.stores import _compat
from taskdedup.stores.base import Outcome
from taskdedup.stores.redis import RedisStore

ITEMS = [(f"taskdedup:compat:{i}", f"owner-{i}", 60_000, "") for i in range(5)]


def test_reserve_many_takes_a_pooled_connection_without_deprecation_warnings(
    redis_client: redis.Redis,
) -> None:
    store = RedisStore(redis_client)
    assert store._take_connection is not None  # the raw exchange, on this redis-py
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # redis-py >= 6 warns when given a command name
        results = store.reserve_many(ITEMS)
    assert [r.outcome for r in results] == [Outcome.ACQUIRED] * len(ITEMS)


def test_without_the_raw_exchange_reserve_many_uses_a_pipeline_and_says_so_once(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(_compat, "_CONNECTION_METHODS",
                        (*_compat._CONNECTION_METHODS, "send_packed_command_v2"))
    monkeypatch.setattr(_compat, "_explained", set())
    with caplog.at_level(logging.INFO, logger="taskdedup"):
        first, second = RedisStore(redis_client), RedisStore(redis_client)
    assert first._take_connection is None and second._take_connection is None
    said = [r.getMessage() for r in caplog.records if "reserve_many uses a redis-py pipeline"
            in r.getMessage()]
    assert said == ["taskdedup: reserve_many uses a redis-py pipeline (Connection lacks "
                    "send_packed_command_v2)"]
    results = first.reserve_many(ITEMS)
    assert [r.outcome for r in results] == [Outcome.ACQUIRED] * len(ITEMS)
    again = second.reserve_many([(k, "someone-else", ttl, c) for k, _, ttl, c in ITEMS])
    assert [(r.outcome, r.owner) for r in again] == [
        (Outcome.DUPLICATE, owner) for _, owner, _, _ in ITEMS
    ]
