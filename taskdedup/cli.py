"""The ``taskdedup`` command: compute identities, look at locks and stats, clear locks.

Usage::

    taskdedup key payments.charge 42 5000            # identity and Redis key of a call
    taskdedup --url redis://localhost:6379/0 list --task payments.charge --state running
    taskdedup inspect taskdedup:payments.charge:1f0c...
    taskdedup clear --task payments.charge --yes
    taskdedup stats --watch

``--url`` defaults to ``TASKDEDUP_URL``; ``--prefix`` to ``TASKDEDUP_PREFIX``, else
``taskdedup``. Keys are found with SCAN, never KEYS, and read in pipelined batches. Every read
command takes ``--json``. Errors are one line on stderr and exit code 1.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import click
import redis
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .core import DEFAULT_PREFIX, Deduplicator
from .exceptions import ConfigurationError
from .limits import summary
from .locks import (
    Lock,
    batches,
    delete_locks,
    iter_locks,
    key_bytes,
    key_text,
    lock_key_error,
    lock_pattern,
    one_line,
    raise_errors,
    redis_error_text,
    scan_keys,
    shown,
    to_lock,
    ttl_text,
)
from .policy import Policy
from .stats import TaskStats, WindowStats, read_stats, read_windows, stats_key
from .stores.memory import MemoryStore
from .stores.redis import RedisStore, redact_url

__all__ = ["main"]

_DIGEST: Final = re.compile(r"[0-9a-f]{32}")
# Characters json.dumps(ensure_ascii=False) leaves raw that a terminal may act on: DEL, C1
# controls (0x9b is CSI), line separators and bidirectional overrides.
_JSON_UNSAFE: Final = re.compile("[\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")

# Commands that live in other modules and are imported only when run (their imports are
# heavy: Celery, RQ, a Redis server). ``taskdedup demo`` is ``taskdedup/demo.py``'s ``demo``
# click command; it is listed once that module exists.
LAZY_COMMANDS: Final[dict[str, str]] = {"demo": "taskdedup.demo:demo",
                                         "outbox": "taskdedup.sql.outbox_cli:outbox",
                                         "sql": "taskdedup.sql.cli:sql",
                                         "web": "taskdedup.web.cli:web"}


class CliError(click.ClickException):
    """A failure reported as one line on stderr, exit code 1, without a traceback."""


# -- the group and its shared state ------------------------------------------------------------


@dataclass
class _Env:
    """What the global options chose; the Redis client is made on first use."""

    url: str | None
    prefix: str
    _client: redis.Redis | None = field(default=None, repr=False)

    @property
    def where(self) -> str:
        return redact_url(self.url) if self.url else "(no URL)"

    def client(self) -> redis.Redis:
        if self._client is None:
            if not self.url:
                raise CliError("no Redis URL: pass --url or set TASKDEDUP_URL")
            try:
                self._client = RedisStore.from_url(self.url).client
            except ConfigurationError as exc:
                raise CliError(str(exc)) from None
        return self._client


SUMMARIES: Final[dict[str, str]] = {
    "clear": "Delete locks, so their calls can be enqueued again.",
    "demo": "Watch duplicates meet real Celery and RQ workers, on this machine.",
    "doctor": "Check that your Redis can keep taskdedup's promises.",
    "inspect": "Show one lock: who holds it, in what state, for how long.",
    "key": "Print the lock key of one call of a task.",
    "list": "List the locks held now.",
    "outbox": "Publish and watch the transactional outbox's rows.",
    "sql": "Create and prune the durable tier's database tables.",
    "stats": "Show each task's counts: accepted, duplicates, skipped, released.",
    "web": "Serve a read-only dashboard of locks and stats.",
}
"""One plain line per command for ``taskdedup --help`` (a command's own help says more)."""

EPILOG: Final = """\b
Examples:
  taskdedup --url redis://localhost:6379/0 doctor
  taskdedup stats --watch
  taskdedup list --task payments.charge
  taskdedup key payments.charge ORD-789 5000 -A proj
  taskdedup demo

\b
'taskdedup COMMAND --help' describes a command. Docs: docs/reference/cli.md and
docs/how-to/operating.md in taskdedup's source."""


class _Group(click.Group):
    """A click group that also lists and loads :data:`LAZY_COMMANDS` on demand, and lists
    each command with its line of :data:`SUMMARIES`."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, SUMMARIES.get(name) or command.get_short_help_str(200)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def list_commands(self, ctx: click.Context) -> list[str]:
        lazy = [name for name, target in LAZY_COMMANDS.items() if _module_exists(target)]
        return sorted({*super().list_commands(ctx), *lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        target = LAZY_COMMANDS.get(cmd_name)
        if command is None and target is not None and _module_exists(target):
            module_name, _, attr = target.partition(":")
            loaded = getattr(importlib.import_module(module_name), attr)
            if not isinstance(loaded, click.Command):
                raise CliError(f"{target} is not a click command")
            command = loaded
        return command


def _module_exists(target: str) -> bool:
    try:
        return importlib.util.find_spec(target.partition(":")[0]) is not None
    except (ImportError, ValueError):
        return False


def _check_prefix(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not value or ":" in value:
        raise click.BadParameter("must be a non-empty string without ':'")
    return value


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=EPILOG)
@click.option(
    "--url", envvar="TASKDEDUP_URL", metavar="URL",
    help="Redis URL (redis://, rediss://, unix://, valkey://); default: $TASKDEDUP_URL.",
)
@click.option(
    "--prefix", envvar="TASKDEDUP_PREFIX", default=DEFAULT_PREFIX, show_default=True,
    callback=_check_prefix, help="First component of every key; default: $TASKDEDUP_PREFIX.",
)
@click.version_option(package_name="taskdedup", prog_name="taskdedup")
@click.pass_context
def main(ctx: click.Context, url: str | None, prefix: str) -> None:
    """Look at taskdedup's locks and counts in Redis, and manage them."""
    ctx.obj = _Env(url or None, prefix)


def _json_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table."
    )(func)


@contextmanager
def _redis_errors(env: _Env) -> Iterator[None]:
    """Turn any Redis failure into one clear line (no traceback)."""
    try:
        yield
    except redis.RedisError as exc:
        raise CliError(redis_error_text(env.where, exc)) from None


# -- output helpers ------------------------------------------------------------------------------


def _console() -> Console:
    # Not a terminal (a pipe, a file): wide enough for full keys instead of 80 columns.
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, width=160 if wide else None)


def _echo_json(data: Any, *, compact: bool = False) -> None:
    """``data`` as JSON, safe for a terminal: undecodable bytes of a key or value read from
    Redis written ``\\xff`` (JSON text cannot hold them), control characters as JSON
    escapes (``\\u001b``), which parse back to the same string."""
    text = json.dumps(_printable(data), indent=None if compact else 2, ensure_ascii=False)
    click.echo(_JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text))


def _printable(data: Any) -> Any:
    """``data`` with the undecodable bytes of its strings escaped (:func:`shown` for those)."""
    if isinstance(data, str):
        return shown(data) if _has_surrogates(data) else data
    if isinstance(data, dict):
        return {_printable(k): _printable(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_printable(item) for item in data]
    return data


def _has_surrogates(text: str) -> bool:
    return any("\ud800" <= char <= "\udfff" for char in text)


def _cell(value: object) -> Text:
    """A table cell shown verbatim: never rich markup (``[bold]`` stays text), and control
    characters from Redis escaped (``\\x1b``), so a stored value cannot drive the terminal."""
    return Text("-" if value is None or value == "" else shown(value))


def _title(text: str) -> Text:
    """A table title shown verbatim (it names the URL, which may hold ``[``)."""
    return Text(shown(text))


# -- keys and lock values -----------------------------------------------------------------------


def _parse_value(text: str) -> Any:
    """JSON when ``text`` parses as JSON (``42``, ``true``, ``[1, 2]``, ``"42"``), else the str."""

    def refuse(constant: str) -> Any:
        raise ValueError(constant)  # NaN / Infinity: keep the text

    try:
        return json.loads(text, parse_constant=refuse)
    except ValueError:
        return text


def _call_arguments(
    args: Sequence[str], kws: Sequence[str], json_args: str | None, json_kwargs: str | None
) -> tuple[list[Any], dict[str, Any]]:
    positional: list[Any] = [_parse_value(a) for a in args]
    if json_args is not None:
        if args:
            raise CliError("pass positional arguments as ARGS or with --json-args, not both")
        try:
            loaded = json.loads(json_args)
        except ValueError as exc:
            raise CliError(f"--json-args is not valid JSON: {exc}") from None
        if not isinstance(loaded, list):
            raise CliError("--json-args must be a JSON array, e.g. '[42, \"ORD-7\"]'")
        positional = loaded
    keywords: dict[str, Any] = {}
    if json_kwargs is not None:
        try:
            loaded = json.loads(json_kwargs)
        except ValueError as exc:
            raise CliError(f"--json-kwargs is not valid JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise CliError("--json-kwargs must be a JSON object, e.g. '{\"amount\": 5}'")
        keywords.update(loaded)
    for item in kws:
        name, sep, raw = item.partition("=")
        if not sep or not name.isidentifier():
            raise CliError(f"--kw takes NAME=VALUE, got {item!r}")
        if name in keywords:
            raise CliError(f"keyword argument {name!r} is given twice")
        keywords[name] = _parse_value(raw)
    return positional, keywords


def _import_object(spec: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"--func takes MODULE:FUNCTION, e.g. myapp.tasks:charge, got {spec!r}")
    if os.getcwd() not in sys.path:  # like `celery -A`: the current directory is importable
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise CliError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CliError(f"{module_name!r} has no attribute {attr!r}") from None
    return obj


def _task_function(obj: Any, spec: str) -> tuple[Callable[..., Any], Policy | None]:
    """The function to bind arguments to, and the Policy of a Celery ``DedupTask``, if any."""
    run = getattr(obj, "run", None)
    if callable(run) and hasattr(obj, "apply_async"):  # a Celery task: bind to its body
        policy = getattr(obj, "_dedup_policy", None)
        return run, policy if isinstance(policy, Policy) else None
    if not callable(obj):
        raise CliError(f"{spec} is not a function (it is a {type(obj).__name__})")
    return obj, None


def _resolve_task(
    task: str, func: str | None, app_name: str | None, *, needed: bool
) -> tuple[Callable[..., Any] | None, Policy | None]:
    """TASK's function and policy for ``taskdedup key``: from ``--func``, the Celery app's
    registry, or TASK's dotted name. A key computed without the signature is not the
    producer's (defaults and positional arguments bind to names), so not finding it is an
    error when the arguments count (``needed``)."""
    if func is not None:
        return _task_function(_import_object(func), func)
    if app_name:
        from .celery.load import load_app  # Celery only when asked for

        try:
            app = load_app(app_name)
        except ConfigurationError as exc:
            raise CliError(one_line(exc)) from None
        found = app.tasks.get(task)
        if found is None:
            raise CliError(f"{task!r} is not a task of the Celery app {app_name!r} "
                           "(give its registered name, or --func MODULE:FUNCTION)")
        return _task_function(found, task)
    module_name, _, attr = task.rpartition(".")
    if module_name:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            return _task_function(getattr(importlib.import_module(module_name), attr), task)
        except (ImportError, AttributeError, CliError):
            pass
        except Exception as exc:  # the module failed to import: say so
            if needed:
                raise CliError(f"cannot import {module_name!r} to find {task!r}'s signature: "
                               f"{type(exc).__name__}: {exc}") from None
    if needed:
        raise CliError(
            f"cannot find {task!r}'s function: the key binds the arguments to its signature, "
            "as the producer does. Pass --func MODULE:FUNCTION or -A/--app MODULE (or set "
            "CELERY_APP), or --unbound if the producer had no function to bind to"
        )
    return None, None


def _names(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


@main.command("key")
@click.argument("task")
@click.argument("args", nargs=-1)
@click.option("--kw", "kws", multiple=True, metavar="NAME=VALUE",
              help="A keyword argument (repeatable); VALUE is JSON when it parses, else a string.")
@click.option("--json-args", metavar="JSON", help="Positional arguments as a JSON array.")
@click.option("--json-kwargs", metavar="JSON", help="Keyword arguments as a JSON object.")
@click.option("--scope", help="The policy's scope (namespace in the key).")
@click.option("--dedup-key", metavar="KEY",
              help="An explicit idempotency key (a string): it replaces the arguments.")
@click.option("--include", metavar="NAMES", help="Only these arguments count (comma-separated).")
@click.option("--exclude", metavar="NAMES", help="These arguments do not count (comma-separated).")
@click.option("--func", metavar="MODULE:FUNCTION",
              help="Bind the arguments to this function's (or Celery task's) signature.")
@click.option("-A", "--app", "app_name", envvar="CELERY_APP", metavar="MODULE",
              help="Find TASK among this Celery app's tasks (default: CELERY_APP).")
@click.option("--unbound", is_flag=True,
              help="No signature: the producer had no function to bind to (an RQ job "
                   "enqueued by a name it could not import).")
@_json_option
@click.pass_obj
def key_command(
    env: _Env, task: str, args: tuple[str, ...], kws: tuple[str, ...], json_args: str | None,
    json_kwargs: str | None, scope: str | None, dedup_key: str | None, include: str | None,
    exclude: str | None, func: str | None, app_name: str | None, unbound: bool,
    as_json: bool,
) -> None:
    """Print the identity (digest) and the Redis key of a call of TASK.

    The arguments are bound to TASK's signature, as the producer binds them: TASK is found
    with --func, else among the tasks of the Celery app of -A/--app (or CELERY_APP), else
    imported by its dotted name (module.function, as Celery and RQ name tasks). When none
    finds it the command refuses, unless --unbound. ARGS are JSON when they parse (42, true,
    null, [1,2], '"42"' for the string), else strings. Put `--` before arguments that start
    with '-'. No Redis is needed.
    """
    positional, keywords = _call_arguments(args, kws, json_args, json_kwargs)
    function: Callable[..., Any] | None = None
    base: Policy | None = None
    if not unbound:
        function, base = _resolve_task(task, func, app_name, needed=dedup_key is None)
    try:
        if include is not None or exclude is not None or base is None:
            selection: dict[str, Any] = {"include": _names(include), "exclude": _names(exclude)}
        else:  # the task's own selection (or key function)
            selection = {"include": base.include, "exclude": base.exclude, "key": base.key}
        if scope is None and base is not None:
            scope = base.scope
        policy = Policy(scope=scope, **selection)
        dedup = Deduplicator(MemoryStore(), prefix=env.prefix)
        identity = dedup.identity(
            task, policy, positional, keywords, func=function, dedup_key=dedup_key
        )
    except (TypeError, ValueError) as exc:  # ConfigurationError is a ValueError
        raise CliError(one_line(exc)) from None
    digest = identity.key.rpartition(":")[2]
    if dedup_key is not None:
        source = "dedup_key"
    elif policy.key is not None:
        source = "key function"
    else:
        source = "arguments"
    data = {
        "task": task,
        "scope": policy.scope,
        "digest": digest,
        "key": identity.key,
        "identity_from": source,
        "check": identity.check or None,
    }
    if as_json:
        _echo_json(data)
        return
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for name, value in data.items():
        if value is not None:
            table.add_row(name, _cell(value))
    _console().print(table)


# -- inspect -----------------------------------------------------------------------------------


@main.command("inspect")
@click.argument("key_or_task")
@click.argument("digest", required=False)
@click.option("--scope", help="The scope, with TASK DIGEST.")
@_json_option
@click.pass_obj
def inspect_command(
    env: _Env, key_or_task: str, digest: str | None, scope: str | None, as_json: bool
) -> None:
    """Show one lock: state, owner, TTL, idempotency check.

    Pass a full key (as printed by `taskdedup key` or `list`), or TASK DIGEST.
    """
    if digest is not None:
        if not _DIGEST.fullmatch(digest):
            raise CliError(f"DIGEST must be 32 lowercase hex characters, got {digest!r}")
        key = Deduplicator(MemoryStore(), prefix=env.prefix).lock_key(key_or_task, digest, scope)
        task: str | None = key_or_task
    else:
        key, task, scope = key_or_task, None, None
    refused = lock_key_error(env.prefix, key)
    if refused is not None:
        raise CliError(f"{refused}; pass a full key, or TASK DIGEST")
    client = env.client()
    with _redis_errors(env):
        pipe = client.pipeline(transaction=True)  # one key: value and TTL read atomically
        pipe.get(key_bytes(key))
        pipe.pttl(key_bytes(key))
        pipe.type(key_bytes(key))
        replies = pipe.execute(raise_on_error=False)
        raise_errors(replies)
    value, pttl, kind = replies
    if pttl == -2:
        if as_json:
            _echo_json({"key": key, "exists": False})
        else:
            click.echo(f"no lock at {shown(key)}: never taken, or released, or expired")
        return
    lock = to_lock(env.prefix, key, value, pttl, task, scope)
    if lock is None:
        raise CliError(f"{shown(key)} holds a {shown(key_text(kind))}, not a taskdedup lock")
    if as_json:
        _echo_json({**lock.as_dict(), "exists": True})
        return
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    table.add_row("key", _cell(lock.key))
    table.add_row("task", _cell(lock.task))
    if lock.scope:
        table.add_row("scope", _cell(lock.scope))
    table.add_row("state", _cell(lock.state))
    table.add_row("owner", _cell(lock.owner))
    table.add_row("ttl", _cell(ttl_text(lock.ttl_ms)))
    table.add_row(
        "idempotency check", "set (explicit dedup_key)" if lock.check else "not set"
    )
    _console().print(table)


# -- list --------------------------------------------------------------------------------------


def _scope_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--scope", help="With --task: the locks of TASK in this scope (without it, the "
        "unscoped locks of TASK only)."
    )(func)


def _check_scope(task: str | None, scope: str | None) -> None:
    if scope is not None and task is None:
        raise CliError("--scope needs --task (a scope alone reads like the start of a task name)")
    if scope is not None and (not scope or ":" in scope):
        raise CliError("--scope must be a non-empty string without ':'")


def _task_text(task: str, scope: str | None) -> str:
    return f"task {task!r}" + (f" in scope {scope!r}" if scope else "")


@main.command("list")
@click.option("--task", help="Only the locks of exactly this task (unscoped unless --scope).")
@_scope_option
@click.option("--state", type=click.Choice(["queued", "running", "done"]),
              help="Only locks in this state.")
@click.option("--limit", type=click.IntRange(min=0), default=100, show_default=True,
              help="Show at most this many locks (0: all).")
@_json_option
@click.pass_obj
def list_command(
    env: _Env, task: str | None, scope: str | None, state: str | None, limit: int,
    as_json: bool,
) -> None:
    """List locks (found with SCAN, never KEYS; read in pipelined batches)."""
    _check_scope(task, scope)
    client = env.client()
    locks: list[Lock] = []
    truncated = False
    with _redis_errors(env):
        for lock in iter_locks(client, env.prefix, task, scope):
            if state is not None and lock.state != state:
                continue
            if limit and len(locks) >= limit:
                truncated = True
                break
            locks.append(lock)
    locks.sort(key=lambda lock: (lock.task, lock.scope, lock.key))
    if as_json:
        _echo_json([lock.as_dict() for lock in locks])
        return
    if not locks:
        click.echo(f"no locks under {env.prefix}:*"
                   + (f" for {shown(_task_text(task, scope))}" if task else "")
                   + (f" in state {state}" if state else "")
                   + ("; a scoped task's locks need --scope" if task and not scope else ""))
        return
    scoped = any(lock.scope for lock in locks)
    table = Table(title=_title(f"taskdedup locks at {env.where}"), title_justify="left")
    table.add_column("key", overflow="fold")
    table.add_column("task")
    if scoped:
        table.add_column("scope")
    table.add_column("state")
    table.add_column("owner", overflow="fold")
    table.add_column("ttl", justify="right")
    for lock in locks:
        cells = [_cell(lock.key), _cell(lock.task)]
        if scoped:
            cells.append(_cell(lock.scope))
        cells += [_cell(lock.state), _cell(lock.owner), _cell(ttl_text(lock.ttl_ms))]
        table.add_row(*cells)
    console = _console()
    console.print(table)
    if truncated:
        console.print(f"showing the first {limit} locks found; --limit 0 shows all")


# -- clear -------------------------------------------------------------------------------------


@main.command("clear")
@click.option("--key", "keys", multiple=True, metavar="KEY",
              help="This lock key (repeatable); refused unless it is a lock key under the prefix.")
@click.option("--task", help="Every lock of exactly this task (unscoped unless --scope).")
@_scope_option
@click.option("--all", "all_", is_flag=True, help="Every lock under the prefix.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.pass_obj
def clear_command(
    env: _Env, keys: tuple[str, ...], task: str | None, scope: str | None, all_: bool,
    yes: bool,
) -> None:
    """Delete locks (SCAN + DEL in batches), so their identities can be enqueued again.

    Only keys under the prefix that hold a lock are deleted; --task TASK takes exactly that
    task's locks (with --scope, that scope's), never those of a longer name such as
    SCOPE:TASK. Stats are kept. A task whose lock is deleted while it runs is not stopped,
    and its completion will find the lock gone (it does not touch a new owner's lock).
    """
    chosen = sum((bool(keys), task is not None, all_))
    if chosen == 0 and scope is None:
        raise CliError("nothing selected: pass --key KEY, --task TASK or --all")
    _check_scope(task, scope)
    if chosen > 1:
        raise CliError("pass only one of --key, --task and --all")
    for key in keys:
        refused = lock_key_error(env.prefix, key)
        if refused is not None:
            raise CliError(f"{refused}: nothing deleted")
    if keys:
        what = f"the lock {shown(keys[0])}" if len(keys) == 1 else f"{len(keys)} locks"
    elif task is not None:
        what = f"every lock of {shown(_task_text(task, scope))}"
    else:
        what = f"every lock under {env.prefix + ':*'!r}"
    client = env.client()
    with _redis_errors(env):
        client.ping()  # a server that is down is reported before asking anything
    if not yes:
        click.confirm(f"Delete {what} at {env.where}?", abort=True)
    deleted = 0
    with _redis_errors(env):
        if keys:
            for batch in batches(keys):
                deleted += delete_locks(client, env.prefix, batch, None)
        else:
            for batch in batches(scan_keys(client, lock_pattern(env.prefix, task, scope))):
                deleted += delete_locks(client, env.prefix, batch, task, scope)
    click.echo(f"deleted {deleted} lock{'' if deleted == 1 else 's'}")


# -- doctor ------------------------------------------------------------------------------------


@main.command("doctor")
@_json_option
@click.pass_obj
def doctor_command(env: _Env, as_json: bool) -> None:
    """Check that the server can hold taskdedup's guarantees; exit 1 if something is wrong.

    Checks: the server's version (Redis 6.2+, Valkey 7.2+), its eviction policy (anything
    but noeviction under a memory limit deletes locks, and duplicates then run), script
    permission, Cluster mode, whether the user reaches keys under the prefix (ACL), the
    bitmap commands of approximate windows (a problem only where windows are in use),
    whether workers met copies of running messages (countdowns beyond visibility_timeout), and
    which workers use the reliable fetch, with messages held by a worker whose lease lapsed.
    """
    from .doctor import diagnose

    client = env.client()
    with _redis_errors(env):
        findings = diagnose(client, env.prefix)
    failed = [f for f in findings if not f.ok]
    if as_json:
        _echo_json({"url": env.where, "ok": not failed,
                    "checks": [f.as_dict() for f in findings]})
    else:
        table = Table(title=_title(f"taskdedup doctor at {env.where}"), title_justify="left")
        for name in ("check", "status", "found", "fix"):
            table.add_column(name)
        styles = {"ok": "green", "not in use": "yellow", "PROBLEM": "bold red"}
        for f in findings:
            table.add_row(f.check, Text(f.status, styles[f.status]), _cell(f.detail),
                          _cell(f.fix))
        _console().print(table)
    if failed:
        raise SystemExit(1)


# -- stats -------------------------------------------------------------------------------------


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _stats_table(stats: dict[str, TaskStats], where: str) -> Table:
    table = Table(title=_title(f"taskdedup stats at {where}"), title_justify="left")
    # the second call's answers (SPEC §15): a column only when some task counted one
    extra = [n for n in ("waits", "coalesced", "superseded")
             if any(item.second_calls[n] for item in stats.values())]
    for name in ("task", "accepted", "duplicates", "dup rate", "retries", "skipped",
                 "released on failure", "lease lost", "store errors", "gate avg", *extra):
        table.add_column(name, justify="left" if name == "task" else "right")
    for item in stats.values():
        avg = item.gate_avg_ms
        table.add_row(
            _cell(item.task), str(item.accepted), str(item.duplicates),
            _rate(item.duplicate_rate), str(item.retries), str(item.skipped),
            str(item.released_on_failure),
            str(item.lease_lost), str(item.store_errors),
            "-" if avg is None else f"{avg:.2f} ms",
            *(str(item.second_calls[n]) for n in extra),
        )
    return table


def _windows_table(windows: dict[str, WindowStats], where: str) -> Table:
    table = Table(title=_title(f"taskdedup approximate windows at {where}"),
                  title_justify="left")
    for name in ("task", "identities", "fill", "fill max", "est. false positives",
                 "live slices", "slices dropped"):
        table.add_column(name, justify="left" if name == "task" else "right")
    for item in windows.values():
        table.add_row(
            _cell(item.task), f"{item.identities:,}", f"{item.fill:.1%}", f"{item.fill_max:.1%}",
            f"{item.false_positive_rate:.3%}", str(item.slices), str(item.slices_dropped),
        )
    return table


def _limits_table(rows: dict[str, dict[str, int]], where: str) -> Table:
    table = Table(title=_title(f"taskdedup limits at {where}"), title_justify="left")
    for name in ("task", "slots in use", "waiting", "put off", "dropped"):
        table.add_column(name, justify="left" if name == "task" else "right")
    for name, row in rows.items():
        table.add_row(_cell(name), str(row["slots_in_use"]), str(row["waiting"]),
                      str(row["limited"]), str(row["dropped"]))
    return table


@main.command("stats")
@click.option("--task", help="Only this task.")
@click.option("--watch", type=click.FloatRange(min=0.1), is_flag=False, flag_value=2.0,
              default=None, metavar="[SECONDS]",
              help="Refresh every SECONDS (default 2) until Ctrl-C.")
@_json_option
@click.pass_obj
def stats_command(env: _Env, task: str | None, watch: float | None, as_json: bool) -> None:
    """Per task: accepted, duplicates, duplicate rate, skipped, released on failure.

    Per task: accepted enqueues (reserved; a retry keeping its lock is not one), duplicates,
    duplicate rate = duplicates / (accepted + duplicates), retries, skipped executions, locks
    released on failure, lost leases, store errors and the mean gate latency. Counts are
    those flushed to Redis by producers and workers (every few seconds). With --json
    --watch, one JSON object per line.

    Tasks with an approximate window (taskdedup.Approximate) also show, read from their live
    slices: identities remembered, fill ratio, estimated false-positive rate, live slices and
    slices dropped (in --json, under the task's "window").

    Tasks with limits (taskdedup.Concurrency / Rate) also show the slots in use and the calls
    waiting now (read live from Redis), and the calls put off and dropped by a limit (in
    --json, under the task's "limits"); per task, never per key value.
    """
    client = env.client()

    def windows() -> dict[str, WindowStats]:
        with _redis_errors(env):
            return read_windows(client, env.prefix, task)

    def read() -> dict[str, TaskStats]:
        with _redis_errors(env):
            return read_stats(client, env.prefix, task)

    def as_data(stats: dict[str, TaskStats]) -> dict[str, Any]:
        data: dict[str, Any] = {name: item.as_dict() for name, item in stats.items()}
        for name, window in windows().items():
            data.setdefault(name, {})["window"] = window.as_dict()
        for name, row in limit_rows(stats).items():
            data.setdefault(name, {})["limits"] = row
        return data

    def limit_rows(stats: dict[str, TaskStats]) -> dict[str, dict[str, int]]:
        with _redis_errors(env):
            return summary(client, env.prefix, stats, task)

    if watch is None:
        stats = read()
        if as_json:
            _echo_json(as_data(stats))
            return
        found = windows()
        limited = limit_rows(stats)
        if not stats and not found and not limited:
            click.echo(_no_stats(env.prefix, task))
        if stats:
            _console().print(_stats_table(stats, env.where))
            for note in _ignored_notes(stats):
                _console().print(Text(note))
        if found:
            _console().print(_windows_table(found, env.where))
        if limited:
            _console().print(_limits_table(limited, env.where))
        return
    try:
        if as_json:
            while True:
                _echo_json(
                    {"time": datetime.now(UTC).isoformat(), "tasks": as_data(read())},
                    compact=True,
                )
                _pause(watch)
        from rich.live import Live

        console = _console()
        with Live(console=console, auto_refresh=False) as live:
            while True:
                stats = read()
                view: Table | Text = (
                    _stats_table(stats, env.where) if stats else Text(_no_stats(env.prefix, task))
                )
                live.update(view, refresh=True)
                _pause(watch)
    except KeyboardInterrupt:
        return


def _ignored_notes(stats: dict[str, TaskStats]) -> list[str]:
    """One line per task whose hash holds fields that are not integers (skipped)."""
    return [
        f"{shown(item.task)}: {len(item.ignored)} field{'' if len(item.ignored) == 1 else 's'} "
        f"not an integer, ignored: {', '.join(shown(name) for name in item.ignored)}"
        for item in stats.values() if item.ignored
    ]


def _pause(seconds: float) -> None:
    """Wait between two refreshes of ``stats --watch`` (a seam for tests)."""
    time.sleep(seconds)


def _no_stats(prefix: str, task: str | None) -> str:
    where = stats_key(prefix, task) if task is not None else stats_key(prefix, "*")
    return (
        f"no stats at {where} yet (producers and workers flush them every few seconds "
        "once taskdedup.stats is attached)"
    )

