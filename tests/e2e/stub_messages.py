"""The Anthropic Messages wire format (`POST /v1/messages`) of the stub upstream.

Answers with message objects (non-stream) or the SSE event sequence the real API sends (stream):
`message_start`, `ping`, per content block `content_block_start`, its deltas (`text_delta`,
`thinking_delta` then `signature_delta`, `input_json_delta`) and `content_block_stop`, then
`message_delta` (stop reason, usage) and `message_stop`. Shapes follow the `anthropic` SDK's types.
`POST /v1/messages/count_tokens` answers `{"input_tokens": N}`.

The script: when a shell tool (`Bash`, Claude Code's; `run_shell`, the SDK tests'; `terminal`,
Hermes') is offered and no `tool_result` is in the last user turn, think (a thinking block with a
signature, when the request enables thinking) and call it with `SHELL_COMMAND`; once the result is
back, answer `MESSAGES_ANSWER`; otherwise `PLAIN_ANSWER`. When pare's retrieve tool is offered (an MCP
client names it `mcp__pare__retrieve`) and the last user turn names a content id (`pare:` + hex), call
it with that id instead (Claude Code defers MCP tools behind its `ToolSearch` tool: load it with that
first); once its result is back, answer `RETRIEVED_ANSWER` followed by the result.
"""

import itertools
import json
import re

from stub_responses import SHELL_COMMAND
from stub_upstream import PLAIN_ANSWER

MESSAGES_ANSWER = "PARE-E2E-DONE: the Bash command ran."
THINKING = "The user wants the marker written; I will run the shell command."
# A signature is opaque base64 to clients; the real API rejects a history whose bytes differ.
SIGNATURE = "RXVTdHViU2lnbmF0dXJlOnBhcmUtZTJlOnRoaW5raW5nLWJsb2NrLWJ5dGVzLW11c3Qtbm90LWNoYW5nZQ=="

SHELL_TOOL = {
    "name": "run_shell",
    "description": "Run a shell command and return its output",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}
SHELL_INPUTS = {
    "Bash": {"command": SHELL_COMMAND, "description": "Write the marker file"},
    "run_shell": {"command": SHELL_COMMAND},
    "terminal": {"command": SHELL_COMMAND},
}

RETRIEVE_TOOL = "mcp__pare__retrieve"
RETRIEVED_ANSWER = "PARE-E2E-RETRIEVED:"
CONTENT_ID = re.compile(r"pare:[0-9a-f]{8,64}")

_ids = itertools.count(1)


def tool_names(body):
    return [t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)]


def last_user_blocks(body):
    messages = body.get("messages") or []
    if not messages or messages[-1].get("role") != "user" or not isinstance(messages[-1].get("content"), list):
        return []
    return messages[-1]["content"]


def thinking_enabled(body):
    return (body.get("thinking") or {}).get("type") in ("enabled", "adaptive")


def block_text(block):
    """The text of a content block, of a tool_result's content too."""
    if not isinstance(block, dict):
        return ""
    content = block.get("content", block.get("text", ""))
    if isinstance(content, list):
        return "".join(block_text(b) for b in content)
    return content if isinstance(content, str) else ""


def user_texts(body):
    """The text the user wrote in the conversation (tool results aside)."""
    out = []
    for message in body.get("messages") or []:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        out.extend(b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text")
    return "\n".join(out)


def called(body):
    """The name of each tool the conversation called, by its tool_use id."""
    names = {}
    for message in body.get("messages") or []:
        if message.get("role") == "assistant" and isinstance(message.get("content"), list):
            names.update((b["id"], b.get("name")) for b in message["content"] if isinstance(b, dict) and b.get("type") == "tool_use")
    return names


def retrieve_step(body):
    """The retrieve script's blocks, or None when it does not apply: the user named a content id and
    pare's retrieve tool is offered (or deferred behind Claude Code's `ToolSearch`, then load it first)."""
    # The last id the user wrote (a client's own reminders before the prompt may quote an example id).
    named = CONTENT_ID.findall(user_texts(body))
    if not named:
        return None
    names = called(body)
    results = [b for b in last_user_blocks(body) if isinstance(b, dict) and b.get("type") == "tool_result"]
    retrieved = [b for b in results if names.get(b.get("tool_use_id")) == RETRIEVE_TOOL]
    if retrieved:
        return [{"type": "text", "text": RETRIEVED_ANSWER + "\n" + block_text(retrieved[0])}]
    if RETRIEVE_TOOL in tool_names(body):
        return [{"type": "tool_use", "id": f"toolu_stub{next(_ids)}", "name": RETRIEVE_TOOL, "input": {"id": named[-1]}}]
    if "ToolSearch" in tool_names(body) and "ToolSearch" not in names.values():
        query = {"query": f"select:{RETRIEVE_TOOL}", "max_results": 1}
        return [{"type": "tool_use", "id": f"toolu_stub{next(_ids)}", "name": "ToolSearch", "input": query}]
    return None


def decide(body):
    """The content blocks to answer one Messages request with."""
    step = retrieve_step(body)
    if step is not None:
        return step
    if any(isinstance(b, dict) and b.get("type") == "tool_result" for b in last_user_blocks(body)):
        return [{"type": "text", "text": MESSAGES_ANSWER}]
    for name in tool_names(body):
        if name in SHELL_INPUTS:
            blocks = []
            if thinking_enabled(body):
                blocks.append({"type": "thinking", "thinking": THINKING, "signature": SIGNATURE})
            blocks.append({"type": "tool_use", "id": f"toolu_stub{next(_ids)}", "name": name, "input": SHELL_INPUTS[name]})
            return blocks
    return [{"type": "text", "text": PLAIN_ANSWER}]


def message(body, content):
    stop = "tool_use" if any(b["type"] == "tool_use" for b in content) else "end_turn"
    return {
        "id": f"msg_stub{next(_ids)}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model") or "stub-model",
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {"input_tokens": 11, "output_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
    }


def respond(body):
    """The non-stream answer: one message object."""
    return message(body, decide(body))


def count_tokens(body):
    return {"input_tokens": max(1, len(json.dumps(body)) // 4)}


def stream_events(body):
    """The streamed answer: `(event type, payload)` pairs."""
    final = message(body, decide(body))
    started = dict(final, content=[], stop_reason=None, usage=dict(final["usage"], output_tokens=1))

    def event(kind, **fields):
        return kind, {"type": kind, **fields}

    yield event("message_start", message=started)
    yield event("ping")
    for index, block in enumerate(final["content"]):
        if block["type"] == "text":
            yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
            words = block["text"].split(" ")
            for i, word in enumerate(words):
                yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": word if i == 0 else " " + word})
        elif block["type"] == "thinking":
            yield event("content_block_start", index=index, content_block={"type": "thinking", "thinking": "", "signature": ""})
            half = len(block["thinking"]) // 2
            for piece in (block["thinking"][:half], block["thinking"][half:]):
                yield event("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": piece})
            yield event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": block["signature"]})
        else:
            yield event("content_block_start", index=index, content_block=dict(block, input={}))
            arguments = json.dumps(block["input"])
            half = len(arguments) // 2
            for piece in ("", arguments[:half], arguments[half:]):
                yield event("content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": piece})
        yield event("content_block_stop", index=index)
    delta = {"stop_reason": final["stop_reason"], "stop_sequence": None}
    yield event("message_delta", delta=delta, usage={"output_tokens": final["usage"]["output_tokens"]})
    yield event("message_stop")
