//! Loop collapse: the same call (tool and identical arguments) made `min_repeats` times or more —
//! every occurrence but the latest becomes a marker saying which repetition it was.

use std::collections::HashMap;

use super::super::Policy;
use super::super::conversation::Conversation;
use super::super::edits::Edits;
use super::super::markers::render;
use super::super::report::RuleId;

pub fn apply(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    let rule = &policy.spec.loops;
    let mut occurrences: HashMap<(&str, &str), Vec<usize>> = HashMap::new();
    for (c, call) in conv.calls.iter().enumerate() {
        if call.result.is_some() {
            occurrences.entry((call.name.as_str(), call.arguments.trim())).or_default().push(c);
        }
    }
    let mut keys: Vec<_> = occurrences.keys().copied().collect();
    keys.sort_unstable();
    // (result, repetition, total) of every earlier occurrence to replace.
    let mut repeats: Vec<(usize, usize, usize)> = Vec::new();
    for key in keys {
        let list = &occurrences[&key];
        if list.len() < rule.min_repeats as usize {
            continue;
        }
        let total = list.len();
        for (k, &c) in list[..total - 1].iter().enumerate() {
            let idx = conv.calls[c].result.expect("only answered calls are listed");
            if idx < conv.boundary && edits.open(idx) {
                repeats.push((idx, k + 1, total));
            }
        }
    }
    // The markers read each result's facts: independent per result.
    let markers = conv.map_each(&repeats, |&(idx, k, total)| {
        render(&rule.template, &|name| match name {
            "k" => Some(k.to_string()),
            "total" => Some(total.to_string()),
            other => conv.fact(idx, other),
        })
    });
    for ((idx, _, _), marker) in repeats.into_iter().zip(markers) {
        edits.set_marker_if_saving(conv, idx, RuleId::Loops, marker);
    }
}
