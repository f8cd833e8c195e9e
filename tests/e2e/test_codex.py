"""Codex CLI (npm `@openai/codex`, installed by run.sh into tests/e2e/.node) pointed at pare → stub:
`codex exec` must run the scripted shell command, print the answer and exit 0, and every request it
sent must pass through pare and be archived in one session.

The provider is the README's Codex config exactly as written (read from README.md; only the address
is pare's): Codex speaks HTTP to it and says nothing about WebSockets. Codex's built-in provider
pointed at pare (`openai_base_url`) asks for its WebSocket transport first: pare answers 426 and Codex
uses HTTP at once, without a retry or a fallback warning.

Offline: an API key in `OPENAI_API_KEY`, no ChatGPT login; analytics, the update check and the plugin
sync (which resolves github.com) off."""

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from conftest import NODE_BIN, new_requests, wait_until
from stub_responses import MARKER, RESPONSES_ANSWER

CODEX_TIMEOUT_S = 180
README = Path(__file__).resolve().parents[2] / "README.md"
# The address the README's examples give pare.
README_ADDR = "http://127.0.0.1:8787"

# What the test itself sets around the provider: the model, no approvals, no sandbox, nothing online.
TEST_SETTINGS = """\
model = "stub-model"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false
"""
OFFLINE_TABLES = """
[analytics]
enabled = false

[features]
plugins = false
"""


def readme_codex_config():
    """The TOML block of README.md's Codex CLI entry, as written."""
    text = README.read_text()
    entry = text[text.index("- **Codex CLI**"):]
    block = re.search(r"```toml\n(.*?)\n\s*```", entry, re.S)
    assert block, "README.md's Codex CLI entry has a toml block"
    return textwrap.dedent(block.group(1)) + "\n"


def codex_config(pare_url):
    """The test's settings and the README's provider block, pointed at this pare."""
    provider = readme_codex_config()
    assert README_ADDR in provider, provider
    return TEST_SETTINGS + provider.replace(README_ADDR, pare_url) + OFFLINE_TABLES


def builtin_provider_config(pare_url):
    """Codex's built-in OpenAI provider with its base URL at this pare."""
    return TEST_SETTINGS + f'openai_base_url = "{pare_url}/v1"\n' + OFFLINE_TABLES


def codex_requests(stub):
    return [
        r for r in stub.recorded()
        if r["path"].split("?")[0] == "/v1/responses" and r["headers"].get("originator") == "codex_exec"
    ]


def run_codex(pare, tmp_path, config):
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(config)
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(CODEX_HOME=str(home), HOME=str(tmp_path), OPENAI_API_KEY="sk-e2e-codex", NO_COLOR="1")
    before = pare.settled_sessions()
    access_before = len(pare.access_log())
    completed = subprocess.run(
        [str(NODE_BIN / "codex"), "exec", "--skip-git-repo-check", "Write the marker file and show it."],
        cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CODEX_TIMEOUT_S,
    )
    return completed, workdir, before, access_before


@pytest.fixture()
def codex_run(pare, fresh, tmp_path):
    return run_codex(pare, tmp_path, codex_config(pare.url))


def report_of(completed):
    return f"exit {completed.returncode}\nstdout:\n{completed.stdout}\nstderr:\n{completed.stderr[-4000:]}"


def test_the_readme_config_is_used_as_written(pare):
    config = codex_config(pare.url)
    provider = readme_codex_config()
    assert "supports_websockets" not in provider and "retries" not in provider, provider
    assert provider.replace(README_ADDR, pare.url) in config


def test_codex_runs_the_command_through_pare(pare, fresh, codex_run):
    completed, workdir, _, access_before = codex_run
    report = report_of(completed)
    assert completed.returncode == 0, report
    assert "websocket" not in (completed.stdout + completed.stderr).lower(), report
    assert RESPONSES_ANSWER in completed.stdout, report
    assert (workdir / "out.txt").read_text() == MARKER + "\n", "the shell command really ran"

    requests = codex_requests(fresh)
    assert len(requests) >= 2, [(r["method"], r["path"]) for r in fresh.recorded()]
    bodies = [json.loads(r["body"]) for r in requests]
    assert all(b.get("stream") is True for b in bodies), "Codex streams every request"
    outputs = [i for i in bodies[-1]["input"] if i.get("type") == "function_call_output"]
    assert len(outputs) == 1 and MARKER in outputs[0]["output"], outputs
    calls = [i for i in bodies[-1]["input"] if i.get("type") == "function_call"]
    assert [c["call_id"] for c in calls] == [outputs[0]["call_id"]]

    # Every request Codex sent went through pare.
    def lines():
        return [line for line in pare.access_log()[access_before:] if line["path"] == "/v1/responses"]

    wait_until(lambda: len(lines()) >= len(requests), what="pare's access lines for Codex's requests")
    assert len(lines()) == len(requests)
    assert all(line["status"] == 200 for line in lines())


def test_codex_session_is_archived(pare, fresh, codex_run):
    completed, _, before, _ = codex_run
    assert completed.returncode == 0, completed.stderr[-4000:]
    requests = codex_requests(fresh)
    wait_until(lambda: sum(new_requests(before, pare.sessions()).values()) >= len(requests), what="Codex's requests archived")
    grown = new_requests(before, pare.sessions())
    assert len(grown) == 1 and sum(grown.values()) == len(requests), grown
    (session,) = grown
    assert pare.bodies(session, "forwarded") == [r["body"] for r in requests]


def test_codex_builtin_provider_falls_back_to_http_at_once(pare, fresh, tmp_path):
    completed, workdir, _, access_before = run_codex(pare, tmp_path, builtin_provider_config(pare.url))
    report = report_of(completed)
    assert completed.returncode == 0, report
    assert RESPONSES_ANSWER in completed.stdout, report
    assert (workdir / "out.txt").read_text() == MARKER + "\n", "the shell command really ran"
    output = completed.stdout + completed.stderr
    assert "Falling back from WebSockets" not in output and "Reconnecting" not in output, report

    requests = codex_requests(fresh)
    assert len(requests) >= 2, [(r["method"], r["path"]) for r in fresh.recorded()]
    assert all(r["method"] == "POST" for r in requests), "the handshake never reached the upstream"

    def lines():
        return [line for line in pare.access_log()[access_before:] if line["path"] == "/v1/responses"]

    wait_until(lambda: len(lines()) >= len(requests) + 1, what="pare's access lines for Codex's requests")
    # One handshake, refused; then every request over HTTP, answered.
    assert [line["status"] for line in lines()] == [426] + [200] * len(requests), lines()
