"""Hermes Agent in its Anthropic mode (`model.api_mode: anthropic_messages` on a custom provider,
whose `base_url` the bundled `anthropic` SDK extends with `/v1/messages`) pointed at pare → stub: it
must run the scripted `terminal` command, print the answer and exit 0, and every request it sent must
pass through pare and be archived in one session."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import new_requests, wait_until
from stub_messages import MESSAGES_ANSWER
from stub_responses import MARKER

HERMES_TIMEOUT_S = 300
HERMES = os.path.join(os.path.dirname(sys.executable), "hermes")
MODEL = "claude-sonnet-4-5"


def hermes_config(pare_url):
    return textwrap.dedent(
        f"""\
        model:
          provider: custom
          base_url: {pare_url}
          api_mode: anthropic_messages
          default: {MODEL}
          api_key: sk-ant-e2e-hermes
          context_length: 131072
        security:
          allow_lazy_installs: false
          tirith_enabled: false
        compression:
          enabled: false
        """
    )


def hermes_requests(stub):
    return [
        r for r in stub.recorded()
        if r["path"].split("?")[0] == "/v1/messages" and r["headers"].get("user-agent", "").startswith("Anthropic/Python")
    ]


@pytest.fixture()
def hermes_run(pare, fresh, tmp_path):
    home = tmp_path / "hermes-home"
    home.mkdir()
    (home / "config.yaml").write_text(hermes_config(pare.url))
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = dict(os.environ, HERMES_HOME=str(home), HOME=str(tmp_path), HERMES_DISABLE_LAZY_INSTALLS="1", NO_COLOR="1")
    for key in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENROUTER_API_KEY", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"):
        env.pop(key, None)
    before = pare.settled_sessions()
    completed = subprocess.run(
        [HERMES, "-z", "Write the marker file and show it."],
        cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=HERMES_TIMEOUT_S,
    )
    return completed, workdir, before


def test_hermes_anthropic_mode_runs_tools_through_pare(pare, fresh, hermes_run):
    completed, workdir, _ = hermes_run
    report = f"exit {completed.returncode}\nstdout:\n{completed.stdout}\nstderr:\n{completed.stderr[-4000:]}"
    assert completed.returncode == 0, report
    assert MESSAGES_ANSWER in completed.stdout, report
    assert (workdir / "out.txt").read_text() == MARKER + "\n", "the terminal command really ran"

    requests = hermes_requests(fresh)
    assert len(requests) == 2, [(r["method"], r["path"]) for r in fresh.recorded()]
    last = json.loads(requests[-1]["body"])
    assert last["model"] == MODEL and last.get("stream") is True
    assistant, result = last["messages"][-2:]
    (use,) = [b for b in assistant["content"] if b["type"] == "tool_use"]
    assert use["name"] == "terminal"
    (tool_result,) = [b for b in result["content"] if b["type"] == "tool_result"]
    assert tool_result["tool_use_id"] == use["id"] and MARKER in json.dumps(tool_result["content"])
    # Hermes marks its history with cache breakpoints; the API allows four.
    marks = json.dumps(last).count('"cache_control"')
    assert 0 < marks <= 4, marks


def test_hermes_anthropic_session_is_archived(pare, fresh, hermes_run):
    completed, _, before = hermes_run
    assert completed.returncode == 0, completed.stderr[-4000:]
    requests = hermes_requests(fresh)
    wait_until(lambda: sum(new_requests(before, pare.sessions()).values()) >= len(requests), what="Hermes' requests archived")
    grown = new_requests(before, pare.sessions())
    assert len(grown) == 1 and sum(grown.values()) == len(requests), grown
    (session,) = grown
    assert pare.bodies(session, "forwarded") == [r["body"] for r in requests]
