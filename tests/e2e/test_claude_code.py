"""Claude Code (npm `@anthropic-ai/claude-code`, installed by run.sh into tests/e2e/.node) run as
`claude -p` with `ANTHROPIC_BASE_URL` at pare → stub: it must run the scripted Bash command, print the
answer and exit 0, and every request it sent must pass through pare and be archived in one session
with its signed thinking block forwarded byte for byte.

Offline: an API key, a temporary HOME, telemetry, error reporting, the auto-updater and nonessential
traffic off."""

import json
import os
import subprocess

import pytest

from conftest import NODE_BIN, json_object_around, new_requests, wait_until
from stub_messages import MESSAGES_ANSWER, SIGNATURE
from stub_responses import MARKER

CLAUDE_TIMEOUT_S = 180
MODEL = "claude-sonnet-4-5"


def claude_requests(stub):
    return [
        r for r in stub.recorded()
        if r["path"].split("?")[0] == "/v1/messages" and r["headers"].get("user-agent", "").startswith("claude-cli/")
    ]


def claude_env(home, base_url):
    """Claude Code's environment, offline: an API key, `home` as HOME, pare at `base_url`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(
        HOME=str(home),
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY="sk-ant-e2e-claude",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        NO_COLOR="1",
    )
    return env


@pytest.fixture()
def claude_run(pare, fresh, tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = claude_env(tmp_path, pare.url)
    before = pare.settled_sessions()
    access_before = len(pare.access_log())
    completed = subprocess.run(
        [str(NODE_BIN / "claude"), "-p", "Write the marker file and show it.", "--model", MODEL, "--allowedTools", "Bash"],
        cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLAUDE_TIMEOUT_S,
    )
    return completed, workdir, before, access_before


def test_claude_code_runs_bash_through_pare(pare, fresh, claude_run):
    completed, workdir, _, access_before = claude_run
    report = f"exit {completed.returncode}\nstdout:\n{completed.stdout}\nstderr:\n{completed.stderr[-4000:]}"
    assert completed.returncode == 0, report
    assert MESSAGES_ANSWER in completed.stdout, report
    assert (workdir / "out.txt").read_text() == MARKER + "\n", "the Bash command really ran"

    requests = claude_requests(fresh)
    assert len(requests) >= 2, [(r["method"], r["path"]) for r in fresh.recorded()]
    assert all(r["path"] == "/v1/messages?beta=true" for r in requests)
    last = json.loads(requests[-1]["body"])
    assert last["model"] == MODEL and last.get("stream") is True
    assistant, result = last["messages"][-2:]
    assert [b["type"] for b in assistant["content"]] == ["thinking", "tool_use"]
    assert assistant["content"][0]["signature"] == SIGNATURE
    (tool_result,) = [b for b in result["content"] if b["type"] == "tool_result"]
    assert tool_result["tool_use_id"] == assistant["content"][1]["id"]
    assert MARKER in json.dumps(tool_result["content"])

    # Every request Claude Code sent went through pare.
    def lines():
        return [line for line in pare.access_log()[access_before:] if line["path"].startswith("/v1/messages")]

    sent = [r for r in fresh.recorded() if r["path"].startswith("/v1/messages")]
    wait_until(lambda: len(lines()) >= len(sent), what="pare's access lines for Claude Code's requests")
    assert len(lines()) == len(sent)
    assert all(line["status"] == 200 for line in lines())


def test_claude_code_session_is_archived(pare, fresh, claude_run):
    completed, _, before, _ = claude_run
    assert completed.returncode == 0, completed.stderr[-4000:]
    requests = claude_requests(fresh)
    wait_until(lambda: sum(new_requests(before, pare.sessions()).values()) >= len(requests), what="Claude Code's requests archived")
    grown = new_requests(before, pare.sessions())
    assert len(grown) == 1 and sum(grown.values()) == len(requests), grown
    (session,) = grown
    assert pare.bodies(session, "forwarded") == [r["body"] for r in requests]
    # The thinking block Claude Code sent back reaches the upstream byte for byte.
    raw = pare.bodies(session, "raw")[-1]
    assert json_object_around(requests[-1]["body"], SIGNATURE) == json_object_around(raw, SIGNATURE)
