"""``python -m benchmarks``: see :mod:`benchmarks.cli`."""

import sys

from .cli import main

if sys.argv[1:2] == ["durable"]:  # the durable tier (taskdedup.sql): its own run, own servers
    from .durable import main as durable

    raise SystemExit(durable(sys.argv[2:]))
if sys.argv[1:2] == ["outbox"]:  # the outbox (taskdedup.sql.outbox): its own run, own servers
    from .outbox import main as outbox

    raise SystemExit(outbox(sys.argv[2:]))
if sys.argv[1:2] == ["ab"]:  # one worker path, two code trees (benchmarks/ab.py)
    from .ab import main as ab

    raise SystemExit(ab(sys.argv[2:]))
raise SystemExit(main())
