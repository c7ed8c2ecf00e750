"""Per-key limits (SPEC §16) on the 3-master Redis Cluster of ``tests/test_topologies``
(Valkey): each limit's key for one key value is one slot (every script touches one key), a
task's key values spread over slots and nodes, and the operators' reads work across nodes."""

from __future__ import annotations

import pytest
from redis.cluster import RedisCluster

from taskdedup import Concurrency, Deduplicator, Rate, RedisStore
from taskdedup import limits as lim
from taskdedup.testing import RedisServer
from tests.test_topologies import cluster as cluster
from tests.test_topologies import cluster_client as cluster_client

pytestmark = pytest.mark.slow


def test_limits_on_a_cluster_spread_over_slots_and_hold(
    cluster: list[RedisServer], cluster_client: RedisCluster
) -> None:
    dedup = Deduplicator(RedisStore(cluster_client))  # type: ignore[arg-type]
    name = "tests.cluster.limited"
    declared = lim.coerce_limits([Concurrency(1, key=lambda tenant: tenant),
                                  Rate(2, per=60, key=lambda tenant: tenant)], name)
    held = [lim.admit(dedup, name, declared, (f"tenant-{i}",), {}, f"id-{i}", 60_000)
            for i in range(60)]
    assert all(a.ok for a in held)
    refused = lim.admit(dedup, name, declared, ("tenant-7",), {}, "again", 60_000)
    assert not refused.ok and isinstance(refused.limit, Concurrency)
    keys = [key for admitted in held for key, _ in admitted.slots]
    assert len(set(keys)) == 120
    assert len({cluster_client.keyslot(k) for k in keys}) > 100  # no hot slot per task
    assert len({cluster_client.get_node_from_key(k).name for k in keys}) == 3
    figures = lim.read_limits(cluster_client, "taskdedup", name)
    assert figures[name].slots_in_use == 60
    for admitted in held:
        lim.release(dedup, admitted.slots)
    assert lim.read_limits(cluster_client, "taskdedup", name) == {}
    # the rate windows kept their starts: a second start each, then a third is refused
    second = lim.admit(dedup, name, declared, ("tenant-7",), {}, "second", 60_000)
    assert second.ok
    lim.release(dedup, second.slots)
    third = lim.admit(dedup, name, declared, ("tenant-3",), {}, "x", 60_000)
    assert third.ok
    lim.release(dedup, third.slots)
    fourth = lim.admit(dedup, name, declared, ("tenant-3",), {}, "y", 60_000)
    assert not fourth.ok and isinstance(fourth.limit, Rate) and fourth.wait_ms > 50_000
