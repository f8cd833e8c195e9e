"""The OpenAI Responses wire format (`POST /v1/responses`) of the stub upstream.

Answers with response objects (non-stream) or the SSE event sequence the real API sends (stream):
`response.created`, `response.in_progress`, then per output item `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`…, `response.output_text.done`,
`response.content_part.done` (messages) or `response.function_call_arguments.delta`/`.done`
(function calls), `response.output_item.done`, and `response.completed` with usage; every event carries
its `sequence_number`. Shapes follow the `openai` SDK's `types/responses` models.

The script: when a shell tool is offered and no `function_call_output` is in the input yet, call it
with `SHELL_COMMAND`; once the output is back, answer `RESPONSES_ANSWER`; otherwise `PLAIN_ANSWER`.
"""

import itertools
import json
import time

from stub_upstream import PLAIN_ANSWER

MARKER = "pare-e2e-marker"
SHELL_COMMAND = f"echo {MARKER} > out.txt && cat out.txt"
RESPONSES_ANSWER = "PARE-E2E-DONE: the shell command ran."

# The SDK tests' tool (Responses function tools are flat: no nested `function` object).
SHELL_TOOL = {
    "type": "function",
    "name": "run_shell",
    "description": "Run a shell command and return its output",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
        "additionalProperties": False,
    },
    "strict": True,
}

# Shell tools by name, and the arguments each takes for `SHELL_COMMAND`: the SDK tests' tool and the
# ones Codex offers (unified exec, the string-command shell, the argv shell).
SHELL_ARGUMENTS = {
    "run_shell": {"command": SHELL_COMMAND},
    "exec_command": {"cmd": SHELL_COMMAND},
    "shell_command": {"command": SHELL_COMMAND},
    "shell": {"command": ["bash", "-lc", SHELL_COMMAND]},
}

_ids = itertools.count(1)
USAGE = {
    "input_tokens": 11,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 4,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 15,
}


def tool_names(body):
    return [t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)]


def function_outputs(body):
    items = body.get("input")
    if not isinstance(items, list):
        return []
    return [i for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"]


def decide(body):
    """`{"text": ...}` or `{"tool", "arguments", "call_id"}` for one Responses request."""
    if function_outputs(body):
        return {"text": RESPONSES_ANSWER}
    for name in tool_names(body):
        if name in SHELL_ARGUMENTS:
            return {"tool": name, "arguments": SHELL_ARGUMENTS[name], "call_id": "call_shell_1"}
    return {"text": PLAIN_ANSWER}


def output_items(reply):
    """The finished output items of `reply`, with fresh ids."""
    n = next(_ids)
    if "text" in reply:
        part = {"type": "output_text", "text": reply["text"], "annotations": [], "logprobs": []}
        return [{"id": f"msg_stub{n}", "type": "message", "status": "completed", "role": "assistant", "content": [part]}]
    return [
        {
            "id": f"fc_stub{n}",
            "type": "function_call",
            "status": "completed",
            "call_id": reply["call_id"],
            "name": reply["tool"],
            "arguments": json.dumps(reply["arguments"]),
        }
    ]


def response_object(body, output, status="completed"):
    done = status == "completed"
    return {
        "id": f"resp_stub{next(_ids)}",
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "completed_at": int(time.time()) if done else None,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model") or "stub-model",
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": USAGE if done else None,
        "metadata": {},
    }


def respond(body):
    """The non-stream answer: one response object."""
    return response_object(body, output_items(decide(body)))


def stream_events(body):
    """The streamed answer: `(event type, payload)` pairs, payloads carrying `type` and `sequence_number`."""
    items = output_items(decide(body))
    final = response_object(body, items)
    started = dict(final, status="in_progress", output=[], usage=None, completed_at=None)
    seq = itertools.count()

    def event(kind, **fields):
        return kind, {"type": kind, "sequence_number": next(seq), **fields}

    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    for index, item in enumerate(items):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield event("response.output_item.added", output_index=index, item=dict(item, status="in_progress", content=[]))
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", **at, content_index=0, part=empty)
            words = text.split(" ")
            for i, word in enumerate(words):
                yield event("response.output_text.delta", **at, content_index=0, delta=word if i == 0 else " " + word, logprobs=[])
            yield event("response.output_text.done", **at, content_index=0, text=text, logprobs=[])
            yield event("response.content_part.done", **at, content_index=0, part=item["content"][0])
        else:
            arguments = item["arguments"]
            half = len(arguments) // 2
            yield event("response.output_item.added", output_index=index, item=dict(item, status="in_progress", arguments=""))
            yield event("response.function_call_arguments.delta", **at, delta=arguments[:half])
            yield event("response.function_call_arguments.delta", **at, delta=arguments[half:])
            yield event("response.function_call_arguments.done", **at, name=item["name"], arguments=arguments)
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.completed", response=final)
