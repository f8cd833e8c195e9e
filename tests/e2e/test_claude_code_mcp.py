"""Claude Code with pare's MCP server (`claude mcp add --transport http pare …/_pare/mcp`, as README
shows) against the scripted Messages stub: the scripted model turn calls the `retrieve` tool on the
id of a marker pare forwarded earlier, Claude Code calls pare's MCP server, and the hidden content
comes back exactly — in the tool result Claude Code sends upstream and in what it prints."""

import json
import subprocess

from conftest import NODE_BIN
from stub_messages import RETRIEVE_TOOL, RETRIEVED_ANSWER
from test_claude_code import MODEL, claude_env, claude_requests
from test_mcp import forwarded_ids, small_pare  # noqa: F401 (a fixture)

CLAUDE_TIMEOUT_S = 180


def claude(args, home, base_url, cwd):
    return subprocess.run([str(NODE_BIN / "claude"), *args], cwd=cwd, env=claude_env(home, base_url),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLAUDE_TIMEOUT_S)


def test_claude_code_gets_a_marker_back_through_pares_mcp_server(small_pare, stub, tmp_path):
    ids, _, texts = forwarded_ids(small_pare, stub)
    assert ids, "the session compacted"
    wanted = ids[0]
    work = tmp_path / "work"
    work.mkdir()
    added = claude(["mcp", "add", "--transport", "http", "pare", f"{small_pare.url}/_pare/mcp",
                    "--header", f"x-pare-token: {small_pare.token}"], tmp_path, small_pare.url, work)
    assert added.returncode == 0, added.stderr[-2000:]

    stub.clear()
    completed = claude(
        ["-p", f"Get back {wanted} from pare and show it.", "--model", MODEL, "--allowedTools", RETRIEVE_TOOL],
        tmp_path, small_pare.url, work,
    )
    report = f"exit {completed.returncode}\nstdout:\n{completed.stdout}\nstderr:\n{completed.stderr[-4000:]}"
    assert completed.returncode == 0, report
    requests = claude_requests(stub)
    offered = [r for r in requests if RETRIEVE_TOOL in r["body"].decode()]
    assert offered, "Claude Code offered pare's retrieve tool to the model"
    last = offered[-1]["body"].decode()
    assert '"tool_result"' in last, report
    # The hidden content, exactly, in the tool result Claude Code sent back (Claude Code appends its own
    # reminders after a tool's output) and in what it printed.
    body = json.loads(last)
    (result,) = [b for b in body["messages"][-1]["content"] if b.get("type") == "tool_result"]
    content = result["content"]
    text = content if isinstance(content, str) else "".join(b.get("text", "") for b in content)
    assert text.startswith(texts[wanted]), text
    tail = text[len(texts[wanted]):].strip()
    assert tail == "" or tail.startswith("<system-reminder>"), tail
    assert RETRIEVED_ANSWER in completed.stdout, report
    assert texts[wanted].splitlines()[0] in completed.stdout, report
