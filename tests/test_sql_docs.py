"""The durable-tier example of docs/explanation/tiers.md runs as written (Redis address and
database path swapped for the test's; Celery in eager mode), and shows what the row adds to
the Redis window: a duplicate that gets past a lost lock finds the committed row and redoes
nothing."""

from __future__ import annotations

from pathlib import Path

import redis
import sqlalchemy as sa

from tests.test_readme import ROOT, _block

TIERS = ROOT / "docs" / "explanation" / "tiers.md"


def test_tiers_durable_example_charges_once_even_when_the_lock_is_lost(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    code = _block("The durable tier in one task", TIERS)
    db = tmp_path / "payments.db"
    code = code.replace("redis://127.0.0.1:6379/0", redis_url).replace(
        "sqlite:///payments.db", f"sqlite:///{db}")
    assert redis_url in code and str(db) in code
    namespace: dict[str, object] = {"__name__": "docs_tiers_sql"}
    exec(compile(code, "docs/explanation/tiers.md (durable tier)", "exec"), namespace)
    app, charge, engine, ledger = (namespace[n] for n in ("app", "charge", "engine", "ledger"))
    app.conf.update(task_always_eager=True, taskdedup_stats=False)
    try:
        first = charge.delay("ORD-789", 5000)
        assert first.get() == {"charged": 5000}
        redis_client.flushdb()  # the lock is lost (failover, eviction): Redis lets it through
        again = charge.delay("ORD-789", 5000)
        assert again.id != first.id and again.get() == {"charged": 5000}
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(ledger)).scalar() == 1
    finally:
        engine.dispose()
