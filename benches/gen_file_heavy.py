#!/usr/bin/env python3
"""Long, file-heavy OpenHands-style sessions derived from the shared corpus, for `pare eval`.

Usage: benches/gen_file_heavy.py CORPUS_SESSIONS_DIR OUT_DIR [--seed N] [--variants K] [--max-sessions M]
       [--only TASK] [--max-file-lines N] [--last-requests K]

`--max-file-lines`, `--last-requests` and `--only` make small test fixtures: files cut to their first
N lines where the agent first views them, only the last K request bodies written, one task.

Reads `CORPUS_SESSIONS_DIR/openhands/*.jsonl` (the shared corpus unpacked) and writes
`OUT_DIR/openhands-fileheavy/fileheavy-sS-vV__<task>.jsonl`: one request body per line, request k
holding every message before the k-th assistant message, as `pare eval` and `pare replay` read them.

Each generated session is one real session made longer the way long OpenHands runs are:

- every turn of the real session, in order, with its real outputs;
- after each large `str_replace_editor view` of a file (over 6,000 chars), work cycles on that file:
  8–11 turns of other work (re-runs of the session's own commands with their real logs, `grep -n`
  over the files it has viewed, ranged views of other files), then a `str_replace` edit quoting
  a 20–60 line region of the file as the agent last saw it (at least 40 identifiers where the file
  has them), its OpenHands answer (the edited snippet with line numbers), and, between cycles, a fresh
  full view of the file as edited (the contents follow every edit, real or generated);
- an edit's region is near an earlier edit of the file half of the time (agents fix up what they
  just changed), elsewhere in the file otherwise.

Deterministic: the same inputs, seed and options give the same bytes. Split by task: a generated
session holds material from its one base session only, and its id names the base session's
SWE-bench task, so `pare eval --split tune|holdout` puts it on its base task's side.
"""

import argparse
import hashlib
import json
import random
import re
import sys
from pathlib import Path

VIEW_HEADER = re.compile(r"^Here's the result of running `cat -n` on (\S+):\n")
NUMBERED = re.compile(r"^ *(\d+)\t(.*)$")
IDENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./\-]*[A-Za-z0-9_]")
TASK = re.compile(r"(?:^|_)([A-Za-z0-9][A-Za-z0-9.-]*__[A-Za-z0-9.-]*-\d+)(?:__|$)")
LARGE_VIEW = 6000
SHELL_TAIL = "[Python Interpreter: /opt/miniconda3/envs/testbed/bin/python]\nroot@openhands-workspace:/workspace # \n[Command finished with exit code {code}]"
FILLER_NOTES = [
    "Let me check how this is used elsewhere:",
    "Let's look at the related code:",
    "Let me run the reproduction again to see the current state:",
    "Let me look for other places that need the same change:",
    "I'll check the surrounding code before editing:",
    "Let's see where this is defined:",
    "Let me verify the behaviour first:",
    "Let me look at the other file as well:",
]
EDIT_NOTES = [
    "Now I'll update this part of {name}:",
    "Based on what we found, let's modify {name}:",
    "Let's make the change in {name}:",
    "I'll adjust the code in {name} accordingly:",
]


def text_of(message):
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def identifiers(text):
    """Identifier-like tokens as `pare eval` counts needles (paths, ids, snake/camel-case names)."""
    out = []
    for m in IDENT.finditer(text):
        token = m.group(0).rstrip(".-/")
        if len(token) < 4 or token in out:
            continue
        alpha = any(c.isalpha() for c in token)
        digit = any(c.isdigit() for c in token)
        name = alpha and (
            ("_" in token and any(c.islower() for c in token))
            or any(a.islower() and b.isupper() for a, b in zip(token, token[1:]))
        )
        if token.isdigit() or (alpha and "/" in token) or (alpha and digit and "." not in token) or name:
            out.append(token)
    return out


def parse_view(text):
    """A full `cat -n` view: (path, lines) or None."""
    head = VIEW_HEADER.match(text)
    if not head:
        return None
    lines = []
    for line in text[head.end() :].split("\n"):
        m = NUMBERED.match(line)
        if m is None:
            if line.strip() == "" or line.strip().isdigit():
                # `   358` with nothing after the tab: an empty last line.
                lines.append("")
                continue
            return None
        lines.append(m.group(2))
    return head.group(1), lines


def render_view(path, lines, first=1):
    body = "\n".join(f"{first + i:6d}\t{line}" for i, line in enumerate(lines))
    return f"Here's the result of running `cat -n` on {path}:\n{body}"


class Builder:
    """The generated conversation, message by message."""

    def __init__(self, seed_tag):
        self.messages = []
        self.calls = 0
        self.tag = seed_tag

    def call_id(self):
        self.calls += 1
        digest = hashlib.sha256(f"{self.tag}:{self.calls}".encode()).hexdigest()[:22]
        return f"toolu_{digest}"

    def turn(self, note, tool, arguments, output):
        call_id = self.call_id()
        self.messages.append(
            {
                "role": "assistant",
                "content": [{"type": "text", "text": note}],
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": tool, "arguments": json.dumps(arguments)},
                    }
                ],
            }
        )
        self.messages.append(
            {"role": "tool", "content": [{"type": "text", "text": output}], "tool_call_id": call_id, "name": tool}
        )


class Session:
    """One base session and the state the generator follows: file contents and edited regions."""

    def __init__(self, final_request, rng, tag, max_file_lines=0):
        self.request = final_request
        self.max_file_lines = max_file_lines
        self.rng = rng
        self.out = Builder(tag)
        self.files = {}  # path → lines, as the agent last saw or left them
        self.edited = {}  # path → line numbers (1-based) of earlier edits
        self.logs = []  # (command, output) of the session's own shell runs
        self.cycled = 0  # large views followed by work cycles

    def filler(self, focus):
        """One turn of other work while the agent works on `focus`."""
        rng = self.rng
        others = sorted(p for p in self.files if p != focus)
        choices = ["grep"]
        if self.logs:
            choices += ["log", "log"]
        if others:
            choices.append("range")
        kind = rng.choice(choices)
        note = rng.choice(FILLER_NOTES)
        if kind == "log":
            command, output = rng.choice(self.logs)
            self.out.turn(note, "execute_bash", {"command": command}, output)
        elif kind == "range":
            path = rng.choice(others)
            lines = self.files[path]
            a = rng.randrange(1, max(2, len(lines) - 20))
            b = min(len(lines), a + rng.randrange(20, 70))
            output = render_view(path, lines[a - 1 : b], a)
            self.out.turn(note, "str_replace_editor", {"command": "view", "path": path, "view_range": [a, b]}, output)
        else:
            path = rng.choice(sorted(self.files))
            names = [n for n in identifiers("\n".join(self.files[path])) if "_" in n and "/" not in n] or ["def "]
            name = rng.choice(names)
            hits = [f"{i + 1}:{line}" for i, line in enumerate(self.files[path]) if name in line][:40]
            command = f"grep -n '{name}' {path}"
            output = command + "\r\n" + "\r\n".join(hits) + "\r\n" + SHELL_TAIL.format(code=0 if hits else 1)
            self.out.turn(note, "execute_bash", {"command": command}, output)

    def region(self, path):
        """Lines (start, end), 1-based inclusive, of the next edit of `path`."""
        rng = self.rng
        lines = self.files[path]
        n = len(lines)
        near = self.edited.get(path)
        if near and rng.random() < 0.5:
            anchor = rng.choice(near) + rng.randrange(-30, 31)
        else:
            anchor = rng.randrange(1, n + 1)
        start = min(max(1, anchor), max(1, n - 20))
        # Back up to a line that starts a block, then take lines until the region quotes at least 40
        # identifiers (20–60 lines).
        for back in range(0, 15):
            if start - back >= 1 and re.match(r"\s*(def |class |@|if |for |with |try:)", lines[start - back - 1]):
                start -= back
                break
        end = min(n, start + 19)
        while end < n and end - start < 59 and len(identifiers("\n".join(lines[start - 1 : end]))) < 40:
            end += 1
        return start, end

    def generated_edit(self, path):
        start, end = self.region(path)
        lines = self.files[path]
        old = lines[start - 1 : end]
        indent = re.match(r"\s*", old[0]).group(0)
        if old[0].rstrip().endswith(":"):
            indent += "    "
        names = identifiers("\n".join(old))
        note = f"{indent}# Keep {names[0] if names else 'this'} consistent with the change above."
        new = [old[0], note] + old[1:]
        name = path.rsplit("/", 1)[-1]
        text = self.rng.choice(EDIT_NOTES).format(name=name)
        args = {"command": "str_replace", "path": path, "old_str": "\n".join(old), "new_str": "\n".join(new)}
        self.files[path] = lines[: start - 1] + new + lines[end:]
        self.edited.setdefault(path, []).append(start)
        a = max(1, start - 4)
        b = min(len(self.files[path]), start + len(new) + 3)
        snippet = "\n".join(f"{i:6d}\t{self.files[path][i - 1]}" for i in range(a, b + 1))
        output = (
            f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet of {path}:\n"
            f"{snippet}\nReview the changes and make sure they are as expected. Edit the file again if necessary."
        )
        self.out.turn(text, "str_replace_editor", args, output)

    def cycles(self, path):
        """Work on `path` after a large view of it: edits 8–11 turns after the agent's latest view."""
        rounds = self.rng.choice([2, 3])
        for r in range(rounds):
            for _ in range(self.rng.randrange(8, 12)):
                self.filler(path)
            self.generated_edit(path)
            if r + 1 < rounds:
                for _ in range(self.rng.randrange(1, 3)):
                    self.filler(path)
                output = render_view(path, self.files[path])
                self.out.turn("Let me view the whole file again:", "str_replace_editor", {"command": "view", "path": path}, output)

    def follow(self, assistant, result):
        """Track what a real turn shows or changes."""
        for call in assistant.get("tool_calls") or []:
            try:
                args = json.loads(call["function"]["arguments"])
            except (KeyError, ValueError):
                continue
            name = call["function"].get("name")
            text = text_of(result) if result else ""
            if name == "execute_bash" and 100 <= len(text) <= 4000 and "command" in args:
                self.logs.append((args["command"], text))
            if name != "str_replace_editor":
                continue
            path = args.get("path")
            if args.get("command") == "view" and "view_range" not in args:
                parsed = parse_view(text)
                if parsed and parsed[0] == path:
                    large = len(text) > LARGE_VIEW
                    lines = parsed[1]
                    if self.max_file_lines and len(lines) > self.max_file_lines:
                        lines = lines[: self.max_file_lines]
                        result["content"] = [{"type": "text", "text": render_view(path, lines)}]
                    self.files[path] = lines
                    if large:
                        return path
            elif args.get("command") == "str_replace" and path in self.files and "has been edited" in text:
                joined = "\n".join(self.files[path])
                old, new = args.get("old_str", ""), args.get("new_str", "")
                if old and joined.count(old) == 1:
                    at = joined[: joined.index(old)].count("\n") + 1
                    self.files[path] = joined.replace(old, new).split("\n")
                    self.edited.setdefault(path, []).append(at)
        return None

    def build(self):
        messages = self.request["messages"]
        i = 0
        while i < len(messages):
            m = messages[i]
            self.out.messages.append(m)
            if m.get("role") == "assistant" and m.get("tool_calls"):
                results = []
                j = i + 1
                while j < len(messages) and messages[j].get("role") == "tool":
                    result = dict(messages[j])
                    results.append(result)
                    self.out.messages.append(result)
                    j += 1
                large = self.follow(m, results[0] if len(results) == 1 else None)
                i = j
                if large:
                    self.cycled += 1
                    self.cycles(large)
                continue
            i += 1
        return self.out.messages


def requests(final, messages):
    """Request k: every message before the k-th assistant message; then the whole conversation, the
    request that carries the last assistant message (a conversation always ends with a tool result or
    a user message)."""
    base = {k: v for k, v in final.items() if k != "messages"}
    cuts = [k for k, m in enumerate(messages) if m.get("role") == "assistant"] + [len(messages)]
    out = []
    for cut in cuts:
        body = {"model": base.get("model"), "messages": messages[:cut]}
        for key, value in base.items():
            if key not in ("model", "messages"):
                body[key] = value
        out.append(json.dumps(body, ensure_ascii=False, separators=(", ", ": ")))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus")
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--variants", type=int, default=1)
    parser.add_argument("--max-sessions", type=int, default=0)
    parser.add_argument("--only", default=None)
    parser.add_argument("--max-file-lines", type=int, default=0)
    parser.add_argument("--last-requests", type=int, default=0)
    args = parser.parse_args()
    files = sorted(Path(args.corpus, "openhands").glob("*.jsonl"))
    if args.only:
        files = [f for f in files if f.stem.endswith("__" + args.only)]
    if not files:
        sys.exit(f"no openhands sessions under {args.corpus}")
    if args.max_sessions:
        files = files[: args.max_sessions]
    out_dir = Path(args.out, "openhands-fileheavy")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = 0
    for path in files:
        task = TASK.search(path.stem)
        task = task.group(1) if task else path.stem
        with path.open(encoding="utf-8") as f:
            last = None
            for line in f:
                if line.strip():
                    last = line
        final = json.loads(last)
        for v in range(args.variants):
            tag = f"{args.seed}:{v}:{path.stem}"
            rng = random.Random(hashlib.sha256(tag.encode()).digest())
            session = Session(final, rng, tag, args.max_file_lines)
            messages = session.build()
            if session.cycled == 0:
                continue
            name = f"fileheavy-s{args.seed}-v{v}__{task}.jsonl"
            bodies = requests(final, messages)
            if args.last_requests:
                bodies = bodies[-args.last_requests :]
            body = "\n".join(bodies) + "\n"
            (out_dir / name).write_text(body, encoding="utf-8")
            written += 1
            print(f"{name}: {len(messages)} messages, {body.count(chr(10))} requests", file=sys.stderr)
    print(f"{written} sessions in {out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
