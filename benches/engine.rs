//! The compaction engine's cost on a large request: parse + rules + serialize of an ~850 KB body
//! (~225 messages, ~200k tokens) built deterministically from corpus-like content, compared in the
//! same run with a plain serde_json parse and serialize of the same body.
//!
//! `cargo bench --bench engine` (add `-- --quick` for a short run). Before criterion's runs it prints
//! one line that times serde_json, pare on one thread and pare on all cores in turn, and their ratios:
//! the figure to read on a shared machine. `cargo bench --bench engine -- no-such-bench` prints only
//! that line.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use pare::budget::tokens::{CountTokens, CounterConfig, QuarterCounter, TokenCounter};
use pare::compact::{CompactOptions, Engine};
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

/// ~225 messages, ~850 KB: a system prompt, a task, then tool turns (reads, test runs, listings,
/// Hermes-shaped JSON results), a few assistant notes.
fn large_request() -> Vec<u8> {
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

fn compact_bytes(engine: &Engine, body: &[u8], target: Option<u64>, counter: &dyn CountTokens) -> Vec<u8> {
    compact_with(engine, body, &CompactOptions { target_tokens: target, ..Default::default() }, counter)
}

fn compact_with(engine: &Engine, body: &[u8], options: &CompactOptions, counter: &dyn CountTokens) -> Vec<u8> {
    let parsed = ChatBody::parse(body).unwrap();
    let out = engine.compact(&parsed, options, counter);
    let mut messages = out.prefix;
    messages.extend(parsed.messages[out.boundary..].iter().map(|m| (*m).to_owned()));
    parsed.to_vec_with_messages(&messages)
}

fn bench(c: &mut Criterion) {
    let body = large_request();
    let engine = Engine::default_pack();
    let n_messages = ChatBody::parse(&body).unwrap().messages.len();
    let tiktoken = TokenCounter::new(&CounterConfig::default());
    let raw_tokens: u64 = ChatBody::parse(&body).unwrap().messages.iter().map(|m| tiktoken.message(m)).sum();
    let out = compact_bytes(&engine, &body, None, &tiktoken);
    let one_thread = CompactOptions { single_thread: true, ..Default::default() };
    assert_eq!(out, compact_with(&engine, &body, &one_thread, &tiktoken), "one thread or all cores: same bytes");
    let out_tokens: u64 = ChatBody::parse(&out).unwrap().messages.iter().map(|m| tiktoken.message(m)).sum();
    eprintln!(
        "request: {} bytes, {n_messages} messages, {raw_tokens} tokens (o200k) → rules: {} bytes, {out_tokens} tokens",
        body.len(),
        out.len()
    );

    interleaved(&engine, &body);

    let mut group = c.benchmark_group("850KB request");
    group.bench_function("serde_json parse + serialize (Value)", |b| {
        b.iter(|| {
            let v: Value = serde_json::from_slice(black_box(&body)).unwrap();
            black_box(serde_json::to_vec(&v).unwrap())
        })
    });
    group.bench_function("serde_json parse only (Value)", |b| {
        b.iter(|| black_box(serde_json::from_slice::<Value>(black_box(&body)).unwrap()))
    });
    group.bench_function("pare parse + rules + serialize", |b| {
        b.iter(|| black_box(compact_bytes(&engine, black_box(&body), None, &QuarterCounter)))
    });
    let one_thread = CompactOptions { single_thread: true, ..Default::default() };
    group.bench_function("pare parse + rules + serialize, one thread", |b| {
        b.iter(|| black_box(compact_with(&engine, black_box(&body), &one_thread, &QuarterCounter)))
    });
    group.bench_function("pare parse + rules + serialize, warm tiktoken cache", |b| {
        b.iter(|| black_box(compact_bytes(&engine, black_box(&body), None, &tiktoken)))
    });
    group.bench_function("pare parse + rules + tiers to 50k tokens + serialize", |b| {
        b.iter(|| black_box(compact_bytes(&engine, black_box(&body), Some(50_000), &QuarterCounter)))
    });
    group.finish();
}

/// serde_json's parse, its parse + serialize, pare on one thread and pare on all cores, run in turn
/// (so that all four see the same machine load) for a bounded number of rounds; prints each one's
/// median and pare's ratios. On a shared machine the budget is a ratio: ≤ 3 ms where serde's
/// parse took 0.8 ms and its serialize 0.6 ms, i.e. pare ≤ 3.75× serde's parse and ≤ 2.14× its parse +
/// serialize.
fn interleaved(engine: &Engine, body: &[u8]) {
    const ROUNDS: usize = 300;
    let all = CompactOptions::default();
    let one = CompactOptions { single_thread: true, ..Default::default() };
    let time = |run: &dyn Fn()| {
        let start = std::time::Instant::now();
        run();
        start.elapsed().as_secs_f64() * 1e3
    };
    let parse = || drop(black_box(serde_json::from_slice::<Value>(black_box(body)).unwrap()));
    let parse_serialize = || {
        let v: Value = serde_json::from_slice(black_box(body)).unwrap();
        black_box(serde_json::to_vec(&v).unwrap());
    };
    let mut ms: [Vec<f64>; 4] = std::array::from_fn(|_| Vec::with_capacity(ROUNDS));
    for _ in 0..ROUNDS {
        ms[0].push(time(&parse));
        ms[1].push(time(&parse_serialize));
        ms[2].push(time(&|| drop(black_box(compact_with(engine, black_box(body), &one, &QuarterCounter)))));
        ms[3].push(time(&|| drop(black_box(compact_with(engine, black_box(body), &all, &QuarterCounter)))));
    }
    let [parse_med, serde_med, one_med, all_med] = ms.map(|mut v| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    });
    eprintln!(
        "interleaved, {ROUNDS} rounds, {} rayon threads (medians): serde_json parse {parse_med:.2} ms, \
         parse + serialize {serde_med:.2} ms; pare one thread {one_med:.2} ms = {:.2}× serde's parse, {:.2}× its \
         parse + serialize; pare all cores {all_med:.2} ms = {:.2}× serde's parse, {:.2}× its parse + serialize, \
         {:.2}× one thread (the issue's budget: 3.75× serde's parse, 2.14× its parse + serialize)",
        rayon::current_num_threads(),
        one_med / parse_med,
        one_med / serde_med,
        all_med / parse_med,
        all_med / serde_med,
        all_med / one_med,
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
