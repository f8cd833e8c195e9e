//! The compaction engine end to end: golden fixtures (real requests from the corpus × rule packs),
//! one test per rule for when it must fire and when it must not, and the engine's invariants.
//!
//! Golden outputs live next to their inputs in `tests/fixtures/compact/`; `PARE_BLESS=1 cargo test
//! --test it compact::` rewrites them after a deliberate change (review the diff before committing).

use std::path::{Path, PathBuf};

use pare::budget::tokens::CountTokens;
use pare::compact::pack::{BUILTIN_PACKS, load_pack};
use pare::compact::{CompactOptions, Compacted, Engine};
use pare::config::{SalienceConfig, TierBudgets};
use pare::wire::ChatBody;
use serde_json::{Value, json};

/// A deterministic stand-in for tiktoken: one token per 4 bytes of JSON, rounded up, plus 3 per message.
pub struct QuarterCounter;

impl CountTokens for QuarterCounter {
    fn message(&self, raw_json: &str) -> u64 {
        raw_json.len().div_ceil(4) as u64 + 3
    }
    fn tools(&self, raw_json: &str) -> u64 {
        raw_json.len().div_ceil(4) as u64
    }
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/compact")
}

fn engine(pack: &str, overrides: Value) -> Engine {
    let text = BUILTIN_PACKS.iter().find(|(n, _)| *n == pack).expect("built-in pack").1;
    let pack = load_pack(pack, text, Some(&overrides)).unwrap_or_else(|e| panic!("{e}"));
    Engine::from_pack(pack, SalienceConfig::default(), TierBudgets::default())
}

/// Compact a body; returns the forwarded body and the engine's result.
pub fn run(engine: &Engine, body: &[u8], target: Option<u64>) -> (Vec<u8>, Compacted) {
    let parsed = ChatBody::parse(body).expect("fixture parses");
    let out = engine.compact(&parsed, &CompactOptions { target_tokens: target }, &QuarterCounter);
    let mut messages: Vec<String> = out.prefix.clone();
    messages.extend(parsed.messages[out.boundary..].iter().map(|m| m.get().to_owned()));
    (parsed.to_vec_with_messages(&messages), out)
}

/// Compare `actual` with the golden file, or rewrite it under `PARE_BLESS=1`.
fn check(expected_path: &Path, actual: &str) {
    if std::env::var_os("PARE_BLESS").is_some() {
        std::fs::write(expected_path, actual).expect("write golden file");
        return;
    }
    let expected = std::fs::read_to_string(expected_path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with PARE_BLESS=1 to create it)", expected_path.display()));
    if expected != actual {
        let first_diff = expected.chars().zip(actual.chars()).position(|(a, b)| a != b).unwrap_or(0);
        let from = first_diff.saturating_sub(120);
        panic!(
            "{} differs at char {first_diff}:\n expected …{}…\n   actual …{}…\n(PARE_BLESS=1 regenerates)",
            expected_path.display(),
            expected.chars().skip(from).take(300).collect::<String>(),
            actual.chars().skip(from).take(300).collect::<String>()
        );
    }
}

const GOLDEN_INPUTS: &[&str] = &[
    "hermes_chat",
    "openhands_django_11066",
    "mini_swe_agent_sqlfluff",
    "swe_agent_function_calling",
    "tau_bench_airline",
];

/// Every fixture × every built-in pack, with the last 2 turns protected so the short fixtures have
/// something to compact. Expected: `<fixture>.<pack>.out.json` (forwarded body) and
/// `<fixture>.<pack>.report.json`.
#[test]
fn golden_fixtures_by_pack() {
    for input in GOLDEN_INPUTS {
        let body = std::fs::read(fixtures().join(format!("{input}.json"))).unwrap();
        for (pack, _) in BUILTIN_PACKS {
            let engine = engine(pack, json!({"protect_last_turns": 2}));
            let (out, result) = run(&engine, &body, None);
            let out = String::from_utf8(out).unwrap();
            check(&fixtures().join(format!("{input}.{pack}.out.json")), &out);
            let report = serde_json::to_string_pretty(&result.report).unwrap() + "\n";
            check(&fixtures().join(format!("{input}.{pack}.report.json")), &report);
            assert_invariants(&body, out.as_bytes(), &result);
        }
    }
}

/// Invariants every output must satisfy, whatever the input.
pub fn assert_invariants(input: &[u8], output: &[u8], result: &Compacted) {
    let before = ChatBody::parse(input).unwrap();
    let after = ChatBody::parse(output).expect("output is valid JSON with messages");
    // Tail byte-identical.
    let tail_in: Vec<&str> = before.messages[result.boundary..].iter().map(|m| m.get()).collect();
    let tail_out: Vec<&str> = after.messages[after.messages.len() - tail_in.len()..].iter().map(|m| m.get()).collect();
    assert_eq!(tail_in, tail_out, "protected tail changed");
    // User messages byte-identical and in order.
    let users = |b: &ChatBody<'_>| -> Vec<String> {
        b.messages
            .iter()
            .filter(|m| serde_json::from_str::<Value>(m.get()).ok().is_some_and(|v| v["role"] == "user"))
            .map(|m| m.get().to_owned())
            .collect()
    };
    assert_eq!(users(&before), users(&after), "user messages changed");
    // Invariant 1.
    let skeletons: Vec<_> = after.messages.iter().map(|m| pare::compact::validate::Skeleton::of(m.get())).collect();
    pare::compact::validate::check(&skeletons).expect("output satisfies invariant 1");
    // Other top-level keys untouched.
    for (key, value) in &before.fields {
        if key != "messages" {
            assert_eq!(after.field(key).map(|v| v.get()), Some(value.get()), "top-level `{key}` changed");
        }
    }
    // Tokens never grow.
    let tokens = |b: &ChatBody<'_>| -> u64 { b.messages.iter().map(|m| QuarterCounter.message(m.get())).sum() };
    assert!(tokens(&after) <= tokens(&before), "tokens grew: {} > {}", tokens(&after), tokens(&before));
}

#[test]
fn golden_outputs_are_idempotent_and_deterministic() {
    for input in GOLDEN_INPUTS {
        let body = std::fs::read(fixtures().join(format!("{input}.json"))).unwrap();
        for (pack, _) in BUILTIN_PACKS {
            let engine = engine(pack, json!({"protect_last_turns": 2}));
            let (once, _) = run(&engine, &body, None);
            let (again, _) = run(&engine, &body, None);
            assert_eq!(once, again, "{input} × {pack}: not deterministic");
            let (twice, report) = run(&engine, &once, None);
            assert_eq!(
                String::from_utf8_lossy(&once),
                String::from_utf8_lossy(&twice),
                "{input} × {pack}: compacting the output changed it: {}",
                report.report
            );
        }
    }
}
