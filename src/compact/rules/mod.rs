//! The rules, run in a fixed priority order over the messages before the protected tail. Each rule
//! is a function `(policy, conversation, edits)` that records its edits; none touches a user
//! message, a message a user rule kept, or a message that already carries a pare marker.
//!
//! Order: user rules first (they may `keep`), then the rules that replace a tool result by a marker
//! (retry pruning, loop collapse, duplicate folding, structural maps, collapse of succeeded results —
//! the most specific first, so that the marker says the most useful thing), then the size limits on
//! what is left (truncation, hard cap), then the non-result rules (old calls' large arguments,
//! reasoning, system messages, consecutive assistant messages).

mod arguments;
mod assistant;
mod collapse;
pub mod custom;
mod duplicates;
mod loops;
mod reasoning;
mod retry;
mod structure;
mod system;
mod truncate;

pub use truncate::{cap_chars, truncate_lines};

use super::Policy;
use super::conversation::Conversation;
use super::edits::Edits;

/// Apply every enabled rule.
pub fn apply(policy: &Policy, conv: &Conversation<'_>, edits: &mut Edits) {
    let rules = &policy.spec;
    custom::apply(policy, conv, edits);
    if rules.retry_pruning.enabled {
        retry::apply(policy, conv, edits);
    }
    if rules.loops.enabled {
        loops::apply(policy, conv, edits);
    }
    if rules.duplicates.enabled {
        duplicates::apply(policy, conv, edits);
    }
    if rules.structure.enabled {
        structure::apply(policy, conv, edits);
    }
    if rules.collapse_succeeded.enabled {
        collapse::apply(policy, conv, edits);
    }
    if rules.truncate.enabled {
        truncate::apply(policy, conv, edits);
    }
    if rules.hard_cap.enabled {
        truncate::apply_hard_cap(policy, conv, edits);
    }
    if rules.arguments.enabled {
        arguments::apply(policy, conv, edits);
    }
    if rules.reasoning.enabled {
        reasoning::apply(policy, conv, edits);
    }
    if rules.system_messages.enabled {
        system::apply(policy, conv, edits);
    }
    if rules.consecutive_assistant.enabled {
        assistant::apply(policy, conv, edits);
    }
}

/// Tool results before the boundary that rules may still change.
fn open_results<'c>(conv: &'c Conversation<'_>, edits: &'c Edits) -> impl Iterator<Item = usize> + 'c {
    (0..conv.boundary).filter(move |&i| conv.outcomes[i].is_some() && edits.open(i))
}
