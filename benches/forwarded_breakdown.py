#!/usr/bin/env python3
"""Where the forwarded characters of the coding sessions go, as shares of the raw characters.

    python3 benches/forwarded_breakdown.py CORPUS_DIR [--window 64000] [--mode eager]
                                           [--config FILE] [--pare target/release/pare]

Runs `pare replay` on every session of the coding sources (everything but tau-bench) and sorts the
characters of each forwarded request into: the protected tail (the last 5 assistant turns and what
follows them, user messages excepted), user and system messages, the tools schema, and, before the
tail, the assistant's old text and old calls, tool results kept whole, truncated results, pare's
result markers and elision markers, and the JSON framing of tool messages. Characters of JSON text
stand in for tokens: the shares are what is left to cut, not token counts.
"""

import argparse
import collections
import json
import pathlib
import subprocess
import sys

TAIL_TURNS = 5
CODING = ["hermes", "mini-swe-agent", "openhands", "swe-agent", "swe-agent-text"]


def size(value):
    return 0 if value is None else len(json.dumps(value, ensure_ascii=False))


def text_of(content):
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)


def classify(body, shares):
    messages = body["messages"]
    shares["tools"] += size(body.get("tools"))
    assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    boundary = assistants[-TAIL_TURNS] if len(assistants) >= TAIL_TURNS else 0
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role in ("user", "system"):
            shares[role] += size(message)
        elif i >= boundary:
            shares["protected tail"] += size(message)
        elif role == "assistant":
            text = text_of(content) if content is not None else ""
            key = "elision markers" if text.startswith("[pare: ") and " elided" in text else "old assistant text"
            shares[key] += size(content)
            shares["old calls"] += size(message.get("tool_calls"))
            shares["framing"] += size(message) - size(content) - size(message.get("tool_calls"))
        elif role == "tool":
            text = text_of(content)
            if text.startswith("["):
                key = "result markers"
            elif "truncated" in text:
                key = "truncated results"
            else:
                key = "results kept whole"
            shares[key] += size(content)
            shares["framing"] += size(message) - size(content)
        else:
            shares["other"] += size(message)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", type=pathlib.Path, help="the unpacked corpus (its sessions/ folder or its parent)")
    parser.add_argument("--window", default="64000")
    parser.add_argument("--mode", default="eager", choices=["epoch", "eager", "off"])
    parser.add_argument("--config")
    parser.add_argument("--pare", default="target/release/pare")
    args = parser.parse_args()
    root = args.corpus / "sessions" if (args.corpus / "sessions").is_dir() else args.corpus
    raw_chars = 0
    shares = collections.Counter()
    for source in CODING:
        for path in sorted((root / source).glob("*.jsonl")):
            command = [args.pare, "replay", "--window", args.window, "--mode", args.mode, str(path)]
            if args.config:
                command += ["--config", args.config]
            forwarded = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()
            raw = [line for line in path.read_text().splitlines() if line.strip()]
            if len(raw) != len(forwarded):
                sys.exit(f"{path}: {len(raw)} requests but {len(forwarded)} forwarded lines")
            for raw_line, line in zip(raw, forwarded):
                raw_chars += len(raw_line)
                classify(json.loads(line), shares)
    if raw_chars == 0:
        sys.exit(f"no coding sessions under {root}")
    total = sum(shares.values())
    print(f"coding sessions, {args.mode} at {args.window}: forwarded {100 * total / raw_chars:.1f} % "
          f"of the raw characters (saved {100 * (1 - total / raw_chars):.1f} %)")
    for key, chars in shares.most_common():
        print(f"  {key:20} {100 * chars / raw_chars:5.1f} %")


if __name__ == "__main__":
    main()
