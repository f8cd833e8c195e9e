"""A scripted OpenAI-compatible upstream for the end-to-end suite.

Speaks the real wire format (JSON completions, SSE `data: {...}` chunks ending with `data: [DONE]`,
streamed tool calls, the usage chunk when `stream_options.include_usage` is set), answers the probes
agents send to guess the server kind with 404, and records every request it receives (a
Responses or Messages stream's SSE bytes too, as `streamed`).
The Responses (`/v1/responses`), Messages (`/v1/messages`) and Gemini (`…/models/M:generateContent`)
formats live in stub_responses.py, stub_messages.py and stub_gemini.py.

Scripts, chosen from the request's tools:
- Hermes (`terminal` among the tools): `terminal` running `ls`, then `read_file notes.txt`, then
  `search_files needle`, then the final answer `HERMES_ANSWER`.
- pare's MCP `retrieve` tool among the tools, as Hermes names it (`PARE_RETRIEVE_TOOL`): a call on
  the first `pare:` id of the last user message, then `RETRIEVED_ANSWER` followed by the tool
  result once it is back (before the Hermes script: Hermes offers its `terminal` too).
- `get_weather` among the tools: one tool call, then `WEATHER_ANSWER` once the tool result is back.
- anything else: `PLAIN_ANSWER`.
"""

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "stub-model"
PLAIN_ANSWER = "Hello from the stub."
WEATHER_ANSWER = "It is sunny in Paris."
HERMES_ANSWER = "PARE-E2E-DONE: the needle is in notes.txt"
# pare's MCP tool as Hermes Agent offers it to the model (`mcp__<server>__<tool>`), and what the
# model answers once its result is back.
PARE_RETRIEVE_TOOL = "mcp__pare__retrieve"
RETRIEVED_ANSWER = "PARE-E2E-RETRIEVED:"
PROBES = ("/api/v1/models", "/api/tags", "/v1/props", "/props", "/version")
# What every answer reports it billed, as OpenAI reports it (`CompletionUsage`, with the cached part).
USAGE = {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15, "prompt_tokens_details": {"cached_tokens": 8}}

# The tool that selects the weather script (the clients' tests send it).
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def hermes_step(messages, search_path):
    """The Hermes script: which tool to call next, from how many tool results came back."""
    n_results = sum(1 for m in messages if m.get("role") == "tool")
    steps = [
        ("terminal", {"command": "ls"}),
        ("read_file", {"path": "notes.txt"}),
        ("search_files", {"pattern": "needle", "path": search_path}),
    ]
    if n_results < len(steps):
        name, args = steps[n_results]
        return {"tool": name, "arguments": args, "call_id": f"call_{n_results + 1}"}
    return {"text": HERMES_ANSWER}


def retrieve_step(messages):
    """The retrieve script: call pare's tool on the id the user named, then answer with its result."""
    if messages and messages[-1].get("role") == "tool":
        return {"text": RETRIEVED_ANSWER + "\n" + str(messages[-1].get("content"))}
    users = [m for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)]
    named = re.search(r"pare:[0-9a-f]{12,64}", users[-1]["content"]) if users else None
    if named is None:
        return {"text": PLAIN_ANSWER}
    return {"tool": PARE_RETRIEVE_TOOL, "arguments": {"id": named.group(0)}, "call_id": "call_retrieve"}


def decide(body, search_path="."):
    """What to answer to a chat request: `{"text": ...}` or `{"tool", "arguments", "call_id"}`."""
    tools = {t.get("function", {}).get("name") for t in body.get("tools") or []}
    messages = body.get("messages") or []
    if PARE_RETRIEVE_TOOL in tools:
        return retrieve_step(messages)
    if "terminal" in tools:
        return hermes_step(messages, search_path)
    if "get_weather" in tools:
        if messages and messages[-1].get("role") == "tool":
            return {"text": WEATHER_ANSWER}
        return {"tool": "get_weather", "arguments": {"city": "Paris"}, "call_id": "call_weather"}
    return {"text": PLAIN_ANSWER}


def completion(model, reply):
    if "text" in reply:
        message = {"role": "assistant", "content": reply["text"]}
        finish = "stop"
    else:
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": reply["call_id"],
                    "type": "function",
                    "function": {"name": reply["tool"], "arguments": json.dumps(reply["arguments"])},
                }
            ],
        }
        finish = "tool_calls"
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": dict(USAGE),
    }


def stream_chunks(model, reply, include_usage):
    def chunk(delta, finish=None):
        return {
            "id": "chatcmpl-stub",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    yield chunk({"role": "assistant", "content": ""})
    if "text" in reply:
        words = reply["text"].split(" ")
        for i, word in enumerate(words):
            yield chunk({"content": word if i == 0 else " " + word})
        yield chunk({}, "stop")
    else:
        arguments = json.dumps(reply["arguments"])
        half = len(arguments) // 2
        yield chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": reply["call_id"],
                        "type": "function",
                        "function": {"name": reply["tool"], "arguments": arguments[:half]},
                    }
                ]
            }
        )
        yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": arguments[half:]}}]})
        yield chunk({}, "tool_calls")
    if include_usage:
        usage = chunk({})
        usage["choices"] = []
        usage["usage"] = dict(USAGE)
        yield usage


class StubUpstream:
    """The stub server on 127.0.0.1:0, serving from a background thread."""

    def __init__(self):
        self.requests = []
        self.lock = threading.Lock()
        # Where the Hermes script's search_files looks. An absolute path: Hermes' grep fallback
        # (no ripgrep installed) passes --exclude-dir='.*', which GNU grep applies to "." itself.
        self.search_path = "."
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):  # noqa: A002 - keep test output quiet
                pass

            def _record(self):
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                entry = {"method": self.command, "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body}
                with stub.lock:
                    stub.requests.append(entry)
                self.entry = entry
                return body

            def _json(self, status, value):
                data = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._record()
                path = self.path.split("?")[0]
                if path == "/v1/models":
                    model = {"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "stub"}
                    self._json(200, {"object": "list", "data": [model]})
                else:
                    self._not_found(path)

            def do_POST(self):
                raw = self._record()
                path = self.path.split("?")[0]
                if path.endswith((":generateContent", ":streamGenerateContent", ":countTokens")):
                    return self._gemini(path, raw)
                if path.endswith(("/responses", "/messages", "/messages/count_tokens")):
                    return self._wire(path, raw)
                if not path.endswith("/chat/completions"):
                    return self._not_found(path)
                try:
                    body = json.loads(raw)
                except ValueError:
                    return self._json(400, {"error": {"message": "invalid json", "type": "invalid_request_error", "code": None}})
                model = body.get("model") or MODEL
                reply = decide(body, stub.search_path)
                if body.get("stream"):
                    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("cache-control", "no-cache")
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for event in stream_chunks(model, reply, include_usage):
                        self._chunk(f"data: {json.dumps(event)}\n\n".encode())
                    self._chunk(b"data: [DONE]\n\n")
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self._json(200, completion(model, reply))

            def _wire(self, path, raw):
                # Imported here: both modules import this one's constants.
                import stub_messages
                import stub_responses

                try:
                    body = json.loads(raw)
                except ValueError:
                    return self._json(400, {"type": "error", "error": {"type": "invalid_request_error", "message": "invalid json"}})
                if path.endswith("/count_tokens"):
                    return self._json(200, stub_messages.count_tokens(body))
                wire = stub_responses if path.endswith("/responses") else stub_messages
                if not body.get("stream"):
                    return self._json(200, wire.respond(body))
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("cache-control", "no-cache")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                events = [f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode() for kind, event in wire.stream_events(body)]
                self.entry["streamed"] = b"".join(events)
                for event in events:
                    self._chunk(event)
                self.wfile.write(b"0\r\n\r\n")

            def _gemini(self, path, raw):
                import stub_gemini

                try:
                    body = json.loads(raw)
                except ValueError:
                    return self._json(400, {"error": {"code": 400, "message": "invalid json", "status": "INVALID_ARGUMENT"}})
                if path.endswith(":countTokens"):
                    return self._json(200, stub_gemini.count_tokens(body))
                if path.endswith(":generateContent"):
                    return self._json(200, stub_gemini.respond(path, body))
                sse = "alt=sse" in self.path.partition("?")[2].split("&")
                frames = stub_gemini.sse_frames(path, body) if sse else stub_gemini.json_array_frames(path, body)
                self.send_response(200)
                self.send_header("content-type", "text/event-stream" if sse else "application/json; charset=UTF-8")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                self.entry["streamed"] = b"".join(frames)
                for frame in frames:
                    self._chunk(frame)
                self.wfile.write(b"0\r\n\r\n")

            def _chunk(self, data):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _not_found(self, path):
                self._json(404, {"error": {"message": f"no route for {path}", "type": "invalid_request_error", "code": None}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def recorded(self):
        with self.lock:
            return list(self.requests)

    def clear(self):
        with self.lock:
            self.requests.clear()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    stub = StubUpstream()
    print(stub.url, flush=True)
    threading.Event().wait()
