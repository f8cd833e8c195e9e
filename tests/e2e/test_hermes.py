"""Hermes Agent (PyPI `hermes-agent`) pointed at pare → scripted stub: it must run the scripted tool
calls (`terminal` ls, `read_file`, `search_files`), print the final answer and exit 0, and every request
it sent must have reached the stub through pare."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import wait_until
from stub_upstream import HERMES_ANSWER, MODEL, PROBES

HERMES_TIMEOUT_S = 300
HERMES = os.path.join(os.path.dirname(sys.executable), "hermes")
NEEDLE_TEXT = "the needle-4242 lives here\n"


def hermes_config(pare_url):
    return textwrap.dedent(
        f"""\
        model:
          provider: custom
          base_url: {pare_url}/v1
          default: {MODEL}
          api_key: sk-e2e-dummy
          context_length: 131072
        security:
          allow_lazy_installs: false
          tirith_enabled: false
        compression:
          enabled: false
        """
    )


@pytest.fixture()
def hermes_run(pare, fresh, tmp_path):
    home = tmp_path / "hermes-home"
    home.mkdir()
    (home / "config.yaml").write_text(hermes_config(pare.url))
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "notes.txt").write_text(NEEDLE_TEXT)
    (workdir / "README.md").write_text("a small project\n")
    fresh.search_path = str(workdir)
    env = dict(
        os.environ,
        HERMES_HOME=str(home),
        HOME=str(tmp_path),
        HERMES_DISABLE_LAZY_INSTALLS="1",
        NO_COLOR="1",
    )
    for key in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENROUTER_API_KEY", "ANTHROPIC_API_KEY"):
        env.pop(key, None)
    before = len(pare.access_log())
    completed = subprocess.run(
        [HERMES, "-z", "Find where the needle is mentioned in this project."],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=HERMES_TIMEOUT_S,
    )
    return completed, before


def test_hermes_runs_tools_through_pare(pare, fresh, hermes_run):
    completed, before = hermes_run
    report = f"exit {completed.returncode}\nstdout:\n{completed.stdout}\nstderr:\n{completed.stderr}"
    assert completed.returncode == 0, report
    assert HERMES_ANSWER in completed.stdout, report

    chats = [r for r in fresh.recorded() if r["path"].endswith("/chat/completions")]
    assert len(chats) >= 4, [r["path"] for r in fresh.recorded()]
    bodies = [json.loads(r["body"]) for r in chats]
    assert all(b.get("stream") is True for b in bodies), "Hermes streams every chat request"

    # The tools really ran: their results came back in the next requests.
    last = bodies[-1]["messages"]
    results = [m for m in last if m.get("role") == "tool"]
    assert len(results) == 3, json.dumps(last, indent=1)[:4000]
    assert "notes.txt" in str(results[0]["content"]), results[0]
    assert "needle-4242" in str(results[1]["content"]), results[1]
    assert "notes.txt" in str(results[2]["content"]), results[2]

    # Every request Hermes sent went through pare and reached the stub (probes included). pare's own
    # context-window detection (budget.detect_window) also asks the stub, with a user-agent ending in
    # `window-detection`: those are not Hermes' requests and never appear in pare's access log.
    from_agent = [r for r in fresh.recorded() if "window-detection" not in r["headers"].get("user-agent", "")]
    wait_until(lambda: len(pare.access_log()) - before >= len(from_agent), what="pare's access lines for every request")
    forwarded = [(line["method"], line["path"]) for line in pare.access_log()[before:]]
    received = [(r["method"], r["path"].split("?")[0]) for r in from_agent]
    assert sorted(forwarded) == sorted(received)
    probed = {path for _, path in received} & set(PROBES)
    assert probed, f"Hermes' server-kind probes should pass through pare to the stub: {received}"
