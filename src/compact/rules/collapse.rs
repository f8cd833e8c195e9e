//! Spec rule 1: a succeeded tool result outside the protected tail becomes a one-line marker with
//! its facts; the assistant's call stays. Failed results are kept (errors are salient).

use super::super::Policy;
use super::super::conversation::Conversation;
use super::super::edits::Edits;
use super::super::report::RuleId;

pub fn apply(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    let rule = &policy.spec.collapse_succeeded;
    let candidates: Vec<usize> = super::open_results(conv, edits).collect();
    for idx in candidates {
        let outcome = conv.outcomes[idx].as_ref().expect("open results have an outcome");
        if !outcome.status.is_ok() || outcome.text.len() < rule.min_chars {
            continue;
        }
        let facts = conv.facts(idx);
        if policy.collapse_except.iter().any(|re| re.is_match(&facts.tool)) {
            continue;
        }
        edits.set_marker(conv, idx, RuleId::CollapseSucceeded, conv.render_marker(idx, &rule.template));
    }
}
