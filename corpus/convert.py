#!/usr/bin/env python3
"""Convert public agent transcripts into pare request-body sessions (the `filebench` corpus).

Source formats
--------------
* `claude-code`: a Claude Code session transcript (`~/.claude/projects/<project>/<session>.jsonl`,
  here as Entire checkpoints store it, `<id>/<n>/full.jsonl` on a repository's
  `entire/checkpoints/v1` branch). One JSON object per line: `user` lines (the prompt, or
  `tool_result` blocks), `assistant` lines (one per content block of an API message, `text`,
  `thinking` or `tool_use`, sharing the message id), and bookkeeping lines (`progress`, `system`,
  `file-history-snapshot`, ...). `Read` shows a file `cat -n` style (`     1→…`); `Edit` and
  `MultiEdit` quote the text they replace in `old_string`.
* `codex`: a Codex session rollout (`~/.codex/sessions/**/rollout-*.jsonl`, here from Entire
  checkpoints). One JSON object per line: `session_meta` (id, base instructions), `turn_context`
  (model), `response_item`s in Responses API shape (`message`, `reasoning`, `function_call`,
  `custom_tool_call`, their `*_output`s) and `event_msg`s. Files are read with `exec_command`
  (`sed -n`, `cat`, `nl`) and edited with `apply_patch`, whose context and `-` lines quote the file.
* `openhands-output`: an OpenHands evaluation `output.jsonl`, one instance per line; `history` is
  the event stream: a `system` action (prompt and tool schemas), the user's task, then agent actions
  each carrying `tool_call_metadata` (the call id and the model response that issued it) and the
  observations they caused. `str_replace_editor view` shows a file `cat -n` style; `str_replace`
  quotes the text it replaces in `old_str`.

Conversion rules (deterministic; converting again gives the same bytes)
---------------------------------------------------------------------
* Every source becomes chat-completions messages: one assistant message per model response (its
  text, and its tool calls with their ids, names and JSON arguments), each tool result the
  `role: tool` message of its call, user text as user messages. Reasoning and thinking are
  dropped. A call that never got a result before the model answered again is dropped from its
  message; user text that arrives while calls still wait is placed after their results (a chat
  request cannot put anything between a call and its result). A transcript is cut at its first
  compaction: what follows was sent without what precedes.
* `claude-code`: blocks of one API message are merged; subagent (`isSidechain`) lines, synthetic
  messages and bookkeeping lines are dropped; a tool_result's text blocks are joined (images
  dropped). The transcript holds neither Claude Code's system prompt nor its tool schemas, so the
  bodies carry none.
* `codex`: the base instructions are the system message, developer messages system messages; a
  custom tool's raw input becomes the arguments `{"input": <raw>}`; messages sub-agents send back
  become user messages; `event_msg`s (which repeat the items) are dropped. The rollout holds no
  tool schemas.
* `openhands-output`: the system action's content and tools are the system message and the body's
  tools; a command's output carries the prefix and suffix CodeActAgent adds (the exit-code line);
  an observation no call is waiting for becomes a user message; workspace-context `recall` events
  are dropped.
* `model` is the run's model name without its provider prefix. Request k holds every message
  before the k-th assistant message, so each request extends the previous one. One body per line,
  JSON with compact separators, UTF-8.
* A session is kept when it shows the case this corpus is for: at least 40 requests, at least one
  large file view (a `Read` without offset or limit, a `str_replace_editor view` without a range,
  or a `cat`/`cat -n`/`nl`/`sed -n '1,Np'` of one file, whose untruncated output is at least
  4,000 characters) and at least one exact-quote edit (an `Edit`/`MultiEdit` `old_string`, a
  `str_replace` `old_str`, the context and `-` lines of an `apply_patch`, or a `bash`/`execute_bash`
  command that edits with `sed -i`/`.replace(`, whose every line of 15+ characters, at least two when it holds two or more,
  appears verbatim in an earlier tool output, line-number prefixes removed).
* Entire checkpoint sources list the transcripts they use (`--discover` chooses them: see
  `discover`); a session one checkpoint after another extends counts once.

Inputs are cached under `--cache` (default `corpus/.cache`) as `<owner>+<repo>/<commit>/<path>`;
`--populate GITDIR` fills the cache from a clone of an upstream repository (`git show`; sources
whose commit the clone lacks are skipped; `--populate-only` stops there). Default action: write
`filebench.tar.zst` next to this script (`zstd -19 --long=27`). `--check`: rebuild from the cache
and verify that the packed archive holds exactly the same tar stream. `--stats`: print per-session
figures (requests, final tokens as characters / 4, large file views, exact-quote edits).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

MIN_REQUESTS = 40
MIN_VIEW_CHARS = 4000
QUOTE_MIN_LINE = 15
QUOTE_MIN_LINES = 2

# Session transcripts from Entire checkpoint branches, as `--discover SOURCE GITDIR` chooses them.
CLAUDE_CODE_TRANSCRIPTS = [
    "00/c9e2351016/0/full.jsonl",
    "04/6bdcb08e27/0/full.jsonl",
    "18/4069756ffc/0/full.jsonl",
    "1c/127425ed32/0/full.jsonl",
    "23/73a92c6c40/0/full.jsonl",
    "25/730c662552/0/full.jsonl",
    "25/9e16a0e452/0/full.jsonl",
    "29/b3ca43fc00/0/full.jsonl",
    "36/1bace85e2c/0/full.jsonl",
    "49/280afe3e31/1/full.jsonl",
    "51/a265047d72/3/full.jsonl",
    "5a/fc89b34b6c/0/full.jsonl",
    "5d/107d133886/0/full.jsonl",
    "60/1ac0eb4d69/0/full.jsonl",
    "61/a440d894cc/0/full.jsonl",
    "64/9d11045222/0/full.jsonl",
    "6d/123b9a5bc6/0/full.jsonl",
    "76/9ddf2969b6/1/full.jsonl",
    "84/a4728b5e36/0/full.jsonl",
    "8c/fa910f8ef9/5/full.jsonl",
    "98/78b713483d/0/full.jsonl",
    "9b/04c3d92e38/2/full.jsonl",
    "a5/d8ec9bae67/0/full.jsonl",
    "bc/cc3b2d7e10/0/full.jsonl",
    "c1/c35c964733/0/full.jsonl",
    "c8/65e23c3009/0/full.jsonl",
    "d5/1bd3632c2d/0/full.jsonl",
    "d5/99f72ee73a/0/full.jsonl",
    "ea/217859e24e/0/full.jsonl",
    "fc/64fce284b3/1/full.jsonl",
]

CODEX_GRAPH_TRANSCRIPTS = [
    "13/a55a80ec0f/0/full.jsonl",
    "54/fb8b1d18b6/0/full.jsonl",
    "cc/5b40fec726/0/full.jsonl",
    "d9/4ea7db13b9/0/full.jsonl",
]

CODEX_GIT_SYNC_TRANSCRIPTS = [
    "00/b8437a4e4a/2/full.jsonl",
    "01/fbd070bdf2/0/full.jsonl",
    "06/f4c46c9252/0/full.jsonl",
    "16/bfc6ff6845/0/full.jsonl",
    "1a/e05f312d98/0/full.jsonl",
    "1e/cffd82af56/1/full.jsonl",
    "6d/070296380b/0/full.jsonl",
    "6f/3629569e1e/0/full.jsonl",
    "be/84133ec5bb/0/full.jsonl",
    "e0/af21de41fb/1/full.jsonl",
    "fb/ad5717af5f/3/full.jsonl",
    "ff/9dd4114171/1/full.jsonl",
]

# Each source: where its trajectories live upstream, and how a session id is formed.
SOURCES = [
    {
        "source": "openhands-msb",
        "id_prefix": "oh-v0.35-llama-4-maverick",
        "repo": "All-Hands-AI/OpenHands",
        "commit": "3d22520992ea4a65c183376e8568bad6d4dedeec",
        "path": "evaluation/benchmarks/multi_swe_bench/examples/output.jsonl",
        "license": "MIT (All-Hands-AI/OpenHands LICENSE)",
        "tasks": ["ponylang__ponyc-4588", "ponylang__ponyc-4593", "ponylang__ponyc-4595"],
        "kind": "openhands-output",
    },
    {
        "source": "claude-code",
        "id_prefix": "claude-code-entire",
        "repo": "entireio/cli",
        "ref": "refs/heads/entire/checkpoints/v1",
        "commit": "394f81fab87f71aa8938d91ff7a067c524ff344b",
        "path": "{task}",
        "license": "MIT (entireio/cli LICENSE); transcripts from the repository's entire/checkpoints/v1 branch",
        "tasks": CLAUDE_CODE_TRANSCRIPTS,
        "kind": "claude-code",
        "model_prefix": "claude",
        "max_requests": 120,
        "max_tokens": 90_000,
        "limit": 30,
    },
    {
        "source": "codex",
        "id_prefix": "codex-entire",
        "repo": "entireio/entire-graph",
        "ref": "refs/heads/entire/checkpoints/v1",
        "commit": "7789048c1f7b7d311939f8021a5572699d598676",
        "path": "{task}",
        "license": "MIT (entireio/entire-graph LICENSE); rollouts from the repository's entire/checkpoints/v1 branch",
        "tasks": CODEX_GRAPH_TRANSCRIPTS,
        "kind": "codex",
        "model_prefix": "gpt",
        "max_requests": 150,
        "max_tokens": 200_000,
        "limit": 10,
    },
    {
        "source": "codex",
        "id_prefix": "codex-entire",
        "repo": "entireio/git-sync",
        "ref": "refs/heads/entire/checkpoints/v1",
        "commit": "8e24a4e9214edf84e753675e5c3ebe0f60e15264",
        "path": "{task}",
        "license": "MIT (entireio/git-sync LICENSE); rollouts from the repository's entire/checkpoints/v1 branch",
        "tasks": CODEX_GIT_SYNC_TRANSCRIPTS,
        "kind": "codex",
        "model_prefix": "gpt",
        "max_requests": 150,
        "max_tokens": 200_000,
        "limit": 12,
    },
]

LINE_NO = re.compile(r"^\s*\d+(?:\t|\u2192)")
VIEW = re.compile(r"^(?:cd \S+ && )?(?:cat(?: -n)?|nl(?: -ba)?|sed -n '1,\d+p') (\S+)\s*$")
EDIT = re.compile(r"sed -i|\.replace\(|str_replace")


def cache_path(cache: Path, src: dict, task: str) -> Path:
    owner_repo = src["repo"].replace("/", "+")
    return cache / owner_repo / src["commit"] / src["path"].format(task=task)


def requests_of(model: str, messages: list[dict], tools: list[dict]) -> list[dict]:
    """Request k = every message before the k-th assistant message."""
    return [{"model": model, "messages": messages[:i], "tools": tools}
            for i, m in enumerate(messages) if m["role"] == "assistant"]


def call_kind(name: str, args: dict) -> tuple[bool, str | None]:
    """(is a large file view, text an edit quotes or None) for one tool call (see the module docs)."""
    if name in ("bash", "execute_bash"):
        command = args.get("command", "")
        return bool(VIEW.match(command.strip())), command if EDIT.search(command) else None
    if name == "exec_command":
        return bool(VIEW.match(args.get("cmd", "").strip())), None
    if name == "apply_patch":
        quoted = [ln[1:] for ln in args.get("input", "").split("\n")
                  if ln[:1] in (" ", "-") and not ln.startswith("---")]
        return False, "\n".join(quoted)
    if name == "Read":
        return "offset" not in args and "limit" not in args, None
    if name == "Edit":
        return False, args.get("old_string") or ""
    if name == "MultiEdit":
        return False, "\n".join(e.get("old_string", "") for e in args.get("edits", []))
    if name == "str_replace_editor":
        if args.get("command") == "view":
            return not args.get("view_range"), None
        if args.get("command") == "str_replace":
            return False, args.get("old_str") or ""
    return False, None


def shape(messages: list[dict]) -> dict:
    """Large file views and exact-quote edits of a converted conversation (see the module docs)."""
    seen_lines: set[str] = set()
    views = edits = 0
    is_view: dict[str, bool] = {}
    for m in messages:
        if m["role"] == "assistant":
            for call in m.get("tool_calls", []):
                try:
                    args = json.loads(call["function"]["arguments"])
                except ValueError:
                    args = {}
                view, quote = call_kind(call["function"]["name"], args if isinstance(args, dict) else {})
                is_view[call["id"]] = view
                if quote is not None:
                    long_lines = [ln for ln in quote.split("\n") if len(ln.strip()) >= QUOTE_MIN_LINE]
                    quoted = [ln for ln in long_lines if ln.rstrip() in seen_lines]
                    if long_lines and len(quoted) >= min(QUOTE_MIN_LINES, len(long_lines)):
                        edits += 1
        elif m["role"] == "tool":
            content = text_of(m["content"])
            truncated = "<warning>" in content or "<output_head>" in content
            if is_view.get(m["tool_call_id"]) and not truncated and len(content) >= MIN_VIEW_CHARS:
                views += 1
            for ln in content.split("\n"):
                ln = LINE_NO.sub("", ln, count=1).rstrip()
                if len(ln.strip()) >= QUOTE_MIN_LINE:
                    seen_lines.add(ln)
    return {"whole_file_views": views, "exact_quote_edits": edits}


def text_of(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def dumps(body: dict) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def final_chars(body: dict) -> int:
    n = len(json.dumps(body["tools"], ensure_ascii=False))
    for m in body["messages"]:
        n += len(text_of(m.get("content")))
        for c in m.get("tool_calls", []):
            n += len(c["function"]["arguments"])
    return n


def observation_text(event: dict) -> str:
    """What CodeActAgent shows the model for an observation event."""
    content = event.get("content") or ""
    meta = (event.get("extras") or {}).get("metadata")
    if event.get("observation") == "run" and isinstance(meta, dict):
        content = (meta.get("prefix") or "") + content + (meta.get("suffix") or "")
    return content


def load_openhands(raw: bytes, task: str) -> tuple[str, list[dict], list[dict], list[str], str]:
    """One instance of an OpenHands evaluation `output.jsonl` (its event `history`) as messages."""
    record = next(r for r in map(json.loads, raw.decode("utf-8").splitlines()) if r["instance_id"] == task)
    history = record["history"]
    system = history[0]
    messages: list[dict] = [{"role": "system", "content": system["args"]["content"]}]
    tools = system["args"].get("tools") or []
    seen_responses: set[str] = set()
    answered: set[str] = set()
    calls_of_action: dict[int, str] = {}
    for e in history[1:]:
        meta = e.get("tool_call_metadata")
        if e.get("source") == "user" and e.get("action") == "message":
            messages.append({"role": "user", "content": e["args"]["content"]})
        elif e.get("action") and meta:
            calls_of_action[e["id"]] = meta["tool_call_id"]
            response = meta["model_response"]
            if response["id"] in seen_responses:
                continue
            seen_responses.add(response["id"])
            msg = response["choices"][0]["message"]
            calls = [{"id": c["id"], "type": "function",
                      "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                     for c in msg.get("tool_calls") or []]
            out = {"role": "assistant", "content": msg.get("content") or ""}
            if calls:
                out["tool_calls"] = calls
            messages.append(out)
        elif e.get("action") == "message" and e.get("source") == "agent":
            messages.append({"role": "assistant", "content": e["args"].get("content") or ""})
        elif e.get("observation") and e.get("observation") != "recall":
            call_id = meta["tool_call_id"] if meta else calls_of_action.get(e.get("cause"))
            if call_id and call_id not in answered:
                answered.add(call_id)
                messages.append({"role": "tool", "tool_call_id": call_id, "content": observation_text(e)})
            else:
                messages.append({"role": "user", "content": observation_text(e)})
    model = record["metadata"]["llm_config"]["model"].split("/")[-1].removeprefix("openrouter-")
    notes = [f"OpenHands {system['args'].get('openhands_version', '?')} {system['args'].get('agent_class', '')} "
             "event history rebuilt as messages: one assistant message per model response, observations as tool "
             "messages by tool_call_id; workspace-context recall events dropped",
             "Multi-SWE-bench (C) task; model served through OpenRouter"]
    return model, messages, tools, notes, task


def tool_result_text(content) -> str:
    """A Claude Code tool_result's content as text (text blocks joined; images dropped)."""
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or [] if isinstance(b, dict) and b.get("type") == "text")


def load_claude_code(raw: bytes, task: str) -> tuple[str, list[dict], list[dict], list[str], str]:
    """A Claude Code session transcript (`~/.claude/projects/*.jsonl` lines) as messages."""
    lines = [json.loads(ln) for ln in raw.decode("utf-8").splitlines() if ln.strip()]
    messages: list[dict] = []
    pending: list[str] = []        # tool call ids of the last assistant message still unanswered
    deferred: list[dict] = []      # user messages that arrived while calls were pending
    model = ""
    last_id = None

    def flush_calls() -> None:
        # Calls never answered before the next assistant turn are dropped from their message.
        if pending:
            for m in reversed(messages):
                if m["role"] == "assistant":
                    m["tool_calls"] = [c for c in m.get("tool_calls", []) if c["id"] not in pending]
                    if not m["tool_calls"]:
                        del m["tool_calls"]
                    break
            pending.clear()
        messages.extend(deferred)
        deferred.clear()

    for d in lines:
        if d.get("isSidechain"):
            continue
        if d.get("type") == "system" and d.get("subtype") == "compact_boundary":
            break
        if d.get("type") == "user" and d.get("isCompactSummary"):
            break
        if d.get("type") == "assistant":
            msg = d["message"]
            model = model or msg.get("model", "")
            if msg.get("model") == "<synthetic>":
                continue
            texts = [b["text"] for b in msg["content"] if b.get("type") == "text"]
            calls = [{"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}}
                     for b in msg["content"] if b.get("type") == "tool_use"]
            if msg.get("id") == last_id and messages and messages[-1]["role"] == "assistant" and not pending:
                target = messages[-1]
            elif msg.get("id") == last_id and pending:
                target = next(m for m in reversed(messages) if m["role"] == "assistant")
            else:
                flush_calls()
                target = {"role": "assistant", "content": ""}
                messages.append(target)
                last_id = msg.get("id")
            if texts:
                target["content"] = "\n\n".join([t for t in [target["content"]] + texts if t])
            if calls:
                target.setdefault("tool_calls", []).extend(calls)
                pending.extend(c["id"] for c in calls)
        elif d.get("type") == "user":
            content = d["message"]["content"]
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for b in blocks:
                if b.get("type") == "tool_result" and b.get("tool_use_id") in pending:
                    pending.remove(b["tool_use_id"])
                    messages.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                     "content": tool_result_text(b.get("content"))})
                elif b.get("type") == "text" and b.get("text"):
                    (deferred if pending else messages).append({"role": "user", "content": b["text"]})
            if not pending:
                messages.extend(deferred)
                deferred.clear()
    flush_calls()
    notes = ["Claude Code transcript (Entire checkpoint) rebuilt as messages: content blocks of one API message "
             "merged, thinking dropped, tool_use as tool calls, tool_result as tool messages; subagent (sidechain) "
             "lines dropped; cut at the first compaction; the system prompt and tool schemas are not in the transcript"]
    session = next((d["sessionId"] for d in lines if d.get("sessionId")), task)
    return model, messages, [], notes, session


def output_text(output) -> str:
    """A Codex tool output (a string, or a list of `input_text`/`output_text` items) as text."""
    if isinstance(output, str):
        return output
    if isinstance(output, dict):
        return output_text(output.get("content", ""))
    return "".join(b.get("text", "") for b in output or [] if isinstance(b, dict))


def load_codex(raw: bytes, task: str) -> tuple[str, list[dict], list[dict], list[str], str]:
    """A Codex session rollout (`~/.codex/sessions/**/rollout-*.jsonl` lines) as messages."""
    messages: list[dict] = []
    pending: list[str] = []
    deferred: list[dict] = []
    model, session = "", task
    open_turn: dict | None = None  # the assistant message the current model response is filling

    def close_turn() -> None:
        nonlocal open_turn
        open_turn = None

    def assistant() -> dict:
        nonlocal open_turn
        if open_turn is None:
            if pending:  # calls of the previous response never answered are dropped
                for m in reversed(messages):
                    if m["role"] == "assistant":
                        m["tool_calls"] = [c for c in m.get("tool_calls", []) if c["id"] not in pending]
                        if not m["tool_calls"]:
                            del m["tool_calls"]
                        break
                pending.clear()
            messages.extend(deferred)
            deferred.clear()
            open_turn = {"role": "assistant", "content": ""}
            messages.append(open_turn)
        return open_turn

    def other(msg: dict) -> None:
        close_turn()
        (deferred if pending else messages).append(msg)

    for line in raw.decode("utf-8").splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        kind, p = d.get("type"), d.get("payload") or {}
        if kind == "compacted":
            break
        if kind == "session_meta":
            session = p.get("id", session)
            text = (p.get("base_instructions") or {}).get("text")
            if text and not messages:
                messages.append({"role": "system", "content": text})
        elif kind == "turn_context":
            model = model or p.get("model", "")
        elif kind == "response_item":
            t = p.get("type")
            if t == "message" and p.get("role") == "assistant":
                a = assistant()
                a["content"] = "\n\n".join(x for x in [a["content"], output_text(p.get("content"))] if x)
            elif t == "message":
                role = "user" if p.get("role") == "user" else "system"
                other({"role": role, "content": output_text(p.get("content"))})
            elif t in ("function_call", "custom_tool_call"):
                arguments = p.get("arguments", "") if t == "function_call" else json.dumps(
                    {"input": p.get("input", "")}, ensure_ascii=False)
                a = assistant()
                a.setdefault("tool_calls", []).append(
                    {"id": p["call_id"], "type": "function", "function": {"name": p.get("name", ""), "arguments": arguments}})
                pending.append(p["call_id"])
            elif t in ("function_call_output", "custom_tool_call_output"):
                close_turn()
                if p.get("call_id") in pending:
                    pending.remove(p["call_id"])
                    messages.append({"role": "tool", "tool_call_id": p["call_id"], "content": output_text(p.get("output"))})
                    if not pending:
                        messages.extend(deferred)
                        deferred.clear()
            elif t == "agent_message":
                other({"role": "user", "content": output_text(p.get("content"))})
    if pending:
        for m in reversed(messages):
            if m["role"] == "assistant":
                m["tool_calls"] = [c for c in m.get("tool_calls", []) if c["id"] not in pending]
                if not m["tool_calls"]:
                    del m["tool_calls"]
                break
    messages.extend(deferred)
    notes = ["Codex rollout (Entire checkpoint) rebuilt as chat messages: base instructions as the system message, "
             "developer messages as system messages, one assistant message per model response (reasoning dropped), "
             "function and custom tool calls as tool calls (a custom tool's raw input as {\"input\": …}), their "
             "outputs as tool messages, sub-agent messages as user messages; cut at the first compaction; tool "
             "schemas are not in the rollout"]
    return model, messages, [], notes, session


LOADERS = {"openhands-output": load_openhands,
           "claude-code": load_claude_code,
           "codex": load_codex}


def build(cache: Path) -> tuple[dict[str, bytes], list[dict]]:
    """Every kept session file (archive path → bytes) and its manifest entry."""
    files: dict[str, bytes] = {}
    entries: list[dict] = []
    for src in SOURCES:
        for task in src["tasks"]:
            path = cache_path(cache, src, task)
            if not path.exists():
                raise SystemExit(f"missing cached input {path} (see --populate)")
            model, messages, tools, notes, session = LOADERS[src["kind"]](path.read_bytes(), task)
            bodies = requests_of(model, messages, tools)
            figures = shape(messages)
            if len(bodies) < MIN_REQUESTS or not figures["whole_file_views"] or not figures["exact_quote_edits"]:
                continue
            session_id = f"{src['id_prefix']}__{session}"
            name = f"sessions/{src['source']}/{session_id}.jsonl"
            data = "".join(dumps(b) + "\n" for b in bodies).encode("utf-8")
            files[name] = data
            last = bodies[-1]
            tool_msgs = [m for m in last["messages"] if m["role"] == "tool"]
            entries.append({
                "file": name,
                "session_id": session_id,
                "source": src["source"],
                "task_id": session,
                "upstream": {"repo": src["repo"], **({"ref": src["ref"]} if "ref" in src else {}),
                             "commit": src["commit"], "path": src["path"].format(task=task)},
                "license": src["license"],
                "model": model,
                "n_requests": len(bodies),
                "n_messages_final": len(last["messages"]),
                "final_chars": final_chars(last),
                "final_tokens_est": final_chars(last) // 4,
                "n_tool_msgs": len(tool_msgs),
                "max_tool_chars": max((len(text_of(m["content"])) for m in tool_msgs), default=0),
                "has_tools_schema": bool(tools),
                "verbatim_capture": False,
                "file_bytes": len(data),
                **figures,
                "notes": notes,
            })
    manifest = {
        "split": "filebench",
        "n_sessions": len(entries),
        "definition": (
            "each line = one chat-completions request body; request k = messages before the k-th assistant "
            "message of the transcript; final_chars = characters of message contents, tool-call arguments and "
            "tool schemas of the last request (final_tokens_est = final_chars / 4); n_tool_msgs/max_tool_chars "
            "over role=tool messages of the last request; whole_file_views/exact_quote_edits as in corpus/convert.py"
        ),
        "sessions": entries,
    }
    files["sessions/MANIFEST.json"] = (json.dumps(manifest, ensure_ascii=False, indent=1) + "\n").encode("utf-8")
    return files, entries


def tar_bytes(files: dict[str, bytes]) -> bytes:
    """An uncompressed tar of `files`, sorted, with fixed metadata."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        dirs = sorted({str(Path(n).parent) for n in files} | {"sessions"})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[name]))
    return buf.getvalue()


def populate(cache: Path, gitdir: Path) -> None:
    """Copy into the cache every input whose commit `gitdir` holds."""
    for src in SOURCES:
        present = subprocess.run(["git", "-C", str(gitdir), "cat-file", "-e", f"{src['commit']}^{{commit}}"],
                                 capture_output=True).returncode == 0
        if not present:
            continue
        for task in src["tasks"]:
            path = cache_path(cache, src, task)
            if path.exists():
                continue
            blob = subprocess.run(["git", "-C", str(gitdir), "show", f"{src['commit']}:{src['path'].format(task=task)}"],
                                  check=True, capture_output=True).stdout
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(blob)


def discover(gitdir: Path, src: dict) -> list[str]:
    """The checkpoint transcripts `SOURCES` lists for an Entire source, chosen from a clone.

    Every `full.jsonl` at the source's commit is converted with the source's loader; transcripts of
    the same session (one per checkpoint it contributed to) and identical conversions count once,
    the one with the most requests kept; sessions whose model name starts with the source's
    `model_prefix`, of 40 to `max_requests` requests, whose final request is at most `max_tokens`
    tokens and that qualify (see the module docs) are ordered by the SHA-1 of their session id and
    the first `limit` taken.
    """
    git = ["git", "-C", str(gitdir)]
    tree = subprocess.run(git + ["ls-tree", "-r", "-l", src["commit"]], check=True, capture_output=True,
                          text=True).stdout.splitlines()
    best: dict[str, tuple[int, str, str]] = {}
    seen_bodies: set[str] = set()
    for row in tree:
        meta, path = row.split("\t", 1)
        if not path.endswith("/full.jsonl") or meta.split()[3] == "-":
            continue
        shown = subprocess.run(git + ["show", f"{src['commit']}:{path}"], capture_output=True)
        if shown.returncode != 0:  # a blob the clone lacks (the snapshot leaves out files of 4 MiB and more)
            continue
        try:
            model, messages, tools, _, session = LOADERS[src["kind"]](shown.stdout, path)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        bodies = requests_of(model, messages, tools)
        if not model.startswith(src["model_prefix"]) or not MIN_REQUESTS <= len(bodies) <= src["max_requests"]:
            continue
        if final_chars(bodies[-1]) // 4 > src["max_tokens"]:
            continue
        figures = shape(messages)
        if not figures["whole_file_views"] or not figures["exact_quote_edits"]:
            continue
        digest = hashlib.sha1(dumps(bodies[-1]).encode("utf-8")).hexdigest()
        if digest in seen_bodies:
            continue
        seen_bodies.add(digest)
        if session not in best or (len(bodies), path) > best[session][:2]:
            best[session] = (len(bodies), path, session)
    chosen = sorted(best.values(), key=lambda b: hashlib.sha1(b[2].encode("utf-8")).hexdigest())[:src["limit"]]
    return sorted(path for _, path, _ in chosen)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=HERE / ".cache")
    ap.add_argument("--out", type=Path, default=HERE / "filebench.tar.zst")
    ap.add_argument("--populate", type=Path, metavar="GITDIR", help="fill the cache from a clone of the upstream")
    ap.add_argument("--populate-only", action="store_true", help="stop after filling the cache")
    ap.add_argument("--check", action="store_true", help="verify the packed tarball against a fresh conversion")
    ap.add_argument("--discover", nargs=2, metavar=("REPO", "GITDIR"),
                    help="print the transcripts to list in SOURCES for an Entire source (owner/name), chosen from a clone")
    ap.add_argument("--stats", action="store_true", help="print per-session figures")
    args = ap.parse_args()
    if args.discover:
        src = next(s for s in SOURCES if s["repo"] == args.discover[0])
        for path in discover(Path(args.discover[1]), src):
            print(f'    "{path}",')
        return 0
    if args.populate:
        populate(args.cache, args.populate)
        if args.populate_only:
            return 0
    files, entries = build(args.cache)
    fresh = tar_bytes(files)
    if args.stats:
        for e in entries:
            print(f"{e['session_id']}\t{e['n_requests']}\t{e['final_tokens_est']}\t"
                  f"{e['whole_file_views']}\t{e['exact_quote_edits']}")
    if args.check:
        packed = subprocess.run(["zstd", "-dc", str(args.out)], check=True, capture_output=True).stdout
        if packed != fresh:
            print(f"{args.out}: differs from a fresh conversion", file=sys.stderr)
            return 1
        print(f"{args.out}: {len(entries)} sessions, identical to a fresh conversion")
        return 0
    packed = subprocess.run(["zstd", "-19", "--long=27", "-q", "-c"], input=fresh, check=True, capture_output=True).stdout
    args.out.write_bytes(packed)
    print(f"wrote {args.out}: {len(entries)} sessions, {len(fresh)} bytes unpacked, {len(packed)} packed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
