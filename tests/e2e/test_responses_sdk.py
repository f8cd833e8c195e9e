"""The official `openai` SDK's Responses API (`client.responses.create`) against pare → stub: a
two-step function-tool loop, streamed and not; pare archives each exchange and says what it forwarded
in its `x-pare-*` headers."""

import json
import subprocess

import httpx
import openai
import pytest

from conftest import wait_until
from stub_responses import MARKER, RESPONSES_ANSWER, SHELL_TOOL

SHELL_TIMEOUT_S = 10
STREAM_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
]


def client(pare):
    return openai.OpenAI(base_url=f"{pare.url}/v1", api_key="sk-e2e-dummy", timeout=30, max_retries=0)


def responses_requests(stub):
    return [r for r in stub.recorded() if r["path"].split("?")[0] == "/v1/responses"]


def create(sdk, items, stream):
    """One `responses.create`: the final response object and the HTTP response's headers."""
    raw = sdk.responses.with_raw_response.create(model="stub-model", input=items, tools=[SHELL_TOOL], stream=stream)
    if not stream:
        return raw.parse(), raw.headers, None
    events = list(raw.parse())
    (completed,) = [e for e in events if e.type == "response.completed"]
    return completed.response, raw.headers, events


def tool_loop(pare, workdir, stream):
    """The model calls run_shell, the client runs it, the model answers: (answer, input, headers, events)."""
    sdk = client(pare)
    items = [{"role": "user", "content": "Write the marker file and show it."}]
    first, first_headers, events = create(sdk, items, stream)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "run_shell"
    command = json.loads(call.arguments)["command"]
    ran = subprocess.run(["bash", "-c", command], cwd=workdir, capture_output=True, text=True, timeout=SHELL_TIMEOUT_S)
    items.append(call.model_dump(exclude_none=True))
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": ran.stdout})
    second, second_headers, _ = create(sdk, items, stream)
    return second.output_text, items, [first_headers, second_headers], events


@pytest.mark.parametrize("stream", [False, True])
def test_responses_tool_loop(pare, fresh, tmp_path, stream):
    answer, items, _, events = tool_loop(pare, tmp_path, stream)
    assert answer == RESPONSES_ANSWER
    assert (tmp_path / "out.txt").read_text() == MARKER + "\n"
    requests = responses_requests(fresh)
    assert len(requests) == 2
    forwarded = json.loads(requests[1]["body"])
    assert forwarded["input"] == items, "the function call and its output reach the upstream"
    assert forwarded["tools"] == [SHELL_TOOL]
    assert bool(forwarded.get("stream")) == stream
    if stream:
        assert [e.type for e in events] == STREAM_EVENTS
        numbers = [e.sequence_number for e in events]
        assert numbers == list(range(len(events))), "the SSE events arrive whole and in order"


def test_responses_stream_text_events(pare, fresh):
    events = list(client(pare).responses.create(model="stub-model", input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == "Hello from the stub."


def test_responses_stream_bytes_reach_the_client_unchanged(pare, fresh):
    body = {"model": "stub-model", "input": "hi", "tools": [SHELL_TOOL], "stream": True}
    with httpx.stream("POST", f"{pare.url}/v1/responses", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        received = b"".join(response.iter_raw())
    (request,) = responses_requests(fresh)
    assert received == request["streamed"]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_archived_with_pare_headers(pare, fresh, tmp_path, stream):
    before = pare.settled_sessions()
    answer, _, headers, _ = tool_loop(pare, tmp_path, stream)
    assert answer == RESPONSES_ANSWER
    sessions = {h.get("x-pare-session") for h in headers}
    assert len(sessions) == 1 and None not in sessions, [dict(h) for h in headers]
    (session,) = sessions
    for h in headers:
        assert int(h["x-pare-tokens-raw"]) > 0 and int(h["x-pare-tokens-forwarded"]) > 0, dict(h)
        assert "x-pare-epoch" in h, dict(h)
    wait_until(lambda: pare.sessions().get(session, {}).get("requests") == 2, what="both requests archived")
    assert pare.sessions().keys() - before.keys() == {session}
    # Small requests are forwarded unchanged: the archive's raw and forwarded bodies are the stub's.
    received = [r["body"] for r in responses_requests(fresh)]
    assert pare.bodies(session, "raw") == received
    assert pare.bodies(session, "forwarded") == received
