//! Spec rule 1: a succeeded tool result outside the protected tail becomes a one-line marker with
//! its facts; the assistant's call stays. Failed results are kept (errors are salient). A large
//! result keeps, under its marker, the lines that name what the conversation works on now
//! (`compact::relevance`), and the marker's `{names}` lists the others.

use super::super::Policy;
use super::super::conversation::Conversation;
use super::super::edits::Edits;
use super::super::markers::{NAMES_PER_MARKER, names_suffix, render, salient_names};
use super::super::relevance::excerpt_of;
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
        (!excepted).then(|| marker_and_kept_lines(policy, conv, idx, &rule.template))
    });
    for (idx, marker) in candidates.into_iter().zip(markers) {
        if let Some((marker, kept)) = marker {
            edits.set_marker(conv, idx, RuleId::CollapseSucceeded, marker);
            if let Some(kept) = kept {
                edits.append_kept_lines(idx, &kept);
            }
        }
    }
}

/// The marker `template` makes for result `idx` and, when relevance keeps some of its lines, those
/// lines (rendered): then the marker's `{names}` skips what they show.
pub(super) fn marker_and_kept_lines(
    policy: &Policy,
    conv: &Conversation<'_>,
    idx: usize,
    template: &str,
) -> (String, Option<String>) {
    let Some(excerpt) = excerpt_of(&policy.spec.relevance, conv, idx) else {
        return (conv.render_marker(idx, template), None);
    };
    let text = conv.outcomes[idx].as_ref().map_or("", |o| o.text.as_str());
    let kept = excerpt.kept_text(text);
    let facts = conv.facts(idx);
    let mut skip: Vec<&str> = facts.files.iter().map(String::as_str).collect();
    skip.push(&facts.arg);
    skip.extend(kept);
    let marker = render(template, &|name| match name {
        "names" => Some(names_suffix(&salient_names(text, NAMES_PER_MARKER, &skip, conv.shown()))),
        other => conv.fact(idx, other),
    });
    (marker, Some(excerpt.render(text)))
}
