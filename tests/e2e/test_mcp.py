"""pare's MCP server (`/_pare/mcp`) through the official `mcp` Python SDK: connect (the SDK probes
`server/discover`, then falls back to the initialize handshake), list the tools, call `retrieve` on
the ids of markers pare forwarded (through the id lists elision markers name), and get the hidden
content back exactly."""

import asyncio
import hashlib
import json
import re
import urllib.error
import urllib.request

import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from conftest import PareProcess
from stub_upstream import MODEL

ID = re.compile(r"pare:([0-9a-f]{12})(?![0-9a-zA-Z_])")
SMALL_WINDOW = """\
budget:
  default_context_window: 6000
  output_reserve: 1000
  detect_window: false
"""


def content_id(text):
    return "pare:" + hashlib.sha256(text.encode()).hexdigest()[:12]


def session(n):
    """Chat requests of a coding session whose old outputs pare compacts at a 6k window."""
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Fix the failing test in src/lib.rs"}]
    bodies = []
    for k in range(n):
        bodies.append({"model": MODEL, "messages": list(messages)})
        call_id = f"call_{k}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function",
                         "function": {"name": "bash", "arguments": json.dumps({"command": f"cat src/file_{k}.rs"})}}]})
        output = "".join(f"fn item_{k}_{i}() -> u32 {{ {k * 1000 + i} }}\n" for i in range(40))
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    return bodies


@pytest.fixture(scope="module")
def small_pare(stub, tmp_path_factory):
    config = tmp_path_factory.mktemp("config") / "pare.yaml"
    config.write_text(SMALL_WINDOW)
    process = PareProcess(f"{stub.url}/v1", tmp_path_factory.mktemp("archive"), ("--config", str(config)))
    yield process
    assert process.stop() == 0


def post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status


def retrieve(small_pare, content_id_):
    with small_pare.open(f"/_pare/retrieve/{content_id_}") as response:
        return response.read().decode()


def forwarded_ids(small_pare, stub):
    """Drive a session through pare; the ids of the outputs its markers hid (an elision marker of
    several names one id list: followed through `/_pare/retrieve`), the list ids, and the raw texts."""
    stub.clear()
    bodies = session(20)
    for body in bodies:
        assert post(f"{small_pare.url}/v1/chat/completions", body) == 200
    forwarded = [r["body"].decode() for r in stub.recorded() if r["path"].endswith("/chat/completions")]
    named = sorted({f"pare:{hex_}" for body in forwarded for hex_ in ID.findall(body)})
    texts = {}
    for message in bodies[-1]["messages"]:
        if isinstance(message.get("content"), str) and message["content"]:
            texts[content_id(message["content"])] = message["content"]
    ids, lists, todo = set(), set(), list(named)
    while todo:
        id_ = todo.pop()
        if id_ in texts:
            ids.add(id_)
        elif id_ not in lists:
            lists.add(id_)
            todo.extend(f"pare:{hex_}" for hex_ in ID.findall(retrieve(small_pare, id_)))
    return sorted(ids), sorted(lists), texts


def test_mcp_sdk_lists_and_calls_retrieve(small_pare, stub):
    ids, lists, texts = forwarded_ids(small_pare, stub)
    assert len(ids) >= 5, "the session compacted"
    assert lists, "an elision marker named an id list"

    async def run():
        # The MCP server reads the archive: the client sends the owner token (README, "The MCP server").
        http = create_mcp_http_client(headers={"x-pare-token": small_pare.token})
        async with Client(streamable_http_client(f"{small_pare.url}/_pare/mcp", http_client=http)) as client:
            assert client.server_info.name == "pare"
            tools = await client.list_tools()
            assert [tool.name for tool in tools.tools] == ["retrieve"]
            assert tools.tools[0].input_schema["required"] == ["id"]
            for content_id_ in ids[:5]:
                result = await client.call_tool("retrieve", {"id": content_id_})
                assert not result.is_error
                assert result.content[0].text == texts[content_id_]
            some = await client.call_tool("retrieve", {"id": ids[0], "lines": "2-3"})
            assert some.content[0].text == "".join(texts[ids[0]].splitlines(keepends=True)[1:3])
            hits = await client.call_tool("retrieve", {"id": ids[0], "grep": r"\{ \d+0 \}"})
            assert all(re.match(r"\d+: fn item_", line) for line in hits.content[0].text.splitlines())
            listed = await client.call_tool("retrieve", {"id": lists[0]})
            assert not listed.is_error and ID.search(listed.content[0].text), "a list names the ids it stands for"
            unknown = await client.call_tool("retrieve", {"id": "pare:000000000000"})
            assert unknown.is_error
            assert "no content with id" in unknown.content[0].text

    asyncio.run(run())


def test_retrieve_endpoint_serves_the_same_content(small_pare, stub):
    ids, _, texts = forwarded_ids(small_pare, stub)
    with small_pare.open(f"/_pare/retrieve/{ids[0]}") as response:
        assert response.headers["content-type"] == "text/plain; charset=utf-8"
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.read().decode() == texts[ids[0]]


def test_retrieve_and_mcp_refuse_a_caller_without_the_owner_token(small_pare, stub):
    """Another user of the machine (no token) and a request forwarded by a proxy read nothing."""
    ids, _, _ = forwarded_ids(small_pare, stub)
    for path, headers in [(f"/_pare/retrieve/{ids[0]}", {}),
                          (f"/_pare/retrieve/{ids[0]}", {"x-forwarded-for": "203.0.113.7"}),
                          ("/_pare/ui/", {}),
                          ("/_pare/metrics", {"x-forwarded-for": "203.0.113.7"})]:
        request = urllib.request.Request(f"{small_pare.url}{path}", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 401, (path, headers)
