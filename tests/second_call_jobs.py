"""The body of the second-call tests' tasks and RQ jobs (SPEC §15), importable by worker
subprocesses.

Each run records ``start<n>``/``end<n>`` (``effects:<label>``) and counts the runs of its
identity in progress (``busy:<label>``): a second run beside the first records ``overlap``.
"""

from __future__ import annotations

import os

from tests.effects import r
from tests.flow_jobs import body


def hold(label: str, n: int, gated: bool = False) -> int:
    """One run of identity ``label``: recorded, checked alone, held by the gate ``label`` when
    asked. Its process id is kept in ``pid:<label>:<n>`` (a test that kills it)."""
    r().set(f"pid:{label}:{n}", os.getpid(), ex=600)
    return body(label, n, label if gated else "", pause=0.2)
