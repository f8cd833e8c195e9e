#!/usr/bin/env python3
"""Does a session forward the same bytes when `pare serve` is restarted in the middle of it?

Usage: benches/resume_restart.py PARE_BINARY --wire chat|responses|messages|gemini [--window TOKENS]
                                  [--no-header] [--no-restart] SESSION.jsonl ...

Each session file holds chat requests (one body per line, as in the shared corpus); for
`--wire responses|messages|gemini` they are converted first, as pare's `wire::convert::chat_to_responses`,
`wire::messages::convert::chat_to_messages` and `wire::gemini::convert::chat_to_gemini` do (a thinking
or thought signature is a SHA-256 prefix here).
The sessions are sent one request at a time to `pare serve` (archive on, in a fresh temporary
directory) in front of a stub upstream that records what it receives and answers every request with
a short text ("ok": not the assistant message the agent goes on with), twice:

- uninterrupted: every session from its first request to its last;
- interrupted: the first half of every session, then SIGTERM and a new `pare serve` on the same
  archive, then the second halves (`--no-restart`: no restart, the two runs must agree).

Reported per session and in total: forwarded bodies of the interrupted run that differ from the
uninterrupted run's; the size of both runs' archives and the interrupted run's stored plans (rows,
packed bytes, the fates' bytes, blobs of rewritten prefix messages). Requests carry `x-pare-session` unless `--no-header`; without it, also the
number of sessions pare assigned the requests of each file to (what the `x-pare-session` answer
header says), and forwarded bodies that differ from what `pare replay` predicts for the file.

Loopback only; every loop is bounded by the session files. Numbers are printed, never asserted.
"""

import argparse
import hashlib
import http.client
import json
import re
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages",
         "gemini": "/v1beta/models/bench:generateContent"}
RECEIVED = []
RECEIVED_LOCK = threading.Lock()


def answer(path):
    if path.endswith("/responses"):
        return {"id": "resp_1", "object": "response", "status": "completed", "model": "bench",
                "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": "ok", "annotations": []}]}],
                "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}
    if path.endswith(":generateContent"):
        return {"candidates": [{"content": {"role": "model", "parts": [{"text": "ok"}]}, "finishReason": "STOP",
                                "index": 0}],
                "usageMetadata": {"promptTokenCount": 1, "candidatesTokenCount": 1, "totalTokenCount": 2}}
    if path.endswith("/messages"):
        return {"id": "msg_1", "type": "message", "role": "assistant", "model": "bench",
                "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": 1, "output_tokens": 1}}
    return {"id": "chatcmpl-bench", "object": "chat.completion", "model": "bench",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        with RECEIVED_LOCK:
            RECEIVED.append(body)
        out = json.dumps(answer(self.path)).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def text_of(content):
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def keep(chat, keys):
    return {k: chat[k] for k in keys if k in chat}


def to_responses(chat):
    out = keep(chat, ["model", "stream", "temperature"])
    items, instructions = [], None
    for idx, m in enumerate(chat["messages"]):
        role, text = m.get("role", ""), text_of(m.get("content"))
        if role == "system" and idx == 0:
            instructions = text
        elif role == "tool":
            items.append({"type": "function_call_output", "call_id": m.get("tool_call_id"), "output": text})
        elif role == "assistant":
            if m.get("reasoning_content"):
                items.append({"type": "reasoning", "id": f"rs_{idx}", "summary": [],
                              "encrypted_content": m["reasoning_content"]})
            if text:
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": text}]})
            for call in m.get("tool_calls") or []:
                function = call.get("function") or {}
                arguments = function.get("arguments", "{}")
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
                items.append({"type": "function_call", "call_id": call.get("id"), "name": function.get("name"),
                              "arguments": arguments})
        else:
            items.append({"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]})
    if instructions is not None:
        out["instructions"] = instructions
    out["input"] = items
    if "tools" in chat:
        out["tools"] = [{"type": "function", **t["function"]} if isinstance(t.get("function"), dict) else t
                        for t in chat["tools"]]
    limit = chat.get("max_tokens", chat.get("max_completion_tokens"))
    if limit is not None:
        out["max_output_tokens"] = limit
    return out


def push_to(turns, role, item):
    """Append `item` to the last of `turns` ((role, items) pairs) when it is `role`'s, else open a turn."""
    if turns and turns[-1][0] == role:
        turns[-1][1].append(item)
    else:
        turns.append((role, [item]))


def arguments_object(arguments):
    """A call's arguments as the object Messages' `input` and Gemini's `args` hold: the JSON object a
    string holds, else the value under `arguments` (`{}` for none)."""
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        return parsed
    return {} if arguments is None else {"arguments": arguments}


def to_messages(chat):
    out = keep(chat, ["model", "stream", "temperature"])
    limit = chat.get("max_tokens", chat.get("max_completion_tokens"))
    if limit is not None:
        out["max_tokens"] = limit
    turns = []

    for idx, m in enumerate(chat["messages"]):
        role, text = m.get("role", ""), text_of(m.get("content"))
        if role == "system" and idx == 0:
            out["system"] = [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]
        elif role == "tool":
            push_to(turns, "user", {"type": "tool_result", "tool_use_id": m.get("tool_call_id"), "content": text})
        elif role == "assistant":
            start = len(turns)
            if m.get("reasoning_content"):
                signature = hashlib.sha256(m["reasoning_content"].encode()).hexdigest()[:16]
                push_to(turns, "assistant",
                        {"type": "thinking", "thinking": m["reasoning_content"], "signature": signature})
            if text:
                push_to(turns, "assistant", {"type": "text", "text": text})
            for call in m.get("tool_calls") or []:
                function = call.get("function") or {}
                push_to(turns, "assistant", {"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                                             "input": arguments_object(function.get("arguments"))})
            if len(turns) == start and (not turns or turns[-1][0] != "assistant"):
                push_to(turns, "assistant", {"type": "text", "text": "(empty)"})
        else:
            push_to(turns, "user", {"type": "text", "text": text})
    for role, blocks in reversed(turns):
        if role == "user":
            blocks[-1]["cache_control"] = {"type": "ephemeral"}
            break
    out["messages"] = [{"role": role, "content": blocks} for role, blocks in turns]
    if "tools" in chat:
        tools = []
        for t in chat["tools"]:
            f = t.get("function")
            if f is None:
                continue
            tool = {"name": f.get("name")}
            if "description" in f:
                tool["description"] = f["description"]
            tool["input_schema"] = f.get("parameters", {"type": "object"})
            tools.append(tool)
        out["tools"] = tools
    return out


def to_gemini(chat):
    out, turns, call_names = {}, [], {}

    for idx, m in enumerate(chat["messages"]):
        role, text = m.get("role", ""), text_of(m.get("content"))
        if role == "system" and idx == 0:
            out["systemInstruction"] = {"parts": [{"text": text}]}
        elif role == "tool":
            name = call_names.get(m.get("tool_call_id"), "tool")
            push_to(turns, "user", {"functionResponse": {"name": name, "response": {"output": text}}})
        elif role == "assistant":
            start = len(turns)
            signature = hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()[:16]
            if m.get("reasoning_content"):
                push_to(turns, "model", {"text": m["reasoning_content"], "thought": True})
            if text:
                push_to(turns, "model", {"text": text})
            for call in m.get("tool_calls") or []:
                function = call.get("function") or {}
                name = function.get("name", "tool")
                if isinstance(call.get("id"), str):
                    call_names[call["id"]] = name
                part = {"functionCall": {"name": name, "args": arguments_object(function.get("arguments"))}}
                if signature is not None:
                    part["thoughtSignature"] = signature
                    signature = None
                push_to(turns, "model", part)
            if len(turns) == start and (not turns or turns[-1][0] != "model"):
                push_to(turns, "model", {"text": "(empty)"})
        else:
            push_to(turns, "user", {"text": text})
    out["contents"] = [{"role": role, "parts": parts} for role, parts in turns]
    if "tools" in chat:
        declarations = []
        for t in chat["tools"]:
            f = t.get("function")
            if f is None:
                continue
            declaration = {"name": f.get("name")}
            for key in ("description", "parameters"):
                if key in f:
                    declaration[key] = f[key]
            declarations.append(declaration)
        out["tools"] = [{"functionDeclarations": declarations}]
    config = {}
    limit = chat.get("max_tokens", chat.get("max_completion_tokens"))
    if limit is not None:
        config["maxOutputTokens"] = limit
    if "temperature" in chat:
        config["temperature"] = chat["temperature"]
    if config:
        out["generationConfig"] = config
    return out


def convert(line, wire):
    chat = json.loads(line)
    body = {"chat": lambda c: c, "responses": to_responses, "messages": to_messages, "gemini": to_gemini}[wire](chat)
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def config_text(window):
    """pare's config: `window` tokens for every format (a Gemini request's model, `bench` in its path,
    is named by a `models:` entry: without one the Gemini API's window is 1,048,576 tokens)."""
    return (f"budget:\n  detect_window: false\n  default_context_window: {window}\n"
            f"  anthropic_context_window: {window}\n"
            f"models:\n  - match: \"^bench$\"\n    context_window: {window}\n")


def start_pare(binary, stub_port, workdir, window):
    config = Path(workdir) / "pare.yaml"
    config.write_text(config_text(window))
    cmd = [binary, "serve", "--config", str(config), "--listen", "127.0.0.1:0",
           "--upstream", f"http://127.0.0.1:{stub_port}/v1", "--archive", str(Path(workdir) / "archive")]
    log_path = Path(workdir) / "pare.log"
    offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 30
    while time.time() < deadline and proc.poll() is None:
        for line in log_path.read_text(errors="replace")[offset:].splitlines():
            if "127.0.0.1:" in line and ("listen" in line or "serving" in line):
                return proc, int(re.findall(r"127\.0\.0\.1:(\d+)", line)[0])
        time.sleep(0.05)
    proc.kill()
    sys.exit("pare did not report its address")


def stop_pare(proc):
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def send(port, wire, name, body, header):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"content-type": "application/json"}
    if header:
        headers["x-pare-session"] = name
    conn.request("POST", PATHS[wire], body=body, headers=headers)
    response = conn.getresponse()
    response.read()
    if response.status != 200:
        sys.exit(f"{name}: pare answered {response.status}")
    session = response.getheader("x-pare-session")
    conn.close()
    return session


def run(args, stub_port, sessions, restart):
    """Forwarded bodies per session and the session ids pare gave each request."""
    with tempfile.TemporaryDirectory() as workdir:
        proc, port = start_pare(args.binary, stub_port, workdir, args.window)
        forwarded = {name: [] for name, _ in sessions}
        assigned = {name: [] for name, _ in sessions}
        for part in (0, 1):
            if part == 1 and restart:
                stop_pare(proc)
                proc, port = start_pare(args.binary, stub_port, workdir, args.window)
            for name, bodies in sessions:
                half = len(bodies) // 2
                for body in bodies[:half] if part == 0 else bodies[half:]:
                    with RECEIVED_LOCK:
                        before = len(RECEIVED)
                    assigned[name].append(send(port, args.wire, name, body, not args.no_header))
                    with RECEIVED_LOCK:
                        forwarded[name].extend(RECEIVED[before:])
        stop_pare(proc)
        store = Path(workdir) / "archive" / "archive.sqlite3"
        db = sqlite3.connect(store)
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        size = store.stat().st_size
        n_exchanges = db.execute("SELECT count(*) FROM exchanges").fetchone()[0]
        has_plans = db.execute("SELECT count(*) FROM sqlite_master WHERE name = 'plans'").fetchone()[0]
        plans = db.execute("SELECT count(*), coalesce(sum(length(raw_hashes) + length(prefix_blobs)"
                           " + length(prefix_seen)), 0) FROM plans").fetchone() if has_plans else (0, 0)
        has_items = db.execute("SELECT count(*) FROM sqlite_master WHERE name = 'plan_items'").fetchone()[0]
        item_bytes = db.execute("SELECT coalesce(sum(length(items)), 0) FROM plan_items").fetchone()[0] if has_items else 0
        # Blobs the plans name (rewritten prefix messages; kept ones are references into the request).
        blobs = set()
        for (packed,) in db.execute("SELECT prefix_blobs FROM plans WHERE prefix_blobs IS NOT NULL") if has_plans else []:
            blobs.update(i for (i,) in struct.iter_unpack("<q", packed) if i > 0)
        blob_bytes = sum(db.execute("SELECT length(data) FROM blobs WHERE id = ?", (i,)).fetchone()[0] for i in blobs)
        db.close()
    stats = {"archive_bytes": size, "exchanges": n_exchanges, "plan_rows": plans[0], "plan_packed_bytes": plans[1],
             "plan_item_bytes": item_bytes, "plan_blobs": len(blobs), "plan_blob_bytes": blob_bytes}
    return forwarded, assigned, stats


def replayed(args, bodies):
    with tempfile.TemporaryDirectory() as workdir:
        config = Path(workdir) / "pare.yaml"
        config.write_text(config_text(args.window))
        session = Path(workdir) / "session.jsonl"
        session.write_bytes(b"\n".join(bodies) + b"\n")
        # The path the proxy received: a Gemini request's model is named there.
        out = subprocess.run([args.binary, "replay", "--config", str(config), "--path", PATHS[args.wire],
                              "--wire", args.wire, str(session)],
                             check=True, capture_output=True).stdout
    return [line for line in out.split(b"\n") if line.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("sessions", nargs="+")
    ap.add_argument("--wire", choices=sorted(PATHS), default="chat")
    ap.add_argument("--window", type=int, default=16000)
    ap.add_argument("--no-header", action="store_true")
    ap.add_argument("--no-restart", action="store_true")
    args = ap.parse_args()
    sessions = []
    for path in args.sessions:
        lines = [l for l in Path(path).read_text().splitlines() if l.strip()]
        sessions.append((Path(path).stem, [convert(l, args.wire) for l in lines]))
    stub = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    straight, _, straight_stats = run(args, stub.server_port, sessions, restart=False)
    interrupted, assigned, stats = run(args, stub.server_port, sessions, restart=not args.no_restart)
    total = differ = 0
    for name, bodies in sessions:
        n = sum(a != b for a, b in zip(straight[name], interrupted[name]))
        n += abs(len(straight[name]) - len(interrupted[name]))
        line = f"{args.wire} {name}: {len(bodies)} requests, {n} forwarded bodies differ from the uninterrupted run"
        if args.no_header:
            predicted = replayed(args, bodies)
            off = sum(a != b for a, b in zip(interrupted[name], predicted)) + abs(len(predicted) - len(bodies))
            line += f"; {len(set(assigned[name]))} sessions; {off} differ from `pare replay`"
        print(line)
        total += len(bodies)
        differ += n
    print(f"{args.wire} total: {differ} of {total} forwarded bodies differ")
    print(f"{args.wire} archive: uninterrupted {straight_stats['archive_bytes']} bytes, interrupted "
          f"{stats['archive_bytes']} bytes, {stats['exchanges']} exchanges, {stats['plan_rows']} plan rows "
          f"({stats['plan_packed_bytes']} bytes of hashes and references, {stats['plan_item_bytes']} bytes of "
          f"fates, {stats['plan_blobs']} blobs of "
          f"rewritten messages, {stats['plan_blob_bytes']} bytes stored)")
    stub.shutdown()


if __name__ == "__main__":
    main()
