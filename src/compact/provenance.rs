//! Where each forwarded message came from, and which rule made it: what `pare compact --diff` and the
//! audit UI show. The engine traces its own output ([`Source`], from [`super::Engine::compact_traced`]);
//! an archived exchange only has its two bodies, so [`align`] recovers the same sources from them
//! (the order of messages never changes and untouched messages keep their bytes). [`steps`] turns
//! sources into one list in raw order, and [`RuleMatcher`] names the rule behind a rewrite by reading
//! the marker it left against the pack's templates.

use regex::Regex;
use similar::{Algorithm, DiffTag, capture_diff_slices};

use super::Source;
use super::markers::parse_elision;
use super::pack::RulesSpec;
use crate::neutral::Message;

/// What happened to the raw messages, in raw order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Raw message `raw` forwarded unchanged as forwarded entry `fwd`.
    Kept { raw: usize, fwd: usize },
    /// Raw message `raw` rewritten into forwarded entry `fwd`.
    Edited { raw: usize, fwd: usize },
    /// Raw messages `start..end` replaced by the one marker entry `fwd`.
    Elided { start: usize, end: usize, fwd: usize },
    /// Raw message `raw` left out.
    Dropped { raw: usize },
}

impl Step {
    /// The first raw message this step is about.
    pub fn raw_idx(&self) -> usize {
        match *self {
            Step::Kept { raw, .. } | Step::Edited { raw, .. } | Step::Dropped { raw } => raw,
            Step::Elided { start, .. } => start,
        }
    }
}

/// The steps for raw messages `0..n_raw` given the source of each forwarded entry: a raw message no
/// source covers was dropped.
pub fn steps(n_raw: usize, sources: &[Source]) -> Vec<Step> {
    let mut covered = vec![false; n_raw];
    let mut out = Vec::with_capacity(n_raw);
    for (fwd, source) in sources.iter().enumerate() {
        match *source {
            Source::Raw(raw) | Source::Edited(raw) if raw < n_raw => {
                covered[raw] = true;
                out.push(if matches!(source, Source::Raw(_)) {
                    Step::Kept { raw, fwd }
                } else {
                    Step::Edited { raw, fwd }
                });
            }
            Source::Elided { start, end } if start < end && end <= n_raw => {
                covered[start..end].iter_mut().for_each(|c| *c = true);
                out.push(Step::Elided { start, end, fwd });
            }
            _ => {}
        }
    }
    out.extend(covered.iter().enumerate().filter(|(_, seen)| !**seen).map(|(raw, _)| Step::Dropped { raw }));
    out.sort_by_key(Step::raw_idx);
    out
}

fn role(raw: &str) -> Option<String> {
    Message::from_raw(raw).ok().map(|m| m.role)
}

/// The source of each forwarded message, recovered from the raw and forwarded message lists of an
/// archived exchange. Byte-identical messages anchor the alignment (a minimal diff, so a message
/// repeated verbatim is not matched out of order); between anchors, an elision marker stands for
/// as many raw messages as it says it elided, and any other entry is the rewrite of the next raw
/// message of its role (raw messages skipped over were dropped).
pub fn align(raw: &[&str], forwarded: &[&str]) -> Vec<Source> {
    let mut sources = Vec::with_capacity(forwarded.len());
    for op in capture_diff_slices(Algorithm::Myers, raw, forwarded) {
        let (tag, old, new) = op.as_tag_tuple();
        match tag {
            DiffTag::Equal => sources.extend(old.map(Source::Raw)),
            DiffTag::Delete => {}
            DiffTag::Insert | DiffTag::Replace => {
                let mut cursor = old.start;
                for fwd in new {
                    let entry = forwarded[fwd];
                    let elided = Message::from_raw(entry).ok().and_then(|m| parse_elision(&m.text()));
                    if let Some(summary) = elided {
                        let end = (cursor + summary.messages).min(old.end);
                        sources.push(Source::Elided { start: cursor, end });
                        cursor = end;
                        continue;
                    }
                    let wanted = role(entry);
                    let same_role = (cursor..old.end).find(|&r| role(raw[r]) == wanted);
                    match same_role {
                        Some(r) => {
                            sources.push(Source::Edited(r));
                            cursor = r + 1;
                        }
                        // Nothing left to pair it with: count it against the message before.
                        None => sources.push(Source::Edited(cursor.saturating_sub(1).min(raw.len().saturating_sub(1)))),
                    }
                }
            }
        }
    }
    sources
}

/// Names the rule behind a rewritten message from the marker it carries, against one pack's templates.
pub struct RuleMatcher {
    /// Markers that make up a whole message, in the order the rules run.
    whole: Vec<(String, Regex)>,
    /// Markers that sit on one line inside a shortened text (truncation, hard cap).
    inline: Vec<(String, Regex)>,
    /// The argument marker, found inside a tool call's arguments.
    arguments: Regex,
}

/// A template as a pattern: its literal text escaped, each `{placeholder}` matching anything.
fn template_pattern(template: &str) -> String {
    let mut out = String::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        match rest[open..].find('}') {
            Some(close) => {
                out.push_str(&regex::escape(&rest[..open]));
                out.push_str(r"[\s\S]*?");
                rest = &rest[open + close + 1..];
            }
            None => break,
        }
    }
    out.push_str(&regex::escape(rest));
    out
}

impl RuleMatcher {
    pub fn new(spec: &RulesSpec) -> RuleMatcher {
        let whole_of = |name: &str, template: &str| {
            Regex::new(&format!(r"^\s*{}\s*$", template_pattern(template))).ok().map(|re| (name.to_owned(), re))
        };
        let line_of = |name: &str, template: &str| {
            Regex::new(&format!(r"(?m)^[ \t]*{}", template_pattern(template))).ok().map(|re| (name.to_owned(), re))
        };
        let mut whole: Vec<(String, Regex)> = spec
            .custom
            .iter()
            .filter_map(|rule| rule.template.as_deref().and_then(|t| whole_of(&format!("custom: {}", rule.name), t)))
            .collect();
        let t = &spec.tiers;
        whole.extend(
            [
                ("retry_pruning", spec.retry_pruning.template.as_str()),
                ("loops", &spec.loops.template),
                ("duplicates", &spec.duplicates.template),
                ("collapse_succeeded", &spec.collapse_succeeded.template),
                ("system_messages", &spec.system_messages.template),
                ("tier_heavy", &t.heavy_template),
                ("tier_facts", &t.facts_template),
                ("tier_facts", &t.facts_text_template),
                ("elision", &t.elision_template),
            ]
            .into_iter()
            .filter_map(|(name, template)| whole_of(name, template)),
        );
        let inline = [
            ("structure", spec.structure.template.as_str()),
            ("truncate", &spec.truncate.template),
            ("hard_cap", &spec.hard_cap.template),
        ]
        .into_iter()
        .filter_map(|(name, template)| line_of(name, template))
        .collect();
        let arguments = Regex::new(&template_pattern(&spec.arguments.template))
            .unwrap_or_else(|_| Regex::new("$^").expect("a valid regex"));
        RuleMatcher { whole, inline, arguments }
    }

    /// The rule that turned `before` into `after` (two messages' JSON), when its mark can be read:
    /// a marker of one of the pack's templates, arguments shortened, reasoning stripped.
    pub fn rule_of(&self, before: &str, after: &str) -> Option<String> {
        let after = Message::from_raw(after).ok()?;
        let text = after.text();
        let found = self.whole.iter().chain(&self.inline).find(|(_, re)| re.is_match(&text));
        if let Some((name, _)) = found {
            return Some(name.clone());
        }
        let calls = after.tool_calls.iter().flatten().filter_map(|call| call.function.as_ref());
        if calls.map(|f| f.arguments.to_string()).any(|args| self.arguments.is_match(&args)) {
            return Some("arguments".into());
        }
        let before = Message::from_raw(before).ok()?;
        let has_reasoning = |m: &Message| m.reasoning_content.is_some() || m.reasoning.is_some();
        if has_reasoning(&before) && !has_reasoning(&after) {
            return Some("reasoning".into());
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn msg(role: &str, content: &str) -> String {
        json!({"role": role, "content": content}).to_string()
    }

    #[test]
    fn align_pairs_rewrites_elisions_and_drops_around_identical_messages() {
        let raw: Vec<String> = vec![
            msg("system", "sys"),
            msg("user", "task"),
            msg("assistant", "a1"),
            msg("tool", "long output"),
            msg("assistant", "a2"),
            msg("tool", "ok"),
            msg("assistant", "a3"),
            msg("tool", "ok"),
            msg("user", "next"),
        ];
        let fwd: Vec<String> = vec![
            msg("system", "sys"),
            msg("user", "task"),
            msg("assistant", "[pare: 2 earlier messages elided — read ×1]"),
            msg("tool", "ok"),
            msg("assistant", "a3"),
            msg("tool", "ok"),
            msg("user", "next"),
        ];
        let raw_refs: Vec<&str> = raw.iter().map(String::as_str).collect();
        let fwd_refs: Vec<&str> = fwd.iter().map(String::as_str).collect();
        let sources = align(&raw_refs, &fwd_refs);
        assert_eq!(sources.len(), fwd.len());
        let steps = steps(raw.len(), &sources);
        assert!(steps.contains(&Step::Elided { start: 2, end: 4, fwd: 2 }), "{steps:?}");
        assert!(steps.contains(&Step::Dropped { raw: 4 }), "{steps:?}");
        assert!(steps.contains(&Step::Kept { raw: 8, fwd: 6 }), "{steps:?}");
        // Every raw message appears in exactly one step, in raw order.
        let firsts: Vec<usize> = steps.iter().map(Step::raw_idx).collect();
        assert!(firsts.windows(2).all(|w| w[0] < w[1]), "{firsts:?}");
    }

    #[test]
    fn align_pairs_a_rewrite_with_the_raw_message_of_its_role() {
        let raw = [msg("user", "u"), msg("assistant", "a"), msg("tool", "big"), msg("user", "v")];
        let fwd = [msg("user", "u"), msg("tool", "[tool: ls → ok, 3 chars, 1 lines]"), msg("user", "v")];
        let raw_refs: Vec<&str> = raw.iter().map(String::as_str).collect();
        let fwd_refs: Vec<&str> = fwd.iter().map(String::as_str).collect();
        let sources = align(&raw_refs, &fwd_refs);
        assert_eq!(sources, vec![Source::Raw(0), Source::Edited(2), Source::Raw(3)]);
        assert_eq!(steps(4, &sources)[1], Step::Dropped { raw: 1 });
    }

    #[test]
    fn rules_are_read_from_their_markers() {
        let matcher = RuleMatcher::new(&RulesSpec::default());
        let before = msg("tool", "line\n".repeat(50).as_str());
        let cases = [
            ("[tool: read_file(\"a.py\") → ok, 250 chars, 50 lines]", Some("collapse_succeeded")),
            ("line\nline\n[...truncated 35 lines...]\nline", Some("truncate")),
            ("[system prompt: SOUL.md]", Some("system_messages")),
            ("[pare: 3 earlier messages elided — read ×2]", Some("elision")),
            ("[retried: ls(\"x\") failed; a later retry succeeded]", Some("retry_pruning")),
            ("something else entirely", None),
        ];
        for (after, rule) in cases {
            assert_eq!(matcher.rule_of(&before, &msg("tool", after)).as_deref(), rule, "{after}");
        }
        let thinking = json!({"role": "assistant", "content": "x", "reasoning_content": "long thoughts"}).to_string();
        assert_eq!(matcher.rule_of(&thinking, &msg("assistant", "x")).as_deref(), Some("reasoning"));
    }
}
