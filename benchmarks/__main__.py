"""``python -m benchmarks``: see :mod:`benchmarks.cli`."""

from .cli import main

raise SystemExit(main())
