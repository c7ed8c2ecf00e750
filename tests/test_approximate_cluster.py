"""Approximate windows (SPEC §12) on the topologies of ``tests/test_topologies`` (Valkey; not
in the version matrix, as that module): on the 3-master Redis Cluster the lock and the slices
of its partition share a hash tag (one slot), and a task's slices spread over slots and nodes;
an ACL user needs exactly the commands docs/how-to/approximate-windows.md lists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from taskdedup import (
    Approximate,
    Deduplicator,
    Policy,
    RedisStore,
    StoreUnavailableError,
    approximate,
)
from taskdedup.core import Verdict
from taskdedup.stats import read_windows
from taskdedup.testing import RedisServer
from tests.test_topologies import ACL_COMMANDS, acl_store
from tests.test_topologies import acl_server as acl_server
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
        held = cluster_client.get(key)  # no done lock: gone, or its owner's tombstone
        assert held is None or held.startswith(b"F|")
        again = dedup.gate(name, policy, dedup.identity(name, policy, (i,)), "late")
        assert (again.verdict, again.existing_id) == (Verdict.DUPLICATE, None)
    slices = [k.decode() for k in cluster_client.scan_iter(
        match=f"taskdedup:bloom:{name}:{{*", target_nodes=RedisCluster.ALL_NODES)]
    # one current slice per partition (two where the loop crossed a slice's end)
    tags = {k[k.index("{"): k.index("}") + 1] for k in slices}
    assert len(tags) == 16 and len(slices) <= 32, slices
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


# -- ACL: the commands docs/how-to/approximate-windows.md lists --------------------------------

WINDOW_COMMANDS = ["+getbit", "+setbit", "+bitfield", "+exists", "+pexpireat", "+time"]
STATS_COMMANDS = ["+bitcount", "+strlen", "+scan"]
GUIDE = Path(__file__).resolve().parent.parent / "docs" / "how-to" / "approximate-windows.md"


def test_the_guide_lists_exactly_these_commands() -> None:
    """Its "Redis permissions" table: one row for the window, one for the stats."""
    section = GUIDE.read_text().split("## Redis permissions", 1)[1]
    rows = re.findall(r"^\|[^|]*\|((?: *`[A-Z]+`)+) *\|$", section, re.M)
    listed = [["+" + c.lower() for c in re.findall(r"`([A-Z]+)`", row)] for row in rows]
    assert listed == [WINDOW_COMMANDS, STATS_COMMANDS]


def _approximate_round(store: RedisStore) -> None:
    dedup = Deduplicator(store)
    policy = Policy(ttl=60, window=Approximate(capacity=1000, error_rate=0.01))
    identity = dedup.identity("tests.acl.approx", policy, (1,))
    assert dedup.gate("tests.acl.approx", policy, identity, "t1").verdict is Verdict.ACCEPTED
    assert dedup.start("tests.acl.approx", policy, identity.key, "t1").verdict is Verdict.ACCEPTED
    dedup.finish("tests.acl.approx", policy, identity.key, "t1", success=True)
    again = dedup.gate("tests.acl.approx", policy, identity, "t2")
    assert (again.verdict, again.existing_id) == (Verdict.DUPLICATE, None)


def test_acl_user_with_the_listed_commands_runs_an_approximate_window_and_its_stats(
    acl_server: RedisServer,
) -> None:
    with acl_store(acl_server, [*ACL_COMMANDS, *WINDOW_COMMANDS, *STATS_COMMANDS]) as store:
        _approximate_round(store)
        windows = read_windows(store.client)
        assert windows["tests.acl.approx"].identities == 1


@pytest.mark.parametrize("missing", WINDOW_COMMANDS)
def test_acl_each_window_command_is_needed_and_a_refused_completion_keeps_the_lock(
    acl_server: RedisServer, missing: str
) -> None:
    """Without any one of them the completion fails loudly; the running lock stays (it
    lapses with its lease) rather than being deleted while the filter lacks the identity."""
    commands = [*ACL_COMMANDS, *(c for c in WINDOW_COMMANDS if c != missing)]
    with acl_store(acl_server, commands) as store:
        with redis.Redis(port=acl_server.port) as admin:
            admin.flushdb()  # a fresh slice: every command of its creation runs
        policy = Policy(ttl=60, window=Approximate(capacity=1000, error_rate=0.01))
        key = Deduplicator(store).identity("tests.acl.approx", policy, (1,)).key
        probe = approximate.probe(key, policy.window, policy.ttl_ms)  # type: ignore[arg-type]
        assert probe is not None
        assert store.claim(key, "t1", 60_000).outcome.name == "ACQUIRED"
        with pytest.raises(StoreUnavailableError, match="permission"):
            if missing == "+getbit":
                store.reserve(key + "x", "t2", 60_000, window=probe)  # the check reads bits
            else:
                store.remember(key, "t1", probe)
        lock = store.get(key)
        assert lock is not None and lock.owner == "t1" and lock.state.value == "R"


@pytest.mark.parametrize("missing", WINDOW_COMMANDS)
def test_doctor_names_each_window_command_a_user_lacks(
    acl_server: RedisServer, missing: str
) -> None:
    """``taskdedup doctor`` probes exactly the commands the window's scripts run (TIME
    included: the server's clock places every call in the slices)."""
    from taskdedup.doctor import diagnose

    commands = [*ACL_COMMANDS, *STATS_COMMANDS, "+ping", "+info", "+config|get",
                *(c for c in WINDOW_COMMANDS if c != missing)]
    with acl_store(acl_server, commands) as store:
        findings = {finding.check: finding for finding in diagnose(store.client, "taskdedup")}
    windows = findings["windows"]
    assert f"may not run {missing[1:]}" in windows.detail and missing in windows.fix
