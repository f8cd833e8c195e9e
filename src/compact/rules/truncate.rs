//! Spec rule 2 and the hard cap: a large tool output keeps its first and last lines around a
//! `[...truncated {n} lines...]` line; an output still over the hard cap (few, very long lines) keeps
//! its first two thirds and last third of the allowed characters around a marker line.

use super::super::Policy;
use super::super::conversation::{Conversation, line_count};
use super::super::edits::Edits;
use super::super::markers::render;
use super::super::relevance::{Excerpt, excerpt_of};
use super::super::report::RuleId;

/// `head` first and `tail` last lines with a marker line between, or `None` when there is nothing
/// to cut. Only the kept lines are split off, from each end; the others are only counted.
pub fn truncate_lines(text: &str, head: usize, tail: usize, template: &str) -> Option<String> {
    let n_lines = line_count(text);
    if n_lines <= head + tail + 1 {
        return None;
    }
    let cut = n_lines - head - tail;
    let marker = render(template, &|name| (name == "n").then(|| cut.to_string()));
    let mut out = String::with_capacity(text.len().min(4096));
    for line in text.lines().take(head) {
        out.push_str(line);
        out.push('\n');
    }
    out.push_str(&marker);
    let mut last: Vec<&str> = text.lines().rev().take(tail).collect();
    last.reverse();
    for line in last {
        out.push('\n');
        out.push_str(line);
    }
    Some(out)
}

/// [`truncate_lines`] that also keeps the lines of `excerpt` (what relevance chose: a test run's
/// failing lines, lines naming what is in play), after the line that says why, with a marker line
/// (`template`) for each run of lines left out.
pub fn truncate_keeping(text: &str, head: usize, tail: usize, excerpt: &Excerpt, template: &str) -> Option<String> {
    let lines: Vec<&str> = text.lines().collect();
    let n = lines.len();
    if n <= head + tail + 1 {
        return None;
    }
    let kept = |j: usize| j < head || j >= n - tail || excerpt.spans.iter().any(|&(a, b)| (a..=b).contains(&j));
    let why = excerpt.render(text);
    let why = why.lines().next().unwrap_or_default();
    let mut out = String::with_capacity(text.len().min(8192));
    let mut cut = 0;
    let mut said_why = false;
    for (j, line) in lines.iter().enumerate() {
        if !kept(j) {
            cut += 1;
            continue;
        }
        if cut > 0 {
            out.push_str(&render(template, &|name| (name == "n").then(|| cut.to_string())));
            out.push('\n');
            cut = 0;
        }
        if !said_why && j >= head && j < n - tail {
            out.push_str(why);
            out.push('\n');
            said_why = true;
        }
        out.push_str(line);
        out.push('\n');
    }
    out.pop();
    Some(out)
}

pub fn apply(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    let rule = &policy.spec.truncate;
    let candidates: Vec<usize> =
        super::open_results(conv, edits).filter(|&idx| edits.current_chars(conv, idx) > rule.max_chars).collect();
    // Cutting reads each text: independent per result (an edit changes only its own message).
    let cuts = {
        let edits = &*edits;
        conv.map_each(&candidates, |&idx| {
            let template = conv.fill_retrieve(idx, &rule.template);
            let text = edits.current_text(conv, idx);
            // The result as it came (no earlier rule rewrote it): relevance may keep lines of its middle.
            let excerpt = edits.text[idx].is_none().then(|| excerpt_of(&policy.spec.relevance, conv, idx)).flatten();
            match excerpt {
                Some(excerpt) => truncate_keeping(&text, rule.head_lines, rule.tail_lines, &excerpt, &template)
                    .map(|short| (short, true)),
                None => truncate_lines(&text, rule.head_lines, rule.tail_lines, &template).map(|short| (short, false)),
            }
        })
    };
    for (idx, short) in candidates.into_iter().zip(cuts) {
        if let Some((short, relevant)) = short {
            edits.set_text(conv, idx, RuleId::Truncate, short, true);
            if relevant {
                edits.savings[idx].push((RuleId::Relevance, 0));
                edits.relevant[idx] = true;
            }
        }
    }
}

/// Keep `max_chars` at most: the first two thirds and the last third of the budget.
pub fn cap_chars(text: &str, max_chars: usize, template: &str) -> Option<String> {
    let n = text.chars().count();
    if n <= max_chars {
        return None;
    }
    let budget = max_chars.saturating_sub(template.chars().count() + 16);
    let head = budget * 2 / 3;
    let tail = budget - head;
    let cut = n - head - tail;
    let marker = render(template, &|name| (name == "n").then(|| cut.to_string()));
    let head_end = text.char_indices().nth(head).map(|(i, _)| i).unwrap_or(text.len());
    let tail_start = text.char_indices().nth(n - tail).map(|(i, _)| i).unwrap_or(text.len());
    Some(format!("{}\n{marker}\n{}", &text[..head_end], &text[tail_start..]))
}

pub fn apply_hard_cap(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    let rule = &policy.spec.hard_cap;
    for idx in 0..conv.boundary {
        // Truncation leaves a result open to the cap; a marker or a kept result is never capped.
        if conv.outcomes[idx].is_none() || edits.kept[idx] || edits.claimed[idx] || edits.dropped[idx] {
            continue;
        }
        if edits.compacted[idx] && edits.text[idx].is_none() {
            continue;
        }
        if edits.current_chars(conv, idx) <= rule.max_chars {
            continue;
        }
        let text = edits.current_text(conv, idx);
        if let Some(short) = cap_chars(&text, rule.max_chars, &conv.fill_retrieve(idx, &rule.template)) {
            edits.set_text(conv, idx, RuleId::HardCap, short, true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_head_and_tail_lines() {
        let text: String = (1..=30).map(|i| format!("line {i}\n")).collect();
        let out = truncate_lines(&text, 10, 5, "[...truncated {n} lines...]").unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 16);
        assert_eq!(lines[9], "line 10");
        assert_eq!(lines[10], "[...truncated 15 lines...]");
        assert_eq!(lines[15], "line 30");
        assert_eq!(truncate_lines("a\nb\nc", 1, 1, "[...truncated {n} lines...]"), None);
    }

    /// The reading by a vector of every line that `truncate_lines` replaced: both must agree.
    fn truncate_by_collected_lines(text: &str, head: usize, tail: usize, template: &str) -> Option<String> {
        let lines: Vec<&str> = text.lines().collect();
        if lines.len() <= head + tail + 1 {
            return None;
        }
        let cut = lines.len() - head - tail;
        let marker = render(template, &|name| (name == "n").then(|| cut.to_string()));
        let mut out = String::new();
        for line in &lines[..head] {
            out.push_str(line);
            out.push('\n');
        }
        out.push_str(&marker);
        for line in &lines[lines.len() - tail..] {
            out.push('\n');
            out.push_str(line);
        }
        Some(out)
    }

    #[test]
    fn cut_from_both_ends_agrees_with_collected_lines() {
        let texts = [
            String::new(),
            "a\nb\nc\nd\ne\nf".to_string(),
            "a\r\nb\r\n\r\nc\nd\ne\r\nf\r\n".to_string(),
            "\n\n\n\n\n\n\n".to_string(),
            "x\ny\nz\r".to_string(),
            (1..=40).map(|i| format!("é {i}\n")).collect(),
            (1..=40).map(|i| format!("line {i}\r\n")).collect::<String>() + "last",
        ];
        for text in &texts {
            for (head, tail) in [(0, 0), (1, 1), (2, 3), (10, 5), (0, 4), (4, 0)] {
                assert_eq!(
                    truncate_lines(text, head, tail, "[...truncated {n} lines...]"),
                    truncate_by_collected_lines(text, head, tail, "[...truncated {n} lines...]"),
                    "{text:?} {head} {tail}"
                );
            }
        }
    }

    #[test]
    fn cap_respects_the_limit_and_char_boundaries() {
        let text = "é".repeat(10_000);
        let out = cap_chars(&text, 1000, "[pare: …truncated {n} chars…]").unwrap();
        assert!(out.chars().count() <= 1000, "{}", out.chars().count());
        assert!(out.contains("\n[pare: …truncated "));
        assert_eq!(cap_chars("short", 1000, "[pare: x {n}]"), None);
    }
}
