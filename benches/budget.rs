//! Compaction overhead of the budget layer on a 200k-token session: *warm* (the session's state and
//! token counts are known; the request adds one turn) and *cold* (a fresh compactor meets the whole
//! session at once, tokenizes every message and runs an epoch). Targets: warm ≤ 2 ms, cold ≤ 40 ms.
//! `warm_eager_…` is the warm request in eager mode, which runs the engine on every turn;
//! `warm_{responses,messages,gemini}_…` the warm request in that format (the session converted as
//! `pare eval --convert` converts it), the adapter's write included.
//!
//! The timings exclude parsing the body ([`ChatBody::parse`], done once per request by the
//! pipeline for every purpose), which `parse_200k_token_body` measures apart
//! (`parse_{responses,messages,gemini}_…` in the other formats).
//!
//! `cargo bench --bench budget`

// The allocator of the `pare` binary: the figures are those of pare as shipped.
#[global_allocator]
static GLOBAL: pare::Allocator = pare::Allocator;

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use pare::budget::SessionCompactor;
use pare::compact::Engine;
use pare::config::Config;
use pare::tokens::request_tokens;
use pare::wire::convert::chat_session_to;
use pare::wire::recent::RecentBodies;
use pare::wire::{ChatBody, Wire};
use serde_json::{Value, json};

const WINDOW: u64 = 65_536;

/// A source-file-like tool output, distinct per turn.
fn tool_output(turn: usize, lines: usize) -> String {
    (0..lines)
        .map(|l| {
            format!("{:>4}    let value_{turn}_{l} = compute_{}(&input[{l}..], {});\n", l + 1, l % 7, turn * 31 + l)
        })
        .collect()
}

/// A coding session: system prompt, task, then tool steps until the request holds `tokens` tokens.
fn session(tokens: u64, compactor: &SessionCompactor) -> Vec<Value> {
    let counter = compactor.counter(Some("bench"));
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. ".repeat(200)}),
        json!({"role": "user", "content": "Fix the failing test in src/parser.rs and explain the cause."}),
    ];
    let mut turn = 0;
    loop {
        let raw: Vec<String> = messages.iter().map(Value::to_string).collect();
        if request_tokens(counter, &raw, None) >= tokens {
            return messages;
        }
        let id = format!("call_{turn}");
        messages.push(json!({"role": "assistant", "content": format!("Reading part {turn}."), "tool_calls": [{"id": id, "type": "function", "function": {"name": "read_file", "arguments": format!("{{\"path\":\"src/mod_{turn}.rs\"}}")}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": tool_output(turn, 60)}));
        turn += 1;
    }
}

fn body(messages: &[Value]) -> Vec<u8> {
    json!({"model": "bench", "messages": messages, "stream": true}).to_string().into_bytes()
}

fn compactor() -> SessionCompactor {
    SessionCompactor::new(&Config::default(), Arc::new(Engine::default_pack())).expect("default config is valid")
}

fn budget(c: &mut Criterion) {
    let builder = compactor();
    let messages = session(200_000, &builder);
    let full = body(&messages);

    // The pipeline parses every chat body once (for sessions and the archive too); shown apart.
    c.bench_function("parse_200k_token_body", |b| b.iter(|| black_box(ChatBody::parse(&full).expect("valid body"))));
    // The other formats' adapters read each item or turn and write its neutral message as they parse.
    for wire in [Wire::Responses, Wire::Messages, Wire::Gemini] {
        let converted = body_in(wire, &messages);
        c.bench_function(&format!("parse_{}_200k_token_body", wire.name()), |b| {
            b.iter(|| black_box(pare::wire::parse(wire, &converted).expect("valid body").messages().len()))
        });
    }
    // As the proxy parses a session's next request: split only after the entries it shares with
    // the previous one (`wire::recent`).
    for wire in [Wire::Chat, Wire::Responses, Wire::Messages, Wire::Gemini] {
        let previous = Bytes::from(body_in(wire, &messages));
        let mut grown = messages.clone();
        grown.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_next", "type": "function", "function": {"name": "terminal", "arguments": "{\"command\":\"ls\"}"}}]}));
        grown.push(json!({"role": "tool", "tool_call_id": "call_next", "content": "src\ntests"}));
        let next = Bytes::from(body_in(wire, &grown));
        let path = "/v1beta/models/bench:generateContent";
        c.bench_function(&format!("parse_{}_200k_token_body_extending_the_last", wire.name()), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let recent = RecentBodies::new();
                    drop(recent.parse(wire, path, &previous).expect("valid body"));
                    let started = Instant::now();
                    black_box(recent.parse(wire, path, &next).expect("valid body").messages().len());
                    total += started.elapsed();
                }
                total
            })
        });
    }
    c.bench_function("tokenize_200k_tokens_cold", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let fresh = compactor();
                let parsed = ChatBody::parse(&full).expect("valid body");
                let raw = parsed.messages().to_vec();
                let started = Instant::now();
                black_box(request_tokens(fresh.counter(Some("bench")), &raw, None));
                total += started.elapsed();
            }
            total
        })
    });
    c.bench_function("engine_rules_200k_tokens", |b| {
        let engine = Engine::default_pack();
        let counter = builder.counter(Some("bench"));
        let parsed = ChatBody::parse(&full).expect("valid body");
        b.iter(|| black_box(engine.compact(&parsed.view(), &pare::compact::CompactOptions::default(), counter)))
    });
    c.bench_function("cold_200k_tokens", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let fresh = compactor();
                let parsed = ChatBody::parse(&full).expect("valid body");
                let started = Instant::now();
                black_box(fresh.compact_body("s", &parsed, Some(WINDOW)));
                total += started.elapsed();
            }
            total
        })
    });

    let mut eager_config = Config::default();
    eager_config.compaction.mode = pare::config::Mode::Eager;
    let eager = SessionCompactor::new(&eager_config, Arc::new(Engine::default_pack())).expect("valid config");
    warm_bench(c, "warm_200k_tokens_one_new_turn", &compactor(), &messages, Wire::Chat);
    // Eager runs the engine on every turn (polling 1), over the frozen prefix and the new messages.
    warm_bench(c, "warm_eager_200k_tokens_one_new_turn", &eager, &messages, Wire::Chat);
    // The same session in the other formats: the adapter writes every request's items or turns
    // from the frozen prefix's plan and checks them.
    for wire in [Wire::Responses, Wire::Messages, Wire::Gemini] {
        let name = format!("warm_{}_200k_tokens_one_new_turn", wire.name());
        warm_bench(c, &name, &compactor(), &messages, wire);
    }
}

/// `messages` as a request body in `wire` (converted as `pare eval --convert` converts).
fn body_in(wire: Wire, messages: &[Value]) -> Vec<u8> {
    match wire {
        Wire::Chat => body(messages),
        _ => chat_session_to(wire, &String::from_utf8(body(messages)).expect("JSON is UTF-8")).trim_end().into(),
    }
}

/// One request adding one turn to a session `warm` already knows, in `wire`.
fn warm_bench(c: &mut Criterion, name: &str, warm: &SessionCompactor, messages: &[Value], wire: Wire) {
    let parsed_full = body_in(wire, messages);
    let parsed = pare::wire::parse(wire, &parsed_full).expect("valid body");
    warm.compact_body("s", parsed.as_ref(), Some(WINDOW));
    let mut turn = 1_000_000;
    c.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let id = format!("call_{turn}");
                let mut grown = messages.to_vec();
                grown.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "terminal", "arguments": "{\"command\":\"cargo test\"}"}}]}));
                grown.push(json!({"role": "tool", "tool_call_id": id, "content": tool_output(turn, 3)}));
                turn += 1;
                let request = body_in(wire, &grown);
                let parsed = pare::wire::parse(wire, &request).expect("valid body");
                let started = Instant::now();
                black_box(warm.compact_body("s", parsed.as_ref(), Some(WINDOW)));
                total += started.elapsed();
            }
            total
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(10));
    targets = budget
}
criterion_main!(benches);
