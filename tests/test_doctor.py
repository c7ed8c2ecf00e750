"""``taskdedup doctor`` and the once-per-process eviction warning, against real servers.

A server whose ``maxmemory-policy`` may evict keys silently breaks deduplication (every lock
has a TTL, so ``volatile-*`` evicts locks too): the first use warns once, naming the policy
and the fix, and the doctor reports it with the other checks and exits 1.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
import redis
from click.testing import CliRunner

from taskdedup import Policy
from taskdedup.cli import main
from taskdedup.core import Deduplicator
from taskdedup.stores import server as server_checks
from taskdedup.stores.redis import RedisStore
from taskdedup.testing import RedisServer


@pytest.fixture(scope="module")
def own_server() -> Iterator[RedisServer]:
    """A server of this module's own: its configuration is changed by the tests."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def own(own_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(own_server.url)
    client.config_set("maxmemory", 0)
    client.config_set("maxmemory-policy", "noeviction")
    client.flushdb()
    yield client
    client.config_set("maxmemory", 0)
    client.config_set("maxmemory-policy", "noeviction")
    client.execute_command("ACL", "DELUSER", "narrow", "noscripts")
    client.close()


def doctor(url: str, *extra: str) -> tuple[int, dict[str, dict[str, object]]]:
    result = CliRunner().invoke(main, ["--url", url, "doctor", "--json", *extra])
    data = json.loads(result.output)
    return result.exit_code, {c["check"]: c for c in data["checks"]}


def test_doctor_passes_on_a_server_that_never_evicts(own: redis.Redis,
                                                     own_server: RedisServer) -> None:
    code, checks = doctor(own_server.url)
    assert code == 0
    assert set(checks) == {"server", "eviction", "cluster", "scripts", "worker steps", "acl",
                           "commands", "windows", "copies", "fetch"}
    assert all(c["ok"] for c in checks.values())
    swaps = "valkey" in str(checks["server"]["detail"])  # the suite's servers: Valkey 9.1 swaps
    assert ("one SET IFEQ each" in str(checks["worker steps"]["detail"])) is swaps
    assert own.keys("taskdedup:doctor:*") == []  # the probe lock was released
    assert own.keys("taskdedup:probe:*") == []  # and the swap's probe key deleted
    assert own.keys("taskdedup:bloom:*") == []  # and the probe bitmap deleted


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
def test_doctor_fails_on_an_evicting_server_naming_the_policy_and_the_fix(
    own: redis.Redis, own_server: RedisServer, policy: str,
) -> None:
    own.config_set("maxmemory", 64 * 1024 * 1024)
    own.config_set("maxmemory-policy", policy)
    code, checks = doctor(own_server.url)
    assert code == 1
    assert checks["eviction"]["ok"] is False
    assert f"maxmemory-policy is {policy}" in str(checks["eviction"]["detail"])
    assert "noeviction" in str(checks["eviction"]["fix"])
    result = CliRunner().invoke(main, ["--url", own_server.url, "doctor"])  # the table
    assert result.exit_code == 1 and "PROBLEM" in result.output


def test_first_use_warns_once_per_process_when_the_server_may_evict(
    own: redis.Redis, own_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    own.config_set("maxmemory", 64 * 1024 * 1024)
    own.config_set("maxmemory-policy", "allkeys-lru")
    monkeypatch.setattr(server_checks, "_checked", set())
    dedup = Deduplicator(RedisStore(own))
    other = Deduplicator(RedisStore(redis.Redis.from_url(own_server.url)))  # same server
    policy = Policy(ttl=60)
    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        for i in range(3):
            dedup.gate("t", policy, dedup.identity("t", policy, (i,)), f"id-{i}")
            other.gate("t", policy, other.identity("t", policy, (i,)), f"other-{i}")
    warnings = [r.getMessage() for r in caplog.records if "may evict locks" in r.getMessage()]
    assert len(warnings) == 1
    assert "maxmemory-policy is allkeys-lru" in warnings[0]
    assert "noeviction" in warnings[0]


def test_first_use_is_silent_on_a_server_that_never_evicts(
    own: redis.Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(server_checks, "_checked", set())
    dedup = Deduplicator(RedisStore(own))
    policy = Policy(ttl=60)
    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        dedup.gate("t", policy, dedup.identity("t", policy, (1,)), "id-1")
    assert not [r for r in caplog.records if "may evict" in r.getMessage()]


def test_doctor_reports_a_user_without_scripts_or_without_the_prefix(
    own: redis.Redis, own_server: RedisServer,
) -> None:
    host_port = own_server.url.split("://", 1)[1]
    own.execute_command("ACL", "SETUSER", "noscripts", "on", ">pw", "~taskdedup:*",
                        "+@all", "-eval", "-evalsha")
    own.execute_command("ACL", "SETUSER", "narrow", "on", ">pw", "~other:*", "+@all")
    code, checks = doctor(f"redis://noscripts:pw@{host_port}")
    assert code == 1 and checks["scripts"]["ok"] is False
    assert "+eval" in str(checks["scripts"]["fix"])
    code, checks = doctor(f"redis://narrow:pw@{host_port}")
    assert code == 1 and checks["scripts"]["ok"] is True and checks["acl"]["ok"] is False
    assert "~taskdedup:*" in str(checks["acl"]["fix"])


def test_doctor_names_the_commands_of_the_rule_a_user_lacks_beyond_the_scripts(
    own: redis.Redis, own_server: RedisServer,
) -> None:
    """The rule the docs used to give: every script ran, but the stats flush (HINCRBY) and
    the operators' tools (HGETALL, TYPE, MULTI/EXEC) were refused, and doctor said nothing."""
    host_port = own_server.url.split("://", 1)[1]
    own.execute_command(*(
        "ACL SETUSER oldrule on >pw resetkeys ~taskdedup:* -@all +evalsha +eval +get +set "
        "+pttl +pexpire +del +script|load +scan +time +getbit +setbit +bitfield +exists "
        "+pexpireat +bitcount +strlen +ping +info"
    ).split())
    try:
        code, checks = doctor(f"redis://oldrule:pw@{host_port}")
        assert code == 1 and checks["commands"]["ok"] is False
        assert checks["scripts"]["ok"] and checks["acl"]["ok"] and checks["windows"]["ok"]
        for name in ("hincrby", "hgetall", "type", "multi", "exec"):
            assert name in str(checks["commands"]["detail"])
            assert f"+{name}" in str(checks["commands"]["fix"])
        assert "the stats flush" in str(checks["commands"]["detail"])
    finally:
        own.execute_command("ACL", "DELUSER", "oldrule")


def test_an_rq_worker_checks_the_server_before_it_forks_work_horses(
    own: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``rq worker`` forks a work-horse per job: the once-per-process check runs in the
    worker's own process, so no work-horse spends a round trip on INFO (before: one per job,
    0.66x of plain RQ's throughput instead of 0.92x)."""
    from taskdedup.rq import DedupWorker

    calls: list[str] = []
    monkeypatch.setattr(server_checks, "warn_once",
                        lambda client, where: calls.append(where))
    worker = DedupWorker(["doctor-q"], connection=own)
    assert calls and worker.dedup._store_checked  # what every forked work-horse inherits
    policy = Policy(ttl=60)
    worker.dedup.gate("t", policy, worker.dedup.identity("t", policy, (1,)), "id-1")
    assert len(calls) == 1


def test_doctor_names_the_window_commands_a_user_lacks_a_problem_only_where_windows_are_used(
    own: redis.Redis, own_server: RedisServer,
) -> None:
    """Approximate windows run GETBIT/SETBIT/BITFIELD/EXISTS/PEXPIREAT inside their scripts
    (an ACL applies there too) and BITCOUNT/STRLEN for their stats: a user without them
    passes the lock checks, then every windowed call fails at completion."""
    host_port = own_server.url.split("://", 1)[1]
    own.execute_command("ACL", "SETUSER", "nobits", "on", ">pw", "~taskdedup:*", "+@all",
                        "-setbit", "-bitfield", "-bitcount")
    url = f"redis://nobits:pw@{host_port}"
    code, checks = doctor(url)  # no window in use yet: said, but not a failure
    assert code == 0 and checks["windows"]["ok"] is True
    assert checks["windows"]["status"] == "not in use"  # the third state, named (#24)
    assert {c["status"] for n, c in checks.items() if n != "windows"} == {"ok"}
    table = CliRunner().invoke(main, ["--url", url, "doctor"], terminal_width=200).output
    row = next(line for line in table.splitlines() if "windows" in line)
    assert row.split("│")[2].strip() == "not in use", row
    header = next(line for line in table.splitlines() if "check" in line)
    assert header.replace("┃", "│").split("│")[2].strip() == "status", header
    assert "setbit, bitfield, bitcount" in str(checks["windows"]["detail"])
    assert "+setbit +bitfield +bitcount" in str(checks["windows"]["fix"])
    own.set("taskdedup:bloom:app.charge:{5f1c09e2.0}:2880123", b"\0" * 16)  # a window's slice
    code, checks = doctor(url)
    assert code == 1 and checks["windows"]["ok"] is False
    assert checks["windows"]["status"] == "PROBLEM"
    assert checks["acl"]["ok"] is True and checks["scripts"]["ok"] is True
    assert own.keys("taskdedup:bloom:doctor:*") == []  # the probe bitmap never stays
    code, checks = doctor(own_server.url)  # the default user may run them all
    assert code == 0 and "permitted" in str(checks["windows"]["detail"])


def test_doctor_reports_copies_of_running_messages_the_workers_put_off(
    own: redis.Redis, own_server: RedisServer
) -> None:
    """#19 A1: where it can tell — the workers' flushed counts show copies put off (kombu
    restores held ETA messages every visibility_timeout): a problem naming the task and the
    fix. An odd field written by someone else is ignored."""
    own.hset("taskdedup:stats:app.remind", mapping={"deferred": 7, "claimed": 3})
    own.hset("taskdedup:stats:app.other", mapping={"deferred": "not a number"})
    code, checks = doctor(own_server.url)
    assert code == 1
    copies = checks["copies"]
    assert not copies["ok"] and "app.remind (7)" in str(copies["detail"])
    assert "app.other" not in str(copies["detail"])
    assert "visibility_timeout" in str(copies["fix"])


def test_doctor_says_which_workers_use_the_reliable_fetch_and_reports_orphaned_messages(
    own: redis.Redis, own_server: RedisServer
) -> None:
    """SPEC §17: the processing lists' registry (taskdedup.processing) names the workers on the
    reliable fetch; messages held by a worker whose lease lapsed are a problem until a live
    worker puts them back. An entry that is not JSON is shown as it can be."""
    from taskdedup import processing

    code, checks = doctor(own_server.url)
    assert code == 0 and "no worker uses the reliable fetch" in checks["fetch"]["detail"]
    owners = processing.owners_key("taskdedup")
    live, dead, odd = "w1@host/11/aaaa", "w2@host/22/bbbb", "w3\x1b/33/cccc"
    own.hset(owners, mapping={live: '{"worker": "w1@host", "pid": 11, "lease_ms": 30000}',
                              dead: '{"worker": "w2@host", "pid": 22, "lease_ms": 30000}',
                              odd: "not json"})
    own.set(processing.lease_key("taskdedup", live), "1", px=30_000)
    own.set(processing.lease_key("taskdedup", odd), "1", px=30_000)
    for owner, count in ((live, 2), (dead, 3)):
        own.sadd(processing.sources_key("taskdedup", owner), "celery")
        own.rpush(processing.list_key("taskdedup", owner, "celery"), *range(count))
    code, checks = doctor(own_server.url)
    fetch = checks["fetch"]
    assert code == 1 and fetch["ok"] is False
    assert "2 worker(s) use the reliable fetch: w1@host (pid 11, 2 held)" in fetch["detail"]
    assert "3 message(s) wait in the processing lists of w2@host (pid 22, 3 held)" in (
        fetch["detail"])
    assert "taskdedup_reliable_fetch" in fetch["fix"]
    own.delete(processing.list_key("taskdedup", dead, "celery"))  # put back by a live worker
    code, checks = doctor(own_server.url)
    assert code == 0 and checks["fetch"]["ok"] is True
