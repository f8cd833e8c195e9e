"""The official `anthropic` SDK (`messages.create`, `messages.stream`) against pare → stub: a tool loop
whose history carries a signed thinking block, which must reach the upstream byte for byte. pare
archives each exchange and says what it forwarded in its `x-pare-*` headers."""

import json
import subprocess

import anthropic
import httpx
import pytest

from conftest import json_object_around, wait_until
from stub_messages import MESSAGES_ANSWER, SHELL_TOOL, SIGNATURE, THINKING
from stub_responses import MARKER

SHELL_TIMEOUT_S = 10
MODEL = "claude-stub-4"
STREAM_EVENTS = [
    "message_start",
    "content_block_start",  # thinking
    "content_block_delta",
    "content_block_delta",
    "content_block_delta",  # signature_delta
    "content_block_stop",
    "content_block_start",  # tool_use
    "content_block_delta",
    "content_block_delta",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
]


class Client:
    """An SDK client that keeps the exact bytes of every request body it sends."""

    def __init__(self, pare):
        self.sent = []
        hooks = {"request": [lambda request: self.sent.append(request.content)]}
        self.sdk = anthropic.Anthropic(
            base_url=pare.url, api_key="sk-ant-e2e-dummy", timeout=30, max_retries=0,
            http_client=anthropic.DefaultHttpxClient(event_hooks=hooks),
        )


def messages_requests(stub):
    return [r for r in stub.recorded() if r["path"].split("?")[0] == "/v1/messages"]


def call(client, messages, stream):
    """One turn: the final message and the HTTP response's headers."""
    args = dict(
        model=MODEL, max_tokens=2048, messages=messages, tools=[SHELL_TOOL],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    if not stream:
        raw = client.sdk.messages.with_raw_response.create(**args)
        return raw.parse(), raw.headers
    with client.sdk.messages.stream(**args) as events:
        return events.get_final_message(), events.response.headers


def tool_loop(client, workdir, stream):
    """The model thinks and calls run_shell, the client runs it, the model answers."""
    messages = [{"role": "user", "content": "Write the marker file and show it."}]
    first, first_headers = call(client, messages, stream)
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    assert first.content[0].signature == SIGNATURE and first.content[0].thinking == THINKING
    use = first.content[1]
    ran = subprocess.run(["bash", "-c", use.input["command"]], cwd=workdir, capture_output=True, text=True, timeout=SHELL_TIMEOUT_S)
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
    messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": ran.stdout}]})
    second, second_headers = call(client, messages, stream)
    return "".join(b.text for b in second.content if b.type == "text"), messages, [first_headers, second_headers]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_loop_keeps_thinking_bytes(pare, fresh, tmp_path, stream):
    client = Client(pare)
    answer, messages, _ = tool_loop(client, tmp_path, stream)
    assert answer == MESSAGES_ANSWER
    assert (tmp_path / "out.txt").read_text() == MARKER + "\n"
    requests = messages_requests(fresh)
    assert len(requests) == 2 and len(client.sent) == 2
    forwarded = json.loads(requests[1]["body"])
    assert forwarded["messages"] == messages, "the thinking block, tool call and result reach the upstream"
    assert forwarded["tools"] == [SHELL_TOOL] and forwarded["thinking"]["type"] == "enabled"
    # The signed thinking block is forwarded byte for byte: the API rejects a changed one.
    sent = json_object_around(client.sent[1], SIGNATURE)
    assert json.loads(sent) == {"type": "thinking", "thinking": THINKING, "signature": SIGNATURE}
    assert json_object_around(requests[1]["body"], SIGNATURE) == sent


def test_messages_stream_events(pare, fresh):
    client = Client(pare)
    stream = client.sdk.messages.create(
        model=MODEL, max_tokens=2048, stream=True, tools=[SHELL_TOOL],
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "Write the marker file."}],
    )
    events = list(stream)
    assert [e.type for e in events] == STREAM_EVENTS, "every event arrives (ping is skipped by the SDK)"
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas == ["thinking_delta", "thinking_delta", "signature_delta"] + ["input_json_delta"] * 3
    assert events[-2].delta.stop_reason == "tool_use"


def test_messages_stream_bytes_reach_the_client_unchanged(pare, fresh):
    body = {"model": MODEL, "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": "sk-ant-e2e-dummy", "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", f"{pare.url}/v1/messages", json=body, headers=headers, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        received = b"".join(response.iter_raw())
    (request,) = messages_requests(fresh)
    assert b"event: ping" in received and received == request["streamed"]


def test_messages_count_tokens(pare, fresh):
    counted = Client(pare).sdk.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert counted.input_tokens > 0
    assert [r["path"] for r in fresh.recorded()] == ["/v1/messages/count_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_archived_with_pare_headers(pare, fresh, tmp_path, stream):
    before = pare.settled_sessions()
    client = Client(pare)
    answer, _, headers = tool_loop(client, tmp_path, stream)
    assert answer == MESSAGES_ANSWER
    sessions = {h.get("x-pare-session") for h in headers}
    assert len(sessions) == 1 and None not in sessions, [dict(h) for h in headers]
    (session,) = sessions
    for h in headers:
        assert int(h["x-pare-tokens-raw"]) > 0 and int(h["x-pare-tokens-forwarded"]) > 0, dict(h)
        assert "x-pare-epoch" in h, dict(h)
    wait_until(lambda: pare.sessions().get(session, {}).get("requests") == 2, what="both requests archived")
    assert pare.sessions().keys() - before.keys() == {session}
    # The archive keeps the client's exact bytes; small requests are forwarded unchanged.
    assert pare.bodies(session, "raw") == client.sent
    assert pare.bodies(session, "forwarded") == [r["body"] for r in messages_requests(fresh)]


def test_pare_errors_reach_the_sdk_in_anthropic_shape(tmp_path):
    """An unreachable upstream: pare's 502 arrives as Anthropic's error shape, which the SDK parses
    into its own error type with pare's message (regression: pare answered OpenAI's shape)."""
    import socket

    from conftest import PareProcess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    pare = PareProcess(f"http://127.0.0.1:{dead_port}", tmp_path / "archive")
    try:
        sdk = anthropic.Anthropic(base_url=pare.url, api_key="sk-ant-e2e-dummy", timeout=30, max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as raised:
            sdk.messages.create(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "hi"}])
        error = raised.value
        assert error.status_code == 502
        body = error.response.json()
        assert body["type"] == "error", body
        assert body["error"]["type"] == "api_error", body
        assert f"127.0.0.1:{dead_port}" in body["error"]["message"], body
    finally:
        assert pare.stop() == 0
