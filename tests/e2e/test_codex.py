"""Codex CLI (npm `@openai/codex`, installed by run.sh into tests/e2e/.node) pointed at pare → stub
through a custom Responses provider: `codex exec` must run the scripted shell command, print the
answer and exit 0, and every request it sent must pass through pare and be archived in one
session.

Offline: an API-key provider (`env_key`), no ChatGPT login; no websockets; analytics, the update
check and the plugin sync (which resolves github.com) off; no retries, so a failing proxy fails fast."""

import json
import os
import subprocess
import textwrap

import pytest

from conftest import NODE_BIN, new_requests, wait_until
from stub_responses import MARKER, RESPONSES_ANSWER

CODEX_TIMEOUT_S = 180


def codex_config(pare_url):
    return textwrap.dedent(
        f"""\
        model = "stub-model"
        model_provider = "pare"
        approval_policy = "never"
        sandbox_mode = "danger-full-access"
        check_for_update_on_startup = false

        [model_providers.pare]
        name = "pare"
        base_url = "{pare_url}/v1"
        wire_api = "responses"
        env_key = "PARE_TEST_KEY"
        supports_websockets = false
        request_max_retries = 0
        stream_max_retries = 0
        stream_idle_timeout_ms = 60000

        [analytics]
        enabled = false

        [features]
        plugins = false
        """
    )


def codex_requests(stub):
    return [
        r for r in stub.recorded()
        if r["path"].split("?")[0] == "/v1/responses" and r["headers"].get("originator") == "codex_exec"
    ]


@pytest.fixture()
def codex_run(pare, fresh, tmp_path):
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(codex_config(pare.url))
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(CODEX_HOME=str(home), HOME=str(tmp_path), PARE_TEST_KEY="sk-e2e-codex", NO_COLOR="1")
    before = pare.settled_sessions()
    access_before = len(pare.access_log())
    completed = subprocess.run(
        [str(NODE_BIN / "codex"), "exec", "--skip-git-repo-check", "Write the marker file and show it."],
        cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CODEX_TIMEOUT_S,
    )
    return completed, workdir, before, access_before


def test_codex_runs_the_command_through_pare(pare, fresh, codex_run):
    completed, workdir, _, access_before = codex_run
    report = f"exit {completed.returncode}\nstdout:\n{completed.stdout}\nstderr:\n{completed.stderr[-4000:]}"
    assert completed.returncode == 0, report
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
