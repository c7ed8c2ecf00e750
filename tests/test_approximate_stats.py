"""Quality signals of approximate windows (SPEC §12): ``taskdedup stats`` and the Prometheus
collector read the live slices (fill, estimated false-positive rate, identities remembered,
slices dropped); nothing is read on the hot path."""

from __future__ import annotations

import json

import pytest
import redis
from click.testing import CliRunner

from taskdedup import Approximate, Deduplicator, Policy, RedisStore
from taskdedup.cli import main
from taskdedup.stats import read_windows
from tests.test_approximate import ServerClock

NAME = "tests.approx.stats"
WINDOW = Approximate(capacity=400, error_rate=0.01, slices=4, partitions=2)
POLICY = Policy(ttl=40, window=WINDOW)  # slices of 10 s


@pytest.fixture
def clock(redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> ServerClock:
    return ServerClock(redis_client, monkeypatch)


@pytest.fixture
def filled(redis_client: redis.Redis, clock: ServerClock) -> list[int]:
    """30, then 20 identities remembered in two consecutive slices (a fake server clock)."""
    dedup = Deduplicator(RedisStore(redis_client))
    counts = [30, 20]
    number = 0
    for count in counts:
        for _ in range(count):
            key = dedup.identity(NAME, POLICY, (number,)).key
            assert dedup.start(NAME, POLICY, key, f"t{number}").verdict.value == "accepted"
            dedup.finish(NAME, POLICY, key, f"t{number}", success=True)
            number += 1
        clock.advance(10)
    return counts


def test_read_windows_reports_fill_false_positives_identities_and_slices(
    redis_client: redis.Redis, filled: list[int]
) -> None:
    window = read_windows(redis_client)[NAME]
    assert window.identities == sum(filled)
    assert (window.partitions, window.slices, window.keys) == (2, 2, 4)
    assert (window.hashes, window.bits) == (WINDOW.hashes, WINDOW.bits)
    # fill and the estimate agree with the bits actually set
    bits = [int(redis_client.execute_command("BITCOUNT", k, 0, WINDOW.bits // 8 - 1))
            for k in redis_client.scan_iter(match="taskdedup:bloom:*")]
    assert window.fill == pytest.approx(sum(bits) / len(bits) / WINDOW.bits)
    assert 0 < window.fill_max <= 1 and window.fill <= window.fill_max
    assert 0 < window.false_positive_rate < 0.01  # below capacity: below error_rate
    assert window.slices_dropped == 0
    assert read_windows(redis_client, task="another.task") == {}


def test_slices_rotated_out_are_counted_as_dropped(
    redis_client: redis.Redis, filled: list[int], clock: ServerClock
) -> None:
    """The fixture filled slices i and i + 1; successes go on through slices i + 2 .. i + 6,
    one slice at a time. Slices i and i + 1 then leave the window (their keys, whose expiry
    is on the real clock, are removed as Redis would on the fake one)."""
    dedup = Deduplicator(RedisStore(redis_client))
    number = 100
    for step in range(2, 7):
        if step > 2:
            clock.advance(10)
        for _ in range(20):
            key = dedup.identity(NAME, POLICY, (number,)).key
            dedup.start(NAME, POLICY, key, f"t{number}")
            dedup.finish(NAME, POLICY, key, f"t{number}", success=True)
            number += 1
    probe_key = dedup.identity(NAME, POLICY, (0,)).key
    from taskdedup import approximate

    probe = approximate.probe(probe_key, WINDOW, POLICY.ttl_ms)
    assert probe is not None
    live_indexes = {k.rsplit(":", 1)[1] for k in probe.keys(clock.now_ms())}
    for key in list(redis_client.scan_iter(match="taskdedup:bloom:*")):
        if key.decode().rsplit(":", 1)[1] not in live_indexes:
            redis_client.delete(key)  # its life ended on the fake clock
    window = read_windows(redis_client)[NAME]
    assert window.slices == 5
    assert window.slices_dropped == 2


def test_stats_command_and_prometheus_show_the_window(
    redis_url: str, redis_client: redis.Redis, filled: list[int]
) -> None:
    result = CliRunner().invoke(main, ["--url", redis_url, "stats", "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)[NAME]["window"]
    assert shown["identities"] == 50 and shown["live_slices"] == 2
    assert 0 < shown["estimated_false_positive_rate"] < 0.01
    table = CliRunner().invoke(main, ["--url", redis_url, "stats"], catch_exceptions=False)
    assert "approximate windows" in table.stdout and NAME in table.stdout

    prometheus = pytest.importorskip("prometheus_client")
    from taskdedup.metrics import attach_windows

    registry = prometheus.CollectorRegistry()
    attach_windows(redis_client, registry=registry)
    assert registry.get_sample_value("taskdedup_window_identities", {"task": NAME}) == 50
    fpr = registry.get_sample_value("taskdedup_window_false_positive_rate", {"task": NAME})
    assert fpr == pytest.approx(shown["estimated_false_positive_rate"])
    assert registry.get_sample_value("taskdedup_window_slices_dropped", {"task": NAME}) == 0
    fill = registry.get_sample_value("taskdedup_window_fill_ratio", {"task": NAME})
    assert fill == pytest.approx(shown["fill_ratio"])
