"""The Gemini API wire format (`POST …/models/{model}:generateContent` and `:streamGenerateContent`)
of the stub upstream.

Answers with one `GenerateContentResponse` (`generateContent`), a stream of them as server-sent
events (`streamGenerateContent?alt=sse`: `data: {…}` frames ending in CRLF CRLF, as Google's servers
write them) or as a JSON array written element by element (`streamGenerateContent` without
`alt=sse`). Text streams in pieces, one response per piece; a function call arrives whole, with its
`thoughtSignature`; the last response carries `finishReason` and `usageMetadata` (with
`cachedContentTokenCount` and `thoughtsTokenCount`). Shapes follow google-genai's `types.py`.
`:countTokens` answers `{"totalTokens": N}`.

The script: a request asking for JSON (`generationConfig.responseMimeType` is `application/json`:
Gemini CLI's next-speaker check and model router) gets `JSON_ANSWER`; when the last user turn carries
a `functionResponse`, answer `GEMINI_ANSWER`; when a shell tool (`run_shell_command`, Gemini CLI's;
`run_shell`, the SDK tests') is declared, think (a `thought: true` part when the request asks for
thoughts) and call it with `SHELL_COMMAND`, the call signed with `SIGNATURE`; otherwise `PLAIN_ANSWER`.
"""

import itertools
import json

from stub_responses import SHELL_COMMAND
from stub_upstream import PLAIN_ANSWER

GEMINI_ANSWER = "PARE-E2E-DONE: the shell command ran."
THOUGHT = "The user wants the marker written; I will run the shell command."
# Opaque base64 to clients; Gemini 3 refuses a function call whose signature does not come back as sent.
SIGNATURE = "Q2lRQlZLaEpzdHViLXNpZ25hdHVyZTpwYXJlLWUyZTpmdW5jdGlvbi1jYWxsLWJ5dGVzLW11c3Qtbm90LWNoYW5nZQ=="
JSON_ANSWER = {"reasoning": "The stub answered; the user speaks next.", "next_speaker": "user", "model_choice": "flash"}

SHELL_TOOL = {
    "name": "run_shell",
    "description": "Run a shell command and return its output",
    "parameters": {"type": "OBJECT", "properties": {"command": {"type": "STRING"}}, "required": ["command"]},
}
SHELL_ARGS = {
    "run_shell_command": {"command": SHELL_COMMAND, "description": "Write the marker file and show it."},
    "run_shell": {"command": SHELL_COMMAND},
}

_ids = itertools.count(1)


def is_generation(path):
    return path.endswith((":generateContent", ":streamGenerateContent"))


def model_of(path):
    return path.rsplit("/", 1)[-1].split(":", 1)[0]


def declared(body):
    names = []
    for tool in body.get("tools") or []:
        for declaration in tool.get("functionDeclarations") or tool.get("function_declarations") or []:
            names.append(declaration.get("name"))
    return names


def last_user_parts(body):
    contents = body.get("contents") or []
    if not contents or contents[-1].get("role", "user") != "user":
        return []
    return contents[-1].get("parts") or []


def config(body):
    return body.get("generationConfig") or body.get("generation_config") or {}


def decide(body):
    """The parts to answer one request with."""
    if config(body).get("responseMimeType") == "application/json":
        return [{"text": json.dumps(JSON_ANSWER)}]
    if any("functionResponse" in p or "function_response" in p for p in last_user_parts(body)):
        return [{"text": GEMINI_ANSWER}]
    for name in declared(body):
        if name in SHELL_ARGS:
            parts = []
            thinking = config(body).get("thinkingConfig") or config(body).get("thinking_config") or {}
            # google-genai writes the inner key in snake case; the API reads both spellings.
            if thinking.get("includeThoughts") or thinking.get("include_thoughts"):
                parts.append({"text": THOUGHT, "thought": True})
            parts.append({"functionCall": {"name": name, "args": SHELL_ARGS[name]}, "thoughtSignature": SIGNATURE})
            return parts
    return [{"text": PLAIN_ANSWER}]


def usage(body, parts):
    prompt = max(1, len(json.dumps(body)) // 4)
    out = sum(len(json.dumps(p)) // 4 for p in parts if not p.get("thought"))
    thoughts = sum(len(p["text"]) // 4 for p in parts if p.get("thought"))
    return {
        "promptTokenCount": prompt,
        "candidatesTokenCount": out,
        "totalTokenCount": prompt + out + thoughts,
        "cachedContentTokenCount": prompt // 2,
        "thoughtsTokenCount": thoughts,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": prompt}],
    }


def response(path, body, parts, finish=True, response_id=None):
    candidate = {"content": {"role": "model", "parts": parts}, "index": 0}
    out = {"candidates": [candidate], "modelVersion": model_of(path), "responseId": response_id or f"stub-{next(_ids)}"}
    if finish:
        candidate["finishReason"] = "STOP"
        out["usageMetadata"] = usage(body, parts)
    return out


def respond(path, body):
    """The `generateContent` answer: one response."""
    return response(path, body, decide(body))


def count_tokens(body):
    return {"totalTokens": max(1, len(json.dumps(body)) // 4)}


def stream_responses(path, body):
    """The `streamGenerateContent` answer: text in word pieces, other parts whole, the last response
    with the finish reason and the usage."""
    parts = decide(body)
    response_id = f"stub-{next(_ids)}"
    pieces = []
    for part in parts:
        if "text" in part and not part.get("thought"):
            words = part["text"].split(" ")
            pieces.extend({"text": w if i == 0 else " " + w} for i, w in enumerate(words))
        else:
            pieces.append(part)
    for piece in pieces[:-1]:
        yield response(path, body, [piece], finish=False, response_id=response_id)
    final = response(path, body, [pieces[-1]], response_id=response_id)
    final["usageMetadata"] = usage(body, parts)
    yield final


def sse_frames(path, body):
    return [f"data: {json.dumps(r)}\r\n\r\n".encode() for r in stream_responses(path, body)]


def json_array_frames(path, body):
    """The JSON array stream as Google's servers write it: `[`, the elements separated by `,` and line ends, `]`."""
    frames = []
    for n, r in enumerate(stream_responses(path, body)):
        frames.append((b"[" if n == 0 else b"\r\n,\r\n") + json.dumps(r, indent=2).encode())
    frames.append(b"\r\n]")
    return frames
