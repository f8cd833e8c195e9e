//! Duplicate-output folding: a tool output seen again, identical, in a later result (the same file
//! read twice, the same listing) becomes a pointer to the later call.

use std::collections::HashMap;

use xxhash_rust::xxh3::xxh3_64;

use super::super::Policy;
use super::super::conversation::Conversation;
use super::super::edits::Edits;
use super::super::markers::render;
use super::super::report::RuleId;

pub fn apply(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    let rule = &policy.spec.duplicates;
    // The last tool message carrying each output (the whole conversation, tail included).
    let mut last: HashMap<u64, usize> = HashMap::new();
    let mut hashes: Vec<Option<u64>> = vec![None; conv.msgs.len()];
    let long: Vec<usize> = (0..conv.msgs.len())
        .filter(|&idx| conv.outcomes[idx].as_ref().is_some_and(|o| o.text.trim().len() >= rule.min_chars))
        .collect();
    // Hashing reads every long output: independent per result.
    let long_hashes = conv.map_each(&long, |&idx| {
        let outcome = conv.outcomes[idx].as_ref().expect("long results have an outcome");
        xxh3_64(outcome.text.trim().as_bytes())
    });
    for (idx, h) in long.into_iter().zip(long_hashes) {
        hashes[idx] = Some(h);
        last.insert(h, idx);
    }
    for (idx, hash) in hashes.iter().enumerate().take(conv.boundary) {
        let Some(h) = *hash else { continue };
        let later = last[&h];
        if later == idx || !edits.open(idx) {
            continue;
        }
        let later_id = conv.msgs[later].as_ref().and_then(|m| m.tool_call_id.clone()).unwrap_or_default();
        let marker = render(&rule.template, &|name| match name {
            "later_id" => Some(later_id.clone()),
            other => conv.fact(idx, other),
        });
        edits.set_marker_if_saving(conv, idx, RuleId::Duplicates, marker);
    }
}
