"""The official `openai` Python SDK against pare → stub: sync and async, streamed and not, tool calls."""

import asyncio
import json

import httpx
import openai
import pytest

from conftest import wait_until
from stub_upstream import MODEL, PLAIN_ANSWER, WEATHER_ANSWER, WEATHER_TOOL

def sync_client(pare):
    return openai.OpenAI(base_url=f"{pare.url}/v1", api_key="sk-e2e-dummy", timeout=30, max_retries=0)


def async_client(pare):
    return openai.AsyncOpenAI(base_url=f"{pare.url}/v1", api_key="sk-e2e-dummy", timeout=30, max_retries=0)


def chat_requests(stub):
    return [r for r in stub.recorded() if r["path"].endswith("/chat/completions")]


def test_models_list(pare, fresh):
    models = sync_client(pare).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert [r["path"] for r in fresh.recorded()] == ["/v1/models"]


def test_sync_non_stream(pare, fresh):
    client = sync_client(pare)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.1)
    assert answer.choices[0].message.content == PLAIN_ANSWER
    (seen,) = chat_requests(fresh)
    body = json.loads(seen["body"])
    assert body["messages"] == messages and body["temperature"] == 0.1
    assert seen["headers"]["authorization"] == "Bearer sk-e2e-dummy"


def test_sync_stream_with_usage(pare, fresh):
    stream = sync_client(pare).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == PLAIN_ANSWER
    assert usage is not None and usage.total_tokens == 15


def test_async_non_stream_and_stream(pare, fresh):
    async def run():
        client = async_client(pare)
        answer = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.close()
        return answer.choices[0].message.content, streamed

    answer, streamed = asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert answer == PLAIN_ANSWER and streamed == PLAIN_ANSWER
    assert len(chat_requests(fresh)) == 2


def run_tool_loop(client_call, stream):
    """One tool round trip: the model asks for get_weather, the client answers, the model concludes."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client_call(messages, stream)
    assert first["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(first["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    messages.append({"role": "assistant", "content": None, "tool_calls": first["tool_calls"]})
    messages.append({"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "sunny, 21 C"})
    second = client_call(messages, stream)
    return second["content"], messages


def sync_call(pare):
    client = sync_client(pare)

    def call(messages, stream):
        if not stream:
            message = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL]).choices[0].message
            calls = [c.model_dump() for c in message.tool_calls or []]
            return {"content": message.content, "tool_calls": calls}
        content, calls = "", {}
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], stream=True):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call_delta in delta.tool_calls or []:
                entry = calls.setdefault(call_delta.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                entry["id"] = call_delta.id or entry["id"]
                if call_delta.function:
                    entry["function"]["name"] += call_delta.function.name or ""
                    entry["function"]["arguments"] += call_delta.function.arguments or ""
        return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}

    return call


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls(pare, fresh, stream):
    answer, messages = run_tool_loop(sync_call(pare), stream)
    assert answer == WEATHER_ANSWER
    requests = chat_requests(fresh)
    assert len(requests) == 2
    forwarded = json.loads(requests[1]["body"])
    assert forwarded["messages"][-1] == messages[-1], "the tool result reaches the upstream"
    assert forwarded["tools"] == [WEATHER_TOOL]


def test_upstream_errors_reach_the_sdk_as_api_errors(pare, fresh):
    client = sync_client(pare)
    with pytest.raises(openai.NotFoundError) as raised:
        client.embeddings.create(model=MODEL, input="hi")
    assert "no route for /v1/embeddings" in str(raised.value)


def test_every_request_is_logged_once(pare, fresh):
    before = len(pare.access_log())
    raw = sync_client(pare).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    raw.parse()

    # A line is written when its response ends, so the previous test's line may land after `before`
    # was taken: look only at chat lines.
    def chat_lines():
        return [line for line in pare.access_log()[before:] if line["path"] == "/v1/chat/completions"]

    wait_until(lambda: chat_lines(), what="pare's access line")
    lines = chat_lines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line["method"] == "POST" and line["status"] == 200
    assert "upstream_ms" in line and "pare_ms" in line and "pare_us" not in line
    # The line carries the figures of the response's x-pare-* headers.
    headers = raw.headers
    assert line["tokens_raw"] == int(headers["x-pare-tokens-raw"]) > 0, (line, dict(headers))
    assert line["tokens_forwarded"] == int(headers["x-pare-tokens-forwarded"]), line
    assert line["epoch"] == int(headers["x-pare-epoch"]), line
    assert line["session"] == headers["x-pare-session"] and line["session"], line
    assert line["over_window"] is False and "x-pare-over-window" not in headers, line


def test_pare_health(pare):
    health = httpx.get(f"{pare.url}/_pare/health", timeout=10).json()
    assert health["status"] == "ok"
