"""The body of the second-call tests' tasks and RQ jobs (SPEC §15), importable by worker
subprocesses.

Each run records ``start<n>``/``end<n>`` (``effects:<label>``) and counts the runs of its
identity in progress (``busy:<label>``): a second run beside the first records ``overlap``.
"""

from __future__ import annotations

import time

from tests.effects import effect, r, wait_gate


def hold(label: str, n: int, gated: bool = False) -> int:
    """One run of identity ``label``: recorded, checked alone, held by the gate when asked."""
    if r().incr(f"busy:{label}") > 1:
        effect(label, "overlap")
    effect(label, f"start{n}")
    try:
        if gated:
            wait_gate(label)
        else:
            time.sleep(0.2)
    finally:
        r().decr(f"busy:{label}")
    effect(label, f"end{n}")
    return n
