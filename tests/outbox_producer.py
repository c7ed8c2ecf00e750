"""A producer for the outbox kill proof (tests/test_outbox_kill.py), run as a subprocess::

    python -m tests.outbox_producer URL PREFIX INDEX PRODUCERS ORDERS SEED RQ_QUEUE

It places orders ``PREFIX-C<n>`` (even ``n``: a Celery call, ``tests.sql_apps.charge``) and
``PREFIX-R<n>`` (odd ``n``: an RQ job, ``tests.sql_jobs.rq_charge`` on ``RQ_QUEUE``) for every
``n < ORDERS`` with ``n % PRODUCERS == INDEX``: one transaction inserts the order row and
``outbox.add``s its charge. Whether an order commits is decided by the seed and its number
alone (:func:`rolls_back`), so the test knows which orders were rolled back whatever moment
the producer was SIGKILLed at, and a restarted producer decides the same. A restart resumes
after the last order this producer committed.

After the commit the producer waits a random while (most of its time between two orders)
before it lets the connection go (the rows are published when the connection returns to the
pool), so a SIGKILL lands between the commit and the publish often: those rows are the
relay's. Broker
and lock store: ``TASKDEDUP_TEST_REDIS_URL``; the Celery queue ``TASKDEDUP_TEST_QUEUE``.
"""

from __future__ import annotations

import os
import random
import sys
import time

import sqlalchemy as sa

ROLLBACK_FRACTION = 0.2

METADATA = sa.MetaData()
ORDERS = sa.Table(
    "orders", METADATA,
    sa.Column("ref", sa.Text, primary_key=True),
    sa.Column("producer", sa.Integer, nullable=False),
    sa.Column("n", sa.Integer, nullable=False),
)


def rolls_back(seed: int, n: int) -> bool:
    """Whether order ``n`` of the run with ``seed`` is rolled back (never committed)."""
    return random.Random(f"{seed}:{n}").random() < ROLLBACK_FRACTION


def ref(prefix: str, n: int) -> str:
    return f"{prefix}-{'C' if n % 2 == 0 else 'R'}{n}"


def producing_key(prefix: str, index: int) -> str:
    """Where producer ``index`` writes its pid once it places orders (its imports done)."""
    return f"outbox-producer:{prefix}:{index}"


class Refused(Exception):
    """Raised inside the transaction to roll it back."""


def engine_for(url: str) -> sa.Engine:
    if url.startswith("sqlite"):
        return sa.create_engine(url, connect_args={"timeout": 60})
    return sa.create_engine(url, pool_pre_ping=True)


def main(argv: list[str]) -> None:
    url, prefix, index, producers, orders, seed, rq_queue = argv
    me, total, every, seed_ = int(index), int(orders), int(producers), int(seed)
    from rq import Retry

    from taskdedup.rq import DedupQueue
    from taskdedup.sql import outbox
    from tests import sql_apps, sql_jobs
    from tests.effects import r

    engine = engine_for(url)
    queue = DedupQueue(rq_queue, connection=r(), dedup=sql_jobs.POLICY)
    with engine.connect() as conn:
        done = conn.execute(sa.select(sa.func.max(ORDERS.c.n))
                            .where(ORDERS.c.producer == me)).scalar()
    start = me if done is None else done + every
    r().set(producing_key(prefix, me), os.getpid(), ex=3600)  # placing orders from now on
    pace = random.Random(f"{seed_}:{me}:{time.time_ns()}")
    mean = float(os.environ.get("TASKDEDUP_TEST_PRODUCER_PACE") or 0.02)
    for n in range(start, total, every):
        order = ref(prefix, n)
        conn = engine.connect()
        try:
            trans = conn.begin()
            try:
                conn.execute(ORDERS.insert().values(ref=order, producer=me, n=n))
                if n % 2 == 0:
                    outbox.add(conn, sql_apps.charge.s(order, 100))
                else:
                    outbox.add(conn, queue, sql_jobs.rq_charge, order, 100,
                               retry=Retry(max=10))
                if rolls_back(seed_, n):
                    raise Refused
                trans.commit()
            except Refused:
                trans.rollback()
            except sa.exc.IntegrityError:
                # committed by the run SIGKILLed before it saw its commit: the order and its
                # outbox row are there (the relay publishes the row)
                trans.rollback()
            time.sleep(pace.uniform(0, 2 * mean))  # committed, not yet published
        finally:
            conn.close()  # back to the pool: the committed rows are published now
        time.sleep(pace.uniform(0, 0.02))
    engine.dispose()


if __name__ == "__main__":
    main(sys.argv[1:])
