"""``python -m benchmarks``: see :mod:`benchmarks.cli`."""

import sys

from .cli import main

if sys.argv[1:2] == ["durable"]:  # the durable tier (taskdedup.sql): its own run, own servers
    from .durable import main as durable

    raise SystemExit(durable(sys.argv[2:]))
raise SystemExit(main())
