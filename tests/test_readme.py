"""The README's quick starts run as written (only the Redis address is swapped for the test
server's), so they cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _block(after_heading: str) -> str:
    section = README.split(f"## {after_heading}", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python block under {after_heading!r}"
    return match.group(1)


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
