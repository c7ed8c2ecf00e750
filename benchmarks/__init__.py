"""taskdedup's benchmark suite, side by side with plain Celery/RQ, celery-once and
celery-singleton, on one Redis server in one run.

Run it with ``python -m benchmarks`` (``--quick`` for tiny sizes, ``--json out.json`` for the
figures); see ``docs/explanation/performance.md`` for what each figure means and the latest results.
"""
