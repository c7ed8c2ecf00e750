"""Approximate windows (SPEC §12) on the 3-master Redis Cluster of ``tests/test_topologies``
(Valkey; not in the version matrix, as that module): the lock and the slices of its
partition share a hash tag (one slot), and a task's slices spread over slots and nodes."""

from __future__ import annotations

from redis.cluster import RedisCluster

from taskdedup import Approximate, Deduplicator, Policy, RedisStore
from taskdedup.core import Verdict
from taskdedup.testing import RedisServer
from tests.test_topologies import cluster as cluster
from tests.test_topologies import cluster_client as cluster_client


def test_cluster_keeps_each_lock_with_its_slices_and_spreads_a_task_over_slots(
    cluster: list[RedisServer], cluster_client: RedisCluster
) -> None:
    store = RedisStore(cluster_client)  # type: ignore[arg-type]
    dedup = Deduplicator(store)
    policy = Policy(ttl=60, window=Approximate(capacity=10_000, error_rate=0.01))
    name = "tests.cluster.approx"  # a fresh cluster per module: a fixed, seeded spread
    keys = []
    for i in range(200):
        identity = dedup.identity(name, policy, (i,))
        assert dedup.gate(name, policy, identity, f"t{i}").verdict is Verdict.ACCEPTED
        assert dedup.start(name, policy, identity.key, f"t{i}").verdict is Verdict.ACCEPTED
        dedup.finish(name, policy, identity.key, f"t{i}", success=True)
        keys.append(identity.key)
    for i, key in enumerate(keys):
        assert cluster_client.exists(key) == 0
        again = dedup.gate(name, policy, dedup.identity(name, policy, (i,)), "late")
        assert (again.verdict, again.existing_id) == (Verdict.DUPLICATE, None)
    slices = [k.decode() for k in cluster_client.scan_iter(
        match=f"taskdedup:bloom:{name}:{{*", target_nodes=RedisCluster.ALL_NODES)]
    assert len(slices) == 16  # one current slice per partition
    slots = {cluster_client.keyslot(k) for k in slices}
    assert len(slots) == 16
    nodes = {cluster_client.get_node_from_key(k).name for k in slices}
    assert len(nodes) == 3  # no single hot key or node per task
    for key in keys:  # each lock lives in the slot of its partition's slices
        tag = key[key.index("{"): key.index("}") + 1]
        assert any(tag in s and cluster_client.keyslot(s) == cluster_client.keyslot(key)
                   for s in slices)
    fresh = dedup.identity(name, policy, ("fresh",))
    assert dedup.gate(name, policy, fresh, "f").verdict is Verdict.ACCEPTED
