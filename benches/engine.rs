//! The compaction engine's cost on a large request: parse + rules + serialize of an ~850 KB body
//! (~225 messages, ~200k tokens) built deterministically from corpus-like content, compared in the
//! same run with a plain serde_json parse and serialize of the same body.
//!
//! `cargo bench --bench engine` (add `-- --quick` for a short run). Before criterion's runs it prints
//! one line that times serde_json, pare on one thread and pare on all cores in turn, and their ratios:
//! the figure to read on a shared machine. `cargo bench --bench engine -- no-such-bench` prints only
//! that line.

// The allocator of the `pare` binary: the figures are those of pare as shipped.
#[global_allocator]
static GLOBAL: pare::Allocator = pare::Allocator;

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use pare::compact::{CompactOptions, Engine};
use pare::neutral::View;
use pare::tokens::{CountTokens, CounterConfig, QuarterCounter, TokenCounter};
use pare::wire::responses::ResponsesBody;
use pare::wire::{ChatBody, Forward, WireBody, WrittenReads, convert};
use serde_json::Value;

#[path = "common/engine_request.rs"]
mod engine_request;
use engine_request::{compact_with, large_request};

fn compact_bytes(engine: &Engine, body: &[u8], target: Option<u64>, counter: &dyn CountTokens) -> Vec<u8> {
    compact_with(engine, body, &CompactOptions { target_tokens: target, ..Default::default() }, counter)
}

/// The Responses API's path for the same conversation: the adapter's parse into neutral messages,
/// the engine, the adapter's write-back (what the proxy does for `POST …/responses`).
fn compact_responses(engine: &Engine, body: &[u8], options: &CompactOptions, counter: &dyn CountTokens) -> Vec<u8> {
    let parsed = ResponsesBody::parse(body).unwrap();
    let messages = parsed.messages();
    let typed = |i: usize| parsed.typed(i);
    let out =
        engine.compact(&View { messages: &messages, tools: parsed.tools(), typed: Some(&typed) }, options, counter);
    let reads = WrittenReads::of(out.typed);
    parsed.write(&Forward::of_plan(&out.plan, out.prefix.iter().map(String::as_str), &reads, messages.len())).unwrap().0
}

fn bench(c: &mut Criterion) {
    let body = large_request();
    let responses =
        convert::chat_to_responses(&serde_json::from_slice(&body).unwrap()).unwrap().to_string().into_bytes();
    let engine = Engine::default_pack();
    let n_messages = ChatBody::parse(&body).unwrap().messages().len();
    let tiktoken = TokenCounter::new(&CounterConfig::default());
    let raw_tokens: u64 = ChatBody::parse(&body).unwrap().messages().iter().map(|m| tiktoken.message(m)).sum();
    let out = compact_bytes(&engine, &body, None, &tiktoken);
    let one_thread = CompactOptions { single_thread: true, ..Default::default() };
    assert_eq!(out, compact_with(&engine, &body, &one_thread, &tiktoken), "one thread or all cores: same bytes");
    let out_tokens: u64 = ChatBody::parse(&out).unwrap().messages().iter().map(|m| tiktoken.message(m)).sum();
    // `cargo bench` passes `--bench`; without it (`cargo test --all-targets`, a debug build) criterion
    // runs each function once as a test, and timings printed here would read like real figures.
    if std::env::args().any(|a| a == "--bench") {
        eprintln!(
            "request: {} bytes, {n_messages} messages, {raw_tokens} tokens (o200k) → rules: {} bytes, {out_tokens} tokens",
            body.len(),
            out.len()
        );
        interleaved(&engine, &body);
    } else {
        eprintln!("engine bench: test mode, no figures (they come from `cargo bench --bench engine`)");
    }

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

    // The same conversation as a Responses request (`wire::convert`), through its adapter.
    let mut group = c.benchmark_group("same conversation, Responses API");
    let rules = CompactOptions::default();
    group.bench_function("pare parse + rules + write (Responses)", |b| {
        b.iter(|| black_box(compact_responses(&engine, black_box(&responses), &rules, &QuarterCounter)))
    });
    group.bench_function("pare parse + rules + write (chat)", |b| {
        b.iter(|| black_box(compact_with(&engine, black_box(&body), &rules, &QuarterCounter)))
    });
    group.finish();

    // Many short outputs compacted to a small target: nearly all of them elided into one run, whose
    // marker each elision step weighs again. Twice the steps should take twice the time.
    let mut group = c.benchmark_group("many short outputs, elided into one run");
    group.sample_size(10);
    for steps in [5_000, 10_000] {
        let body = short_outputs(steps);
        group.bench_function(format!("{steps} steps to 8k tokens"), |b| {
            b.iter(|| black_box(compact_bytes(&engine, black_box(&body), Some(8_000), &QuarterCounter)))
        });
    }
    group.finish();
}

/// A chat request of `steps` tool calls, each with a one-line output naming a file and a number.
fn short_outputs(steps: usize) -> Vec<u8> {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a coding agent."}),
        serde_json::json!({"role": "user", "content": "Find the failing test."}),
    ];
    for k in 0..steps {
        let id = format!("c{k}");
        let arguments = serde_json::json!({"cmd": format!("ls {k}")}).to_string();
        messages.push(
            serde_json::json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": "sh", "arguments": arguments}}]}),
        );
        messages.push(serde_json::json!({"role": "tool", "tool_call_id": id, "content": format!("out {k} /path/file_{k}.py line 1234{k}")}));
    }
    messages.push(serde_json::json!({"role": "user", "content": "go on"}));
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).unwrap()
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
