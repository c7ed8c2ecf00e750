"""docs/how-to/migrate.md's worked example, run as a user copies it (#24 stumble 8): the
celery-once task it replaces raised ``AlreadyQueued`` on a duplicate, and so must the copy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from celery import Celery

from taskdedup import DuplicateTaskError, MemoryStore

PAGE = Path(__file__).resolve().parent.parent / "docs" / "how-to" / "migrate.md"


def test_the_worked_example_keeps_celery_once_s_raise_on_a_duplicate() -> None:
    text = PAGE.read_text()
    example = text.split("becomes:", 1)[1]
    code = re.search(r"```python\n(.*?)```", example, re.S)
    assert code is not None
    app = Celery("migrate-doc", broker="memory://", set_as_current=False)
    app.conf.update(taskdedup_store=MemoryStore(), taskdedup_stats=False)
    scope: dict[str, object] = {"app": app}
    exec(compile(code[1], str(PAGE), "exec"), scope)  # the page's own example
    charge = scope["charge"]
    first = charge.delay(1, 500)  # type: ignore[attr-defined]
    with pytest.raises(DuplicateTaskError) as raised:
        charge.delay(1, 700)  # type: ignore[attr-defined]
    assert raised.value.existing_id == first.id
