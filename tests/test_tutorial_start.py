"""The tutorial's first step as a new user runs it (#24 stumbles 4 and 5): the first install
line is one that works from a checkout (taskdedup is not on PyPI), and the server command
listens on loopback only and prints no banner."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import redis

from taskdedup.testing import free_port, wait_for

TUTORIAL = Path(__file__).resolve().parent.parent / "docs" / "tutorial.md"


def _commands() -> list[str]:
    """The lines of the tutorial's ```bash blocks, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", TUTORIAL.read_text(), re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_the_first_install_line_installs_from_a_checkout() -> None:
    first = next(line for line in _commands() if "pip install" in line)
    assert re.search(r"pip install -e '/path/to/taskdedup\[celery,rq,server\]'", first), first


def test_the_server_command_listens_on_loopback_only_and_prints_no_banner() -> None:
    line = next(line for line in _commands() if "find_server_binary" in line)
    assert "--bind 127.0.0.1" in line and "--port 6379" in line
    port = free_port()
    command = line.replace("python -c", f"{sys.executable} -c").replace(
        "--port 6379", f"--port {port}")
    with subprocess.Popen(["bash", "-c", f"exec {command}"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as server:
        try:
            client = redis.Redis(port=port)

            def up() -> bool:
                try:
                    return bool(client.ping())
                except redis.ConnectionError:
                    return False

            wait_for(up, timeout=20, what="the tutorial's server")
            assert client.config_get("bind")["bind"] == "127.0.0.1"
            assert client.config_get("loglevel")["loglevel"] == "warning"
        finally:
            server.terminate()
            output, _ = server.communicate(timeout=20)
    assert "Port:" not in output and "Running mode" not in output, output  # no ASCII banner
