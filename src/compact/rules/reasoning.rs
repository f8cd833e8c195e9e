//! Old reasoning outside the protected tail: `reasoning_content` / `reasoning` keys, thinking
//! content parts, and a leading `<think>…</think>` block are removed. The model's current reasoning
//! (in the tail) is untouched; old chains of thought are the costliest and least reused tokens.

use super::super::Policy;
use super::super::conversation::Conversation;
use super::super::edits::{Edits, THINKING_PARTS};
use super::super::report::RuleId;
use crate::neutral::Content;

pub fn apply(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    for idx in 0..conv.boundary {
        let Some(m) = &conv.msgs[idx] else { continue };
        if m.role != "assistant" || edits.kept[idx] || edits.dropped[idx] {
            continue;
        }
        let mut saved = 0i64;
        for (key, value) in [("reasoning_content", &m.reasoning_content), ("reasoning", &m.reasoning)] {
            if let Some(v) = value
                && !v.is_null()
            {
                edits.removed[idx].push(key);
                saved += v.to_string().len() as i64;
            }
        }
        if let Some(Content::Parts(parts)) = &m.content {
            let thinking: Vec<_> =
                parts.iter().filter(|p| p.kind.as_deref().is_some_and(|k| THINKING_PARTS.contains(&k))).collect();
            if !thinking.is_empty() && edits.text[idx].is_none() {
                edits.drop_thinking_parts[idx] = true;
                saved +=
                    thinking.iter().map(|p| serde_json::to_string(p).map(|s| s.len()).unwrap_or(0) as i64).sum::<i64>();
            }
        }
        if saved > 0 {
            edits.savings[idx].push((RuleId::Reasoning, saved));
        }
        if policy.spec.reasoning.think_tags && edits.text[idx].is_none() && !edits.compacted[idx] {
            let text = m.text();
            if let Some(rest) = strip_think(&text) {
                edits.set_text(conv, idx, RuleId::Reasoning, rest, false);
            }
        }
    }
}

/// The text without a leading `<think>…</think>` block, when it has one.
fn strip_think(text: &str) -> Option<String> {
    let t = text.trim_start();
    let rest = t.strip_prefix("<think>")?;
    let end = rest.find("</think>")?;
    Some(rest[end + "</think>".len()..].trim_start().to_owned())
}

#[cfg(test)]
mod tests {
    #[test]
    fn strips_only_a_leading_think_block() {
        assert_eq!(super::strip_think("<think>hmm</think>\nAnswer").as_deref(), Some("Answer"));
        assert_eq!(super::strip_think("Answer <think>x</think>"), None);
        assert_eq!(super::strip_think("<think>unclosed"), None);
    }
}
