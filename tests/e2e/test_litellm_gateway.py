"""A real LiteLLM proxy using pare as its context compressor: LiteLLM's Headroom guardrail posts the
conversation to pare's `POST /v1/compress`, forwards the compacted messages (and a
`headroom_retrieve` tool) to a scripted upstream whose first turn calls that tool with a marker's id;
LiteLLM then fetches `GET /v1/retrieve/{hash}` from pare and sends the content back to the model.
Offline: LITELLM_LOCAL_MODEL_COST_MAP=True, both servers on 127.0.0.1."""

import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import PareProcess

MODEL = "stub-model"
ID = re.compile(r"pare:([0-9a-f]{12})(?![0-9a-zA-Z_])")
START_TIMEOUT_S = 120


class ScriptedModel:
    """An OpenAI-compatible upstream: the first turn calls `headroom_retrieve` with the first id a
    marker names; the turn after the tool result answers with the retrieved content's size."""

    def __init__(self):
        self.requests = []
        model = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):  # noqa: A002 - keep test output quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
                model.requests.append(body)
                last = body["messages"][-1]
                if last.get("role") == "tool" and last.get("tool_call_id") == "call_retrieve":
                    message = {"role": "assistant", "content": f"retrieved {len(last['content'])} chars"}
                elif not ID.search(json.dumps(body["messages"])):
                    message = {"role": "assistant", "content": "no marker in the request"}
                else:
                    ids = ID.findall(json.dumps(body["messages"]))
                    message = {"role": "assistant", "content": None, "tool_calls": [{
                        "id": "call_retrieve", "type": "function",
                        "function": {"name": "headroom_retrieve", "arguments": json.dumps({"hash": ids[0]})}}]}
                finish = "tool_calls" if message.get("tool_calls") else "stop"
                data = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000,
                                   "model": MODEL, "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                                   "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                data = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def conversation(n):
    """A coding session's messages: each old output is one pare collapses to a marker."""
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Fix the failing test in src/lib.rs"}]
    for k in range(n):
        call_id = f"call_{k}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function",
                         "function": {"name": "bash", "arguments": json.dumps({"command": f"cat src/file_{k}.rs"})}}]})
        output = "".join(f"fn item_{k}_{i}() -> u32 {{ {k * 1000 + i} }}\n" for i in range(40))
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    return messages


@pytest.fixture()
def litellm_with_pare(tmp_path):
    model = ScriptedModel()
    pare = PareProcess(f"{model.url}/v1", tmp_path / "archive")
    port = free_port()
    config = tmp_path / "litellm.yaml"
    config.write_text(f"""\
model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: {model.url}/v1
      api_key: sk-stub
guardrails:
  - guardrail_name: pare
    litellm_params:
      guardrail: headroom
      mode: pre_call
      api_base: {pare.url}
      api_key: {pare.token}
      default_on: true
""")
    # tests/e2e/run.sh installs LiteLLM in a venv of its own and names its command here.
    litellm = os.environ.get("LITELLM_BIN") or shutil.which("litellm", path=str(Path(sys.executable).parent)) or "litellm"
    master_key = "sk-" + secrets.token_hex(32)
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False",
               LITELLM_MASTER_KEY=master_key)
    log = open(tmp_path / "litellm.log", "w")
    process = subprocess.Popen([litellm, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health/liveliness", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"litellm did not start: {(tmp_path / 'litellm.log').read_text()[-3000:]}")
        time.sleep(0.5)
    yield url, master_key, model, pare
    process.terminate()
    process.wait(timeout=30)
    log.close()
    pare.stop()
    model.close()


def test_litellm_compresses_through_pare_and_retrieves_a_marker(litellm_with_pare):
    url, master_key, model, pare = litellm_with_pare
    messages = conversation(16)
    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json", "authorization": f"Bearer {master_key}"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())

    first, second = model.requests
    # The model saw pare's markers and the guardrail's retrieve tool.
    ids = ID.findall(json.dumps(first["messages"]))
    assert ids, first["messages"]
    assert len(first["messages"]) == len(messages), "pare keeps one message per message"
    assert "headroom_retrieve" in [t["function"]["name"] for t in first["tools"]]
    # LiteLLM fetched the id from pare and handed the model the original output, exactly.
    originals = {hashlib.sha256(m["content"].encode()).hexdigest()[:12]: m["content"]
                 for m in messages if isinstance(m.get("content"), str)}
    tool_result = second["messages"][-1]
    assert tool_result["role"] == "tool"
    assert tool_result["content"] == originals[ids[0]]
    assert answer["choices"][0]["message"]["content"] == f"retrieved {len(originals[ids[0]])} chars"
    # pare archived the compress call.
    sessions = [json.loads(line) for line in pare.cli("sessions", "list", "--json").splitlines()]
    assert sessions and sessions[0]["requests"] >= 1
