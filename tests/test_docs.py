"""The docs cannot rot: the site builds in strict mode (a broken link, a missing anchor or a page
left out of the nav fails), every relative link of the README and of docs/ points to a file
and heading that exist, and every name the code defines (policy fields, settings, CLI
commands and options, events, errors) appears on its reference page."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from functools import cache
from pathlib import Path

import click
import pytest
import redis

import taskdedup
from taskdedup import exceptions, metrics
from taskdedup.approximate import Approximate
from taskdedup.cli import main as cli_main
from taskdedup.events import Event
from taskdedup.policy import Mode, OnDuplicate, OnStoreError, Policy

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"


# -- the site ---------------------------------------------------------------------------------


def test_mkdocs_builds_in_strict_mode(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI"):  # as for a missing Redis binary: on CI an error, not a skip
            pytest.fail("mkdocs is not installed: the docs dependency group is missing")
        pytest.skip("mkdocs is not installed (pip install --group docs)")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "index.html").exists()


def test_every_page_of_docs_is_in_the_nav() -> None:
    """mkdocs warns about it too (strict: an error); this says which page, without mkdocs."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    missing = [p for p in pages if f": {p}" not in nav]
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"


# -- links: README (outside the site) and docs/ -----------------------------------------------


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces → '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)  # code spans keep their text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = text.strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The GitHub anchors of a Markdown file's headings (duplicates numbered as GitHub does)."""
    seen: dict[str, int] = {}
    found = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        match = None if in_code else re.match(r"#{1,6} (.+?)\s*#*$", line)
        if match:
            slug = github_slug(match.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(found)


def markdown_links(path: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every inline link and image outside code blocks."""
    links = []
    in_code = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        links += [(number, m.group(1))
                  for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line)]
    return links


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the relative links of ``path``: a missing file, a missing anchor."""
    problems = []
    for number, target in markdown_links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        where = f"{path.relative_to(root)}:{number}: {target}"
        if target.startswith("/"):
            problems.append(f"{where}: absolute link (breaks on GitHub or on the site)")
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with the anchor #{anchor} in {dest.name}")
    return problems


def checked_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("path", checked_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_and_headings_that_exist(path: Path) -> None:
    assert broken_links(path) == []


def test_the_link_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## A heading: with `code` — and more\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-heading-with-code--and-more) [gone](missing.md) "
        "[bad](other.md#nope) [self](#page) [web](https://example.com/x)\n"
        "```\n[in code](nowhere.md)\n```\n# Page\n"
    )
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "missing.md: no such file",
        "other.md#nope: no heading with the anchor #nope in other.md",
    ]


def test_readme_links_to_every_page_of_the_docs() -> None:
    """The README is the front door: its map reaches every page."""
    linked = {(ROOT / t.partition("#")[0]).resolve()
              for _, t in markdown_links(ROOT / "README.md") if t.startswith("docs/")}
    pages = {p.resolve() for p in DOCS.rglob("*.md")}
    assert sorted(str(p.relative_to(ROOT)) for p in pages - linked) == []


# -- reference pages: every name the code defines ---------------------------------------------


def page(name: str) -> str:
    return (REFERENCE / name).read_text()


def missing_from(text: str, names: list[str]) -> list[str]:
    """The names that do not appear in ``text`` as code: in a code span, alone or among
    other words (`--url URL`, `Policy(ttl=...)`)."""
    spans = re.findall(r"`([^`]+)`", re.sub(r"^```.*$", "", text, flags=re.M))
    return [n for n in names
            if not any(re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", s) for s in spans)]


def test_policy_reference_names_every_field_value_and_approximate_field() -> None:
    names = [f.name for f in dataclasses.fields(Policy)]
    names += [m.value for enum in (Mode, OnDuplicate, OnStoreError) for m in enum]
    names += [f.name for f in dataclasses.fields(Approximate)]
    names += ["bytes", "ttl_ms", "lease_ms", "TASKDEDUP_DISABLED"]
    names += ["disable", "enable", "disabled", "is_disabled"]
    assert len(names) > 25
    assert missing_from(page("policy.md"), names) == []


def celery_settings() -> list[str]:
    """The ``taskdedup_*`` settings the Celery integration reads from ``app.conf`` (there is no
    table of them in the code: every read is ``conf.get("taskdedup_...")``)."""
    sources = (ROOT / "taskdedup" / "celery").rglob("*.py")
    found = {m for path in sources
             for m in re.findall(r"conf\.get\(\s*\"(taskdedup_\w+)\"", path.read_text())}
    return sorted(found)


def environment_variables() -> list[str]:
    sources = (ROOT / "taskdedup").rglob("*.py")
    return sorted({m for path in sources
                   for m in re.findall(r"\bTASKDEDUP_[A-Z_]+\b", path.read_text())})


def test_settings_reference_names_every_celery_setting_rq_argument_and_variable() -> None:
    from taskdedup.rq import DedupQueue, DedupWorker

    settings = celery_settings()
    assert {"taskdedup_url", "taskdedup_store", "taskdedup_prefix"} <= set(settings)
    rq_arguments = [
        name for cls in (DedupQueue, DedupWorker)
        for name in cls.__init__.__code__.co_varnames if name.startswith("dedup")
    ]
    assert {"dedup", "dedup_store", "dedup_prefix"} <= set(rq_arguments)
    variables = environment_variables()
    assert {"TASKDEDUP_URL", "TASKDEDUP_PREFIX", "TASKDEDUP_DISABLED"} <= set(variables)
    names = [*settings, *rq_arguments, *variables, "heal_grace", "store_retry_delay"]
    assert missing_from(page("settings.md"), names) == []


def cli_commands() -> list[tuple[str, click.Command]]:
    """Every command of ``taskdedup`` (the lazy ones included), with its path."""
    found: list[tuple[str, click.Command]] = []

    def walk(path: str, command: click.Command, ctx: click.Context) -> None:
        found.append((path, command))
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None, f"{path} {name}"
                walk(f"{path} {name}", sub, click.Context(sub, parent=ctx, info_name=name))

    walk("taskdedup", cli_main, click.Context(cli_main, info_name="taskdedup"))
    return found


def test_cli_reference_names_every_command_and_option() -> None:
    commands = cli_commands()
    assert {"taskdedup key", "taskdedup web", "taskdedup sql prune", "taskdedup demo"} <= {
        path for path, _ in commands}
    text = page("cli.md")
    missing = []
    for path, command in commands:
        if path != "taskdedup" and not re.search(rf"^#+ `{re.escape(path)}`$", text, re.M):
            missing.append(f"{path}: no heading")
        for param in command.params:
            if isinstance(param, click.Option):
                names = [*param.opts, *param.secondary_opts]
                missing += [f"{path}: {n}" for n in missing_from(text, names)]
            elif not re.search(rf"\b{param.human_readable_name}\b", text):  # an argument
                missing.append(f"{path}: {param.human_readable_name}")
    assert missing == []


def test_events_reference_names_every_event_and_metric() -> None:
    text = page("events.md")
    assert missing_from(text, [e.value for e in Event]) == []
    source = (ROOT / "taskdedup" / "metrics.py").read_text()
    metric_names = sorted(set(re.findall(r"\"(taskdedup_[a-z_]+)\"", source)))
    counters = ("taskdedup_events", "taskdedup_second_calls")  # exposed with _total
    metric_names = [n + "_total" if n in counters else n for n in metric_names]
    assert len(metric_names) == 9, metric_names  # a tripwire: the regex still finds them
    assert missing_from(text, metric_names) == []
    assert missing_from(text, [f.name for f in dataclasses.fields(taskdedup.DedupEvent)]) == []
    assert metrics.INSTALL_HINT.split()[-1].strip("'") in text  # taskdedup[prometheus]


def test_errors_reference_has_a_section_for_every_exception() -> None:
    text = page("errors.md")
    missing = [name for name in exceptions.__all__
               if not re.search(rf"^## {name}$", text, re.M)]
    assert missing == []
    for name in exceptions.__all__:
        assert issubclass(getattr(exceptions, name), exceptions.TaskDedupError)


def test_operating_guide_lists_exactly_the_acl_commands_the_fault_suite_checks() -> None:
    from tests.test_topologies import ACL_COMMANDS

    text = (DOCS / "how-to" / "operating.md").read_text()
    section = text.split("### A least-privilege Redis user", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([A-Z]+(?: [A-Z]+)?)` \|", section, re.M)
    assert sorted(c.lower().replace(" ", "|") for c in listed) == sorted(
        c.lstrip("+") for c in ACL_COMMANDS)
    rule = " ".join(sorted(ACL_COMMANDS))
    assert all(c in section for c in rule.split())


# -- the tutorial runs as written -------------------------------------------------------------


@pytest.mark.slow
def test_tutorial_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its files and interactive sessions (doctest), against a server of its own on another
    port, with a real Celery worker and a real RQ worker."""
    import doctest

    from taskdedup import stats
    from taskdedup.testing import RedisServer

    text = (DOCS / "tutorial.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    files, sessions = [b for b in blocks if ">>>" not in b], [b for b in blocks if ">>>" in b]
    assert len(files) == 2 and len(sessions) == 5
    bindir = Path(sys.executable).parent
    with RedisServer() as server:
        port = str(server.port)

        def local(code: str) -> str:
            return code.replace("6379", port).replace("Redis()", f"Redis(port={port})")

        (tmp_path / "tasks.py").write_text(local(files[0]))
        (tmp_path / "jobs.py").write_text(local(files[1]))
        monkeypatch.syspath_prepend(str(tmp_path))
        env = {**os.environ, "PYTHONPATH": str(tmp_path)}
        namespace: dict[str, object] = {}

        def run(session: str, name: str) -> None:
            test = doctest.DocTestParser().get_doctest(local(session), namespace, name, None, 0)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
            output: list[str] = []
            runner.run(test, out=output.append, clear_globs=False)
            namespace.update(test.globs)
            assert runner.failures == 0, "".join(output)

        worker = subprocess.Popen(
            [str(bindir / "celery"), "-A", "tasks", "worker", "--loglevel=warning",
             "--pool=solo"], cwd=tmp_path, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            # the tutorial starts the worker first, in a terminal of its own: wait until it
            # answers (on a loaded machine its start takes longer than the session's get(10))
            from celery import Celery

            from taskdedup.testing import wait_for

            probe = Celery("probe", broker=server.url, set_as_current=False)
            try:
                wait_for(lambda: probe.control.ping(timeout=0.5), timeout=90, interval=0.2,
                         what="the tutorial's Celery worker to answer a ping")
            finally:
                probe.close()
            for i, session in enumerate(sessions[:3]):
                run(session, f"tutorial celery {i + 3}")
        finally:
            worker.terminate()
            worker.wait(timeout=30)
            for module in ("tasks", "jobs"):
                sys.modules.pop(module, None)
        run(sessions[3], "tutorial rq enqueue")
        subprocess.run(
            [str(bindir / "rq"), "worker", "-w", "taskdedup.rq.DedupWorker", "--job-class",
             "taskdedup.rq.DedupJob", "--burst", "--url", server.url, "emails"],
            cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120)
        run(sessions[4], "tutorial rq worker")
        sys.modules.pop("jobs", None)
        stats.flush_all()  # this process's counts, while their server still runs


def test_the_tutorials_server_command_listens_on_loopback_only_and_quietly(
    tmp_path: Path,
) -> None:
    """The bash line of step 1, as written (on a free port): the server answers on 127.0.0.1,
    is bound to nothing else, and prints no banner."""
    from taskdedup.testing import free_port, wait_for

    text = (DOCS / "tutorial.md").read_text()
    line = next(b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)
                if "find_server_binary" in b)
    port = free_port()
    command = line.replace("--port 6379", f"--port {port}").replace(
        "python -c", f"{sys.executable} -c")
    server = subprocess.Popen(command, shell=True, cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        client = redis.Redis(port=port)
        wait_for(lambda: _pings(client), timeout=15, what="the tutorial's server")
        assert client.config_get("bind")["bind"] == "127.0.0.1"
    finally:
        os.killpg(server.pid, 15)
        output, _ = server.communicate(timeout=15)
    assert "is starting" not in output and "Ready to accept" not in output, output  # quiet


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
