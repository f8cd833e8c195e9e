"""Compaction of the two new wire formats, end to end: a long tool-using history sent through the
`openai` SDK's `responses.create` and the `anthropic` SDK's `messages.create` to a pare whose window is
16k tokens. pare must forward fewer tokens, say so in its `x-pare-*` headers, archive the client's and
the forwarded bytes, and keep what the upstream relies on: user turns, instructions/system, the tail,
call pairing, reasoning and thinking blocks byte for byte (or gone with their whole turn), at most four
cache breakpoints."""

import base64
import hashlib
import json
import textwrap

import anthropic
import openai
import pytest

from conftest import PareProcess, json_object_around, wait_until
from stub_messages import MESSAGES_ANSWER
from stub_messages import SHELL_TOOL as MESSAGES_SHELL_TOOL
from stub_responses import RESPONSES_ANSWER
from stub_responses import SHELL_TOOL as RESPONSES_SHELL_TOOL

ROUNDS = 40
WINDOW = 16384
INSTRUCTIONS = "You are a careful coding agent. Run commands with run_shell."
FIRST_ASK = "Survey the repository: read every source file, then tell me which one defines the marker."
LAST_ASK = "Now write the marker file."


@pytest.fixture(scope="module")
def small_pare(stub, tmp_path_factory):
    """pare with a 16k window (no detection) in front of the stub, archiving apart from the suite's."""
    config = tmp_path_factory.mktemp("small-pare") / "pare.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            budget:
              default_context_window: {WINDOW}
              anthropic_context_window: {WINDOW}
              detect_window: false
            """
        )
    )
    process = PareProcess(f"{stub.url}/v1", tmp_path_factory.mktemp("small-archive"), ["--config", str(config)])
    yield process
    assert process.stop() == 0


def file_listing(i):
    """A deterministic source file of about 450 tokens: what `cat src/module_i.py` printed."""
    lines = [f"# src/module_{i}.py"]
    lines += [f"def handler_{i}_{j}(request, retries={j}):\n    return dispatch(request, 'route_{i}_{j}', retries)" for j in range(16)]
    return "\n".join(lines) + "\n"


def opaque(label, size=480):
    """Deterministic base64 standing for an encrypted reasoning item or a thinking signature."""
    digest = b"".join(hashlib.sha256(f"{label}:{n}".encode()).digest() for n in range(size // 32 + 1))
    return base64.b64encode(digest[:size]).decode()


def responses_history():
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": FIRST_ASK}]}]
    for i in range(ROUNDS):
        if i % 10 == 0:
            items.append({"type": "reasoning", "id": f"rs_{i}", "summary": [], "encrypted_content": opaque(f"rs_{i}")})
        arguments = json.dumps({"command": f"cat src/module_{i}.py"})
        items.append({"type": "function_call", "call_id": f"call_{i}", "name": "run_shell", "arguments": arguments})
        items.append({"type": "function_call_output", "call_id": f"call_{i}", "output": file_listing(i)})
    items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": LAST_ASK}]})
    items.append({"type": "function_call", "call_id": "call_last", "name": "run_shell", "arguments": '{"command": "true"}'})
    items.append({"type": "function_call_output", "call_id": "call_last", "output": "ok"})
    return items


def messages_history():
    messages = [{"role": "user", "content": [{"type": "text", "text": FIRST_ASK}]}]
    for i in range(ROUNDS):
        content = []
        if i % 10 == 0:
            content.append({"type": "thinking", "thinking": f"Round {i}: read the next module.", "signature": opaque(f"sig_{i}")})
        content.append({"type": "tool_use", "id": f"toolu_{i}", "name": "run_shell", "input": {"command": f"cat src/module_{i}.py"}})
        messages.append({"role": "assistant", "content": content})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": file_listing(i)}]})
    messages[-1]["content"].append({"type": "text", "text": LAST_ASK})
    messages.append({"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_last", "name": "run_shell", "input": {"command": "true"}}]})
    result = {"type": "tool_result", "tool_use_id": "toolu_last", "content": "ok", "cache_control": {"type": "ephemeral"}}
    messages.append({"role": "user", "content": [result]})
    return messages


def last_request(stub, path):
    return [r for r in stub.recorded() if r["path"].split("?")[0] == path][-1]


def assert_headers_show_compaction(headers):
    raw, forwarded = int(headers["x-pare-tokens-raw"]), int(headers["x-pare-tokens-forwarded"])
    assert raw > WINDOW > forwarded > 0, dict(headers)
    return headers["x-pare-session"]


def assert_archived(pare, session, sent, received):
    wait_until(lambda: pare.sessions().get(session, {}).get("requests") == 1, what="the request archived")
    assert pare.bodies(session, "raw") == [sent]
    assert pare.bodies(session, "forwarded") == [received]


def test_responses_long_history_is_compacted(small_pare, stub):
    stub.clear()
    items = responses_history()
    sent = []
    hooks = {"request": [lambda request: sent.append(request.content)]}
    sdk = openai.OpenAI(
        base_url=f"{small_pare.url}/v1", api_key="sk-e2e-dummy", timeout=60, max_retries=0,
        http_client=openai.DefaultHttpxClient(event_hooks=hooks),
    )
    raw = sdk.responses.with_raw_response.create(model="stub-model", instructions=INSTRUCTIONS, input=items, tools=[RESPONSES_SHELL_TOOL])
    assert raw.parse().output_text == RESPONSES_ANSWER
    session = assert_headers_show_compaction(raw.headers)
    request = last_request(stub, "/v1/responses")
    assert len(request["body"]) < len(sent[0])
    forwarded = json.loads(request["body"])
    assert forwarded["instructions"] == INSTRUCTIONS and forwarded["tools"] == [RESPONSES_SHELL_TOOL]
    kept = forwarded["input"]
    assert [i for i in kept if i.get("role") == "user"] == [i for i in items if i.get("role") == "user"], "user turns are kept"
    assert kept[-3:] == items[-3:], "the tail is kept"
    calls = [i["call_id"] for i in kept if i.get("type") == "function_call"]
    outputs = [i["call_id"] for i in kept if i.get("type") == "function_call_output"]
    assert calls == outputs, "every call keeps its output and every output its call, in order"
    # A reasoning item is forwarded byte for byte right before the item it precedes, or it went
    # together with that whole turn (the API refuses a reasoning item without its following item).
    kept_calls = set(calls)
    for at, item in enumerate(items):
        if item["type"] != "reasoning":
            continue
        follower = items[at + 1]["call_id"]
        if item["encrypted_content"] in request["body"].decode():
            ours = json_object_around(sent[0], item["encrypted_content"])
            assert json_object_around(request["body"], item["encrypted_content"]) == ours, "reasoning bytes are kept"
            position = next(i for i, k in enumerate(kept) if k.get("id") == item["id"])
            assert kept[position + 1].get("call_id") == follower, "a reasoning item stays before its call"
        else:
            assert follower not in kept_calls, "a reasoning item goes only with its whole turn"
    assert_archived(small_pare, session, sent[0], request["body"])


def test_messages_long_history_is_compacted(small_pare, stub):
    stub.clear()
    messages = messages_history()
    system = [{"type": "text", "text": INSTRUCTIONS, "cache_control": {"type": "ephemeral"}}]
    sent = []
    hooks = {"request": [lambda request: sent.append(request.content)]}
    sdk = anthropic.Anthropic(
        base_url=small_pare.url, api_key="sk-ant-e2e-dummy", timeout=60, max_retries=0,
        http_client=anthropic.DefaultHttpxClient(event_hooks=hooks),
    )
    raw = sdk.messages.with_raw_response.create(
        model="claude-stub-4", max_tokens=1024, system=system, messages=messages, tools=[MESSAGES_SHELL_TOOL],
        thinking={"type": "enabled", "budget_tokens": 512},
    )
    assert [b.text for b in raw.parse().content if b.type == "text"] == [MESSAGES_ANSWER]
    session = assert_headers_show_compaction(raw.headers)
    request = last_request(stub, "/v1/messages")
    assert len(request["body"]) < len(sent[0])
    forwarded = json.loads(request["body"])
    assert forwarded["system"] == system and forwarded["tools"] == [MESSAGES_SHELL_TOOL]
    kept = forwarded["messages"]
    assert kept[-2:] == messages[-2:], "the tail is kept"

    def texts(history):
        return [b for m in history if m["role"] == "user" for b in m["content"] if b["type"] == "text"]

    assert texts(kept) == texts(messages), "user text is kept"
    for before, after in zip(kept, kept[1:]):
        uses = [b["id"] for b in before["content"] if b["type"] == "tool_use"]
        results = [b["tool_use_id"] for b in after["content"] if b["type"] == "tool_result"]
        if uses or results:
            assert before["role"] == "assistant" and uses == results, (before, after)
    # A thinking block is forwarded byte for byte at the head of its turn, or it went together with
    # that whole turn (its signature must verify against the turn it opened).
    kept_uses = {b["id"] for m in kept if m["role"] == "assistant" for b in m["content"] if b["type"] == "tool_use"}
    for message in messages:
        for block in message["content"]:
            if block["type"] != "thinking":
                continue
            uses = {b["id"] for b in message["content"] if b["type"] == "tool_use"}
            if block["signature"] in request["body"].decode():
                ours = json_object_around(sent[0], block["signature"])
                assert json_object_around(request["body"], block["signature"]) == ours, "thinking bytes are kept"
                turn = next(m for m in kept if any(b.get("signature") == block["signature"] for b in m["content"]))
                assert turn["content"][0]["type"] == "thinking" and uses <= kept_uses, "thinking opens its own turn"
            else:
                assert not uses & kept_uses, "a thinking block goes only with its whole turn"
    assert request["body"].count(b'"cache_control"') <= 4
    assert_archived(small_pare, session, sent[0], request["body"])
