"""``manage.py taskdedup_relay``: publish the outbox's calls that were committed but not
published (the committing process died, or the broker was down), with the project's Celery
app and RQ connection. SIGTERM/SIGINT: the current batch finishes, exit 0."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

__all__ = ["Command"]


class Command(BaseCommand):  # type: ignore[misc]
    help = ("Publish the taskdedup outbox's committed calls that were not published (in "
            "batches, after a grace period); SIGTERM stops it after the current batch.")

    def add_arguments(self, parser: CommandParser) -> None:
        from taskdedup.outbox import DEFAULT_GRACE

        parser.add_argument("--database", default="default",
                            help="the database alias of the outbox (default: default)")
        parser.add_argument("--grace", type=float, default=DEFAULT_GRACE,
                            help="seconds a row waits for its own process to publish it "
                                 f"(default {DEFAULT_GRACE:g})")
        parser.add_argument("--batch", type=int, default=100,
                            help="rows taken at once (default 100)")
        parser.add_argument("--poll", type=float, default=1.0,
                            help="seconds between looks at an empty outbox (default 1)")
        parser.add_argument("--once", action="store_true",
                            help="publish one batch, then exit (cron, tests)")

    def handle(self, *args: Any, **options: Any) -> None:
        from taskdedup.django.outbox import DjangoRowSource, check_table
        from taskdedup.django.project import publisher
        from taskdedup.exceptions import ConfigurationError
        from taskdedup.outbox import Relay

        for option, bad, wanted in (("batch", options["batch"] < 1, "at least 1"),
                                    ("grace", options["grace"] < 0, "0 or more"),
                                    ("poll", options["poll"] <= 0, "more than 0")):
            if bad:
                raise CommandError(f"--{option} must be {wanted}, got {options[option]:g}")
        try:
            check_table(options["database"])
        except ConfigurationError as exc:
            raise CommandError(str(exc)) from None
        relay = Relay(DjangoRowSource(options["database"]), publisher(),
                      batch=options["batch"], grace=options["grace"], poll=options["poll"])
        if options["once"]:
            self.stdout.write(f"taskdedup relay: {relay.run_once()} row(s) taken")
            return
        stop = threading.Event()

        def stopping(signum: int, frame: FrameType | None) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, stopping)
        signal.signal(signal.SIGINT, stopping)
        self.stdout.write(f"taskdedup relay: database {options['database']!r}, grace "
                          f"{options['grace']:g}s, batch {options['batch']}")
        self.stdout.flush()
        relay.run(stop)
        self.stdout.write("taskdedup relay: stopped")
