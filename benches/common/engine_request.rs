//! The engine bench's request, shared by `benches/engine.rs` and `examples/instructions.rs` (included
//! with `#[path]`): ~225 messages, ~780 KB, built deterministically from corpus-like content — a
//! system prompt, a task, then tool turns (reads, test runs, listings, Hermes-shaped JSON results) and
//! a few assistant notes.

use pare::compact::{CompactOptions, Engine};
use pare::tokens::CountTokens;
use pare::wire::ChatBody;
use serde_json::{Value, json};

fn numbered_source(seed: usize, n: usize) -> String {
    let mut out = format!("Here's the result of running `cat -n` on /workspace/repo/src/module_{seed}.py:\n");
    let mut line = 1;
    for f in 0..n {
        for l in [
            format!("class Handler{seed}_{f}(Base):"),
            format!("    \"\"\"Handles case {f} of module {seed}.\"\"\""),
            format!("    def run(self, request, retries={f}):"),
            "        result = self.prepare(request)".to_string(),
            "        if result is None:".to_string(),
            format!("            raise ValueError('no result for {seed}/{f}')"),
            "        return self.finish(result)".to_string(),
            String::new(),
        ] {
            out.push_str(&format!("{line:6}\t{l}\n"));
            line += 1;
        }
    }
    out
}

fn pytest_output(seed: usize, fail: bool) -> String {
    let mut out = format!(
        "============================= test session starts ==============================\nplatform linux -- Python 3.11.4, pytest-7.4.0\ncollected {} items\n\n",
        40 + seed % 17
    );
    for i in 0..90 {
        out.push_str(&format!("tests/test_module_{seed}.py::test_case_{i} PASSED{:>40}\n", format!("[{:3}%]", i * 2)));
    }
    if fail {
        out.push_str("=================================== FAILURES ===================================\n");
        out.push_str("Traceback (most recent call last):\n");
        for i in 0..25 {
            out.push_str(&format!("  File \"/workspace/repo/src/module_{seed}.py\", line {}, in run\n    result = self.prepare(request)\n", 10 + i));
        }
        out.push_str(&format!("ValueError: no result for {seed}/3\nFAILED tests/test_module_{seed}.py::test_case_3\n"));
    }
    out.push_str(&format!("[Command finished with exit code {}]", u8::from(fail)));
    out
}

fn listing(seed: usize) -> String {
    (0..60)
        .map(|i| format!("-rw-r--r-- 1 root root {:6} Nov 21 21:{:02} file_{seed}_{i}.py\n", 1000 + i * 37, i % 60))
        .collect()
}

/// ~225 messages, ~780 KB: a system prompt, a task, then tool turns (reads, test runs, listings,
/// Hermes-shaped JSON results), a few assistant notes.
pub fn large_request() -> Vec<u8> {
    let mut messages = vec![
        json!({"role": "system", "content": format!("You are a coding agent.\n{}", "# Rules\nFollow the repository conventions. ".repeat(400))}),
        json!({"role": "user", "content": "Fix the failing tests in src/module_3.py without breaking the other modules."}),
    ];
    let mut i = 0;
    while messages.len() < 223 {
        let (tool, args, result) = match i % 5 {
            0 => ("str_replace_editor", json!({"command": "view", "path": format!("/workspace/repo/src/module_{i}.py")}), json!([{"type": "text", "text": numbered_source(i, 30 + i % 9)}])),
            1 => ("execute_bash", json!({"command": format!("cd /workspace/repo && python -m pytest tests/test_module_{i}.py")}), Value::String(pytest_output(i, i % 3 == 0))),
            2 => ("terminal", json!({"command": format!("ls -la /workspace/repo/src/pkg_{i}")}), Value::String(json!({"output": listing(i), "exit_code": 0, "error": null}).to_string())),
            3 => ("read_file", json!({"path": format!("/workspace/repo/src/module_{}.py", i % 7)}), Value::String(json!({"content": numbered_source(i % 7, 24), "total_lines": 192}).to_string())),
            _ => ("search_files", json!({"pattern": format!("Handler{i}"), "path": "/workspace/repo"}), Value::String(json!({"total_count": 3, "matches": [{"path": format!("src/module_{i}.py"), "line": 3, "content": format!("class Handler{i}_0(Base):")}]}).to_string())),
        };
        let id = format!("call_{i:04}");
        messages.push(json!({"role": "assistant", "content": format!("Step {i}: checking {tool}."), "tool_calls": [
            {"id": id, "type": "function", "function": {"name": tool, "arguments": args.to_string()}}
        ]}));
        messages.push(json!({"role": "tool", "tool_call_id": id, "name": tool, "content": result}));
        i += 1;
    }
    messages.push(json!({"role": "assistant", "content": "All tests pass now."}));
    serde_json::to_vec(&json!({"model": "local", "messages": messages, "stream": true, "max_tokens": 4096})).unwrap()
}

/// Parse, compact and serialize one body, as the proxy does for a request that crosses its high-water mark.
pub fn compact_with(engine: &Engine, body: &[u8], options: &CompactOptions, counter: &dyn CountTokens) -> Vec<u8> {
    let parsed = ChatBody::parse(body).unwrap();
    let out = engine.compact(&parsed.view(), options, counter);
    let mut messages = out.prefix;
    messages.extend(parsed.messages()[out.boundary..].iter().map(|m| (*m).to_owned()));
    parsed.to_vec_with_messages(&messages)
}
