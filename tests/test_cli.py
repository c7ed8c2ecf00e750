"""The ``taskdedup`` command with click's CliRunner, against real lock keys made by a
Deduplicator on the session's Redis server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import click
import pytest
import redis
from celery import Celery
from click.testing import CliRunner, Result

import taskdedup.cli as cli
from taskdedup import Deduplicator, MemoryStore, Policy, RedisStore, fingerprint
from taskdedup.celery import DedupTask
from taskdedup.cli import main
from taskdedup.identity import fingerprint_value
from taskdedup.stats import attach
from taskdedup.testing import free_port

NEVER = 3600.0


# -- call targets for `key --func` ---------------------------------------------------------------


def charge(user_id: int, amount: int = 5) -> None:
    """A plain task function (RQ style)."""


celery_app = Celery("cli-test", broker="memory://")
celery_app.conf.taskdedup_store = MemoryStore()
celery_app.finalize()


@celery_app.task(base=DedupTask, shared=False, name="cli.charge",
                 dedup=Policy(include=["user_id"], scope="t9"))
def celery_charge(user_id: int, amount: int = 5) -> None:
    """A Celery DedupTask whose policy (include, scope) `key --func` must apply."""


@click.command("demo")
def fake_demo() -> None:
    click.echo("demo ran")


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
def dedup(redis_url: str, redis_client: redis.Redis) -> Iterator[Deduplicator]:
    """A Deduplicator on a flushed database (``redis_client`` flushes it)."""
    d = Deduplicator(RedisStore.from_url(redis_url))
    yield d
    d.store.close()  # type: ignore[attr-defined]


@pytest.fixture
def locks(dedup: Deduplicator) -> Iterator[dict[str, str]]:
    """Four real locks: two of app.charge (queued, running), one scoped app.mail (done) and
    an app.refund reserved with an explicit idempotency key (check set)."""
    policy, scoped = Policy(), Policy(scope="t1")
    c1 = dedup.identity("app.charge", policy, (1, 5))
    c2 = dedup.identity("app.charge", policy, (2, 5))
    m1 = dedup.identity("app.mail", scoped, ("welcome",))
    r1 = dedup.identity("app.refund", policy, (7,), dedup_key="ORD-9")
    dedup.gate("app.charge", policy, c1, "id-c1")
    dedup.gate("app.charge", policy, c2, "id-c2")
    dedup.start("app.charge", policy, c2.key, "id-c2")
    dedup.gate("app.mail", scoped, m1, "id-m1")
    dedup.start("app.mail", scoped, m1.key, "id-m1")
    dedup.finish("app.mail", scoped, m1.key, "id-m1", success=True)
    dedup.gate("app.refund", policy, r1, "id-r1")
    yield {"c1": c1.key, "c2": c2.key, "m1": m1.key, "r1": r1.key}
    dedup.stop_heartbeat(c2.key, "id-c2")


@pytest.fixture
def run(redis_url: str) -> Any:
    runner = CliRunner()

    def invoke(*args: str, input: str | None = None, url: str | None = redis_url) -> Result:
        argv = ["--url", url, *args] if url else list(args)
        return runner.invoke(main, argv, input=input, catch_exceptions=False)

    return invoke


def as_json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def flushed_stats(dedup: Deduplicator) -> None:
    """Record a known history in the stats hashes: app.charge 3 accepted, 1 duplicate, one
    skipped execution, one failure, one lost lease; app.mail 1 accepted."""
    rec = attach(dedup, interval=NEVER)
    assert rec is not None
    policy = Policy()
    ids = [dedup.identity("app.charge", policy, (n,)) for n in range(3)]
    for n, identity in enumerate(ids):
        dedup.gate("app.charge", policy, identity, f"s-{n}")
    dedup.gate("app.charge", policy, ids[0], "s-dup")
    dedup.start("app.charge", policy, ids[0].key, "s-other")  # held by s-0: skipped
    dedup.start("app.charge", policy, ids[1].key, "s-1")
    dedup.finish("app.charge", policy, ids[1].key, "s-1", success=False)
    dedup.start("app.charge", policy, ids[2].key, "s-2")
    dedup.store.release(ids[2].key, "s-2")  # the lock is gone before completion
    dedup.finish("app.charge", policy, ids[2].key, "s-2", success=True)  # lease_lost
    mail = dedup.identity("app.mail", policy, ("x",))
    dedup.gate("app.mail", policy, mail, "s-m")
    assert rec.flush()
    rec.close(flush=False)


# -- key -----------------------------------------------------------------------------------------


def test_key_prints_the_digest_and_full_key_of_a_call(run: Any) -> None:
    data = as_json(run("key", "app.charge", "42", "ORD-7", "--kw", "amount=5", "--unbound",
                       "--json"))
    digest = fingerprint("app.charge", [42, "ORD-7"], {"amount": 5})
    assert data["digest"] == digest
    assert data["key"] == f"taskdedup:app.charge:{digest}"
    assert data["identity_from"] == "arguments"
    table = run("key", "app.charge", "42", "ORD-7", "--kw", "amount=5", "--unbound")
    assert table.exit_code == 0
    assert f"taskdedup:app.charge:{digest}" in table.stdout


def test_key_values_are_json_when_they_parse_else_strings(run: Any) -> None:
    parsed = as_json(run("key", "t", "42", "true", "null", "[1, 2]", "ORD-7", "--unbound",
                         "--json"))
    assert parsed["digest"] == fingerprint("t", [42, True, None, [1, 2], "ORD-7"])
    quoted = as_json(run("key", "t", '"42"', "--unbound", "--json"))
    assert quoted["digest"] == fingerprint("t", ["42"])
    from_json = as_json(run("key", "t", "--json-args", '[42, "x"]', "--json-kwargs",
                            '{"a": {"b": 1}}', "--unbound", "--json"))
    assert from_json["digest"] == fingerprint("t", [42, "x"], {"a": {"b": 1}})


def test_key_with_func_binds_arguments_to_its_signature(run: Any) -> None:
    func = "tests.test_cli:charge"
    positional = as_json(run("key", "app.charge", "42", "--func", func, "--json"))
    keywords = as_json(run("key", "app.charge", "--kw", "user_id=42", "--kw", "amount=5",
                           "--func", func, "--json"))
    assert positional["digest"] == keywords["digest"] == fingerprint(
        "app.charge", (42,), func=charge
    )


def test_key_with_a_celery_dedup_task_uses_its_policy(run: Any) -> None:
    data = as_json(run("key", "cli.charge", "42", "7", "--func", "tests.test_cli:celery_charge",
                       "--json"))
    digest = fingerprint("cli.charge", (42, 7), func=charge, include=["user_id"], scope="t9")
    assert data["key"] == f"taskdedup:t9:cli.charge:{digest}"
    assert data["digest"] == fingerprint("cli.charge", (42, 99), func=charge,
                                         include=["user_id"], scope="t9")  # amount excluded


def test_key_with_scope_and_dedup_key(run: Any) -> None:
    data = as_json(run("--prefix", "pfx", "key", "app.refund", "7", "--scope", "t1",
                       "--dedup-key", "ORD-9", "--json"))
    digest = fingerprint_value("app.refund", "ORD-9", scope="t1")
    assert data["key"] == f"pfx:t1:app.refund:{digest}"
    assert data["identity_from"] == "dedup_key"
    assert data["check"] == fingerprint("app.refund", [7], scope="t1")


def test_key_finds_the_task_by_its_dotted_name_as_the_producer_binds_it(run: Any) -> None:
    # the operating guide's form: no --func; positional arguments bind to the parameters'
    # names and defaults apply, as at the producer
    by_name = as_json(run("key", "tests.test_cli.charge", "42", "--json"))
    assert by_name["digest"] == fingerprint("tests.test_cli.charge", (42,), func=charge)
    assert by_name["digest"] != fingerprint("tests.test_cli.charge", [42])  # the unbound key


def test_key_finds_a_celery_task_through_the_app(run: Any, monkeypatch: Any) -> None:
    data = as_json(run("key", "cli.charge", "42", "7", "-A", "tests.test_cli:celery_app",
                       "--json"))
    digest = fingerprint("cli.charge", (42, 7), func=charge, include=["user_id"], scope="t9")
    assert data["key"] == f"taskdedup:t9:cli.charge:{digest}"
    monkeypatch.setenv("CELERY_APP", "tests.test_cli:celery_app")
    assert as_json(run("key", "cli.charge", "42", "7", "--json"))["key"] == data["key"]
    unknown = run("key", "cli.nope", "1", "-A", "tests.test_cli:celery_app")
    assert unknown.exit_code == 1 and "is not a task of the Celery app" in unknown.stderr


def test_key_refuses_a_task_it_cannot_find_instead_of_printing_a_wrong_key(run: Any) -> None:
    result = run("key", "payments.charge", "ORD-789", "5000")
    assert result.exit_code == 1
    assert "--func" in result.stderr and "--unbound" in result.stderr
    assert "taskdedup:" not in result.stdout
    # an explicit idempotency key does not need the signature
    assert run("key", "payments.charge", "ORD-789", "--dedup-key", "K").exit_code == 0


def test_key_refuses_arguments_without_identity_in_one_line(run: Any) -> None:
    result = run("key", "t", "--json-args", "[1, NaN]", "--unbound")
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "args[1]" in result.stderr
    both = run("key", "t", "1", "--json-args", "[1]", "--unbound")
    assert both.exit_code == 1 and "not both" in both.stderr


def test_key_needs_no_redis(run: Any) -> None:
    result = run("key", "t", "1", "--unbound", "--json", url=None)
    assert result.exit_code == 0, result.output


# -- inspect -------------------------------------------------------------------------------------


def test_inspect_shows_state_owner_ttl_and_check(run: Any, locks: dict[str, str]) -> None:
    running = as_json(run("inspect", locks["c2"], "--json"))
    assert running["exists"] is True
    assert (running["task"], running["state"], running["owner"]) == ("app.charge", "running",
                                                                    "id-c2")
    assert 0 < running["ttl_ms"] <= 60_000
    assert running["idempotency_check"] is False
    done = as_json(run("inspect", locks["m1"], "--json"))
    assert (done["task"], done["scope"], done["state"], done["owner"]) == ("app.mail", "t1",
                                                                          "done", "id-m1")
    refund = as_json(run("inspect", locks["r1"], "--json"))
    assert (refund["state"], refund["idempotency_check"]) == ("queued", True)

    by_digest = as_json(run("inspect", "app.charge", locks["c1"].rsplit(":", 1)[1], "--json"))
    assert (by_digest["key"], by_digest["owner"]) == (locks["c1"], "id-c1")
    table = run("inspect", locks["c2"])
    assert table.exit_code == 0
    for word in ("running", "id-c2", "not set"):
        assert word in table.stdout


def test_inspect_says_clearly_when_the_lock_is_absent(run: Any, locks: dict[str, str]) -> None:
    absent = "taskdedup:app.charge:" + "0" * 32
    result = run("inspect", absent)
    assert result.exit_code == 0
    assert f"no lock at {absent}" in result.stdout
    assert as_json(run("inspect", absent, "--json")) == {"key": absent, "exists": False}
    not_a_key = run("inspect", "app.charge")
    assert not_a_key.exit_code == 1 and "not a lock key" in not_a_key.stderr


# -- list ----------------------------------------------------------------------------------------


def test_list_shows_every_lock_and_skips_stats_keys(
    run: Any, dedup: Deduplicator, locks: dict[str, str]
) -> None:
    flushed_stats(dedup)  # adds stats hashes and more locks of app.charge / app.mail
    rows = as_json(run("list", "--limit", "0", "--json"))
    keys = {row["key"] for row in rows}
    assert set(locks.values()) <= keys
    assert not any(":stats:" in key for key in keys)
    assert set(rows[0]) == {"key", "task", "scope", "digest", "state", "owner", "ttl_ms",
                            "idempotency_check"}
    table = run("list")
    assert table.exit_code == 0
    for key in locks.values():
        assert key in table.stdout


def test_list_filters_by_task_state_and_limit(run: Any, locks: dict[str, str]) -> None:
    charge_rows = as_json(run("list", "--task", "app.charge", "--json"))
    assert {r["key"] for r in charge_rows} == {locks["c1"], locks["c2"]}
    running = as_json(run("list", "--task", "app.charge", "--state", "running", "--json"))
    assert [(r["key"], r["owner"]) for r in running] == [(locks["c2"], "id-c2")]
    scoped = as_json(run("list", "--task", "app.mail", "--scope", "t1", "--json"))
    assert [(r["scope"], r["state"]) for r in scoped] == [("t1", "done")]
    assert as_json(run("list", "--task", "app.mail", "--json")) == []  # exactly that name
    assert "need --scope" in run("list", "--task", "app.mail").stdout
    assert len(as_json(run("list", "--limit", "2", "--json"))) == 2
    truncated = run("list", "--limit", "1")
    assert "--limit 0 shows all" in truncated.stdout
    nothing = run("list", "--task", "app.none")
    assert nothing.exit_code == 0 and "no locks" in nothing.stdout


def test_list_uses_scan_and_never_keys(
    run: Any, redis_client: redis.Redis, locks: dict[str, str]
) -> None:
    def calls(command: str) -> int:
        stats: dict[str, Any] = redis_client.info("commandstats")
        return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))

    keys_before, scan_before = calls("keys"), calls("scan")
    assert len(as_json(run("list", "--json"))) == 4
    assert run("list", "--task", "app.charge").exit_code == 0
    assert calls("keys") == keys_before
    assert calls("scan") > scan_before


# -- clear ---------------------------------------------------------------------------------------


def test_clear_asks_for_confirmation(run: Any, redis_client: redis.Redis,
                                     locks: dict[str, str]) -> None:
    declined = run("clear", "--task", "app.charge", input="n\n")
    assert declined.exit_code == 1
    assert "Delete every lock of task 'app.charge'" in declined.stdout
    assert redis_client.exists(locks["c1"], locks["c2"]) == 2
    accepted = run("clear", "--task", "app.charge", input="y\n")
    assert accepted.exit_code == 0
    assert "deleted 2 locks" in accepted.stdout
    assert redis_client.exists(locks["c1"], locks["c2"]) == 0


def test_clear_yes_skips_confirmation_and_deletes_only_matching_locks(
    run: Any, redis_client: redis.Redis, dedup: Deduplicator, locks: dict[str, str]
) -> None:
    flushed_stats(dedup)
    before = {k.decode() for k in redis_client.scan_iter(match="taskdedup:*")}
    result = run("clear", "--task", "app.mail", "--yes")
    assert result.exit_code == 0
    assert "?" not in result.stdout  # no prompt
    after = {k.decode() for k in redis_client.scan_iter(match="taskdedup:*")}
    gone = before - after
    assert len(gone) == 1 and locks["m1"] not in gone  # the unscoped lock only
    assert all(key.startswith("taskdedup:app.mail:") for key in gone)
    assert "deleted 1 lock" in result.stdout
    scoped = run("clear", "--task", "app.mail", "--scope", "t1", "--yes")
    assert "deleted 1 lock" in scoped.stdout and not redis_client.exists(locks["m1"])

    one = run("clear", "--key", locks["c1"], "--yes")
    assert "deleted 1 lock" in one.stdout
    assert not redis_client.exists(locks["c1"])
    assert redis_client.exists(locks["c2"])

    everything = run("clear", "--all", "--yes")
    assert everything.exit_code == 0
    left = {k.decode() for k in redis_client.scan_iter(match="taskdedup:*")}
    # every lock gone, the stats kept (a stats flush of an earlier test's deduplicator in
    # this process may add its own task's counters: stats, not locks)
    assert {k for k in left if not k.startswith("taskdedup:stats:")} == set()
    assert {"taskdedup:stats:app.charge", "taskdedup:stats:app.mail"} <= left


def test_clear_refuses_to_run_with_nothing_or_too_much_selected(
    run: Any, redis_client: redis.Redis, locks: dict[str, str]
) -> None:
    nothing = run("clear", "--yes")
    assert nothing.exit_code == 1
    assert nothing.stderr.strip() == (
        "Error: nothing selected: pass --key KEY, --task TASK or --all"
    )
    both = run("clear", "--all", "--task", "app.charge", "--yes")
    assert both.exit_code == 1 and "only one of" in both.stderr
    assert redis_client.exists(*locks.values()) == 4


# -- stats ---------------------------------------------------------------------------------------


def test_stats_shows_the_per_task_figures(run: Any, dedup: Deduplicator) -> None:
    flushed_stats(dedup)
    data = as_json(run("stats", "--json"))
    charge = data["app.charge"]
    assert {k: charge[k] for k in ("accepted", "duplicates", "skipped", "released_on_failure",
                                   "lease_lost", "store_errors")} == {
        "accepted": 3, "duplicates": 1, "skipped": 1, "released_on_failure": 1,
        "lease_lost": 1, "store_errors": 0,
    }
    assert charge["duplicate_rate"] == pytest.approx(0.25)
    assert charge["gate"]["count"] == 4
    assert data["app.mail"]["accepted"] == 1
    only = as_json(run("stats", "--task", "app.mail", "--json"))
    assert list(only) == ["app.mail"]
    table = run("stats")
    assert table.exit_code == 0
    assert "app.charge" in table.stdout and "25.0%" in table.stdout


def test_stats_without_any_says_so(run: Any, redis_client: redis.Redis) -> None:
    result = run("stats")
    assert result.exit_code == 0 and "no stats" in result.stdout
    assert as_json(run("stats", "--json")) == {}


def test_stats_watch_refreshes_until_ctrl_c(
    run: Any, dedup: Deduplicator, monkeypatch: pytest.MonkeyPatch
) -> None:
    flushed_stats(dedup)
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 1:  # between the two reads: one more accepted enqueue
            dedup.store.client.hincrby("taskdedup:stats:app.mail", "reserved", 1)  # type: ignore[attr-defined]
            return
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_pause", pause)
    lines = run("stats", "--watch", "0.5", "--json")
    assert lines.exit_code == 0
    frames = [json.loads(line) for line in lines.stdout.splitlines()]
    assert [f["tasks"]["app.mail"]["accepted"] for f in frames] == [1, 2]
    assert pauses == [0.5, 0.5]

    pauses.clear()
    live = run("stats", "--watch")
    assert live.exit_code == 0
    assert "app.mail" in live.stdout
    assert pauses == [2.0, 2.0]  # --watch alone: every 2 s


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ("list",), ("inspect", "taskdedup:t:" + "0" * 32), ("clear", "--all"), ("stats",),
])
def test_redis_down_is_one_line_on_stderr_and_exit_code_1(run: Any, args: tuple[str, ...]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = run(*args, url=url)
    assert result.exit_code == 1
    assert result.stderr == f"Error: cannot reach Redis at {url}: Connection refused\n"
    assert result.stdout == ""


def test_no_url_is_a_clear_error(run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TASKDEDUP_URL", raising=False)
    result = run("list", url=None)
    assert result.exit_code == 1
    assert result.stderr == "Error: no Redis URL: pass --url or set TASKDEDUP_URL\n"


def test_url_from_the_environment(run: Any, redis_url: str, locks: dict[str, str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKDEDUP_URL", redis_url)
    assert len(as_json(run("list", "--json", url=None))) == 4


def test_a_permission_error_is_reported_not_mistaken_for_no_locks(
    run: Any, redis_url: str, redis_client: redis.Redis, locks: dict[str, str]
) -> None:
    user = "taskdedup-cli-noget"
    redis_client.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"],
                             commands=["+@all", "-get"])
    try:
        url = redis_url.replace("redis://", f"redis://{user}:pw@")
        result = run("list", url=url)
        assert result.exit_code == 1
        assert result.stderr.count("\n") == 1
        assert "lacks a permission" in result.stderr and "'get'" in result.stderr
    finally:
        redis_client.acl_deluser(user)


def test_password_is_not_printed(run: Any) -> None:
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    result = run("list", url=url)
    assert result.exit_code == 1
    assert "s3cret" not in result.stderr and "***" in result.stderr


# -- the command itself --------------------------------------------------------------------------


def test_python_m_taskdedup_runs_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "taskdedup", "key", "app.charge", "42", "--unbound", "--json"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["digest"] == fingerprint("app.charge", [42])


def test_demo_is_loaded_lazily_from_its_module(run: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.LAZY_COMMANDS["demo"] == "taskdedup.demo:demo"
    monkeypatch.setitem(cli.LAZY_COMMANDS, "demo", "tests.test_cli:fake_demo")
    assert "demo" in run("--help").stdout
    result = run("demo")
    assert result.exit_code == 0 and result.stdout == "demo ran\n"


def _commands(group: click.Group, ctx: click.Context) -> Iterator[tuple[str, click.Command]]:
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        yield name, command
        if isinstance(command, click.Group):
            yield from _commands(command, click.Context(command, parent=ctx, info_name=name))


def test_the_top_level_help_gives_each_command_one_whole_plain_line_examples_and_the_docs(
) -> None:
    """#24 stumble 13: click cut each summary mid-sentence ('Delete locks (SCAN + DEL in
    batches), so their identities can...') and spent it on how, not what."""
    out = CliRunner().invoke(main, ["--help"], terminal_width=80).stdout
    listed = out.split("Commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    names = [line.split()[0] for line in listed]
    assert names == sorted(cli.SUMMARIES) == main.list_commands(click.Context(main))
    for line in listed:
        assert line.endswith(".") and "..." not in line, line
        assert not {"SCAN", "pipelined", "DEL", "Lua"} & set(line.replace("(", " ").split())
    assert "Examples:\n    taskdedup --url redis://" in out  # kept as written, not rewrapped
    assert "docs/reference/cli.md" in out


def test_every_option_says_what_it_is_and_no_command_repeats_the_global_url() -> None:
    """#24 stumble 14: `web --port` had no help, `web` listed a second --url, `demo --url`
    showed TEXT where the others show URL, `stats` said "failures" for its column
    `released (failure)`."""
    ctx = click.Context(main, info_name="taskdedup")
    for name, command in _commands(main, ctx):
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.help, f"{name} {param.opts}"
                if name in ("web", "demo") and "--url" in param.opts:  # a Redis URL
                    assert param.metavar == "URL", name
    for name in ("web", "demo"):
        out = CliRunner().invoke(main, [name, "--help"], terminal_width=80).stdout
        assert ("--url" in out.split("Options:")[1]) is (name == "demo"), name
        assert "TEXT" not in out.split("--url", 1)[-1].split("\n")[0]
    stats = CliRunner().invoke(main, ["stats", "--help"], terminal_width=200).stdout
    assert "failures" not in stats and "released on failure" in stats.split("\n\n")[1]


# -- input written by someone else (SPEC §8: input is not trusted) -------------------------------

LOCK_VALUE = "Q||id-odd"  # a well-formed queued lock value (state, no check, owner)


def test_clear_task_deletes_exactly_that_tasks_locks_never_a_scoped_or_longer_name(
    run: Any, redis_client: redis.Redis,
) -> None:
    digest = "1" * 32
    keys = {
        "charge": f"taskdedup:charge:{digest}",
        "billing:charge": f"taskdedup:billing:charge:{digest}",  # scope billing (or a task)
        "charge:v2": f"taskdedup:charge:v2:{digest}",
        "xcharge": f"taskdedup:xcharge:{digest}",
        "approximate": f"taskdedup:charge:{{0badcafe.3}}{digest}",
        "a?c": f"taskdedup:a?c:{digest}",
        "abc": f"taskdedup:abc:{digest}",
    }
    for key in keys.values():
        redis_client.set(key, LOCK_VALUE)
    listed = as_json(run("list", "--task", "charge", "--json"))
    assert {row["key"] for row in listed} == {keys["charge"], keys["approximate"]}
    result = run("clear", "--task", "charge", "--yes")
    assert result.exit_code == 0 and "deleted 2 locks" in result.stdout
    assert not redis_client.exists(keys["charge"]) and not redis_client.exists(keys["approximate"])
    assert redis_client.exists(keys["billing:charge"], keys["charge:v2"], keys["xcharge"]) == 3
    scoped = run("clear", "--task", "charge", "--scope", "billing", "--yes")
    assert "deleted 1 lock" in scoped.stdout and not redis_client.exists(keys["billing:charge"])
    assert redis_client.exists(keys["charge:v2"])
    assert "deleted 1 lock" in run("clear", "--task", "a?c", "--yes").stdout  # glob escaped
    assert redis_client.exists(keys["abc"]) and not redis_client.exists(keys["a?c"])
    alone = run("clear", "--scope", "billing", "--yes")
    assert alone.exit_code == 1 and "--scope needs --task" in alone.stderr


def test_clear_key_refuses_a_key_outside_the_prefix_like_inspect(
    run: Any, redis_client: redis.Redis,
) -> None:
    redis_client.set("elsewhere:app:" + "0" * 32, LOCK_VALUE)  # a lock-like value elsewhere
    redis_client.set("taskdedupx:app:" + "0" * 32, LOCK_VALUE)
    for key in ("elsewhere:app:" + "0" * 32, "taskdedupx:app:" + "0" * 32):
        refused = run("clear", "--key", key, "--yes")
        assert refused.exit_code == 1 and "not a lock key" in refused.stderr
        assert redis_client.exists(key)
        assert "not a lock key" in run("inspect", key).stderr


def test_a_non_utf8_key_under_the_prefix_breaks_neither_list_nor_clear_all(
    run: Any, redis_client: redis.Redis, locks: dict[str, str],
) -> None:
    odd = b"taskdedup:app.\xff\xfe:" + b"2" * 32
    redis_client.set(odd, LOCK_VALUE)
    rows = as_json(run("list", "--limit", "0", "--json"))
    assert set(locks.values()) < {row["key"] for row in rows}
    shown = [row for row in rows if row["owner"] == "id-odd"]
    assert len(shown) == 1 and "\\xff\\xfe" in shown[0]["key"]  # escaped, not raw bytes
    table = run("list", "--limit", "0")
    assert table.exit_code == 0 and "app.\\xff\\xfe" in table.stdout
    assert locks["c1"] in table.stdout
    cleared = run("clear", "--all", "--yes")
    assert cleared.exit_code == 0 and "deleted 5 locks" in cleared.stdout
    assert redis_client.exists(odd, *locks.values()) == 0


def test_a_non_integer_stats_field_is_reported_and_the_rest_still_shown(
    run: Any, redis_client: redis.Redis, dedup: Deduplicator,
) -> None:
    flushed_stats(dedup)
    redis_client.hset("taskdedup:stats:app.charge", mapping={"reserved:odd": "many",
                                                             b"\xff\x1b": b"1"})
    redis_client.hset(b"taskdedup:stats:app.\xff", "reserved", "oops")
    data = as_json(run("stats", "--json"))
    assert data["app.charge"]["accepted"] == 3
    assert data["app.charge"]["ignored_fields"] == ["reserved:odd"]
    assert data["app.mail"]["accepted"] == 1
    table = run("stats")
    assert table.exit_code == 0 and "app.charge" in table.stdout and "25.0%" in table.stdout
    assert "not an integer" in table.stdout and "\x1b" not in table.stdout


def test_control_characters_and_markup_from_redis_are_printed_escaped(
    run: Any, redis_client: redis.Redis,
) -> None:
    task = "app.\x1b[31mred[/]\x07[bold]x"
    key = f"taskdedup:{task}:{'3' * 32}"
    redis_client.set(key, "R||owner-\x1b]0;pwned\x07-\x9b1m")
    redis_client.hset(f"taskdedup:stats:{task}", "reserved", 1)
    for args in (("list",), ("inspect", key), ("stats",), ("list", "--json"),
                 ("inspect", key, "--json"), ("stats", "--json")):
        result = run(*args)
        assert result.exit_code == 0, (args, result.output)
        out = result.stdout
        for raw in ("\x1b", "\x07", "\x9b"):
            assert raw not in out, (args, out)
        assert "[/]" in out and "[bold]" in out  # markup shown as text, not interpreted
        if "--json" not in args:
            assert "\\x1b" in out, (args, out)
