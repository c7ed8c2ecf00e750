"""Load the user's Celery app by name, as ``celery -A`` does: for the commands that need it
(``taskdedup key -A``, ``taskdedup outbox relay -A``)."""

from __future__ import annotations

import os
import sys
from typing import Any

from ..exceptions import ConfigurationError

__all__ = ["load_app"]


def load_app(name: str) -> Any:
    """The Celery app ``name`` names (``proj``, ``proj.celery``, ``proj.celery:app``), with its
    tasks registered (``imports``, ``include``, autodiscovery).

    The current directory is importable, as for ``celery -A``.

    Raises:
        ConfigurationError: nothing Celery can load is found under that name.
    """
    from celery.app.utils import find_app

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        app = find_app(name)
    except Exception as exc:
        raise ConfigurationError(
            f"cannot load the Celery app {name!r}: {type(exc).__name__}: {exc}") from None
    app.loader.import_default_modules()
    return app
