"""``manage.py taskdedup_outbox_status``: the outbox's backlog (rows waiting, the oldest
one's age, rows whose publish failed, per Celery task or RQ queue); ``--json`` for scripts
and monitoring."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

__all__ = ["Command"]


class Command(BaseCommand):  # type: ignore[misc]
    help = ("Show the taskdedup outbox's backlog: rows waiting per target, the oldest one's "
            "age, rows whose publish failed.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", default="default",
                            help="the database alias of the outbox (default: default)")
        parser.add_argument("--json", action="store_true", help="one JSON object")

    def handle(self, *args: Any, **options: Any) -> None:
        from taskdedup.django.outbox import DjangoRowSource, check_table
        from taskdedup.exceptions import ConfigurationError

        try:  # a wrong alias, a database down, no table: one line and exit 1
            check_table(options["database"])
        except ConfigurationError as exc:
            raise CommandError(str(exc)) from None
        now = datetime.now(UTC)
        targets = [b.as_dict(now) for b in DjangoRowSource(options["database"]).backlog()]
        ages = [float(str(t["oldest_age_s"])) for t in targets]
        summary = {
            "rows": sum(int(str(t["rows"])) for t in targets),
            "oldest_age_s": max(ages) if ages else None,
            "failing": sum(int(str(t["failing"])) for t in targets),
            "targets": targets,
        }
        if options["json"]:
            self.stdout.write(json.dumps(summary))
            return
        oldest = summary["oldest_age_s"]
        self.stdout.write(f"{summary['rows']} row(s) waiting, oldest "
                          f"{'-' if oldest is None else f'{oldest:.1f}s'}, "
                          f"{summary['failing']} failing")
        for t in targets:
            line = (f"  {t['kind']:<6} {t['target']:<40} rows {t['rows']:<6} oldest "
                    f"{t['oldest_age_s']}s failing {t['failing']}")
            if t["last_error"]:
                line += f" last error: {t['last_error']}"
            self.stdout.write(line)
