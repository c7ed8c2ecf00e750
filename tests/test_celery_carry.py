"""The claim carried by kombu's unacked record (``taskdedup.celery._compat``), in process, on a
real kombu Redis channel and a real server: the record's transaction carries the claim and
hands back its reply; whatever happens to the claim, kombu's record is written as kombu
writes it; and the claim rides only where the locks are in the broker's database.

The real solo worker that carries its claims is ``tests/test_celery_solo.py``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection

from taskdedup.celery import _compat
from taskdedup.stores import RedisStore


class Message:
    """What kombu's ``QoS.append`` reads of a received message."""

    def __init__(self) -> None:
        self.delivery_info = {"exchange": "", "routing_key": "q"}
        self._raw = {"body": "", "headers": {"id": str(uuid.uuid4())}}


class Carried:
    """A claim for the record to carry: its command, and the replies handed back."""

    def __init__(self, *command: Any) -> None:
        self.command = command
        self.replies: list[Any] = []

    def reply(self, value: Any) -> None:
        self.replies.append(value)


@pytest.fixture
def channel(redis_url: str) -> Iterator[Any]:
    with Connection(redis_url) as connection:
        channel = connection.default_channel
        yield channel


def recorded(client: redis.Redis, tag: str) -> bool:
    """Whether kombu's unacked record of ``tag`` is on the server, both halves."""
    return client.hexists("unacked", tag) and client.zscore("unacked_index", tag) is not None


def append(channel: Any, carried: Carried | None, carry: bool = True) -> tuple[str, list[bool]]:
    """Record one message on ``channel`` with ``carried`` for its transaction to carry: the
    delivery tag, and the ``carry`` flags ``before`` was called with."""
    asked: list[bool] = []

    def before(message: Any, carry: bool) -> Carried | None:
        asked.append(carry)
        return carried if carry else None

    assert _compat.wrap_qos_append(channel, before, carry=carry) is None
    tag = str(uuid.uuid4())
    channel.qos.append(Message(), tag)
    return tag, asked


def test_the_records_transaction_carries_the_claim_and_hands_back_its_reply(
    channel: Any, redis_client: redis.Redis,
) -> None:
    key = f"it-carry:{uuid.uuid4().hex}"
    redis_client.set(key, "Q||me", px=60_000)
    carried = Carried("SET", key, "R||me", "IFEQ", "Q||me", "PX", 60_000, "GET") \
        if _ifeq(redis_client) else Carried("SET", key, "R||me", "XX", "PX", 60_000, "GET")
    tag, asked = append(channel, carried)
    assert asked == [True]
    assert carried.replies == [b"Q||me"]  # as the server sent it: undecoded, not a bool
    assert redis_client.get(key) == b"R||me"
    assert recorded(redis_client, tag)


def test_a_claim_the_server_refuses_as_queued_leaves_kombus_record_as_kombu_writes_it(
    channel: Any, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture,
) -> None:
    """A carried command refused as the transaction is queued aborts it whole (EXECABORT):
    kombu's commands are sent again alone, the claim gets no reply (its read makes it on its
    own), and claims are no longer carried on that channel."""
    refused = Carried("SET", f"it-carry:{uuid.uuid4().hex}")  # wrong arity: refused as queued
    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        tag, asked = append(channel, refused)
    assert recorded(redis_client, tag)
    assert refused.replies == []
    assert "no longer carries the claim" in caplog.text
    next_tag = str(uuid.uuid4())
    channel.qos.append(Message(), next_tag)
    assert asked == [True, False]  # the next claim is not handed to the record
    assert recorded(redis_client, next_tag)


def test_a_claim_that_fails_as_it_runs_gets_its_error_and_kombus_record_stands(
    channel: Any, redis_client: redis.Redis,
) -> None:
    key = f"it-carry:{uuid.uuid4().hex}"
    redis_client.rpush(key, "a list, not a lock")
    carried = Carried("SET", key, "R||me", "XX", "PX", 60_000, "GET")
    tag, _ = append(channel, carried)
    assert recorded(redis_client, tag)
    assert len(carried.replies) == 1 and isinstance(carried.replies[0], redis.ResponseError)
    assert redis_client.type(key) == b"list"


def test_carrying_records_share_one_client_while_the_channel_keeps_its_pool(
    channel: Any, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kombu builds a new ``redis.Redis`` for every record (~100-140 µs: redis-py's reply
    callbacks); a record that carries a claim is written through a client kept on the
    channel, made again only when the channel's pool is replaced (a reconnection)."""
    made: list[Any] = []
    create = type(channel)._create_client

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        client = create(self, *args, **kwargs)
        made.append(client)
        return client

    monkeypatch.setattr(type(channel), "_create_client", counting)
    key = f"it-carry:{uuid.uuid4().hex}"
    claims = [Carried("SET", key, "R||me", "PX", 60_000, "GET") for _ in range(4)]
    queue = list(claims)
    assert _compat.wrap_qos_append(channel, lambda message, carry: queue.pop(0) if queue
                                   else None, carry=True) is None
    tags = [str(uuid.uuid4()) for _ in range(5)]
    for tag in tags[:3]:
        channel.qos.append(Message(), tag)
    assert len(made) == 1 and made[0].connection_pool is channel.pool
    channel._pool = None  # what kombu does when it reconnects
    channel.qos.append(Message(), tags[3])
    assert len(made) == 2 and made[1].connection_pool is channel.pool
    assert [len(claim.replies) for claim in claims] == [1, 1, 1, 1]
    channel.qos.append(Message(), tags[4])  # nothing carried: kombu's own client
    assert len(made) == 3
    assert all(recorded(redis_client, tag) for tag in tags)


def test_the_claim_rides_only_where_the_locks_share_the_brokers_database(
    channel: Any, redis_url: str,
) -> None:
    assert _compat.carry_missing(channel) is None
    same = redis.Redis.from_url(redis_url)
    assert _compat.same_database_missing(channel, same) is None
    other_db = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/3")
    assert _compat.same_database_missing(channel, other_db) == \
        "the locks are not in the broker's database"
    decoding = redis.Redis.from_url(redis_url, decode_responses=True)
    assert _compat.same_database_missing(channel, decoding) == \
        "the broker's client decodes its replies"
    assert _compat.same_database_missing(channel, object()) is not None


def test_kombus_key_prefix_keeps_the_claim_off_the_record(redis_url: str) -> None:
    options = {"global_keyprefix": "tenant1:"}
    with Connection(redis_url, transport_options=options) as connection:
        assert _compat.carry_missing(connection.default_channel) == \
            "kombu prefixes its keys (global_keyprefix)"


def _ifeq(client: redis.Redis) -> bool:
    """Whether the server takes ``SET … IFEQ`` (Valkey 8.1+), as the store found it."""
    return bool(RedisStore(client)._swaps())
