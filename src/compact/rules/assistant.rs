//! Spec rule 4: in a run of consecutive assistant messages, every message without tool calls that is
//! followed by another assistant message is dropped (the last one is kept; a message with tool calls
//! is never dropped, so no tool-call group is ever split). pare's own marker messages neither count
//! as a following assistant message nor are dropped.

use super::super::Policy;
use super::super::conversation::Conversation;
use super::super::edits::Edits;
use super::super::markers::is_compacted;
use super::super::report::RuleId;

pub fn apply(_policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    for idx in 0..conv.boundary {
        let Some(m) = &conv.msgs[idx] else { continue };
        if m.role != "assistant" || m.tool_calls.as_ref().is_some_and(|t| !t.is_empty()) {
            continue;
        }
        if edits.kept[idx] || edits.compacted[idx] || edits.dropped[idx] {
            continue;
        }
        let Some(Some(next)) = conv.msgs.get(idx + 1) else {
            continue;
        };
        let next_counts = next.role == "assistant"
            && (next.tool_calls.as_ref().is_some_and(|t| !t.is_empty()) || !is_compacted(&next.text()));
        if next_counts {
            edits.drop_message(conv, idx, RuleId::ConsecutiveAssistant);
        }
    }
}
