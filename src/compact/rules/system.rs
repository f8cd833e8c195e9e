//! Spec rule 3: system messages after the first become `[system prompt: …]` with a summary (first
//! line, section headings, size). The first system message is kept unless `replace_first` is set: it
//! is the agent's instructions and the start of every prompt cache.

use super::super::Policy;
use super::super::conversation::{Conversation, is_system};
use super::super::edits::Edits;
use super::super::markers::{group_digits, render, shorten};
use super::super::report::RuleId;

pub fn apply(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    let rule = &policy.spec.system_messages;
    for idx in 0..conv.boundary {
        let Some(m) = &conv.msgs[idx] else { continue };
        if !is_system(&m.role) || !edits.open(idx) {
            continue;
        }
        if conv.first_system == Some(idx) && !rule.replace_first {
            continue;
        }
        let text = m.text();
        if text.trim().is_empty() {
            continue;
        }
        let chars = text.chars().count();
        let lines = text.lines().count();
        let summary = summarize(&text);
        let marker = render(&rule.template, &|name| match name {
            "summary" => Some(summary.clone()),
            "chars" => Some(group_digits(chars)),
            "lines" => Some(group_digits(lines)),
            "retrieve" => Some(conv.retrieve(idx)),
            _ => None,
        });
        edits.set_marker(conv, idx, RuleId::SystemMessages, marker);
    }
}

/// `"first line…" (4,210 chars; sections: Tools, Memory)`.
pub fn summarize(text: &str) -> String {
    let first = text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("");
    let first = shorten(first.trim_start_matches('#').trim(), 80);
    let headings: Vec<String> = text
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix('#'))
        .map(|h| shorten(h.trim_start_matches('#').trim(), 40))
        .filter(|h| !h.is_empty() && *h != first)
        .take(6)
        .collect();
    let mut out = format!("\"{first}\" ({} chars", group_digits(text.chars().count()));
    if !headings.is_empty() {
        out.push_str("; sections: ");
        out.push_str(&headings.join(", "));
    }
    out.push(')');
    out
}
