//! Uncached prefill: the prompt tokens an upstream with a prefix cache computes afresh for a request,
//! given the request of the same session before it. One rule, used by the proxy for each request's
//! raw and forwarded form ([`crate::exchange::PrefillEstimate`]) and by `pare eval`:
//!
//! `uncached = tokens − reused`, `reused` being the tools' tokens when the tools are unchanged (they
//! are rendered first: a change invalidates everything after) plus the tokens of the longest run of
//! leading messages equal, byte for byte, to the previous request's. Nothing is reused on a
//! session's first request. A real cache may reuse less (an evicted entry, a block boundary), never
//! more.

/// How many leading entries of `current` equal `previous`'s (message hashes,
/// [`crate::neutral::message_hashes`]).
pub fn shared_prefix(previous: impl IntoIterator<Item = u128>, current: &[u128]) -> usize {
    previous.into_iter().zip(current).take_while(|(a, b)| a == *b).count()
}

/// Tokens of a request a cache holding the previous one reuses: `tools_tokens` when the tools are
/// unchanged, plus the tokens of its first `shared` messages (`message_tokens`, one per message);
/// 0 when the tools changed.
pub fn reused(tools_unchanged: bool, tools_tokens: u64, message_tokens: &[u64], shared: usize) -> u64 {
    if !tools_unchanged {
        return 0;
    }
    tools_tokens + message_tokens[..shared.min(message_tokens.len())].iter().sum::<u64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_append_reuses_the_tools_and_every_message_before() {
        let previous = [1, 2, 3];
        let current = [1, 2, 3, 4, 5];
        let shared = shared_prefix(previous, &current);
        assert_eq!(shared, 3);
        assert_eq!(reused(true, 100, &[10, 20, 30, 40, 50], shared), 160);
    }

    #[test]
    fn a_rewritten_message_ends_what_is_reused_and_changed_tools_reuse_nothing() {
        assert_eq!(shared_prefix([1, 9, 3], &[1, 2, 3, 4]), 1);
        assert_eq!(reused(true, 100, &[10, 20, 30, 40], 1), 110);
        assert_eq!(reused(false, 100, &[10, 20, 30, 40], 4), 0);
        assert_eq!(shared_prefix([], &[1, 2]), 0);
        assert_eq!(reused(true, 0, &[10], 5), 10, "a shared count past the end is capped");
    }
}
