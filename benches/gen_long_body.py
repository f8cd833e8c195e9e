"""Write a chat body of N messages (system, user, then assistant/tool pairs with small outputs) to
stdout: the input of the fitting figures in BENCHMARKS.md. Usage: gen_long_body.py N [USERS_EVERY]"""
import json, sys
n = int(sys.argv[1]); users_every = int(sys.argv[2]) if len(sys.argv) > 2 else 0
msgs = [{"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the failing test in src/lib.rs."}]
k = 0
while len(msgs) < n:
    if users_every and k % users_every == users_every - 1:
        msgs.append({"role": "user", "content": f"continue with step {k}"})
    else:
        cid = f"call_{k}"
        msgs.append({"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function", "function": {"name": "terminal", "arguments": json.dumps({"command": f"cat f{k}.txt"})}}]})
        msgs.append({"role": "tool", "tool_call_id": cid, "content": f"ok {k} done"})
    k += 1
print(json.dumps({"model": "m", "messages": msgs[:n]}))
