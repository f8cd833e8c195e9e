"""Write a session whose protected tail alone overflows a 16k window to DIR/tail_over_window.jsonl:
30 requests, each turn a tool output of 3-5k tokens (o200k), the next call naming a ticket the
previous output printed. The input of the epoch-thrash figures in BENCHMARKS.md.
Usage: thrash_session.py DIR"""
import json
import os
import sys

out_dir = sys.argv[1]
os.makedirs(out_dir, exist_ok=True)
msgs = [{"role": "system", "content": "You are a coding agent working in a large repository."},
        {"role": "user", "content": "Find why the nightly build fails and fix it."}]
out = []
for k in range(30):
    out.append(json.dumps({"model": "m", "messages": msgs}, ensure_ascii=False, separators=(",", ":")))
    cid = f"call_{k}"
    ticket = f"T{70000 + k}" if k == 0 else f"T{70000 + k - 1}"
    msgs = msgs + [{"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function", "function": {"name": "terminal", "arguments": json.dumps({"command": f"grep -n {ticket} build_{k}.log"}, separators=(",", ":"))}}]}]
    lines = 130 + (k * 37) % 80
    text = "".join(f"build_{k}.log:{i}: step {i} of stage_{k} compiled module_{k}_{i} in {i % 97} ms\n" for i in range(lines))
    text += f"ticket T{70000 + k} opened for stage_{k}\n"
    msgs = msgs + [{"role": "tool", "tool_call_id": cid, "content": text}]
open(os.path.join(out_dir, "tail_over_window.jsonl"), "w").write("\n".join(out) + "\n")
