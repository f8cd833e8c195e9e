//! The agent's prompt-cache plan: the `cache_control` marks of a Messages request, and where they stand
//! after compaction.
//!
//! A mark ends a cached prefix: the API caches everything up to and including the marked block, in
//! the order tools → system → messages, and accepts at most 4 marks, longer `ttl`s before shorter
//! ones. pare never adds a mark and never moves one on its own account. Between epochs nothing the
//! agent already sent is rewritten: the marks are not part of the neutral form, so the session's
//! frozen prefix keeps matching when the agent moves its last mark, and each forwarded request
//! extends the previous one. When an epoch starts (the prompt is re-sent anyway), [`placement`]
//! keeps each mark on its block — rewritten or not — and moves the mark of an elided block to the
//! nearest surviving block before it that may carry one, after the previous mark; with no such block
//! the mark is dropped. So the forwarded request has no more marks than the agent's, in the agent's
//! order.

use serde_json::Value;

/// Where a mark sits, in the API's order: `Tool < System < Block`, blocks by message then block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Place {
    /// The `tools[i]` definition.
    Tool(usize),
    /// The `system[i]` text block.
    System(usize),
    /// Block `block` of `messages[message].content` (a mark inside a `tool_result`'s content counts
    /// as its enclosing block's).
    Block { message: usize, block: usize },
}

/// One `cache_control` mark: where it is and what it says (`{"type": "ephemeral", "ttl": "1h"}`).
#[derive(Debug, Clone, PartialEq)]
pub struct Mark {
    pub place: Place,
    pub value: Value,
}

/// What compaction does to one block (a message whose content is a string is one block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Kept,
    Rewritten,
    Elided,
}

/// The marks of a Messages request body, in the API's order.
pub fn marks(body: &Value) -> Vec<Mark> {
    let mut out = Vec::new();
    let list = |key: &str| body.get(key).and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    for (i, tool) in list("tools").iter().enumerate() {
        push_marks(tool, Place::Tool(i), &mut out);
    }
    for (i, block) in list("system").iter().enumerate() {
        push_marks(block, Place::System(i), &mut out);
    }
    for (message, turn) in list("messages").iter().enumerate() {
        let blocks = turn.get("content").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
        for (block, value) in blocks.iter().enumerate() {
            push_marks(value, Place::Block { message, block }, &mut out);
        }
    }
    out
}

/// The block's own mark, then the marks inside its `content` blocks (a `tool_result`'s).
pub(super) fn push_marks(block: &Value, place: Place, out: &mut Vec<Mark>) {
    if let Some(value) = block.get("cache_control").filter(|v| !v.is_null()) {
        out.push(Mark { place, value: value.clone() });
    }
    for inner in block.get("content").and_then(Value::as_array).into_iter().flatten() {
        if let Some(value) = inner.get("cache_control").filter(|v| !v.is_null()) {
            out.push(Mark { place, value: value.clone() });
        }
    }
}

/// Where each mark stands in the forwarded request when an epoch applies `fates`: `Some(place)` (its
/// own block, or the block it moved to) or `None` (dropped: no surviving block before it may carry
/// it). `may_carry(message, block)` says whether pare may add a mark to that block (the adapter
/// excludes thinking blocks, which the API refuses to mark, and blocks pare must not alter).
pub fn placement(marks: &[Mark], fates: &[Vec<Fate>], may_carry: impl Fn(usize, usize) -> bool) -> Vec<Option<Place>> {
    let fate =
        |message: usize, block: usize| fates.get(message).and_then(|b| b.get(block)).copied().unwrap_or(Fate::Kept);
    let mut out: Vec<Option<Place>> = Vec::with_capacity(marks.len());
    let mut previous: Option<Place> = None;
    for mark in marks {
        let placed = match mark.place {
            Place::Block { message, block } if fate(message, block) == Fate::Elided => {
                // The nearest surviving block before it that may carry a mark, after the previous mark:
                // landing on or before the previous mark would reorder the ttls or merge two marks.
                let after_previous =
                    |message: usize, block: usize| previous.is_none_or(|p| p < Place::Block { message, block });
                (0..=message)
                    .rev()
                    .flat_map(|m| {
                        let n_blocks = fates.get(m).map_or(0, Vec::len);
                        let end = if m == message { block } else { n_blocks };
                        (0..end).rev().map(move |b| (m, b))
                    })
                    .take_while(|&(m, b)| after_previous(m, b))
                    .find(|&(m, b)| fate(m, b) != Fate::Elided && may_carry(m, b))
                    .map(|(message, block)| Place::Block { message, block })
            }
            place => Some(place),
        };
        if placed.is_some() {
            previous = placed;
        }
        out.push(placed);
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use Fate::{Elided, Kept, Rewritten};

    /// A Claude Code request: a marked tool, the system prompt marked with a 1h ttl, and the last two
    /// user turns marked (the last one's last block), around a run of tool calls.
    fn claude_code_body() -> Value {
        let ephemeral = json!({"type": "ephemeral"});
        json!({
            "model": "claude-sonnet-4-5",
            "tools": [{"name": "Bash", "input_schema": {}}, {"name": "Read", "input_schema": {}, "cache_control": ephemeral}],
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0"},
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            ],
            "messages": [
                {"role": "user", "content": "Fix the build."},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"}, {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "cargo build"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "error", "cache_control": ephemeral}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "Read", "input": {"file_path": "a.rs"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "fn main() {}"}, {"type": "text", "text": "go on", "cache_control": ephemeral}]},
            ],
        })
    }

    fn block(message: usize, block: usize) -> Place {
        Place::Block { message, block }
    }

    #[test]
    fn marks_are_read_in_the_api_order_with_their_values() {
        let marks = marks(&claude_code_body());
        let places: Vec<Place> = marks.iter().map(|m| m.place).collect();
        assert_eq!(places, vec![Place::Tool(1), Place::System(1), block(2, 0), block(4, 1)]);
        assert_eq!(marks[1].value, json!({"type": "ephemeral", "ttl": "1h"}));
        assert!(places.windows(2).all(|w| w[0] < w[1]));
        let nested = json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]}]});
        assert_eq!(super::marks(&nested).iter().map(|m| m.place).collect::<Vec<_>>(), vec![block(0, 0)]);
        assert!(super::marks(&json!({"system": "plain", "messages": [{"role": "user", "content": "hi"}]})).is_empty());
    }

    fn all_kept() -> Vec<Vec<Fate>> {
        vec![vec![Kept], vec![Kept, Kept], vec![Kept], vec![Kept], vec![Kept, Kept]]
    }

    #[test]
    fn in_an_epoch_marks_stay_on_rewritten_blocks_and_kept_ones() {
        let marks = marks(&claude_code_body());
        let mut fates = all_kept();
        fates[2][0] = Rewritten;
        fates[1][1] = Rewritten;
        let placed = placement(&marks, &fates, |_, _| true);
        assert_eq!(placed, marks.iter().map(|m| Some(m.place)).collect::<Vec<_>>());
    }

    #[test]
    fn an_elided_marked_block_hands_its_mark_to_the_nearest_kept_block_before_it() {
        let marks = marks(&claude_code_body());
        // The first call and its result are elided: the result's mark goes back to the user's text
        // only if pare may mark it; the thinking block may never carry one.
        let mut fates = all_kept();
        fates[1] = vec![Elided, Elided];
        fates[2] = vec![Elided];
        let not_thinking = |m: usize, b: usize| (m, b) != (1, 0);
        assert_eq!(placement(&marks, &fates, not_thinking)[2], Some(block(0, 0)));
        assert_eq!(placement(&marks, &fates, |m, _| m != 0 && m != 1)[2], None, "nothing before it may carry it");
        // Only the result is elided: the assistant's tool_use before it takes the mark.
        let mut fates = all_kept();
        fates[2] = vec![Elided];
        let placed = placement(&marks, &fates, not_thinking);
        assert_eq!(placed, vec![Some(Place::Tool(1)), Some(Place::System(1)), Some(block(1, 1)), Some(block(4, 1))]);
        assert!(placed.iter().flatten().count() <= marks.len());
    }

    #[test]
    fn a_moved_mark_never_lands_on_or_before_the_previous_one() {
        // Two marked results in a row; both elided: the second may not land on the first's new block
        // (one block carries one mark) nor before it (a shorter ttl before a longer one).
        let ttl = json!({"type": "ephemeral", "ttl": "1h"});
        let body = json!({"messages": [
            {"role": "user", "content": "task"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "1", "cache_control": ttl}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "b", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "b", "content": "2", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": "done"},
        ]});
        let marks = marks(&body);
        let fates = vec![vec![Kept], vec![Kept], vec![Elided], vec![Elided], vec![Elided], vec![Kept]];
        let placed = placement(&marks, &fates, |m, _| m != 0);
        assert_eq!(placed, vec![Some(block(1, 0)), None]);
        // A kept mark after an elided one keeps its place.
        let fates = vec![vec![Kept], vec![Kept], vec![Elided], vec![Kept], vec![Kept], vec![Kept]];
        assert_eq!(placement(&marks, &fates, |_, _| true), vec![Some(block(1, 0)), Some(block(4, 0))]);
    }
}
