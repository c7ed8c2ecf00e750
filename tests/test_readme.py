"""The README's quick starts run as written (only the Redis address is swapped for the test
server's), so they cannot rot. ``_block`` also serves the tests that run the code of a page
under docs/ (tests/test_sql_docs.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _block(after_heading: str, path: Path = README) -> str:
    """The first python block after the heading ``after_heading`` (any level) in ``path``."""
    text = path.read_text()
    match = re.search(rf"^#+ {re.escape(after_heading)}\n(.*)", text, re.M | re.S)
    assert match, f"no heading {after_heading!r} in {path.name}"
    block = re.search(r"```python\n(.*?)```", match.group(1), re.S)
    assert block, f"no python block under {after_heading!r} in {path.name}"
    return block.group(1)


def test_celery_quick_start_runs(redis_url: str, redis_client: redis.Redis) -> None:
    code = _block("Quick start: Celery").replace("redis://127.0.0.1:6379/0", redis_url)
    assert redis_url in code
    namespace: dict[str, object] = {"__name__": "readme_celery"}
    exec(compile(code, "README.md (Celery)", "exec"), namespace)  # asserts inside
    client = redis_client
    assert client.llen("celery") == 3  # first call, the dedup_key call, the dedup=False call


@pytest.mark.parametrize("heading", ["Quick start: RQ"])
def test_rq_quick_start_runs(redis_url: str, redis_client: redis.Redis, heading: str) -> None:
    code = _block(heading).replace("Redis()", f"Redis.from_url({redis_url!r})")
    assert redis_url in code
    namespace: dict[str, object] = {"__name__": "readme_rq"}
    exec(compile(code, "README.md (RQ)", "exec"), namespace)  # asserts inside
    client = redis_client
    assert client.llen("rq:queue:emails") == 2  # the first call and the dedup_key call
    assert client.zcard("rq:scheduled:emails") == 1  # enqueue_in
