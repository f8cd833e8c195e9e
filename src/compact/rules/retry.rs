//! Retry pruning: a failed call that was later retried (same tool, same key argument) with success
//! keeps only a marker with its first error line: the failure is history, the retry is what counts.

use std::collections::HashMap;

use super::super::Policy;
use super::super::conversation::Conversation;
use super::super::edits::Edits;
use super::super::markers::is_compacted;
use super::super::report::RuleId;

pub fn apply(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    // For each (tool, key argument), the index of the last call whose result succeeded. A pare marker
    // is no evidence of success (it may stand for a failure folded by another rule): counting it would
    // make a second compaction prune what the first kept.
    let mut last_success: HashMap<(&str, &str), usize> = HashMap::new();
    for (c, call) in conv.calls.iter().enumerate() {
        let ok = call
            .result
            .and_then(|r| conv.outcomes[r].as_ref())
            .is_some_and(|o| o.status.is_ok() && !is_compacted(&o.text));
        if ok {
            last_success.insert((call.name.as_str(), retry_key(call)), c);
        }
    }
    for (c, call) in conv.calls.iter().enumerate() {
        let Some(idx) = call.result else { continue };
        if idx >= conv.boundary || !edits.open(idx) {
            continue;
        }
        let failed = conv.outcomes[idx].as_ref().is_some_and(|o| !o.status.is_ok());
        let retried = last_success.get(&(call.name.as_str(), retry_key(call))).is_some_and(|&later| later > c);
        if failed && retried {
            let marker = conv.facts(idx).render(&policy.spec.retry_pruning.template);
            edits.set_marker(conv, idx, RuleId::RetryPruning, marker);
        }
    }
}

/// What makes two calls "the same attempt": the key argument, or the whole arguments.
fn retry_key(call: &super::super::conversation::Call) -> &str {
    call.key_arg.as_deref().unwrap_or(call.arguments.as_str())
}
