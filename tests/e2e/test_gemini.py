"""The Gemini API through pare: the official `google-genai` SDK (`generate_content`,
`generate_content_stream`, a function-calling loop whose signed call must reach the upstream byte for
byte), the JSON-array stream, the API key kept out of the archive and the logs, pare's own errors in
Google's shape; and Gemini CLI (npm `@google/gemini-cli`, installed by run.sh into tests/e2e/.node) run
as `gemini -p` with `GOOGLE_GEMINI_BASE_URL` at pare → stub: it must run the scripted shell command,
print the answer and exit 0, and every request of its conversation must be archived in one session.

Gemini CLI offline: an API key (`GEMINI_API_KEY`, auth type `gemini-api-key` in a temporary HOME's
settings), usage statistics (Clearcut), telemetry, auto-update and its notification off, `--yolo`
to run the shell tool without asking, the work directory trusted (`GEMINI_CLI_TRUST_WORKSPACE`)."""

import json
import os
import subprocess

import httpx
import pytest
from google import genai
from google.genai import types

from conftest import NODE_BIN, json_object_around, new_requests, wait_until
from stub_gemini import GEMINI_ANSWER, SHELL_TOOL, SIGNATURE, THOUGHT
from stub_responses import MARKER

SHELL_TIMEOUT_S = 10
GEMINI_TIMEOUT_S = 180
MODEL = "gemini-2.5-flash"
API_KEY = "AIzaE2E-gemini-SECRET-key"


def gemini_requests(stub, method=None):
    def wanted(path):
        return path.endswith((":generateContent", ":streamGenerateContent")) and (method is None or path.endswith(f":{method}"))

    return [r for r in stub.recorded() if wanted(r["path"].split("?")[0])]


class Client:
    """A google-genai client at pare that keeps the exact bytes of every request body it sends."""

    def __init__(self, pare):
        self.sent = []
        self.headers = []
        hooks = {
            "request": [lambda request: self.sent.append(request.read())],
            "response": [lambda response: self.headers.append(response.headers)],
        }
        self.sdk = genai.Client(
            api_key=API_KEY,
            http_options=types.HttpOptions(base_url=pare.url, client_args={"event_hooks": hooks}),
        )


def config():
    return types.GenerateContentConfig(
        system_instruction="You run shell commands for the user.",
        tools=[types.Tool(function_declarations=[types.FunctionDeclaration(**SHELL_TOOL)])],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        thinking_config=types.ThinkingConfig(include_thoughts=True),
        max_output_tokens=2048,
    )


def generate(client, contents, stream):
    """One turn: the model's content (streamed pieces joined as the SDK's callers join them)."""
    if not stream:
        return client.sdk.models.generate_content(model=MODEL, contents=contents, config=config()).candidates[0].content
    parts = []
    for chunk in client.sdk.models.generate_content_stream(model=MODEL, contents=contents, config=config()):
        for part in chunk.candidates[0].content.parts or []:
            if parts and part.text is not None and parts[-1].text is not None and not part.thought and not parts[-1].thought:
                parts[-1].text += part.text
            else:
                parts.append(part)
    return types.Content(role="model", parts=parts)


def tool_loop(client, workdir, stream):
    """The model thinks and calls run_shell (signed), the client runs it, the model answers."""
    contents = [types.Content(role="user", parts=[types.Part(text="Write the marker file and show it.")])]
    first = generate(client, contents, stream)
    thought, call = first.parts
    assert thought.thought and thought.text == THOUGHT
    assert call.function_call.name == "run_shell" and call.thought_signature is not None
    ran = subprocess.run(
        ["bash", "-c", call.function_call.args["command"]], cwd=workdir, capture_output=True, text=True, timeout=SHELL_TIMEOUT_S,
    )
    contents.append(first)
    response = types.Part.from_function_response(name="run_shell", response={"output": ran.stdout})
    contents.append(types.Content(role="user", parts=[response]))
    second = generate(client, contents, stream)
    return "".join(p.text or "" for p in second.parts)


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_function_calling_keeps_the_signature_bytes(pare, fresh, tmp_path, stream):
    before = pare.settled_sessions()
    client = Client(pare)
    assert tool_loop(client, tmp_path, stream) == GEMINI_ANSWER
    assert (tmp_path / "out.txt").read_text() == MARKER + "\n"
    requests = gemini_requests(fresh)
    assert len(requests) == 2 and len(client.sent) == 2
    method = "streamGenerateContent?alt=sse" if stream else "generateContent"
    assert all(r["path"].endswith(f"/models/{MODEL}:{method}") for r in requests), [r["path"] for r in requests]
    assert all(r["headers"].get("x-goog-api-key") == API_KEY for r in requests), "the key passes upstream"
    forwarded = json.loads(requests[1]["body"])
    assert forwarded["systemInstruction"]["parts"][0]["text"] == "You run shell commands for the user."
    # The signed call reaches the upstream byte for byte (Gemini 3 refuses a changed one).
    sent = json_object_around(client.sent[1], SIGNATURE)
    assert json.loads(sent)["thoughtSignature"] == SIGNATURE
    assert json_object_around(requests[1]["body"], SIGNATURE) == sent
    # pare says what it did, and archives both requests in one session, as sent.
    sessions = {h.get("x-pare-session") for h in client.headers}
    assert len(sessions) == 1 and None not in sessions, [dict(h) for h in client.headers]
    for h in client.headers:
        assert int(h["x-pare-tokens-raw"]) > 0 and int(h["x-pare-tokens-forwarded"]) > 0, dict(h)
    (session,) = sessions
    wait_until(lambda: pare.sessions().get(session, {}).get("requests") == 2, what="both requests archived")
    assert pare.sessions().keys() - before.keys() == {session}
    assert pare.sessions()[session].get("wire") == "gemini", pare.sessions()[session]
    assert pare.bodies(session, "raw") == client.sent
    assert pare.bodies(session, "forwarded") == [r["body"] for r in requests]


def test_sdk_stream_reaches_the_client_as_sent(pare, fresh):
    client = Client(pare)
    chunks = list(client.sdk.models.generate_content_stream(model=MODEL, contents="Say hello."))
    assert "".join(c.text for c in chunks) == "Hello from the stub."
    assert len(chunks) == 4, "one response per word"
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
    assert chunks[-1].usage_metadata.cached_content_token_count > 0
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    url = f"{pare.url}/v1beta/models/{MODEL}:streamGenerateContent?alt=sse"
    with httpx.stream("POST", url, json=body, headers={"x-goog-api-key": API_KEY}, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        received = b"".join(response.iter_raw())
    assert received == gemini_requests(fresh)[-1]["streamed"]


def test_json_array_stream_passes_through_and_the_key_is_never_stored(pare, fresh):
    """`streamGenerateContent` without `alt=sse` streams a JSON array; the key in `key=` reaches the
    upstream but neither the archive nor pare's log lines."""
    before = pare.settled_sessions()
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    url = f"{pare.url}/v1beta/models/{MODEL}:streamGenerateContent?key={API_KEY}"
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        assert response.status_code == 200
        session = response.headers["x-pare-session"]
        received = b"".join(response.iter_raw())
    (request,) = gemini_requests(fresh)
    assert request["path"].endswith(f"?key={API_KEY}"), "the query string passes upstream"
    assert received == request["streamed"] and received.startswith(b"[")
    assert [c["candidates"][0]["content"]["parts"][0]["text"] for c in json.loads(received)] == ["Hello", " from", " the", " stub."]
    wait_until(lambda: pare.sessions().get(session, {}).get("requests") == 1, what="the request archived")
    assert new_requests(before, pare.sessions()) == {session: 1}
    for path in pare.archive.rglob("*"):
        if path.is_file():
            assert API_KEY.encode() not in path.read_bytes(), f"the API key reached {path}"
    assert not any(API_KEY in json.dumps(line) for line in pare.lines), "the API key reached pare's log"


def test_pare_errors_reach_the_sdk_in_google_shape(tmp_path):
    """An unreachable upstream: pare's 502 arrives as Google's error shape, which the SDK parses into
    its own error with pare's message."""
    import socket

    from conftest import PareProcess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    pare = PareProcess(f"http://127.0.0.1:{dead_port}", tmp_path / "archive")
    try:
        sdk = genai.Client(api_key=API_KEY, http_options=types.HttpOptions(base_url=pare.url))
        with pytest.raises(genai.errors.ServerError) as raised:
            sdk.models.generate_content(model=MODEL, contents="hi")
        error = raised.value
        assert error.code == 502 and error.status == "UNAVAILABLE", error
        assert f"127.0.0.1:{dead_port}" in error.message, error
    finally:
        assert pare.stop() == 0


@pytest.fixture()
def gemini_run(pare, fresh, tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    home = tmp_path / "home"
    (home / ".gemini").mkdir(parents=True)
    settings = {
        "security": {"auth": {"selectedType": "gemini-api-key"}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
    }
    (home / ".gemini" / "settings.json").write_text(json.dumps(settings))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GEMINI_", "GOOGLE_"))}
    env.update(
        HOME=str(home),
        GEMINI_API_KEY=API_KEY,
        GOOGLE_GEMINI_BASE_URL=pare.url,
        GEMINI_TELEMETRY_ENABLED="false",
        # Headless runs in an untrusted folder fall back to asking before each tool: trust the work dir.
        GEMINI_CLI_TRUST_WORKSPACE="true",
        NO_COLOR="1",
        CI="1",
    )
    before = pare.settled_sessions()
    completed = subprocess.run(
        [str(NODE_BIN / "gemini"), "-p", "Write the marker file and show it.", "-m", MODEL, "--yolo"],
        cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=GEMINI_TIMEOUT_S,
    )
    return completed, workdir, before


def test_gemini_cli_runs_the_shell_tool_through_pare(pare, fresh, gemini_run):
    completed, workdir, before = gemini_run
    report = f"exit {completed.returncode}\nstdout:\n{completed.stdout}\nstderr:\n{completed.stderr[-4000:]}"
    assert completed.returncode == 0, report
    assert GEMINI_ANSWER in completed.stdout, report
    assert (workdir / "out.txt").read_text() == MARKER + "\n", "the shell command really ran"

    # The conversation: Gemini CLI's streamed requests, the last one carrying the signed call and its response.
    requests = gemini_requests(fresh, "streamGenerateContent")
    assert len(requests) >= 2, [(r["method"], r["path"]) for r in fresh.recorded()]
    assert all(r["path"].endswith(f"/models/{MODEL}:streamGenerateContent?alt=sse") for r in requests), [r["path"] for r in requests]
    assert all(r["headers"].get("x-goog-api-key") == API_KEY for r in requests)
    last = json.loads(requests[-1]["body"])
    model_turn, user_turn = last["contents"][-2:]
    (call,) = [p for p in model_turn["parts"] if "functionCall" in p]
    assert call["functionCall"]["name"] == "run_shell_command" and call["thoughtSignature"] == SIGNATURE
    (response,) = [p for p in user_turn["parts"] if "functionResponse" in p]
    assert MARKER in json.dumps(response["functionResponse"]["response"])

    # Every request of the conversation is archived in one session, forwarded as pare says.
    wait_until(
        lambda: sum(new_requests(before, pare.sessions()).values()) >= len(gemini_requests(fresh)),
        what="Gemini CLI's requests archived",
    )
    grown = new_requests(before, pare.sessions())
    conversation = [sid for sid in grown if pare.bodies(sid, "forwarded")[-1] == requests[-1]["body"]]
    assert len(conversation) == 1, grown
    (session,) = conversation
    assert grown[session] == len(requests), (grown, len(requests))
    assert pare.bodies(session, "forwarded") == [r["body"] for r in requests]
    raw = pare.bodies(session, "raw")[-1]
    assert json_object_around(requests[-1]["body"], SIGNATURE) == json_object_around(raw, SIGNATURE)
