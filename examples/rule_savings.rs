//! Per-rule token savings of the default pack on a corpus of sessions (rules only, no target).
//!
//! `cargo run --release --example rule_savings -- /tmp/corpus/sessions/{swe-agent,mini-swe-agent,openhands,hermes}`
//!
//! Every request of every `*.jsonl` session under the given directories is compacted as the engine
//! would on its own (protected tail of 5 turns); tokens are counted in o200k_base (per
//! message, OpenAI chat accounting, cached). Prints, per source directory and in total, the share of
//! the raw messages' tokens each rule removes, and the share of tokens in tool results before the
//! protected tail — what removing every one of them outright would save; only the `arguments` rule
//! (the assistant's own calls) saves tokens outside that share.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use pare::compact::{CompactOptions, Engine};
use pare::neutral::role_of;
use pare::tokens::{CountTokens, CounterConfig, TokenCounter};
use pare::wire::ChatBody;

#[derive(Default)]
struct Totals {
    requests: u64,
    raw_tokens: u64,
    /// Tokens of the tool results before the protected tail.
    old_results: u64,
    saved: BTreeMap<String, i64>,
}

fn sessions(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    out.sort();
    out
}

fn main() {
    let dirs: Vec<PathBuf> = std::env::args().skip(1).map(PathBuf::from).collect();
    if dirs.is_empty() {
        eprintln!("usage: rule_savings DIR...");
        std::process::exit(2);
    }
    let engine = Engine::default_pack();
    let counter = TokenCounter::new(&CounterConfig::default());
    let mut all = Totals::default();
    let mut per_source: Vec<(String, Totals)> = Vec::new();
    for dir in &dirs {
        let mut t = Totals::default();
        for session in sessions(dir) {
            let text = std::fs::read_to_string(&session).expect("read session");
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                let Ok(body) = ChatBody::parse(line.as_bytes()) else { continue };
                let out = engine.compact(&body.view(), &CompactOptions::default(), &counter);
                t.requests += 1;
                t.raw_tokens += body.messages().iter().map(|m| counter.message(m)).sum::<u64>();
                t.old_results += body.messages()[..out.boundary]
                    .iter()
                    .filter(|m| role_of(m) == "tool")
                    .map(|m| counter.message(m))
                    .sum::<u64>();
                for (rule, stats) in &out.report.rules {
                    *t.saved.entry(rule.name().to_owned()).or_default() += stats.tokens_saved;
                }
            }
        }
        all.requests += t.requests;
        all.raw_tokens += t.raw_tokens;
        all.old_results += t.old_results;
        for (rule, saved) in &t.saved {
            *all.saved.entry(rule.clone()).or_default() += saved;
        }
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        per_source.push((name, t));
    }
    per_source.push(("total".into(), all));
    println!(
        "tokens: o200k_base per message (OpenAI chat accounting); rules only, default pack, 5 turns protected; \
         old results: tool results before the tail"
    );
    for (name, t) in &per_source {
        let total_saved: i64 = t.saved.values().sum();
        println!(
            "\n{name}: {} requests, {} raw message tokens, rules remove {:.1} % (old results {:.1} %)",
            t.requests,
            t.raw_tokens,
            100.0 * total_saved as f64 / t.raw_tokens.max(1) as f64,
            100.0 * t.old_results as f64 / t.raw_tokens.max(1) as f64
        );
        let mut rows: Vec<(&String, &i64)> = t.saved.iter().collect();
        rows.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        for (rule, saved) in rows {
            println!("  {rule:<24}{:>12} tokens {:>6.1} %", saved, 100.0 * *saved as f64 / t.raw_tokens.max(1) as f64);
        }
    }
}
