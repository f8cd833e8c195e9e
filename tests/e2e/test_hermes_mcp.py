"""Hermes Agent with pare's MCP server, configured as README shows (`mcp_servers.pare` with the
owner token), against the scripted stub: Hermes offers pare's `retrieve` tool to the model, the
scripted model calls it on the id of a marker pare forwarded earlier, Hermes calls pare's MCP server,
and the hidden content comes back exactly — in the tool result Hermes sends upstream and in what it
prints. Hermes needs its `mcp` extra for that (`pip install 'hermes-agent[mcp]'`, the MCP SDK at the
version Hermes pins): run.sh installs it in a venv of its own, since the suite's own MCP SDK tests
use a later SDK whose HTTP client Hermes cannot import."""

import json
import os
import subprocess
import textwrap

from stub_upstream import MODEL, PARE_RETRIEVE_TOOL, RETRIEVED_ANSWER
from test_mcp import forwarded_ids, small_pare  # noqa: F401 (a fixture)

HERMES_TIMEOUT_S = 300


def hermes_mcp_config(pare):
    return textwrap.dedent(
        f"""\
        model:
          provider: custom
          base_url: {pare.url}/v1
          default: {MODEL}
          api_key: sk-e2e-dummy
          context_length: 131072
        security:
          allow_lazy_installs: false
          tirith_enabled: false
        compression:
          enabled: false
        mcp_servers:
          pare:
            url: "{pare.url}/_pare/mcp"
            headers:
              x-pare-token: "{pare.token}"
        """
    )


def test_hermes_gets_a_marker_back_through_pares_mcp_server(small_pare, stub, tmp_path):
    hermes = os.environ.get("HERMES_MCP_BIN")
    assert hermes, "HERMES_MCP_BIN must name Hermes installed with its mcp extra (tests/e2e/run.sh sets it)"
    ids, _, texts = forwarded_ids(small_pare, stub)
    assert ids, "the session compacted"
    wanted = ids[0]
    home = tmp_path / "hermes-home"
    home.mkdir()
    (home / "config.yaml").write_text(hermes_mcp_config(small_pare))
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, HERMES_HOME=str(home), HOME=str(tmp_path), HERMES_DISABLE_LAZY_INSTALLS="1", NO_COLOR="1")
    for key in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENROUTER_API_KEY", "ANTHROPIC_API_KEY"):
        env.pop(key, None)

    stub.clear()
    completed = subprocess.run(
        [hermes, "-z", f"Get back {wanted} from pare and show it."],
        cwd=work, env=env, capture_output=True, text=True, timeout=HERMES_TIMEOUT_S,
    )
    report = f"exit {completed.returncode}\nstdout:\n{completed.stdout}\nstderr:\n{completed.stderr[-4000:]}"
    assert completed.returncode == 0, report
    chats = [json.loads(r["body"]) for r in stub.recorded() if r["path"].endswith("/chat/completions")]
    offered = [b for b in chats if PARE_RETRIEVE_TOOL in {t["function"]["name"] for t in b.get("tools") or []}]
    assert offered, f"Hermes offered pare's retrieve tool to the model: {report}"
    # The scripted model called the tool; Hermes sent its result back in the next request.
    last = offered[-1]["messages"]
    (call,) = [c for m in last if m.get("role") == "assistant" for c in m.get("tool_calls") or []]
    assert call["function"]["name"] == PARE_RETRIEVE_TOOL
    assert json.loads(call["function"]["arguments"]) == {"id": wanted}
    (result,) = [m for m in last if m.get("role") == "tool" and m.get("tool_call_id") == call["id"]]
    assert retrieved(result["content"]) == texts[wanted], result
    assert RETRIEVED_ANSWER in completed.stdout, report
    assert texts[wanted].splitlines()[0] in completed.stdout, report


def retrieved(content):
    """What Hermes read from an MCP tool's result, as it sends it to the model: `{"result": TEXT}`
    inside an `<untrusted_tool_result>` block that tells the model the text is data."""
    assert content.startswith('<untrusted_tool_result source="mcp__pare__retrieve">'), content[:200]
    start = content.index('{"result": ')
    value, _ = json.JSONDecoder().raw_decode(content, start)
    return value["result"]
