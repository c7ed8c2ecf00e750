"""``python -m taskdedup``: the ``taskdedup`` command (see :mod:`taskdedup.cli`)."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    main()
