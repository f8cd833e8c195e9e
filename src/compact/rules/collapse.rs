//! Spec rule 1: a succeeded tool result outside the protected tail becomes a one-line marker with
//! its facts; the assistant's call stays. Failed results are kept (errors are salient).

use super::super::Policy;
use super::super::conversation::Conversation;
use super::super::edits::Edits;
use super::super::report::RuleId;

pub fn apply(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    let rule = &policy.spec.collapse_succeeded;
    let candidates: Vec<usize> = super::open_results(conv, edits)
        .filter(|&idx| {
            let outcome = conv.outcomes[idx].as_ref().expect("open results have an outcome");
            outcome.status.is_ok() && outcome.text.len() >= rule.min_chars
        })
        .collect();
    // Facts and markers read each result's text: the costly part, independent per result.
    let markers = conv.map_each(&candidates, |&idx| {
        let excepted = policy.collapse_except.iter().any(|re| re.is_match(&conv.facts(idx).tool));
        (!excepted).then(|| conv.render_marker(idx, &rule.template))
    });
    for (idx, marker) in candidates.into_iter().zip(markers) {
        if let Some(marker) = marker {
            edits.set_marker(conv, idx, RuleId::CollapseSucceeded, marker);
        }
    }
}
