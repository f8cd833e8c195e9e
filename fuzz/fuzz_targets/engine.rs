//! Fuzz the compaction engine: arbitrary bytes that parse as a chat request are compacted with the
//! default pack, with no budget, a token target or a history budget; the engine must not panic and
//! the output must keep the invariants — every message JSON or forwarded as sent, valid tool
//! pairing whenever the input had it, the protected tail and every user message byte-identical,
//! tokens never growing, the same bytes on a second run, and nothing changed by compacting the
//! output again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pare::tokens::CountTokens;
use pare::compact::validate::{Skeleton, check};
use pare::compact::{CompactOptions, Engine, HistoryBudget};
use pare::neutral::View;
use pare::wire::ChatBody;

/// A cheap deterministic counter (a quarter of the bytes, at least one).
struct Quarter;

impl CountTokens for Quarter {
    fn message(&self, raw_json: &str) -> u64 {
        (raw_json.len() as u64 / 4).max(1)
    }
    fn tools(&self, raw_json: &str) -> u64 {
        raw_json.len() as u64 / 4
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(body) = ChatBody::parse(data) else { return };
    let engine = Engine::default_pack();
    let raw = body.messages().to_vec();
    let raw_tokens: u64 = raw.iter().map(|m| Quarter.message(m)).sum();
    let input_valid = check(&raw.iter().map(|m| Skeleton::of(m)).collect::<Vec<_>>()).is_ok();
    let history = HistoryBudget { high: raw_tokens / 8, low: raw_tokens / 16 };
    for (target, history) in [(None, None), (Some(raw_tokens / 2), None), (None, Some(history))] {
        let opts = CompactOptions { target_tokens: target, history, ..CompactOptions::default() };
        let out = engine.compact(&body.view(), &opts, &Quarter);
        assert!(out.boundary <= raw.len());
        let forwarded: Vec<&str> =
            out.prefix.iter().map(String::as_str).chain(raw[out.boundary..].iter().copied()).collect();
        // What the engine writes is JSON serde_json reads back; a message it could not read (JSON
        // that serde_json refuses as a value, e.g. a number out of f64's range) is forwarded as sent.
        for m in &forwarded {
            assert!(
                serde_json::from_str::<serde_json::Value>(m).is_ok() || raw.contains(m),
                "forwarded message is neither JSON nor a message as sent: {m}"
            );
        }
        if input_valid {
            let skeletons: Vec<_> = forwarded.iter().map(|m| Skeleton::of(m)).collect();
            assert!(check(&skeletons).is_ok(), "compaction broke tool pairing");
        } else {
            assert_eq!(forwarded, raw, "an invalid input must be forwarded unchanged");
        }
        let fwd_tokens: u64 = forwarded.iter().map(|m| Quarter.message(m)).sum();
        assert!(fwd_tokens <= raw_tokens, "tokens grew: {raw_tokens} -> {fwd_tokens}");
        let users_in = raw.iter().filter(|m| Skeleton::of(m).is_some_and(|s| s.role == "user")).count();
        let users_out: Vec<&&str> =
            forwarded.iter().filter(|m| Skeleton::of(m).is_some_and(|s| s.role == "user")).collect();
        assert_eq!(users_in, users_out.len(), "a user message was dropped or added");
        assert!(users_out.iter().all(|u| raw.contains(u)), "a user message changed");
        let again = engine.compact(&body.view(), &opts, &Quarter);
        assert_eq!(again.prefix, out.prefix, "not deterministic");
        // Idempotent: compacting the forwarded request again changes nothing.
        let forwarded_body = body.to_vec_with_messages(&forwarded);
        let reparsed = ChatBody::parse(&forwarded_body).expect("pare's own output parses");
        let twice = engine.compact(&reparsed.view(), &opts, &Quarter);
        // The forwarded messages typed as the engine gave them compact as their texts read.
        let typed = |i: usize| out.typed.get(i)?.as_ref().map(|m| (Some((**m).clone()), None));
        let view = View { messages: reparsed.messages(), tools: reparsed.view().tools, typed: Some(&typed) };
        assert_eq!(engine.compact(&view, &opts, &Quarter).prefix, twice.prefix, "typed otherwise than read");
        let twice: Vec<&str> = twice
            .prefix
            .iter()
            .map(String::as_str)
            .chain(reparsed.messages()[twice.boundary..].iter().copied())
            .collect();
        assert_eq!(twice, forwarded, "not idempotent");
    }
});
